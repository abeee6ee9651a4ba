"""Start-up on the wall clock: from launching `python -m train` (debug preset, embedded Ray) to its first
training step, against a plain PyTorch process that imports torch, builds the same model, reads the
same first batch and takes one step, measured in the same run.

    python -m bench.train.startup [--repeats 3] [--workdir DIR] [--json]

The first step is the first row of the run's metrics.jsonl (`--log-every 1`); its `time` is when rank 0
wrote it. Each line the command prints is stamped when it arrives, so the gaps between them say where
the time goes (imports, Ray's start, the controller, the worker group). Printed: each run's time to
its first step and what it spent where, the median, and the ratio plain/train (the issue's target is
10 s to the first step on 2 cores).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from bench.train import common

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def first_step(root: str, ref: str, run: str, env: dict) -> dict:
    """Launch `python -m train` and time it: to the first step row, and to its exit."""
    cmd = [sys.executable, "-m", "train", "--dataset", ref, "--preset", "debug", "--no-use-gpu", "--max-steps", "3",
           "--log-every", "1", "--eval-every", "3", "--run", run]
    started = time.time()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = [(time.time() - started, line.rstrip()) for line in proc.stderr]
    if proc.wait():
        raise RuntimeError(f"{' '.join(cmd)} failed:\n" + "\n".join(text for _, text in lines[-30:]))
    ended = time.time() - started
    with open(os.path.join(root, "runs", run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    step = next(r for r in rows if "loss" in r)
    begin = next(r for r in rows if r.get("event") == "start")
    return {"first_step_s": step["time"] - started, "worker_start_s": begin["time"] - started, "exit_s": ended,
            "lines": lines}


PLAIN = """
import time, sys
t0 = float(sys.argv[1])
import torch
from bench.train import common
spec = common.debug_spec(sys.argv[2], sys.argv[3], 16, 1)
torch.manual_seed(0)
from train.data import open_batches
from train.model import GPT
from train.step import make_optimizer, train_step
from train.config import lr_at
model = GPT(spec.model)
opt = make_optimizer(model, spec.train)
batch = next(open_batches(spec.sources, batch_size=16, rank=0, world_size=1, seed=0).from_step(0))
train_step(model, opt, [batch], lr_at(0, spec.train), spec.train, torch.device("cpu")).item()
print(time.time() - t0)
"""


def plain_first_step(root: str, ref: str, env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", PLAIN, repr(time.time()), root, ref], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each side (default 3)")
    args = parser.parse_args(argv)
    root, ref = common.make_dataset(args.workdir)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(STRATA_STORAGE=root, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    runs, plains = [], []
    for i in range(args.repeats):
        plains.append(plain_first_step(root, ref, env))
        r = first_step(root, ref, f"bench-startup-{time.strftime('%Y%m%d-%H%M%S')}-{i}", env)
        runs.append(r)
        print(f"launch {i + 1}: first step at {r['first_step_s']:5.1f} s (worker started {r['worker_start_s']:5.1f} s),"
              f" exit at {r['exit_s']:5.1f} s; plain PyTorch's first step {plains[-1]:4.1f} s", flush=True)
        for at, text in r["lines"]:
            print(f"    {at:5.1f} s  {text[:110]}")
    train = statistics.median(r["first_step_s"] for r in runs)
    plain = statistics.median(plains)
    if args.json:
        print(json.dumps({"first_step_s": [r["first_step_s"] for r in runs], "exit_s": [r["exit_s"] for r in runs],
                          "plain_first_step_s": plains}))
    print(f"median first step: python -m train {train:.1f} s, plain PyTorch {plain:.1f} s")
    print(f"ratio plain/train time to the first step: {plain / train:.3f}")


if __name__ == "__main__":
    main()
