"""Run a notebook headless and show what it shows, as it goes.

    .venv/bin/python notebooks/run.py notebooks/sweep.ipynb [--out DIR]

`jupyter execute` runs a notebook and prints none of its output. This prints each code cell's output in the
terminal while the cell runs (printed lines, errors, tables as text), saves each image it displays as a PNG
under `--out` (default: runs/notebooks/NAME) and prints its path, and writes the executed notebook there too,
to open later. A cell that fails ends the run with its error and exit code 1.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="notebooks/run.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebook")
    p.add_argument("--out", help="where the images and the executed notebook go (default: runs/notebooks/NAME)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds a cell may run (default 1800)")
    a = p.parse_args(argv)
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    name = os.path.splitext(os.path.basename(a.notebook))[0]
    out = a.out or os.path.join("runs", "notebooks", name)
    os.makedirs(out, exist_ok=True)
    nb = nbformat.read(a.notebook, as_version=4)
    images = [0]

    def show(output: dict) -> None:
        kind = output.get("output_type")
        if kind == "stream":
            (sys.stderr if output.get("name") == "stderr" else sys.stdout).write(output.get("text", ""))
        elif kind == "error":
            sys.stdout.write("\n".join(output.get("traceback", [])) + "\n")
        elif kind in ("display_data", "execute_result"):
            data = output.get("data", {})
            if "image/png" in data:
                images[0] += 1
                path = os.path.join(out, f"image-{images[0]:02d}.png")
                with open(path, "wb") as f:
                    f.write(base64.b64decode(data["image/png"]))
                print(f"[image: {path}]")
            elif "text/plain" in data:
                print(data["text/plain"])
        sys.stdout.flush()

    class Showing(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):  # each output as it arrives, shown and kept
            out = super().output(outs, msg, display_id, cell_index)
            if out is not None:
                show(out)
            return out

    client = Showing(nb, timeout=a.timeout, resources={"metadata": {"path": os.getcwd()}})
    failed = False
    with client.setup_kernel():
        for i, cell in enumerate(nb.cells):
            if cell.cell_type == "markdown" and cell.source.startswith("#"):
                print(f"\n{cell.source.splitlines()[0]}", flush=True)
            elif cell.cell_type == "code":
                try:
                    client.execute_cell(cell, i)
                except CellExecutionError:
                    failed = True
                    break
    executed = os.path.join(out, f"{name}.ipynb")
    nbformat.write(nb, executed)
    print(f"\nexecuted notebook: {executed}" + (" (stopped at the failing cell)" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
