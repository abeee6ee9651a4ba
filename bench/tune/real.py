"""Real configs: a sweep's wall time against a plain loop over the same configs on the same cores.

    python -m bench.tune.real [--configs 64,256] [--steps 10] [--json]

For each size N: `python -m tune --scheduler fifo --num-samples N --steps S --report-every S` on the debug
preset and a small generated dataset, timed on the wall clock as a user runs it (its own embedded Ray,
default packing); then the configs that sweep trained (from its trials.json), split between one process
per core, each training its share in turn with the trial's own code (tune.sweep.ModelFit: the same model
build, data path and step) and one torch thread, as a trial gets one CPU. Alternating, the fastest of
`--rounds` each. Printed per size: both walls, the overhead ratio (sweep / plain; target <= 1.1), and
where the sweep's extra time went: before the first trial reported, and after the last one reported.
The last line: the ratio at each size.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _plain(args: tuple) -> float:
    """One core's share of the configs, trained in turn; the seconds it took after imports."""
    configs, sweep, dataset, storage_root = args
    import torch

    torch.set_num_threads(1)
    from strata.storage import Storage
    from tune.driver import spec_for
    from tune.sweep import ModelFit, SweepConfig, load_space

    cfg = SweepConfig(**sweep)
    spec = spec_for(cfg, load_space(cfg.space), dataset, "debug", Storage(storage_root))
    started = time.perf_counter()
    for hp in configs:
        fit = ModelFit(hp, None, spec)
        for _ in range(cfg.reports):
            fit.advance()
    return time.perf_counter() - started


def plain(configs: list[dict], sweep: dict, dataset: str, storage_root: str, cores: int) -> float:
    """Wall seconds of `cores` processes (started, imported and done) over `configs`, dealt round-robin."""
    started = time.perf_counter()
    with mp.get_context("spawn").Pool(cores) as pool:
        pool.map(_plain, [(configs[i::cores], sweep, dataset, storage_root) for i in range(cores)])
    return time.perf_counter() - started


def sweep(n: int, steps: int, dataset: str, storage_root: str, name: str) -> tuple[float, dict]:
    env = {**os.environ, "STRATA_STORAGE": storage_root, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tune", "--dataset", dataset, "--preset", "debug", "--scheduler",
                           "fifo", "--num-samples", str(n), "--steps", str(steps), "--report-every", str(steps),
                           "--sweep", name, "--json"], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return wall, summary


def _reports(sweep_dir: str) -> list[float]:
    """The wall-clock times of every report of every trial (trials/*/metrics.jsonl)."""
    out = []
    for f in Path(sweep_dir, "trials").glob("*/metrics.jsonl"):
        out += [json.loads(line)["time"] for line in f.read_text().splitlines() if line.strip()]
    return sorted(out)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.tune.real", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="64,256", help="sweep sizes, comma-separated")
    p.add_argument("--steps", type=int, default=10, help="training steps per config")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    from bench.train.common import make_dataset

    cores = os.cpu_count() or 1
    work = tempfile.mkdtemp(prefix="bench-tune-real-")
    storage_root, dataset = make_dataset(work, mb=2.0)
    results = {}
    for n in (int(x) for x in a.configs.split(",")):
        walls, plains, gaps = [], [], []
        for r in range(a.rounds):
            name = f"real-{n}-{r}"
            started = time.time()
            wall, summary = sweep(n, a.steps, dataset, storage_root, name)
            sweep_dir = summary["path"]
            trials = json.loads(Path(sweep_dir, "trials.json").read_text())["trials"]
            reports = _reports(sweep_dir)
            gaps.append({"before_first_report_s": reports[0] - started if reports else None,
                         "after_last_report_s": started + wall - reports[-1] if reports else None})
            cfg = {"num_samples": n, "steps": a.steps, "report_every": a.steps, "scheduler": "fifo"}
            plains.append(plain([t["config"] for t in trials], cfg, dataset, storage_root, cores))
            walls.append(wall)
        best = min(range(a.rounds), key=lambda i: walls[i])
        results[n] = {"sweep_s": walls[best], "plain_s": min(plains), "ratio": walls[best] / min(plains), **gaps[best]}
        r = results[n]
        print(f"{n:,} configs x {a.steps} steps: sweep {r['sweep_s']:.1f} s, plain loop on {cores} cores "
              f"{r['plain_s']:.1f} s: overhead {r['ratio']:.2f}x (target <= 1.1); first report after "
              f"{r['before_first_report_s']:.1f} s, last report {r['after_last_report_s']:.1f} s before the end",
              flush=True)
    if a.json:
        print(json.dumps(results))
    print("overhead, sweep / plain loop: " + ", ".join(f"{r['ratio']:.2f}x at {n:,} configs" for n, r in results.items())
          + " (target <= 1.1)")
    return results


if __name__ == "__main__":
    main()
