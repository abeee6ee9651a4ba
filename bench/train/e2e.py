"""The real command against plain PyTorch, on the wall clock: `python -m train` end to end (CLI,
embedded Ray, Ray Train, checkpoint at the end) vs a plain loop doing the same steps on the same data.

    python -m bench.train.e2e [--steps 700] [--short-steps 100] [--log-every 10 1] [--batch-size 16] [--workdir DIR]

Every run is a whole process timed from outside, on the same cores: plain
PyTorch, `python -m train --log-every 10` and `--log-every 1`, in turn, at
`--short-steps` and then at `--steps`. The plain loop (`--plain`) builds the
same debug model, reads the same shards with the same `TokenBatches` and
`Prefetch`, runs the same `train_step`, syncs its loss every 10 steps and
saves its weights at the end (bench/train/common.py).

Two lengths split each command's wall time into a fixed cost (start-up,
the final checkpoint, shutdown) and a cost per step (the slope between the
two lengths). Printed: every run; the fixed cost `python -m train` adds;
the whole-command ratio plain/train at `--steps` and for a run whose plain
training takes an hour; and, as the last two lines, the per-step ratio
plain/train with --log-every 10 and with 1 (target >= 0.97).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.train import common

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOUR = 3600.0


def plain(root: str, ref: str, steps: int, batch_size: int, threads: int) -> None:
    """The same training in plain PyTorch, in this process."""
    import torch

    model, _ = common.plain_loop(common.debug_spec(root, ref, batch_size, steps), threads)
    torch.save(model.state_dict(), os.path.join(root, "plain-final.pt"))


def _timed(cmd: list[str], env: dict) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def fit_line(short: int, long: int, seconds: tuple[float, float]) -> tuple[float, float]:
    """(fixed seconds, seconds per step) of a command timed at two lengths."""
    per_step = (seconds[1] - seconds[0]) / (long - short)
    return seconds[0] - per_step * short, per_step


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--steps", type=int, default=700, help="training steps of the long runs")
    parser.add_argument("--short-steps", type=int, default=100, help="training steps of the short runs")
    parser.add_argument("--log-every", type=int, nargs="+", default=[10, 1], help="the train runs' --log-every "
                        "values (default: 10 1)")
    parser.add_argument("--plain", nargs=2, metavar=("ROOT", "REF"), help=argparse.SUPPRESS)  # the plain side
    args = parser.parse_args(argv)
    if args.plain:
        plain(*args.plain, args.steps, args.batch_size, args.threads)
        return
    if not 0 < args.short_steps < args.steps:
        parser.error("need 0 < --short-steps < --steps")
    root, ref = common.make_dataset(args.workdir)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(STRATA_STORAGE=root, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")

    def command(side: str, steps: int) -> list[str]:
        same = ["--batch-size", str(args.batch_size)]
        if side == "plain":
            return [sys.executable, "-m", "bench.train.e2e", "--plain", root, ref, "--steps", str(steps), *same,
                    "--threads", str(args.threads)]
        log_every = side.removeprefix("log")
        return [sys.executable, "-m", "train", "--dataset", ref, "--preset", "debug", "--no-use-gpu",
                "--max-steps", str(steps), *same, "--log-every", log_every, "--eval-every", str(steps),
                "--cpus-per-worker", str(args.threads),
                "--run", f"bench-e2e-{log_every}-{steps}-{time.strftime('%Y%m%d-%H%M%S')}"]

    lengths = (args.short_steps, args.steps)
    sides = {"plain": "plain PyTorch", **{f"log{n}": f"train --log-every {n}" for n in args.log_every}}
    print(f"debug model, batch {args.batch_size}, {args.threads} torch thread(s), dataset {ref}; whole processes "
          f"at {lengths[0]} and {lengths[1]} steps, in turn", flush=True)
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    for steps in lengths:
        for side in sides:
            seconds[side].append(_timed(command(side, steps), env))
    fits = {side: fit_line(*lengths, tuple(seconds[side])) for side in sides}
    for side, label in sides.items():
        fixed, per_step = fits[side]
        print(f"{label:22} {seconds[side][0]:7.1f} s / {seconds[side][1]:7.1f} s: {1e3 * per_step:6.1f} ms a step, "
              f"{fixed:5.1f} s fixed", flush=True)
    plain_fixed, plain_step = fits["plain"]
    trains = [side for side in sides if side != "plain"]
    for side in trains:
        fixed, per_step = fits[side]
        hour = (f"{HOUR / (HOUR * per_step / plain_step + fixed - plain_fixed):.3f}" if per_step > 0 < plain_step
                else "n/a (runs too short to show a slope)")
        print(f"{sides[side]}: {fixed - plain_fixed:.1f} s more fixed cost than plain PyTorch (Ray and Ray Train "
              f"start-up, shutdown); whole command plain/train {seconds['plain'][1] / seconds[side][1]:.3f} at "
              f"{args.steps} steps, {hour} for an hour of training")
    if args.json:
        print(json.dumps({"seconds": seconds, "lengths": lengths, "batch_size": args.batch_size,
                          "fits": {side: {"fixed_s": f, "step_s": s} for side, (f, s) in fits.items()}}))
    for side in trains:
        print(f"ratio plain/train wall per step, --log-every {side[3:]}: {plain_step / fits[side][1]:.3f}")


if __name__ == "__main__":
    main()
