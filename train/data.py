"""Per-rank, deterministic, resumable batches from a dataset version's shards.

Every epoch orders the shards by a seeded permutation and gives each rank an
equal, contiguous range of rows, so every rank runs the same number of steps
(a collective on unequal counts hangs). Rows are shuffled in a seeded buffer.
The position is (epoch, batch index): skipping to it replays the same order,
so a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import math
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


class Mixture:
    """Which source each row of a mixed stream comes from, as a function of the row's index alone.

    Sources split off in turn: source 0 takes its share p0 of all rows, source 1 its share of the rest,
    and so on. At each split the first n rows send floor(n * p + 1/2) rows to that source (a Beatty
    sequence), so the counts after any number of rows are closed-form and within one row per split of
    the weights, and row r's source and its position in that source's stream need no history: a resumed
    run computes the same batches from its step alone.
    """

    def __init__(self, weights: list[float]):
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, not {weights}")
        total = sum(weights)
        self.weights = [w / total for w in weights]
        rest, self.splits = 1.0, []
        for w in self.weights[:-1]:
            self.splits.append(min(w / rest, 1.0))
            rest -= w

    @staticmethod
    def _taken(n: int, p: float) -> int:
        return math.floor(n * p + 0.5)

    def counts(self, n: int) -> list[int]:
        """Rows of each source among the first n rows of the stream."""
        out = []
        for p in self.splits:
            out.append(self._taken(n, p))
            n -= out[-1]
        return [*out, n]

    def source(self, r: int) -> tuple[int, int]:
        """(source, position in that source's stream) of row r."""
        for i, p in enumerate(self.splits):
            before = self._taken(r, p)
            if self._taken(r + 1, p) > before:
                return i, before
            r -= before
        return len(self.splits), r


class MixedBatches:
    """Batches whose rows come from several datasets in proportion to their weights (`Mixture`); each
    source is its own endless `TokenBatches` stream of rows (which wraps around, an epoch at a time)."""

    def __init__(self, sources: list[TokenBatches], weights: list[float], *, batch_size: int):
        self.sources, self.mixture, self.batch_size = sources, Mixture(weights), batch_size
        self.steps_per_epoch = max(1, sum(s.rows_per_rank for s in sources) // batch_size)

    def rows_taken(self, step: int) -> list[int]:
        """Rows this rank has drawn from each source after `step` batches."""
        return self.mixture.counts(step * self.batch_size)

    def repeats(self, step: int) -> list[float]:
        """Passes over each source's rows after `step` batches (1.0: every row seen once)."""
        return [n / s.rows_per_rank for n, s in zip(self.rows_taken(step), self.sources, strict=True)]

    def from_step(self, step: int) -> Iterator[np.ndarray]:
        """Endless batches starting at batch `step` (resume)."""
        streams = [s.from_step(n) for s, n in zip(self.sources, self.rows_taken(step), strict=True)]
        r = step * self.batch_size
        while True:
            rows = [next(streams[self.mixture.source(r + j)[0]]) for j in range(self.batch_size)]
            r += self.batch_size
            yield np.concatenate(rows)
