"""A training run's state as its files hold it, read in one place: its launches (launches/NNNN.json, each
launch's resolved config) and its log (metrics.jsonl: a row per log point and an event row per start,
preemption and end; a sweep trial's log has the same rows). The training driver's summary and progress
line, `python -m strata report` and the tests all read a run through here; rank 0 writes the log
(train/metrics.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from strata.data.storage import (
    JsonlTail,
    create_exclusive,
    join,
    list_dir,
    read_json,
    read_jsonl,
    write_json_atomic,
)

LOG = "metrics.jsonl"
TASK_EVAL = "task_eval"  # an event row: an evaluation during training (--eval-task), at its checkpoint's step


def is_step(row: dict) -> bool:
    """A log point (loss at a step), not an event."""
    return "loss" in row and "step" in row


@dataclass(frozen=True)
class RunLog:
    """A run's log rows in order, those of a time window when asked."""

    rows: tuple[dict, ...]

    @property
    def steps(self) -> list[dict]:
        """The run's curve, each step once: metrics.jsonl is append-only, so a launch that resumed from a
        checkpoint before steps an earlier launch had logged (it was stopped after them) logs them again;
        the rows kept are those of the launch that went on."""
        out: list[dict] = []
        for r in self.rows:
            if r.get("event") == "start":
                while out and out[-1]["step"] > r.get("start_step", 0):
                    out.pop()
            elif is_step(r):
                out.append(r)
        return out

    def events(self, kind: str) -> list[dict]:
        return [r for r in self.rows if r.get("event") == kind]

    def launch_steps(self) -> list[int]:
        """The step each launch started at (a restart after a failure, at the same step, is the same launch)."""
        starts = [r["start_step"] for r in self.events("start")]
        return [s for i, s in enumerate(starts) if i == 0 or s != starts[i - 1]]


def read_log(run_dir: str, since: float = 0.0, until: float = float("inf")) -> RunLog:
    """The run's log rows written from `since` to `until` (wall clock)."""
    return RunLog(tuple(r for r in read_jsonl(join(run_dir, LOG)) if since <= r.get("time", 0) <= until))


def read_metrics(run_dir: str) -> list[dict]:
    """Every log point of the run, every launch's."""
    return read_log(run_dir).steps


def follow(run_dir: str) -> JsonlTail:
    """The rows appended to the run's log since the last `read()` (the driver's progress)."""
    return JsonlTail(join(run_dir, LOG))


def read_launches(run_dir: str) -> list[dict]:
    """Every launch of the run (its resolved config, code and library versions), oldest first."""
    return [read_json(join(run_dir, "launches", name)) for name, d in list_dir(join(run_dir, "launches"))
            if not d and name.endswith(".json")]


def record_launch(run_dir: str, n: int, record: dict) -> None:
    """Each launch's config is kept (launches/NNNN.json); run.json is the first launch's."""
    if not create_exclusive(join(run_dir, "launches", f"{n:04d}.json"), (json.dumps(record, indent=2) + "\n").encode()):
        raise RuntimeError(f"launch {n} of {run_dir} was recorded by another process: is the run's lease broken?")
    if n == 0:
        write_json_atomic(join(run_dir, "run.json"), record)
