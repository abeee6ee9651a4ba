"""Sweeps at scale: the driver's cost per config, queued and as a Tune trial per config, and what ASHA saves.

    python -m bench.tune [--trials 2000] [--max-concurrent 8] [--baseline-trials 200] [--asha-trials 16]
                         [--real-configs 64] [--fleet 'ARGS' | --fleet skip]

1. ASHA's worth: the same seeded random configs of the debug model on a small
   generated dataset, swept twice, with ASHA and without early stopping (fifo).
   Printed: trial iterations used (compute) and the best validation loss reached.
2. Overhead: trivial configs (each reports one number) run through the
   sweep's real driver path (`tune.driver.fit_queued`: the queue actor,
   `--max-concurrent` worker trials, the results written in parts, and
   `collect_queued`), at `--trials` and at half that (alternating, the fastest
   of `--rounds` each). The slope between the two is the marginal cost of a
   config; what is left is the fixed cost of starting the workers, which a
   longer sweep pays once. The baseline, measured in the same run, is a Tune
   trial per config (`--pack 1`, `--baseline-trials`). Driver memory is the
   driver's RSS growth over the larger sweep, per 1,000 configs.

3. Real configs (`bench.tune.real --configs REAL_CONFIGS`): the sweep command's
   wall time over a plain loop of the same configs (target <= 1.1).
4. The fleet (`bench.tune.fleet`): the driver's CPU at 100 workers on a
   simulated 4-node cluster (target < 1 core), and the share of 512 configs
   run again when 2 of the 4 nodes are lost (target <= 2%).

The line before the last lists every target; the last extrapolates to 50,000 configs: fixed cost + 50,000 x marginal
cost, per config, and the memory (targets: <= 10 ms per config, <= 60 MB per
1,000 configs).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")

TARGET_TRIALS = 50_000


class TrivialFit:
    """A config that costs nothing to train: its metric is a function of its hyperparameters."""

    def __init__(self, hp: dict, state: dict | None):
        self.hp, self.step = hp, 0

    def advance(self) -> tuple[float, list[float]]:
        self.step += 1
        return abs(self.hp["lr"] - 3e-3) + self.hp["batch_size"] / 1000, [0.0]

    def state(self) -> dict:
        return {}


def trivial_worker(config: dict, *, sweep, space: dict, queue: str) -> None:
    from tune.queued import run_worker

    run_worker(sweep=sweep, space=space, make_fit=TrivialFit, queue=queue)


def trivial_trial(config: dict, *, sweep) -> None:
    from tune.sweep import run_trial

    run_trial(config, sweep=sweep, make_fit=TrivialFit)


def overhead(trials: int, queued: bool, max_concurrent: int, root: str) -> dict:
    """Trivial configs through the sweep's driver path; wall time and driver RSS growth."""
    import ray
    from ray import tune

    from strata.cluster.procs import rss_mb
    from tune.config import SweepConfig
    from tune.driver import collect, fit, fit_queued, make_tuner
    from tune.sweep import load_space

    cfg = SweepConfig(num_samples=trials, pack=0 if queued else 1, steps=1, report_every=1,
                      max_concurrent=max_concurrent, scheduler="fifo",
                      cpus_per_trial=ray.cluster_resources()["CPU"] / max_concurrent)  # all at once
    space, where = load_space(cfg.space), os.path.join(root, f"overhead-{trials}-{int(queued)}")
    gc.collect()
    before, started = rss_mb(), time.perf_counter()
    if queued:
        grid, rows, _ = fit_queued(trivial_worker, cfg, space, where, workers=max_concurrent, progress=False,
                                   sweep=cfg)
    else:
        rows = collect(fit(make_tuner(tune.with_parameters(trivial_trial, sweep=cfg), cfg, space, where,
                                      progress=False)), cfg, space)
    seconds = time.perf_counter() - started
    gc.collect()
    after = rss_mb()
    if len(rows) != trials or any(r["status"] != "completed" for r in rows):
        raise RuntimeError(f"{sum(r['status'] != 'completed' for r in rows)} of {trials} trivial configs failed")
    return {"trials": trials, "queued": queued, "tune_trials": max_concurrent if queued else trials,
            "seconds": seconds, "ms_per_trial": 1e3 * seconds / trials, "mb_per_1000": (after - before) * 1000 / trials}


def asha_vs_random(trials: int, root: str) -> dict:
    """The same seeded configs swept with ASHA and with no early stopping."""
    from bench.train.common import make_dataset
    from strata.data.storage import Storage
    from tune.config import SweepConfig
    from tune.driver import run

    storage_root, ref = make_dataset(root, mb=2.0)
    out = {}
    for scheduler in ("asha", "fifo"):
        cfg = SweepConfig(num_samples=trials, steps=80, report_every=10, max_rows=1024, eval_rows=64,
                          scheduler=scheduler, space="small", seed=0)
        r = run(cfg, dataset=ref, model_preset="debug", sweep_name=f"asha-{scheduler}",
                storage=Storage(storage_root), progress=False)
        out[scheduler] = {"iterations": r["iterations"], "best": r["best"]["metric"], "seconds": r["seconds"]}
    return out


def _sub(module: str, *args: str) -> dict:
    """Run a benchmark module with --json, its output shown as it comes; its JSON result line."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", module, *args, "--json"], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    for line in lines:
        if not line.startswith("{"):
            print(line, flush=True)
    if proc.returncode:
        raise RuntimeError(f"{module} failed ({proc.returncode})")
    return json.loads(next(line for line in reversed(lines) if line.startswith("{")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2000, help="trivial configs, queued (default 2000)")
    parser.add_argument("--baseline-trials", type=int, default=200, help="trivial trials, one per Tune trial")
    parser.add_argument("--max-concurrent", type=int, default=8,
                        help="workers (trial actors) at once (default 8: what 2 cores hold; use 200 on a spot fleet)")
    parser.add_argument("--asha-trials", type=int, default=16, help="trials of each ASHA/random sweep (0: skip)")
    parser.add_argument("--rounds", type=int, default=2, help="queued sweeps of each size; the fastest counts")
    parser.add_argument("--real-configs", default="64", help="sizes for bench.tune.real, the overhead ratio over "
                        "real configs (comma-separated; empty: skip)")
    parser.add_argument("--fleet", default="", help="arguments for bench.tune.fleet, the simulated spot fleet "
                        "(concurrency and preemption; 'skip': skip)")
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the last line")
    args = parser.parse_args(argv)

    from strata.cluster.connect import connect

    connect()
    root = tempfile.mkdtemp(prefix="strata-bench-tune-")
    result = {}
    try:
        if args.asha_trials:
            a = result["asha"] = asha_vs_random(args.asha_trials, root)
            print(f"ASHA vs random search, {args.asha_trials} trials each (debug model, 80 steps, same configs): "
                  f"ASHA used {a['asha']['iterations']} trial iterations for best val_loss {a['asha']['best']:.4f}; "
                  f"no early stopping used {a['fifo']['iterations']} for {a['fifo']['best']:.4f} "
                  f"(compute ratio {a['asha']['iterations'] / a['fifo']['iterations']:.2f}, "
                  f"wall {a['asha']['seconds']:.0f} s vs {a['fifo']['seconds']:.0f} s)")
        base = result["baseline"] = overhead(args.baseline_trials, False, args.max_concurrent, root)
        runs = {n: [] for n in (args.trials // 2, args.trials)}
        for i in range(args.rounds):  # alternating sizes, fastest of each: the machine is shared and noisy
            for n in runs:
                runs[n].append(overhead(n, True, args.max_concurrent, os.path.join(root, str(i))))
        half, full = (min(r, key=lambda x: x["seconds"]) for r in runs.values())
        result["half"], result["queued"] = half, full
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for r, what in ((base, "a Tune trial each"), (half, "queued"), (full, "queued")):
        print(f"{r['trials']:,} trivial configs, {what} ({r['tune_trials']:,} Tune trials, "
              f"{args.max_concurrent} concurrent): {r['seconds']:.1f} s, {r['ms_per_trial']:.2f} ms per config, "
              f"driver {r['mb_per_1000']:+.1f} MB per 1,000 configs")
    marginal = max(0.0, (full["seconds"] - half["seconds"]) / (full["trials"] - half["trials"]))
    fixed = max(0.0, full["seconds"] - marginal * full["trials"])
    at_target = 1e3 * (fixed / TARGET_TRIALS + marginal)
    print(f"queued: {1e3 * marginal:.2f} ms per extra config, {fixed:.1f} s fixed (starting {args.max_concurrent} "
          f"workers); all-in {base['ms_per_trial'] / full['ms_per_trial']:.0f}x less per config than a Tune "
          f"trial per config")
    result["extrapolated"] = {"ms_per_trial": at_target, "mb_per_1000": full["mb_per_1000"]}
    targets = [f"{at_target:.2f} ms per config (<= 10)", f"driver {full['mb_per_1000']:+.1f} MB per 1,000 (<= 60)"]
    # Each in a process of its own: the fleet starts a simulated cluster, the real sweep its own embedded Ray.
    if args.real_configs:
        real = result["real"] = _sub("bench.tune.real", "--configs", args.real_configs)
        targets.insert(0, "overhead " + ", ".join(f"{r['ratio']:.2f}x at {int(n):,}" for n, r in real.items())
                       + " (<= 1.1)")
    if args.fleet != "skip":
        fleet = result["fleet"] = _sub("bench.tune.fleet", *args.fleet.split())
        targets += [f"re-run share {100 * fleet['preemption']['rerun_share']:.1f}% (<= 2%)",
                    f"driver {fleet['concurrency']['driver_cores']:.2f} cores at {fleet['concurrency']['workers']} "
                    "workers (< 1)"]
    if args.json:
        print(json.dumps(result))
    print("targets: " + "; ".join(targets))
    print(f"extrapolated to {TARGET_TRIALS:,} configs (queued): {at_target * TARGET_TRIALS / 1e3:.0f} s "
          f"of overhead ({at_target:.2f} ms/config, target <= 10), driver memory "
          f"{full['mb_per_1000'] * TARGET_TRIALS / 1000:+,.0f} MB "
          f"({full['mb_per_1000']:.1f} MB per 1,000 configs, target <= 60)")


if __name__ == "__main__":
    main()
