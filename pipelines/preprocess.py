"""Tier 1's command line: raw text to a committed, versioned parquet dataset.

    python -m pipelines.preprocess --input PATH_GLOB_OR_URI [--input ...] --dataset NAME [--json]

Three Ray Data passes on cpu-tier nodes (see pipelines/pack.py): read, clean,
filter and sign every record; drop exact and near duplicates (across the
whole input and the versions in --dedup-window), tokenize and pack; shuffle rows into
shards. Every record is kept, filtered, duplicate or rejected with a reason;
the version is published only when complete. The run itself: pipelines/driver.py.
"""

from __future__ import annotations

import logging
import sys
import time

from pipelines.config import PRESETS, STAGES
from pipelines.driver import run
from pipelines.stats import format_table
from strata.commands.cli import (
    add_config_arguments,
    add_openlineage,
    finish,
    overrides,
    use_openlineage,
)
from strata.commands.cli import parser as cli_parser
from strata.commands.shell import EXIT_BUSY, Command
from strata.commands.shell import log as _logger
from strata.data.dataset import DatasetError, latest
from strata.data.lease import LeaseBusy
from strata.data.storage import Storage, check_name

_say = _logger("preprocess").info


def main(argv: list[str] | None = None) -> dict:
    return Command("python -m pipelines.preprocess", argv).run(_main)


def _main(cmd: Command) -> dict:
    argv = cmd.argv
    parser = cli_parser("python -m pipelines.preprocess", __doc__)
    parser.add_argument("--dataset", required=True, help="dataset name under $STRATA_STORAGE/datasets")
    parser.add_argument("--preset", default="debug", choices=sorted(PRESETS), help="config preset (default: debug)")
    parser.add_argument("--run-id", default="", help="idempotency key (e.g. the scheduled slot): a run id "
                        "that already produced a version returns it instead of running again")
    parser.add_argument("--no-wait", action="store_true", help="when another run is writing the dataset, exit "
                        f"at once with code {EXIT_BUSY} instead of waiting for it")
    for cls in STAGES.values():
        add_config_arguments(parser, cls)
    add_openlineage(parser)
    args = parser.parse_args(argv)
    use_openlineage(args)
    try:
        cfg = PRESETS[args.preset](args.dataset, **{n: overrides(args, c) for n, c in STAGES.items()})
    except ValueError as e:
        parser.error(str(e))
    storage = Storage.from_env(args.storage)
    started = time.time()
    cmd.interrupted = lambda: _interrupted(storage, cfg.dataset, started, cmd.continue_with(*argv))
    try:
        if args.run_id:
            check_name(args.run_id, "run id")
        # The command ends with its run: an embedded Ray needs no dashboard (a joined cluster keeps its own).
        summary = run(cfg, storage, run_id=args.run_id, wait=not args.no_wait, dashboard=False)
    except LeaseBusy as e:
        print(f"error: {e}; not waiting (--no-wait): its inputs are left for a later run", file=sys.stderr)
        sys.exit(EXIT_BUSY)
    except (FileNotFoundError, DatasetError, ValueError) as e:
        sys.exit(f"error: {e}")
    if summary["already_existed"]:
        _say(f"run {args.run_id!r} already exists as {summary['dataset']}@{summary['version']}")
    elif summary["version"] is None:
        _say(f"no version created ({summary['note']}): {summary['documents']['kept']} documents kept")
    else:
        _say(f"committed {summary['dataset']}@{summary['version']} at {summary['path']}")
        rows = (summary.get("snapshot") or {}).get("rows", {})
        if cfg.pack.validation_fraction > 0 and rows.get("train") and not rows.get("validation"):
            _logger("preprocess").warning(
                f"warning: {summary['dataset']}@{summary['version']} has no validation rows: "
                f"--validation-fraction {cfg.pack.validation_fraction:g} of its documents (chosen per document by a "
                "hash) held none out, so training reports no validation loss on it; add documents or raise "
                "--validation-fraction")
    if _logger("preprocess").isEnabledFor(logging.INFO):  # the table as it is, after the tagged lines (not --quiet)
        print(format_table(summary["stats"]), file=sys.stderr, flush=True)
    return finish(summary, args.json)


def _interrupted(storage: Storage, dataset: str, started: float, again: str) -> str:
    """What Ctrl-C left: a version committed before it, or nothing (the run's files go with the next run).
    A version made since the command started is its own (the lease keeps other writers out)."""
    now = latest(storage, dataset)
    kept = (f"version {dataset}@{now.manifest.version}, committed before the interrupt"
            if now and now.manifest.created_at >= started else
            "no new version: nothing was committed, and its inputs stay new for the next run")
    return f"preprocessing into dataset {dataset}; kept {kept}; continue with: {again}"


if __name__ == "__main__":
    main()
