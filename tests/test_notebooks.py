"""notebooks/sweep.ipynb runs top to bottom in a fresh kernel against an embedded local Ray."""

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import REPO


def _execute(nb, env: dict) -> str:
    """Run `nb` in a fresh kernel with `env` set; its stdout. The temp dir of the Ray it started, which it names,
    is removed after it if the notebook left it: removing every /tmp/strata-ray-* made meanwhile deleted the Ray
    of a test running beside it in the other pytest process (its workers' logs gone mid-run, in
    test_concurrency)."""
    nbclient = pytest.importorskip("nbclient")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": REPO}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        said = "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
        for temp in re.findall(r"started embedded local Ray \(.*temp (/\S+strata-ray-\w+)\)", said):
            shutil.rmtree(temp, ignore_errors=True)
    return "\n".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stdout")


def _images(nb) -> list:
    return [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]


@pytest.mark.ray
@pytest.mark.slow("runs a notebook's sweep in a kernel")
def test_sweep_notebook_runs_top_to_bottom_and_shows_an_ended_sweep_without_running_it_again(storage_root, tmp_path,
                                                                                            sweep_space):
    nbformat = pytest.importorskip("nbformat")
    import ray

    path = os.path.join(REPO, "notebooks", "sweep.ipynb")
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code"), \
        "commit the notebook with its outputs stripped"
    ray.shutdown()  # the kernel starts its own embedded Ray; two on 2 CPUs would only slow each other
    env = {"STRATA_STORAGE": str(tmp_path / "storage"), "STRATA_SWEEP": "nb", "STRATA_NUM_SAMPLES": "3",
           "STRATA_SWEEP_STEPS": "8", "STRATA_TRAIN_STEPS": "4", "STRATA_SPACE": sweep_space}
    corpora = set(glob.glob(os.path.join(tempfile.gettempdir(), "strata-notebook-corpus-*")))
    text = _execute(nb, env)
    assert "finished:" in text and "best config:" in text and "has ended" not in text
    assert set(glob.glob(os.path.join(tempfile.gettempdir(), "strata-notebook-corpus-*"))) == corpora  # none left
    # Ray's own lines stay in its files: its loggers (a timestamp first), its C++ log, its workers' output, and
    # the notices of missing widgets (tqdm, Ray) and of asyncio tasks left pending.
    said = [line for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stderr"
            for line in o.get("text", "").splitlines()]
    noise = re.compile(r"^(\d{4}-\d\d-\d\d[ T]|\[\d{4}-\d\d-\d\d |\(\w.* pid=\d+|.*Warning: |.*IProgress|"
                       r".*Missing packages|.*Task was destroyed|Traceback)")
    assert said and not [line for line in said if noise.match(line)], "\n".join(x for x in said if noise.match(x))
    assert len(_images(nb)) == 3  # the histogram of every config's best metric, params.png and curves.png
    sweep = tmp_path / "storage" / "sweeps" / "nb"
    best = json.loads((sweep / "best.json").read_text())
    run = json.loads((tmp_path / "storage" / "runs" / "nb-best" / "run.json").read_text())
    assert run["config"]["train"]["lr"] == pytest.approx(best["config"]["lr"])
    assert json.loads((sweep / "progress.json").read_text())["done"] == 3

    # The same sweep named again (its dataset given, no training): shown as it ended, nothing run or written.
    written = {str(f): f.stat().st_mtime_ns for f in sweep.rglob("*") if f.is_file()}
    again = nbformat.read(path, as_version=4)
    again.cells = [c for c in again.cells if not c.source.startswith("train_args")]
    text = _execute(again, {**env, "STRATA_DATASET": best["dataset"]})
    assert "sweep nb has ended: showing its results" in text and "best config:" in text
    assert len(_images(again)) == 3
    assert {str(f): f.stat().st_mtime_ns for f in sweep.rglob("*") if f.is_file()} == written


def test_run_py_shows_a_notebooks_output_as_it_runs(tmp_path):
    """notebooks/run.py prints what `jupyter execute` keeps to itself: printed lines, a table as text, an
    image saved and named; a failing cell ends it with exit code 1 and the executed notebook is kept."""
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A notebook"),
                nbformat.v4.new_code_cell("print('hello from a cell')\nimport pandas as pd\npd.DataFrame({'loss': [2.5, 1.25]})"),
                nbformat.v4.new_code_cell("import io\nfrom matplotlib.figure import Figure\nfrom IPython.display import Image, "
                                          "display\nf = Figure(); f.subplots().plot([1, 2]); b = io.BytesIO()\n"
                                          "f.savefig(b, format='png'); display(Image(data=b.getvalue()))"),
                nbformat.v4.new_code_cell("raise ValueError('the third cell fails')"),
                nbformat.v4.new_code_cell("print('never reached')")]
    nbformat.write(nb, tmp_path / "t.ipynb")
    out = subprocess.run([sys.executable, os.path.join(REPO, "notebooks", "run.py"), str(tmp_path / "t.ipynb"), "--out",
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "# A notebook" in out.stdout and "hello from a cell" in out.stdout and "1.25" in out.stdout
    assert f"[image: {tmp_path / 'out' / 'image-01.png'}]" in out.stdout
    assert (tmp_path / "out" / "image-01.png").read_bytes().startswith(b"\x89PNG")
    assert "the third cell fails" in out.stdout and "never reached" not in out.stdout
    assert (tmp_path / "out" / "t.ipynb").exists() and "stopped at the failing cell" in out.stdout
