"""Step time under Ray Train's TorchTrainer vs the same loop in plain PyTorch, same CPU, same run.

    python -m bench.train.step [--steps 60] [--warmup 10] [--rounds 2] [--threads 1] [--workdir DIR]

Both run train/loop.py's `train_step` on the debug model over the same
tier-1 dataset (made once under --workdir), with batches read ahead by the
same `Prefetch`, on `--threads` torch threads. The two alternate, plain
first and last, `--rounds` times, and each side's fastest run counts (noise
on a shared machine only ever adds time). The trainer's step time comes from
its own metrics, over the steps after warm-up, excluding evaluation and
checkpoints. Prints every run and, as the last line, the ratio trainer/plain
(target <= 1.05).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from bench.train import common


def configs(preset_name: str, batch_size: int, steps: int, warmup: int):
    from train.loop import TRAIN_PRESETS
    from train.model import preset

    tcfg = replace(TRAIN_PRESETS[preset_name], batch_size=batch_size, max_steps=warmup + steps, log_every=warmup,
                   eval_every=warmup + steps, checkpoint_every=warmup + steps, strategy="ddp")
    return preset(preset_name), tcfg


def plain_step_seconds(storage_root: str, ref: str, mcfg, tcfg, warmup: int, threads: int) -> float:
    """Mean seconds per step after warm-up of the training loop without Ray."""
    import torch

    from train.data import TokenBatches
    from train.loop import Prefetch, lr_at, make_optimizer, train_step
    from train.model import GPT

    torch.set_num_threads(threads)
    _, shards = common.train_shards(storage_root, ref)
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    optimizer = make_optimizer(model, tcfg)
    batches = Prefetch(TokenBatches(shards, batch_size=tcfg.batch_size, seed=tcfg.seed).from_step(0))
    device = torch.device("cpu")
    loss = torch.zeros(())
    try:
        for step in range(tcfg.max_steps):
            if step == warmup:
                loss.item()
                started = time.perf_counter()
            loss += train_step(model, optimizer, [next(batches)], lr_at(step, tcfg), tcfg, device)
            if (step + 1) % tcfg.log_every == 0:
                loss.item()  # the trainer syncs at each report too
                loss.zero_()
        return (time.perf_counter() - started) / (tcfg.max_steps - warmup)
    finally:
        batches.close()


def trainer_step_seconds(storage_root: str, ref: str, mcfg, tcfg, warmup: int, threads: int) -> float:
    """Mean seconds per step after warm-up under TorchTrainer (one worker), from the run's own metrics."""
    from strata.storage import Storage
    from train.trainer import read_metrics, run

    out = run(mcfg, tcfg, dataset=ref, run_name=f"bench-step-{time.strftime('%Y%m%d-%H%M%S')}",
              storage=Storage(storage_root), workers=1, use_gpu=False, cpus_per_worker=threads)
    rows = read_metrics(out["path"])
    tokens_per_step = tcfg.batch_size * mcfg.seq_len
    seconds, steps, prev = 0.0, 0, None
    for r in rows:
        if prev is not None and prev >= warmup:
            seconds += tokens_per_step * (r["step"] - prev) / r["tokens_per_s"]
            steps += r["step"] - prev
        prev = r["step"]
    return seconds / steps


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--steps", type=int, default=60, help="timed steps (after warm-up)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="trainer runs, each between two plain ones")
    args = parser.parse_args(argv)

    from strata.connect import connect

    root, ref = common.make_dataset(args.workdir)
    connect()
    mcfg, tcfg = configs("debug", args.batch_size, args.steps, args.warmup)
    print(f"debug model, batch {args.batch_size} x {mcfg.seq_len}, {args.steps} timed steps after {args.warmup}, "
          f"{args.threads} torch thread(s), dataset {ref}", flush=True)
    plain = [plain_step_seconds(root, ref, mcfg, tcfg, args.warmup, args.threads)]
    trainer = []
    for _ in range(args.rounds):
        trainer.append(trainer_step_seconds(root, ref, mcfg, tcfg, args.warmup, args.threads))
        plain.append(plain_step_seconds(root, ref, mcfg, tcfg, args.warmup, args.threads))
    for name, runs in (("plain PyTorch", plain), ("TorchTrainer", trainer)):
        print(f"{name:15} {min(runs) * 1e3:8.2f} ms/step  (runs: {', '.join(f'{r * 1e3:.2f}' for r in runs)})")
    if args.json:
        print(json.dumps({"plain_s": plain, "trainer_s": trainer}))
    trainer, plain = min(trainer), min(plain)
    print(f"ratio TorchTrainer/plain step time: {trainer / plain:.3f}")


if __name__ == "__main__":
    main()
