"""What the training driver shows while its run trains, read from rank 0's metrics.jsonl.

One line per log point, at most one every few seconds (`step 130/300 · loss 2.42 · 16.0k tok/s · ETA
1m20s`), or a progress bar when stderr is a terminal; the workers' events (a node being drained, an
evaluation) in words. Ray's own worker logs stay in Ray's log files (`--verbose` shows them): the
driver speaks for the run.
"""

from __future__ import annotations

import sys
import time

from strata.accounting.runlog import follow, is_step


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:.1f}M" if tokens_per_s >= 1e6 else f"{tokens_per_s / 1e3:.1f}k"


def step_size(start: dict) -> str:
    """What one optimizer step trains on, from a worker's start event, and whether the blocks compiled."""
    mb, accum, world, tokens = start["micro_batch"], start["grad_accum"], start["world_size"], start["tokens_per_step"]
    seq = tokens // (mb * accum * world)
    line = (f"{tokens:,} tokens per step: micro-batch {mb} x {seq} tokens x {accum} accumulated x {world} "
            f"worker{'s' if world > 1 else ''}")
    if target := start.get("tokens_per_step_target"):
        line += f" (recipe {target:,}{'' if target == tokens else ', as near as this micro-batch and world come'})"
    if start.get("compiled", "").startswith("off:"):
        line += f"; compile {start['compiled']} (eager instead)"
    return line


class Progress:
    """Follows a run's metrics.jsonl from `since` (this launch's start) and says how far it is."""

    def __init__(self, run_dir: str, max_steps: int, since: float, out=None, every_s: float = 5.0,
                 tag: str = "[train]"):
        self.tail = follow(run_dir)
        out = out or sys.stderr  # the stderr of now, not of import time
        self.max_steps, self.since, self.out, self.every_s, self.tag = max_steps, since, out, every_s, tag
        self.first: tuple[float, int] | None = None  # (time, step) of this launch's first log point
        self.last: dict | None = None  # the newest log point read
        self.shown, self.shown_step = 0.0, None
        self.bar = None
        if getattr(out, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, desc=tag, unit="step", file=out, dynamic_ncols=True, leave=True)

    def poll(self, final: bool = False) -> None:
        rows = [r for r in self.tail.read() if r.get("time", 0) >= self.since]
        for r in rows:
            if r.get("event") == "start":
                self.first = (r["time"], r["start_step"])
                self._say(step_size(r))
                if self.bar is not None:
                    self.bar.n = r["start_step"]
            elif r.get("event") == "preempted":
                self._say(f"a node of this run is being drained: checkpointed at step {r['step']}")
            elif r.get("event") == "slow_step":
                n, first = r["micro_batches"], r["first_micro_s"]
                self._say(f"one step is {n:,} micro-batches, about {duration(first * n)} on this device (the first "
                          f"took {first:.2f} s); --tokens-per-step (or --grad-accum, --batch-size) makes steps smaller")
            elif r.get("event") == "micro":
                left = r["seconds"] / r["done"] * (r["of"] - r["done"])
                self._say(f"step {r['step']}/{self.max_steps}: micro-batch {r['done']:,}/{r['of']:,} after "
                          f"{duration(r['seconds'])}; this step ends in about {duration(left)}")
            elif is_step(r):
                self.last = r
        last = self.last
        if last is None or last["step"] == self.shown_step:
            return
        if self.bar is not None:
            self.bar.n = last["step"]
            self.bar.set_postfix_str(self.line(last, with_step=False), refresh=True)
            self.shown_step = last["step"]
        elif final or time.monotonic() - self.shown >= self.every_s:
            self._say(self.line(last))
            self.shown, self.shown_step = time.monotonic(), last["step"]

    def line(self, r: dict, with_step: bool = True) -> str:
        parts = [f"step {r['step']}/{self.max_steps}"] if with_step else []
        parts.append(f"loss {r['loss']:.3f}")
        if r.get("val_loss") is not None:
            parts.append(f"val {r['val_loss']:.3f}")
        parts.append(f"{rate(r['tokens_per_s'])} tok/s")
        if self.first and r["step"] > self.first[1] and r["step"] < self.max_steps:
            per_step = (r["time"] - self.first[0]) / (r["step"] - self.first[1])
            parts.append(f"ETA {duration(per_step * (self.max_steps - r['step']))}")
        return " · ".join(parts)

    def close(self) -> None:
        self.poll(final=True)
        if self.bar is not None:
            self.bar.close()

    def _say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"{self.tag} {text}", file=self.out)
        else:
            print(f"{self.tag} {text}", file=self.out, flush=True)
