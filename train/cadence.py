"""When the training loop logs, reports to Ray and checkpoints: a small pure policy, and the clock
that splits the loop's wall time into named shares. Neither touches Ray or torch.

`ray.train.report` blocks until Ray Train's controller polls the worker, and
polls are at least RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s) apart: a loop that
reports every few steps spends most of its time blocked. So every step's
metrics stay on the worker (metrics.jsonl, TensorBoard) at `log_every`, and
Ray hears from the loop on a timer no shorter than the poll interval, at
every checkpoint, and at the end.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

POLL_ENV, POLL_DEFAULT_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", 2.0


def poll_interval_s() -> float:
    """Ray Train's controller poll interval (its own setting; read the same way Ray reads it)."""
    return float(os.environ.get(POLL_ENV) or POLL_DEFAULT_S)


@dataclass(frozen=True)
class Decision:
    """What to do at a log point."""

    report: bool
    """Hand metrics (and any written checkpoint) to Ray now."""
    save: bool
    """Start a checkpoint now."""
    reason: str
    """Why a checkpoint is taken: end, preemption, interval."""


@dataclass
class Cadence:
    """The loop's schedule; `now` is the caller's clock (time.perf_counter)."""

    max_steps: int
    log_every: int
    report_every_s: float
    checkpoint_every: int = 0
    checkpoint_every_s: float = 0.0
    task_every: int = 0
    """With --eval-task: also checkpoint every this many steps (--eval-every), for the evaluation to read."""
    start_step: int = 0
    started: float = 0.0
    drain_check_every_s: float = 2.0
    """How often to ask Ray whether a node of the run is being drained: the question is a round trip to
    an actor and a barrier (about 15 ms), too dear for every log point; drain notices come tens of
    seconds to minutes ahead."""
    last_report: float = field(init=False)
    last_save: float = field(init=False)
    last_check: float = field(init=False)

    def __post_init__(self):
        # Never report faster than Ray polls: a report before the last one was drained blocks the loop.
        self.report_every_s = max(self.report_every_s, 1.5 * poll_interval_s())
        self.last_report = self.last_save = self.last_check = self.started

    def log_due(self, done: int) -> bool:
        """Whether step `done` is a log point (metrics synced across ranks and written on the worker)."""
        return (done == self.start_step + 1 or done == self.max_steps or done % self.log_every == 0
                or self._by_steps(done))

    def _by_steps(self, done: int) -> bool:
        return any(every and done % every == 0 for every in (self.checkpoint_every, self.task_every))

    def timers(self, now: float) -> tuple[bool, bool, bool]:
        """(report timer elapsed, checkpoint timer elapsed, drain-check timer elapsed) on this rank;
        ranks OR them together."""
        return (now - self.last_report >= self.report_every_s,
                bool(self.checkpoint_every_s) and now - self.last_save >= self.checkpoint_every_s,
                now - self.last_check >= self.drain_check_every_s)

    def decide(self, done: int, *, report_due: bool, save_due: bool, preempted: bool,
               checkpoint_written: bool) -> Decision:
        """The agreed timers (any rank's), a drain notice and whether a background checkpoint is
        written (and so ready to hand over) give this log point's decision."""
        last = done == self.max_steps
        save = last or preempted or save_due or self._by_steps(done)
        reason = "end" if last else "preemption" if preempted else "interval"
        return Decision(report=save or report_due or checkpoint_written or done == self.start_step + 1,
                        save=save, reason=reason)

    def checked(self, now: float) -> None:
        self.last_check = now

    def reported(self, now: float) -> None:
        self.last_report = now

    def saved(self, now: float) -> None:
        self.last_save = now


SHARES = ("data", "eval", "checkpoint", "report")


class Clock:
    """Wall time of the loop split into named shares; compute is the rest, so the shares of any window
    add up to 1. `window()` closes a window and returns its seconds and shares."""

    def __init__(self, now: float | None = None):
        self.start = self.mark = time.perf_counter() if now is None else now
        self.total = dict.fromkeys(SHARES, 0.0)
        self._at_mark = dict(self.total)

    def add(self, share: str, seconds: float) -> None:
        self.total[share] += seconds

    @contextlib.contextmanager
    def timed(self, share: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.add(share, time.perf_counter() - t)

    def window(self, now: float | None = None) -> tuple[float, dict[str, float]]:
        now = time.perf_counter() if now is None else now
        seconds = max(now - self.mark, 1e-9)
        shares = {k: (self.total[k] - self._at_mark[k]) / seconds for k in SHARES}
        shares["compute"] = 1.0 - sum(shares.values())
        self.mark, self._at_mark = now, dict(self.total)
        return seconds, shares

    def overall(self, now: float | None = None) -> tuple[float, dict[str, float]]:
        """Seconds since the loop started, and the shares over all of it."""
        now = time.perf_counter() if now is None else now
        seconds = max(now - self.start, 1e-9)
        shares = {k: self.total[k] / seconds for k in SHARES}
        shares["compute"] = 1.0 - sum(shares.values())
        return seconds, shares
