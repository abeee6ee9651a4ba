"""The real command against plain PyTorch, on the wall clock: `python -m train` end to end (CLI,
embedded Ray, Ray Train, checkpoint at the end) vs a plain loop doing the same steps on the same data.

    python -m bench.train.e2e [--steps 400] [--batch-size 16] [--threads 1] [--workdir DIR]

Both are whole processes timed from outside, on the same cores, alternating:
plain, train with --log-every 10, train with --log-every 1, plain. The plain
loop (`--plain`) builds the same debug model, reads the same shards with
the same `TokenBatches` and `Prefetch`, runs the same `train_step`, syncs its
loss every 10 steps and saves its weights at the end. Each side's fastest run
counts (noise on a shared machine only adds time). The last two lines are the
throughput ratios plain wall / `python -m train` wall with --log-every 10
and with 1 (target >= 0.97: on a short run Ray's start-up alone is more than 3%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

from bench.train import common

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain(root: str, ref: str, steps: int, batch_size: int, threads: int) -> None:
    """The same training in plain PyTorch, in this process."""
    import torch

    from train.data import TokenBatches
    from train.loop import TRAIN_PRESETS, Prefetch, lr_at, make_optimizer, train_step
    from train.model import GPT, fit_to_dataset, preset

    torch.set_num_threads(threads)
    version, shards = common.train_shards(root, ref)
    mcfg = fit_to_dataset(preset("debug"), vocab=version.manifest.tokenizer.vocab_size, seq_len=version.manifest.seq_len)
    tcfg = replace(TRAIN_PRESETS["debug"], max_steps=steps, batch_size=batch_size)
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    optimizer = make_optimizer(model, tcfg)
    batches = Prefetch(TokenBatches(shards, batch_size=batch_size, seed=tcfg.seed).from_step(0))
    device, loss = torch.device("cpu"), torch.zeros(())
    try:
        for step in range(steps):
            loss += train_step(model, optimizer, [next(batches)], lr_at(step, tcfg), tcfg, device)
            if (step + 1) % 10 == 0:
                loss.item()
                loss.zero_()
    finally:
        batches.close()
    torch.save(model.state_dict(), os.path.join(root, "plain-final.pt"))


def _timed(cmd: list[str], env: dict) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--steps", type=int, default=400, help="training steps of every run")
    parser.add_argument("--plain", nargs=2, metavar=("ROOT", "REF"), help=argparse.SUPPRESS)  # the plain side
    args = parser.parse_args(argv)
    if args.plain:
        plain(*args.plain, args.steps, args.batch_size, args.threads)
        return
    root, ref = common.make_dataset(args.workdir)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(STRATA_STORAGE=root, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    same = ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--threads", str(args.threads)]
    plain_cmd = [sys.executable, "-m", "bench.train.e2e", "--plain", root, ref, *same]

    def train_cmd(log_every: int) -> list[str]:
        return [sys.executable, "-m", "train", "--dataset", ref, "--preset", "debug", "--no-use-gpu",
                "--max-steps", str(args.steps), "--batch-size", str(args.batch_size), "--log-every", str(log_every),
                "--eval-every", str(args.steps), "--cpus-per-worker", str(args.threads),
                "--run", f"bench-e2e-{log_every}-{time.strftime('%Y%m%d-%H%M%S')}"]

    print(f"debug model, {args.steps} steps of batch {args.batch_size}, {args.threads} torch thread(s), "
          f"dataset {ref}; whole processes, alternating", flush=True)
    runs = {"plain": [_timed(plain_cmd, env)], "log10": [_timed(train_cmd(10), env)],
            "log1": [_timed(train_cmd(1), env)]}
    runs["plain"].append(_timed(plain_cmd, env))
    for name, label in (("plain", "plain PyTorch"), ("log10", "train --log-every 10"),
                        ("log1", "train --log-every 1")):
        print(f"{label:22} {min(runs[name]):8.1f} s  (runs: {', '.join(f'{r:.1f}' for r in runs[name])})")
    best = {k: min(v) for k, v in runs.items()}
    if args.json:
        print(json.dumps({"seconds": runs, "steps": args.steps, "batch_size": args.batch_size}))
    print(f"ratio plain/train wall, --log-every 10: {best['plain'] / best['log10']:.3f}")
    print(f"ratio plain/train wall, --log-every 1: {best['plain'] / best['log1']:.3f}")


if __name__ == "__main__":
    main()
