"""Per-rank, deterministic, resumable batches from a dataset version's shards.

Every epoch orders the shards by a seeded permutation and gives each rank an
equal, contiguous range of rows, so every rank runs the same number of steps
(a collective on unequal counts hangs). Rows are shuffled in a seeded buffer.
The position is (epoch, batch index): skipping to it replays the same order,
so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from strata.dataset import read_rows


@dataclass(frozen=True)
class ShardRef:
    path: str
    rows: int


class TokenBatches:
    def __init__(self, shards: list[ShardRef], *, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle_buffer: int = 4096):
        self.shards, self.batch_size = shards, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle_buffer = max(shuffle_buffer, batch_size)
        self.rows_per_rank = sum(s.rows for s in shards) // world_size
        self.steps_per_epoch = self.rows_per_rank // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{sum(s.rows for s in shards)} rows cannot give {world_size} worker(s) "
                             f"one batch of {batch_size}: use a smaller batch or a larger dataset")

    def _rows(self, epoch: int) -> Iterator[np.ndarray]:
        """This rank's rows for `epoch` in stream order, as (n, seq_len + 1) arrays."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        lo, hi = self.rank * self.rows_per_rank, (self.rank + 1) * self.rows_per_rank
        start = 0
        for i in order:
            shard = self.shards[i]
            end = start + shard.rows
            if end > lo and start < hi:
                rows = read_rows(shard.path)
                yield rows[max(lo - start, 0): min(hi, end) - start]
            start = end

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[np.ndarray]:
        """Batches (batch_size, seq_len + 1) of `epoch`, starting after `skip` batches."""
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        pending = np.zeros((0, 0), dtype=np.int64)
        emitted = 0
        for rows in self._rows(epoch):
            pending = rows if pending.size == 0 else np.concatenate([pending, rows])
            while len(pending) >= self.shuffle_buffer:
                chunk, pending = pending[: self.shuffle_buffer], pending[self.shuffle_buffer:]
                emitted, leftover = yield from self._emit(chunk[rng.permutation(len(chunk))], emitted, skip)
                pending = leftover if pending.size == 0 else np.concatenate([leftover, pending])
        if pending.size:
            yield from self._emit(pending[rng.permutation(len(pending))], emitted, skip)

    def _emit(self, rows: np.ndarray, emitted: int, skip: int):
        n = len(rows) // self.batch_size
        for b in range(n):
            if emitted >= skip:
                yield rows[b * self.batch_size: (b + 1) * self.batch_size]
            emitted += 1
        return emitted, rows[n * self.batch_size:]

    def from_step(self, step: int) -> Iterator[np.ndarray]:
        """Endless batches starting at global step `step` (resume)."""
        epoch, skip = divmod(step, self.steps_per_epoch)
        while True:
            yield from self.epoch(epoch, skip)
            epoch, skip = epoch + 1, 0
