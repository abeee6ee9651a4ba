"""Sweep entry point: Ray Tune over train's loop, trials on spot-tier nodes.

    python -m tune --dataset NAME[@VERSION] --preset debug [--space lr-batch|small|FILE.yaml]
                   [--dataset NAME ...] [--metric val_loss|val_bpb | --metric task_acc|task_acc_norm --eval-task FILE]
                   [--search random|optuna] [--num-samples N] [--max-concurrent N] [--json]

ASHA stops weak trials early by default. The best config is written to
`$STRATA_STORAGE/sweeps/SWEEP/best.json`; `python -m train --from-sweep SWEEP`
trains with it.
"""

from __future__ import annotations

import sys
import time

from strata.cluster.connect import connect_early
from strata.commands.cli import add_config_arguments, finish, overrides
from strata.commands.cli import parser as cli_parser
from strata.commands.shell import Command
from strata.commands.shell import log as _logger
from strata.data.dataset import DatasetError
from strata.data.lease import LeaseBusy
from strata.data.signing import Untrusted
from strata.data.storage import Storage, check_name
from train import mixture
from tune.config import SweepConfig
from tune.queued import SweepPartError

_log = _logger("tune")


def main(argv: list[str] | None = None) -> dict:
    return Command("python -m tune", argv).run(_main)


def _main(cmd: Command) -> dict:
    argv = cmd.argv
    parser = cli_parser("python -m tune", __doc__)
    parser.add_argument("--dataset", required=True, action="append", help="NAME or NAME@VERSION of a tier-1 "
                        "dataset; repeat it for a mixture (NAME[:WEIGHT], or weights swept as mix.NAME in the space)")
    parser.add_argument("--preset", default="debug", help="model preset whose search space to sweep")
    parser.add_argument("--sweep", help="sweep name (default: DATASET-sweep-TIME)")
    parser.add_argument("--dashboard", action="store_true", help="start the embedded Ray's dashboard (off by "
                        "default: on 2 cores its processes take CPU from the trials; a joined cluster keeps its own)")
    add_config_arguments(parser, SweepConfig)
    args = parser.parse_args(argv)
    name = args.sweep or f"{args.dataset[0].partition('@')[0].partition(':')[0]}-sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = Storage.from_env(args.storage)
    again = argv if args.sweep else [*argv, "--sweep", name]
    cmd.interrupted = lambda: (f"sweep {name}; kept Tune's saved state (the trials it finished are not run "
                               f"again); continue with: {cmd.continue_with(*again)}")
    try:
        cfg = SweepConfig(**overrides(args, SweepConfig))
    except ValueError as e:
        parser.error(str(e))
    try:
        check_name(name, "sweep name")
        dataset = mixture.spec(mixture.parse(args.dataset, weighted=False))
        mixture.resolve_all(storage, dataset, weighted=False)  # a missing dataset is said before Ray starts
        # Ray's processes start while this one loads the model code (torch): the trials start 1-2 s sooner
        # on 2 cores.
        connect_early(quiet=True, dashboard=args.dashboard, log_to_driver=args.verbose)
        from tune.driver import run

        summary = run(cfg, dataset=dataset, model_preset=args.preset, sweep_name=name, storage=storage,
                      dashboard=args.dashboard, verbose=args.verbose)
    except LeaseBusy as e:
        sys.exit(f"error: {e}: its driver is still running; resume it once that one has ended")
    except (DatasetError, ValueError, Untrusted, SweepPartError) as e:
        sys.exit(f"error: {e}")
    b = summary["best"]
    _log.info(f"sweep {name}: {outcome(summary)}, {summary['iterations']} iterations; best {b['metric_name']} "
              f"{b['metric']:.4f} with {b['config']}")
    return finish(summary, args.json)


def outcome(summary: dict) -> str:
    """`8 trials: 5 completed, 3 stopped early, 0 failed`: the summary's own counts (`ended` is the first
    two together: every trial that ended without error)."""
    return (f"{summary['trials']} trials: {summary['completed']} completed, {summary['stopped_early']} stopped early, "
            f"{summary['errors']} failed")



if __name__ == "__main__":
    main()
