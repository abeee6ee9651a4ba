"""Ray Tune's per-trial cost at scale: trivial trials, driver time and memory, extrapolated to 50,000.

    python -m bench.tune [--trials 2000] [--max-concurrent 200] [--loggers compact|default]

Each trial reports one number and ends, so what is measured is Tune's own
bookkeeping: wall time per trial on the driver, and the driver's resident
memory growth per 1,000 trials (its RSS after the sweep minus before; the
trials' results stay held, as a sweep's would). `--loggers compact` is what
`python -m tune` runs (no per-trial JSON/TensorBoard loggers, one CSV per
trial); `default` is Tune's default set, for comparison. The last line
extrapolates both figures to 50,000 trials (targets: <= 10 ms per trial,
<= 60 MB per 1,000 trials).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def trivial(config: dict) -> None:
    from ray import tune

    tune.report({"score": config["x"]})


def sweep(trials: int, max_concurrent: int, loggers: str, storage: str) -> dict:
    if loggers == "compact":
        os.environ["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] = "1"
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback

    callbacks = [CSVLoggerCallback()] if loggers == "compact" else None
    tuner = tune.Tuner(
        tune.with_resources(trivial, {"CPU": 0.01}),
        param_space={"x": tune.uniform(0, 1)},
        tune_config=tune.TuneConfig(metric="score", mode="max", num_samples=trials,
                                    max_concurrent_trials=max_concurrent, reuse_actors=True),
        run_config=tune.RunConfig(name=f"bench-{loggers}-{trials}", storage_path=storage, callbacks=callbacks,
                                  verbose=0),
    )
    before = _rss_mb()
    started = time.perf_counter()
    grid = tuner.fit()
    seconds = time.perf_counter() - started
    after = _rss_mb()
    assert len(grid) == trials and grid.num_errors == 0
    return {"trials": trials, "seconds": seconds, "ms_per_trial": 1e3 * seconds / trials,
            "driver_rss_mb_before": before, "driver_rss_mb_after": after,
            "mb_per_1000_trials": (after - before) * 1000 / trials}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--max-concurrent", type=int, default=200)
    parser.add_argument("--loggers", choices=["compact", "default"], default="compact")
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the last line")
    args = parser.parse_args(argv)

    from strata.connect import connect

    connect()
    storage = tempfile.mkdtemp(prefix="strata-bench-tune-")
    try:
        r = sweep(args.trials, args.max_concurrent, args.loggers, storage)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    print(f"{r['trials']:,} trivial trials ({args.loggers} loggers, {args.max_concurrent} concurrent): "
          f"{r['seconds']:.1f} s, {r['ms_per_trial']:.1f} ms per trial; driver RSS "
          f"{r['driver_rss_mb_before']:.0f} -> {r['driver_rss_mb_after']:.0f} MB, "
          f"{r['mb_per_1000_trials']:.1f} MB per 1,000 trials")
    if args.json:
        print(json.dumps(r))
    print(f"extrapolated to 50,000 trials: {r['ms_per_trial'] * 50:.0f} s of Tune overhead "
          f"({r['ms_per_trial']:.1f} ms/trial, target <= 10), driver memory +{r['mb_per_1000_trials'] * 50:,.0f} MB "
          f"({r['mb_per_1000_trials']:.1f} MB per 1,000 trials, target <= 60)")


if __name__ == "__main__":
    main()
