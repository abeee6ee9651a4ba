"""Real configs: a sweep's wall time against a plain loop over the same configs on the same cores.

    python -m bench.tune.real [--configs 64,256] [--steps 10] [--json]

For each size N: `python -m tune --scheduler fifo --num-samples N --steps S --report-every S` on the debug
preset and a small generated dataset, timed on the wall clock as a user runs it (its own embedded Ray,
default packing); then the configs that sweep trained (from its trials.json), split between one process
per core, each training its share in turn with the trial's own code (tune.sweep.ModelFit: the same model
build, data path and step) and one torch thread, as a trial gets one CPU. Alternating, the fastest of
`--rounds` each. Printed per size: both walls, the overhead ratio (sweep / plain; target <= 1.1), where
the sweep's extra time went (before the first report, after the last), the files and MB the sweep wrote,
and the driver's memory as configs completed (its RSS in progress.json: at a tenth done, at the end),
then those figures extrapolated to the reference sweep of 50,000 configs by their law: results parts,
MB and the driver's growth go as the configs (a part per 10 s or 2,000 results), the rest is a few
files per worker. The last line: the ratio at each size.
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
REFERENCE = 50_000  # configs of the reference sweep


def _plain(args: tuple) -> float:
    """One core's share of the configs, trained in turn; the seconds it took after imports."""
    configs, sweep, dataset, storage_root = args
    import torch

    torch.set_num_threads(1)
    from strata.data.storage import Storage
    from tune.config import SweepConfig
    from tune.driver import spec_for
    from tune.sweep import ModelFit, load_space

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


def sweep(n: int, steps: int, dataset: str, storage_root: str, name: str) -> tuple[float, dict, list]:
    """The sweep command's wall time, its summary, and (configs done, driver RSS MB) from its progress.json
    every 2 s."""
    env = {**os.environ, "STRATA_STORAGE": storage_root, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    progress = Path(storage_root, "sweeps", name, "progress.json")
    started, samples = time.perf_counter(), []
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "tune", "--dataset", dataset, "--preset", "debug",
                                 "--scheduler", "fifo", "--num-samples", str(n), "--steps", str(steps),
                                 "--report-every", str(steps), "--sweep", name, "--json"],
                                cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        while proc.poll() is None:
            time.sleep(2)
            try:
                p = json.loads(progress.read_text())
                samples.append((p["done"] + p["errors"], p["driver_rss_mb"]))
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
        wall = time.perf_counter() - started
        out.seek(0), err.seek(0)
        if proc.returncode:
            raise RuntimeError(err.read()[-3000:])
        summary = json.loads(out.read().strip().splitlines()[-1])
    return wall, summary, samples


def footprint(sweep_dir: str, samples: list, n: int) -> dict:
    """What the sweep left on disk (files, MB) and how the driver's memory moved as configs completed: its RSS
    when a tenth and when all of them were done, and the slope between (MB per 1,000 configs)."""
    files = [f for f in Path(sweep_dir).rglob("*") if f.is_file()]
    mb = sum(f.stat().st_size for f in files) / 2**20
    out = {"files": len(files), "mb": mb, "results_files": len(list(Path(sweep_dir, "results").glob("*.jsonl")))}
    fixed = out["files"] - out["results_files"]  # per worker (its trial's files, its metrics.jsonl): no n in it
    scale = REFERENCE / n
    out.update(files_at_reference=round(fixed + out["results_files"] * scale), mb_at_reference=mb * scale)
    early = next(((d, r) for d, r in samples if d >= n / 10), None)
    if early and samples and samples[-1][0] > early[0]:
        late = samples[-1]
        out.update(rss_at_tenth_mb=early[1], rss_at_end_mb=late[1],
                   rss_mb_per_1000=(late[1] - early[1]) * 1000 / (late[0] - early[0]))
        out["rss_at_reference_mb"] = late[1] + out["rss_mb_per_1000"] * (REFERENCE - late[0]) / 1000
    return out


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
            wall, summary, samples = sweep(n, a.steps, dataset, storage_root, name)
            sweep_dir = summary["path"]
            foot = footprint(sweep_dir, samples, n)
            trials = json.loads(Path(sweep_dir, "trials.json").read_text())["trials"]
            reports = _reports(sweep_dir)
            gaps.append({"before_first_report_s": reports[0] - started if reports else None,
                         "after_last_report_s": started + wall - reports[-1] if reports else None, **foot})
            cfg = {"num_samples": n, "steps": a.steps, "report_every": a.steps, "scheduler": "fifo"}
            plains.append(plain([t["config"] for t in trials], cfg, dataset, storage_root, cores))
            walls.append(wall)
        best = min(range(a.rounds), key=lambda i: walls[i])
        results[n] = {"sweep_s": walls[best], "plain_s": min(plains), "ratio": walls[best] / min(plains), **gaps[best]}
        r = results[n]
        print(f"{n:,} configs x {a.steps} steps: sweep {r['sweep_s']:.1f} s, plain loop on {cores} cores "
              f"{r['plain_s']:.1f} s: overhead {r['ratio']:.2f}x (target <= 1.1); first report after "
              f"{r['before_first_report_s']:.1f} s, last report {r['after_last_report_s']:.1f} s before the end; "
              f"it wrote {r['files']} files, {r['mb']:.1f} MB ({r['results_files']} of results)"
              + (f"; driver RSS {r['rss_at_tenth_mb']:.0f} MB at a tenth done, {r['rss_at_end_mb']:.0f} MB at the "
                 f"end ({r['rss_mb_per_1000']:+.1f} MB per 1,000 configs)" if "rss_mb_per_1000" in r else ""),
              flush=True)
        print(f"  extrapolated to {REFERENCE:,} configs: {r['files_at_reference']:,} files, {r['mb_at_reference']:.0f} MB"
              + (f", driver RSS {r['rss_at_reference_mb']:.0f} MB" if "rss_at_reference_mb" in r else ""), flush=True)
    if a.json:
        print(json.dumps(results))
    print("overhead, sweep / plain loop: " + ", ".join(f"{r['ratio']:.2f}x at {n:,} configs" for n, r in results.items())
          + " (target <= 1.1)")
    return results


if __name__ == "__main__":
    main()
