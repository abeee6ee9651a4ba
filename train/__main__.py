"""Tier 2 entry point: train a GPT on a tier-1 dataset version with Ray Train.

    python -m train --dataset NAME[@VERSION] --preset debug [--max-steps N] [--run NAME] [--json]
    python -m train --dataset web:0.7 --dataset code:0.3 [--max-repeat N]     # a mixture
    python -m train --dataset NAME --init-from DIR|RUN[@STEP]                  # fine-tune

Workers run on gpu-tier nodes (`TorchTrainer` with the tier's label selector);
DDP by default, FSDP2 (`--strategy fsdp`) for the large presets; bf16 on GPU.
Running the same command again with the same `--run` continues from the
run's latest checkpoint instead of starting over. Metrics (loss, validation
loss, learning rate, tokens/s, MFU, data wait, checkpoint time) go to Ray, to
the run's metrics.jsonl and to TensorBoard (`tensorboard --logdir RUN/tensorboard`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from strata.commands.cli import (
    add_config_arguments,
    add_openlineage,
    finish,
    overrides,
    use_openlineage,
)
from strata.commands.cli import parser as cli_parser
from strata.commands.shell import Command
from strata.commands.shell import log as _logger
from strata.data.dataset import DatasetError
from strata.data.lease import LeaseBusy
from strata.data.storage import Storage, check_name
from train import mixture
from train.checkpoint import read_meta
from train.committed import committed_checkpoints
from train.config import TRAIN_PRESETS, TrainConfig, as_swept, with_hyperparameters
from train.mixture import load_file
from train.model import PRESETS, GPTConfig, preset
from train.placement import PlacementError
from train.spec import resolve
from train.trainer import DATA_ORDER, best_of_sweep, run

_log = _logger("train")

def main(argv: list[str] | None = None) -> dict:
    return Command("python -m train", argv).run(_main)


def _main(cmd: Command) -> dict:
    argv = cmd.argv
    parser = cli_parser("python -m train", __doc__)
    parser.add_argument("--dataset", action="append", help="NAME or NAME@VERSION of a tier-1 dataset (default: "
                        "the sweep's, with --from-sweep); repeat it as NAME[@VERSION]:WEIGHT to train on a mixture")
    parser.add_argument("--mixture", metavar="FILE", help="a mixture file: {datasets: {NAME[@VERSION]: WEIGHT}}")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="model preset (default: the sweep's, else debug)")
    parser.add_argument("--from-sweep", metavar="SWEEP", help="train with the best config of this sweep "
                        "($STRATA_STORAGE/sweeps/SWEEP/best.json); flags still override it")
    parser.add_argument("--init-from", metavar="DIR|RUN[@STEP]", help="fine-tune: start from these weights, a "
                        "GPT-2-layout directory (train.export's, or a Hugging Face GPT-2 with model.safetensors) "
                        "or a run's checkpoint; the model's shape comes from them")
    parser.add_argument("--run", help="run name; an existing run continues (default: DATASET-PRESET-TIME)")
    parser.add_argument("--workers", type=int, help="training workers (default: the GPUs of one model on the "
                        "gpu tier; 1 on CPU)")
    parser.add_argument("--use-gpu", action=argparse.BooleanOptionalAction,
                        help="train on GPUs (default: on a cluster, always, waiting for the autoscaler to bring "
                        "them up; on the embedded local Ray, when it has one). --no-use-gpu trains on CPU")
    parser.add_argument("--gpu-wait-s", type=float, default=900.0, help="how long to wait for GPUs to come up "
                        "before failing (default: 900)")
    parser.add_argument("--allow-mixed-gpus", action="store_true", help="let one run span GPU models")
    parser.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs reserved per worker (default: 1)")
    parser.add_argument("--max-failures", type=int, default=2, help="worker-group restarts from checkpoint")
    parser.add_argument("--allow-change", action="store_true", help="continue a run on another dataset or "
                        f"with another data order ({', '.join(DATA_ORDER)})")
    parser.add_argument("--allow-tainted", action="store_true", help="start from (--init-from) or continue weights "
                        "a takedown tainted anyway; the use is recorded in their run (strata takedown)")
    parser.add_argument("--reschedule", action="store_true", help="continuing with another --max-steps: decay the "
                        "learning rate over the new length (by default a run keeps the schedule it started with)")
    add_config_arguments(parser, GPTConfig)
    add_config_arguments(parser, TrainConfig)
    add_openlineage(parser)
    args = parser.parse_args(argv)
    use_openlineage(args)
    storage = Storage.from_env(args.storage)
    for flag, value, ok in (("--cpus-per-worker", args.cpus_per_worker, args.cpus_per_worker > 0),
                            ("--gpu-wait-s", args.gpu_wait_s, args.gpu_wait_s >= 0),
                            ("--max-failures", args.max_failures, args.max_failures >= -1),
                            ("--workers", args.workers, args.workers is None or args.workers >= 1)):
        if not ok:
            parser.error(f"{flag} {value}: out of range")
    try:  # every value given is checked before anything is read or started
        TrainConfig(**overrides(args, TrainConfig))
        replace(PRESETS[args.preset or "debug"], **overrides(args, GPTConfig))
    except ValueError as e:
        parser.error(str(e))
    try:
        best = best_of_sweep(storage, args.from_sweep) if args.from_sweep else {}
        if args.mixture and args.dataset:
            raise ValueError("give --dataset or --mixture, not both")
        # A mixture sweep's best config weighs its datasets (mix.NAME): that is the mixture to train on.
        hp = {k: v for k, v in best.get("config", {}).items() if not k.startswith(mixture.MIX)}
        swept = [f"{ref}:{w!r}" for ref, w in mixture.swept(best["config"], mixture.split(best["dataset"],
                                                                                         weighted=False))] if best else []
        parts = load_file(args.mixture) if args.mixture else args.dataset or swept
        if not parts:
            raise ValueError("give --dataset (or --mixture FILE, or --from-sweep SWEEP)")
        dataset = mixture.spec(mixture.parse(parts))
        preset_name = args.preset or best.get("preset") or "debug"
        first = dataset.partition("@")[0].partition(":")[0]
        run_name = args.run or f"{first}{'-mix' if ',' in dataset else ''}-{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_name(run_name, "run name")
        again = argv if args.run else [*argv, "--run", run_name]
        cmd.interrupted = lambda: _interrupted(storage.run(run_name), run_name, cmd.continue_with(*again))
        model_cfg, train_cfg = with_hyperparameters(hp, preset(preset_name), TRAIN_PRESETS[preset_name])
        given = overrides(args, TrainConfig)
        train_cfg = replace(train_cfg, **given)
        if best:  # the config trains as its trials did, but for what the flags give
            train_cfg = as_swept(train_cfg, seed=best.get("seed", 0), keep=frozenset(given))
            _log.info(f"best config of sweep {args.from_sweep}: {json.dumps(best['config'])}")
        spec = resolve(storage, dataset, model_cfg, train_cfg, model_flags=overrides(args, GPTConfig),
                       # a fine-tuning sweep's best config: the same start
                       init_from=args.init_from or best.get("init_from"), run_name=run_name,
                       allow_change=args.allow_change, allow_tainted=args.allow_tainted)
        summary = run(spec, run_name=run_name, storage=storage, workers=args.workers, use_gpu=args.use_gpu,
                      cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures,
                      allow_change=args.allow_change, allow_mixed_gpus=args.allow_mixed_gpus,
                      gpu_wait_s=args.gpu_wait_s, verbose=args.verbose, reschedule=args.reschedule,
                      from_sweep=args.from_sweep, allow_tainted=args.allow_tainted)
    except LeaseBusy as e:
        sys.exit(f"error: {e}: wait for it to end, or use another --run")
    except (DatasetError, ValueError, FileNotFoundError, PlacementError) as e:
        sys.exit(f"error: {e}")
    if summary["steps"] == 0:
        _log.info(f"run {run_name} is already at step {summary['start_step']}: nothing to do")
    else:
        mfu = f", MFU {summary['mfu']:.1%}" if summary["mfu"] is not None else ""
        _log.info(f"run {run_name}: steps {summary['start_step']} -> {summary['start_step'] + summary['steps']}, "
                  f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, "
                  f"micro-batch {summary['micro_batch']}, "
                  f"{summary['tokens_per_s']:,.0f} tokens/s over {summary['loop_s']:.1f} s of loop{mfu}; of that time "
                  f"data wait {summary['data_wait']:.1%}, evaluation {summary['eval_share']:.1%}, checkpoints "
                  f"{summary['checkpoint_blocked']:.1%}, reports {summary['report_blocked']:.1%}; "
                  f"checkpoint {summary['checkpoint']}")
        if summary.get("val_loss") is not None:
            _log.info(f"validation: {_scores(summary['val_loss'], summary.get('val_bpb'))}")
        for ref, tokens in (summary.get("tokens_by_source") or {}).items():
            loss = (summary.get("val_loss_by_source") or {}).get(ref)
            bpb = (summary.get("val_bpb_by_source") or {}).get(ref)
            _log.info(f"  {ref}: {tokens:,} tokens ({summary['repeats_by_source'][ref]:.3f} passes)"
                      f"{f', validation {_scores(loss, bpb)}' if loss is not None else ''}")
    return finish(summary, args.json)


def _interrupted(run_dir: str, run_name: str, again: str) -> str:
    """What Ctrl-C left of the run: its newest committed checkpoint, and the command that continues."""
    found = committed_checkpoints(run_dir)
    kept = (f"the checkpoint at step {read_meta(found[-1])['step']} ({found[-1]})" if found
            else "no checkpoint yet (the run starts from step 0)")
    return f"training run {run_name}; kept {kept}; continue with: {again}"


def _scores(loss: float, bpb: float | None) -> str:
    return f"loss {loss:.3f}" + (f", {bpb:.3f} bits per byte" if bpb is not None else "")


if __name__ == "__main__":
    main()
