"""Sweep entry point: Ray Tune over train's loop, trials on spot-tier nodes.

    python -m tune --dataset NAME[@VERSION] --preset debug [--space lr-batch|small|FILE.yaml]
                   [--search random|optuna] [--num-samples N] [--max-concurrent N] [--json]

ASHA stops weak trials early by default. The best config is written to
`$STRATA_STORAGE/sweeps/SWEEP/best.json`; `python -m train --from-sweep SWEEP`
trains with it.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict

from strata import tiers
from strata.cli import add_config_arguments, finish, overrides
from strata.cli import parser as cli_parser
from strata.connect import connect
from strata.dataset import DatasetError, check_compatible, resolve
from strata.runinfo import run_info
from strata.storage import Storage, check_name, join, write_bytes_atomic, write_json_atomic
from train.loop import TRAIN_PRESETS
from train.model import preset
from tune.sweep import SweepConfig, load_rows, load_space, to_tune, trial

METRIC, MODE = "val_loss", "min"


def run(cfg: SweepConfig, *, dataset: str, model_preset: str, sweep_name: str, storage: Storage) -> dict:
    # Per-trial JSON/TensorBoard loggers cost driver memory and time; keep CSV only.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    space = to_tune(load_space(cfg.space))  # read and checked once, on the driver, before anything starts
    print(f"[tune] {connect()}", file=sys.stderr)
    model_cfg = preset(model_preset)
    version = resolve(storage, dataset)
    check_compatible(version, vocab_size=model_cfg.vocab_size, seq_len=model_cfg.seq_len)
    rows = load_rows(version, "train", cfg.max_rows)
    val_rows = load_rows(version, "validation", cfg.eval_rows)
    if len(val_rows) == 0:  # no validation split: hold out the last training rows
        rows, val_rows = rows[: -cfg.eval_rows], rows[-cfg.eval_rows:]
    if len(rows) == 0:
        raise DatasetError(f"dataset {version.ref} has too few rows to sweep on")
    sweep_dir = storage.sweep(sweep_name)
    write_json_atomic(join(sweep_dir, "sweep.json"),
                      run_info("sweep", {"sweep": asdict(cfg), "dataset": version.ref, "preset": model_preset}))
    print(f"[tune] sweep {sweep_name}: {cfg.num_samples} trials on {len(rows)} rows of {version.ref}",
          file=sys.stderr)

    # Data goes into the object store once; every trial reads the same copy.
    trainable = tune.with_parameters(trial, rows=rows, val_rows=val_rows, model=asdict(model_cfg),
                                     train=asdict(TRAIN_PRESETS[model_preset]), sweep=asdict(cfg))
    trainable = tune.with_resources(trainable, tune.PlacementGroupFactory(
        [{"CPU": 1}], bundle_label_selector=[tiers.selector(tiers.Tier.SPOT)]))
    max_t = -(-cfg.steps // cfg.report_every)
    scheduler = (ASHAScheduler(max_t=max_t, grace_period=min(2, max_t), reduction_factor=2)
                 if cfg.scheduler == "asha" else FIFOScheduler())
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, num_samples=cfg.num_samples,
                                    max_concurrent_trials=cfg.max_concurrent or None, scheduler=scheduler,
                                    search_alg=_searcher(cfg)),
        run_config=tune.RunConfig(name=sweep_name, storage_path=storage.sweeps(),
                                  callbacks=[CSVLoggerCallback()], verbose=1),
    )
    started = time.time()
    grid = tuner.fit()
    best = grid.get_best_result(METRIC, MODE, scope="all")
    best_metric = float(best.metrics_dataframe[METRIC].min())
    trials = [{"trial": os.path.basename(r.path or ""), "config": r.config,
               "iterations": r.metrics.get("training_iteration"),
               "best": float(r.metrics_dataframe[METRIC].min()) if r.metrics_dataframe is not None else None,
               "status": "error" if r.error else "completed" if r.metrics.get("training_iteration") == max_t
               else "stopped early",
               "node_id": (r.metrics or {}).get("node_id"), "error": str(r.error) if r.error else None}
              for r in grid]
    write_json_atomic(join(sweep_dir, "best.json"), {"config": best.config, METRIC: best_metric,
                                                     "preset": model_preset, "dataset": version.ref,
                                                     "space": cfg.space, "search": cfg.search})
    write_json_atomic(join(sweep_dir, "trials.json"), {"trials": trials})
    write_bytes_atomic(join(sweep_dir, "trials.csv"), trials_csv(trials).encode())
    print(trials_table(trials), file=sys.stderr)
    return {
        "sweep": sweep_name, "path": sweep_dir, "dataset": version.ref,
        "trials": len(grid), "completed": sum(1 for r in grid if r.error is None), "errors": grid.num_errors,
        "best": {"config": best.config, "metric": best_metric, "metric_name": METRIC},
        "iterations": sum(t["iterations"] or 0 for t in trials), "seconds": round(time.time() - started, 1),
    }


def trials_csv(trials: list[dict]) -> str:
    """One row per trial: id, status, iterations, best metric, then each hyperparameter."""
    import csv
    import io

    keys = sorted({k for t in trials for k in t["config"]})
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(["trial", "status", "iterations", f"best_{METRIC}", *keys])
    for t in sorted(trials, key=_rank):
        w.writerow([t["trial"], t["status"], t["iterations"], t["best"], *(t["config"].get(k) for k in keys)])
    return out.getvalue()


def trials_table(trials: list[dict], top: int = 10) -> str:
    """The best trials as an aligned table, with a count by status."""
    keys = sorted({k for t in trials for k in t["config"]})
    rows = [[f"{t['best']:.4f}" if t["best"] is not None else "-", str(t["iterations"] or 0), t["status"],
             *(f"{v:.4g}" if isinstance(v := t["config"].get(k), float) else str(v) for k in keys)]
            for t in sorted(trials, key=_rank)[:top]]
    head = [METRIC, "iters", "status", *keys]
    widths = [max(len(c) for c in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]]
    counts = {s: sum(t["status"] == s for t in trials) for s in ("completed", "stopped early", "error")}
    return "\n".join([f"[tune] best {min(top, len(trials))} of {len(trials)} trials "
                      f"({', '.join(f'{n} {s}' for s, n in counts.items())}):", *lines])


def _rank(t: dict) -> tuple:
    return (t["best"] is None, t["best"] if t["best"] is not None else 0.0)


def _searcher(cfg: SweepConfig):
    from ray import tune

    if cfg.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            return OptunaSearch(seed=cfg.seed)  # TPE
        except (ImportError, AssertionError):  # Ray asserts optuna is importable
            raise ValueError("--search optuna needs the optuna package: pip install optuna") from None
    return tune.search.BasicVariantGenerator(random_state=cfg.seed)


def main(argv: list[str] | None = None) -> dict:
    parser = cli_parser("python -m tune", __doc__)
    parser.add_argument("--dataset", required=True, help="NAME or NAME@VERSION of a tier-1 dataset")
    parser.add_argument("--preset", default="debug", help="model preset whose search space to sweep")
    parser.add_argument("--sweep", help="sweep name (default: DATASET-sweep-TIME)")
    add_config_arguments(parser, SweepConfig)
    args = parser.parse_args(argv)
    name = args.sweep or f"{args.dataset.partition('@')[0]}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_name(name, "sweep name")
        cfg = SweepConfig(**overrides(args, SweepConfig))
        summary = run(cfg, dataset=args.dataset, model_preset=args.preset, sweep_name=name,
                      storage=Storage.from_env(args.storage))
    except (DatasetError, ValueError) as e:
        sys.exit(f"error: {e}")
    b = summary["best"]
    print(f"[tune] sweep {name}: {summary['completed']}/{summary['trials']} trials completed, "
          f"{summary['iterations']} iterations; best {b['metric_name']} {b['metric']:.4f} with {b['config']}",
          file=sys.stderr)
    return finish(summary, args.json)


if __name__ == "__main__":
    main()
