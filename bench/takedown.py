"""A takedown at scale, for bench.scale (`--takedown-versions`, `--takedown-datasets`): one request against
datasets of many versions on the S3 API server, each step the real command, timed on the wall clock, its
requests counted by the logging proxy.

    python -m bench.takedown [--datasets 3] [--versions 100] [--json]   (bench.scale runs it too)

The datasets are built first (not measured), in one process on one embedded Ray: `--datasets` datasets
of `--versions` small versions each. Version 1 of every dataset but the last reads the claimed file, the
same bytes under each dataset's own path; version 2 of the last reads its text in other bytes (upper case:
the same exact key). Then, measured:

- `strata takedown open --source FILE`: every copy by digest (every version's manifest), their documents
  by lineage (each version's source column, then only the row groups holding them), the same text by exact
  key (each version's exact column, then only those row groups);
- `strata takedown plan ID`;
- `strata takedown apply ID`: a forget commit in each dataset.

Per step: wall seconds, requests, MB read, and the lineage files' requests among them.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "ru", "ta", "po", "el", "su", "vi") for b in ("n", "r", "s", "t", "")]

BUILD = """
import json, sys
from pipelines.config import debug
from pipelines.driver import run
from strata.data.storage import Storage
root, plan = sys.argv[1], json.loads(sys.argv[2])
storage = Storage(root)
for name, inputs in plan:
    run(debug(name, read={"inputs": tuple(inputs)}), storage)
    print(name, inputs[0], file=sys.stderr, flush=True)
"""


def _text(rng: random.Random, tag: str) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 200))) + f" {tag}."


def build(work: Path, root: str, env: dict, datasets: int, versions: int) -> dict:
    """The datasets and their inputs; the claimed file's path in the first dataset."""
    rng = random.Random(7)
    claimed = _text(rng, "claimed")
    plan = []
    for v in range(1, versions + 1):
        for d in range(datasets):
            folder = work / "takedown" / f"ds{d}" / f"v{v:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(4):
                (folder / f"doc{i}.txt").write_text(_text(rng, f"{d}-{v}-{i}"))
            if v == 1 and (d < datasets - 1 or datasets == 1):
                (folder / f"claimed-{d}.txt").write_text(claimed)
            if v == 2 and d == datasets - 1 and datasets > 1:  # not beside a copy: dedup would drop it
                (folder / "same-text.txt").write_text(claimed.upper())
            plan.append((f"td{d}", [str(folder)]))
    started = time.time()
    proc = subprocess.run([sys.executable, "-c", BUILD, root, json.dumps(plan)], cwd=REPO,
                          env={**env, "STRATA_STORAGE": root}, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"building the takedown datasets failed: {proc.stderr[-3000:]}")
    return {"claimed": str(work / "takedown" / "ds0" / "v001" / "claimed-0.txt"),
            "build_s": round(time.time() - started, 1)}


def step(args: list[str], root: str, env: dict, proxy) -> tuple[dict, dict]:
    """One `strata takedown` command: its JSON output and its figures."""
    from bench.s3proxy import tally

    first = len(proxy.log) if proxy else 0
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "strata", "takedown", *args, "--storage", root, "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.time() - started
    if proc.returncode:
        raise RuntimeError(f"strata takedown {args[0]} failed: {proc.stderr[-3000:]}")
    row = {"wall_s": round(wall, 2)}
    if proxy:
        log = proxy.log[first:]
        lineage = [r for r in log if "lineage.parquet" in r.path]
        row.update(requests=len(log), read_mb=round(tally(log)["read_bytes"] / 2**20, 3),
                   lineage_requests=len(lineage), lineage_read_kb=round(tally(lineage)["read_bytes"] / 1024, 1))
    return json.loads(proc.stdout.strip().splitlines()[-1]), row


def takedown_at_scale(work: Path, root: str, env: dict, proxy, datasets: int, versions: int) -> dict:
    """Build, then open, plan and apply one request; the figures of each step."""
    built = build(work, root, env, datasets, versions)
    out = {"datasets": datasets, "versions": versions, "build_s": built["build_s"]}
    request, out["open"] = step(["open", "--source", built["claimed"], "--reason", "bench request"], root, env, proxy)
    plan, out["plan"] = step(["plan", request["id"]], root, env, proxy)
    applied, out["apply"] = step(["apply", request["id"]], root, env, proxy)
    out.update(copies=len(request["copies"]), documents=len(request["documents"]),
               same_text=len(request["same_text"]), versions_holding=len(request["versions"]),
               datasets_forgotten=len(applied["applied"]))
    out["total_s"] = round(sum(out[k]["wall_s"] for k in ("open", "plan", "apply")), 2)
    return out


def text(r: dict) -> str:
    steps = " · ".join(f"{k} {r[k]['wall_s']} s" + (f", {r[k]['requests']} requests ({r[k]['lineage_requests']} to "
                                                     f"lineage files, {r[k]['lineage_read_kb']} KB)"
                                                     if "requests" in r[k] else "") for k in ("open", "plan", "apply"))
    return (f"Takedown across {r['datasets']} datasets of {r['versions']} versions: {r['copies']} copies by digest, "
            f"{r['documents']} documents ({r['same_text']} by exact key) in {r['versions_holding']} versions; "
            f"{r['datasets_forgotten']} forget commits; {r['total_s']} s in all: {steps}.")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os
    import shutil
    import tempfile

    from bench.s3proxy import s3_server

    p = argparse.ArgumentParser(prog="python -m bench.takedown", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", type=int, default=3)
    p.add_argument("--versions", type=int, default=100)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="strata-takedown-"))
    server, proxy, s3_env = s3_server("scale")
    try:
        r = takedown_at_scale(work, "s3://scale/strata", {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                                          **s3_env}, proxy, a.datasets, a.versions)
    finally:
        proxy.close()
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(text(r))
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
