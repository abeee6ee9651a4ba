"""What rank 0 writes while a run trains: throughput and MFU per window (`Meter`), and metrics.jsonl and
TensorBoard (`MetricsLog`)."""

from __future__ import annotations

import os
import time

from strata.data.storage import JsonlWriter


class Meter:
    """Throughput over wall time: each window's, and the whole loop's."""

    def __init__(self, flops_per_token: float, peak: float | None, tokens_per_step: int, world: int,
                 start_step: int):
        self.flops_per_token, self.peak, self.tokens_per_step = flops_per_token, peak, tokens_per_step
        self.world, self.start_step, self.last_step = world, start_step, start_step

    def _mfu(self, tps: float) -> float | None:
        return self.flops_per_token * tps / self.world / self.peak if self.peak else None

    def window(self, done: int, losses: list[float], seconds: float, shares: dict, **extra) -> dict:
        steps, self.last_step = done - self.last_step, done
        tps = self.tokens_per_step * steps / seconds
        return {"step": done, "start_step": self.start_step, "loss": sum(losses) / steps, **extra,
                "tokens_per_s": tps, "tokens_per_s_per_worker": tps / self.world, "mfu": self._mfu(tps),
                "data_wait": shares["data"], "world_size": self.world,
                **{f"share_{k}": v for k, v in shares.items()}}

    def total(self, seconds: float, shares: dict) -> dict:
        tokens = self.tokens_per_step * (self.last_step - self.start_step)
        return {"steps": self.last_step - self.start_step, "tokens": tokens, "loop_s": seconds,
                "tokens_per_s": tokens / seconds, "mfu": self._mfu(tokens / seconds),
                **{f"share_{k}": v for k, v in shares.items()}}


class MetricsLog:
    """Rank 0's per-step metrics: metrics.jsonl (JsonlWriter) and TensorBoard; other ranks write nothing.
    On local disk each row is appended at once; on an object store, where an append is a PUT, step rows
    go out every FLUSH_S seconds, at reports and with events, so logging every step costs a PUT per
    interval, not per step. TensorBoard's own thread writes its events."""

    FLUSH_S = 5.0

    def __init__(self, run_dir: str, rank: int):
        self.jsonl = JsonlWriter(f"{run_dir}/metrics.jsonl") if rank == 0 else None
        self.tb = tensorboard_writer(run_dir) if rank == 0 else None
        self.rows: list[dict] = []
        self.flushed = time.perf_counter()

    def event(self, row: dict) -> None:
        if self.jsonl:
            self.rows.append({"time": time.time(), **row})
            self.flush()

    def step(self, metrics: dict, losses: list[float]) -> None:
        if not self.jsonl:
            return
        self.rows.append({"time": time.time(), **metrics, "step_losses": losses})
        if self.tb:
            for k, v in metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "start_step"):
                    self.tb.add_scalar(f"train/{k}", v, metrics["step"])
        if self.jsonl.local or time.perf_counter() - self.flushed >= self.FLUSH_S or metrics.get("reported"):
            self.flush()

    def flush(self) -> None:
        self.jsonl.extend(self.rows)
        self.rows, self.flushed = [], time.perf_counter()

    def close(self) -> None:
        if self.jsonl:
            self.flush()
        if self.tb:
            self.tb.close()


def tensorboard_writer(run_dir: str, suffix: str = ""):
    """TensorBoard events under the run, when the run lives on a local or mounted filesystem (`suffix`: a
    writer beside rank 0's, in an events file of its own)."""
    import pyarrow.fs as pafs

    from strata.data.storage import filesystem

    fs, path = filesystem(run_dir)
    if not isinstance(fs, pafs.LocalFileSystem):
        return None
    from tensorboardX import SummaryWriter

    return SummaryWriter(os.path.join(path, "tensorboard"), flush_secs=10, filename_suffix=suffix)  # its own thread writes the events
