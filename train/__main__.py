"""Tier 2 entry point: train a GPT on a tier-1 dataset version with Ray Train.

    python -m train --dataset NAME[@VERSION] --preset debug [--max-steps N] [--run NAME] [--json]

Workers run on gpu-tier nodes (`TorchTrainer` with the tier's label selector).
Running the same command again with the same `--run` continues from the
run's latest checkpoint instead of starting over.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

from strata import tiers
from strata.cli import add_config_arguments, finish, overrides
from strata.cli import parser as cli_parser
from strata.connect import connect
from strata.dataset import DatasetError, check_compatible, resolve
from strata.runinfo import run_info
from strata.storage import Storage, check_name, exists, filesystem, join, write_json_atomic
from train.loop import TRAIN_PRESETS, TrainConfig, train_loop_per_worker
from train.model import GPT, PRESETS, GPTConfig, preset


def _gpu_tier_gpus() -> int:
    import ray

    return int(sum(n["Resources"].get("GPU", 0) for n in ray.nodes()
                   if n["Alive"] and tiers.Tier.GPU in tiers.tiers_of(n.get("Labels", {}))))


def read_metrics(run_dir: str) -> list[dict]:
    fs, path = filesystem(join(run_dir, "metrics.jsonl"))
    if not exists(join(run_dir, "metrics.jsonl")):
        return []
    with fs.open_input_stream(path) as f:
        return [json.loads(line) for line in f.read().decode().splitlines() if line.strip()]


def run(model_cfg: GPTConfig, train_cfg: TrainConfig, *, dataset: str, run_name: str, storage: Storage,
        workers: int | None = None, use_gpu: bool | None = None, cpus_per_worker: float = 1,
        max_failures: int = 2) -> dict:
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    print(f"[train] {connect()}", file=sys.stderr)
    version = resolve(storage, dataset)
    check_compatible(version, vocab_size=model_cfg.vocab_size, seq_len=model_cfg.seq_len)
    if use_gpu is None:
        use_gpu = _gpu_tier_gpus() > 0
    workers = workers or (_gpu_tier_gpus() if use_gpu else 1)
    run_dir = storage.run(run_name)
    resuming = exists(join(run_dir, "run.json"))
    import torch

    with torch.device("meta"):  # count parameters without allocating them
        n = GPT(model_cfg)
    print(f"[train] {'continuing' if resuming else 'starting'} run {run_name}: {n.num_params() / 1e6:.2f}M params, "
          f"{n.flops_per_token() / 1e6:.1f} MFLOP/token, {workers} worker(s), "
          f"{'GPU' if use_gpu else 'CPU'}, dataset {version.ref}", file=sys.stderr)
    del n
    record = run_info("train", {"model": asdict(model_cfg), "train": asdict(train_cfg), "dataset": version.ref,
                                "workers": workers, "use_gpu": use_gpu, "cpus_per_worker": cpus_per_worker})
    write_json_atomic(join(run_dir, "run.json"), record)

    m = version.manifest
    shard_refs = {split: [{"path": join(version.path, s.path), "rows": s.rows} for s in m.shards if s.split == split]
                  for split in ("train", "validation")}
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"model": asdict(model_cfg), "train": asdict(train_cfg), "run_dir": run_dir,
                           "shards": shard_refs["train"], "val_shards": shard_refs["validation"],
                           "tokenizer": asdict(m.tokenizer), "tokenizer_definition": version.tokenizer_definition()},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cpus_per_worker},
                                     label_selector=tiers.selector(tiers.Tier.GPU)),
        run_config=RunConfig(name=run_name, storage_path=storage.runs(),
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(max_failures=max_failures)),
    )
    started = time.time()
    result = trainer.fit()
    history = read_metrics(run_dir)
    mine = [h for h in history if h["time"] >= started]
    checkpoint = result.checkpoint.path if result.checkpoint else None
    start_step = mine[0]["start_step"] if mine else (history[-1]["step"] if history else 0)
    return {
        "run": run_name, "path": run_dir, "dataset": version.ref,
        "start_step": start_step, "steps": (mine[-1]["step"] - start_step) if mine else 0,
        "first_loss": mine[0]["loss"] if mine else None, "last_loss": mine[-1]["loss"] if mine else None,
        "val_loss": next((h["val_loss"] for h in reversed(mine) if "val_loss" in h), None),
        "tokens_per_s": mine[-1]["tokens_per_s"] if mine else None,
        "checkpoint": checkpoint, "seconds": round(time.time() - started, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = cli_parser("python -m train", __doc__)
    parser.add_argument("--dataset", required=True, help="NAME or NAME@VERSION of a tier-1 dataset")
    parser.add_argument("--preset", default="debug", choices=sorted(PRESETS), help="model preset (default: debug)")
    parser.add_argument("--run", help="run name; an existing run continues (default: DATASET-PRESET-TIME)")
    parser.add_argument("--workers", type=int, help="training workers (default: GPUs of the gpu tier, else 1)")
    parser.add_argument("--use-gpu", action=argparse.BooleanOptionalAction,
                        help="train on GPUs (default: when the gpu tier has any)")
    parser.add_argument("--cpus-per-worker", type=float, default=1, help="CPUs reserved per worker (default: 1)")
    parser.add_argument("--max-failures", type=int, default=2, help="worker-group restarts from checkpoint")
    add_config_arguments(parser, TrainConfig)
    args = parser.parse_args(argv)
    name = args.dataset.partition("@")[0]
    run_name = args.run or f"{name}-{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        check_name(run_name, "run name")
        train_cfg = TrainConfig(**{**asdict(TRAIN_PRESETS[args.preset]), **overrides(args, TrainConfig)})
        summary = run(preset(args.preset), train_cfg, dataset=args.dataset, run_name=run_name,
                      storage=Storage.from_env(args.storage), workers=args.workers, use_gpu=args.use_gpu,
                      cpus_per_worker=args.cpus_per_worker, max_failures=args.max_failures)
    except (DatasetError, ValueError) as e:
        sys.exit(f"error: {e}")
    if summary["steps"] == 0:
        print(f"[train] run {run_name} is already at step {summary['start_step']}: nothing to do", file=sys.stderr)
    else:
        print(f"[train] run {run_name}: steps {summary['start_step']} -> {summary['start_step'] + summary['steps']}, "
              f"loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}, checkpoint {summary['checkpoint']}",
              file=sys.stderr)
    return finish(summary, args.json)


if __name__ == "__main__":
    main()
