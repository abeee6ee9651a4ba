"""Per-rank, deterministic, resumable batches from a dataset version's shards.

Every epoch orders the shards by a seeded permutation and gives each rank an
equal, contiguous range of rows, so every rank runs the same number of steps
(a collective on unequal counts hangs). Rows are shuffled in a seeded buffer.
The position is (epoch, batch index): a resumed run sees exactly the batches an
uninterrupted one would. It seeks there without reading what comes before:
which rows each shuffle buffer held follows from the seed alone, so a resume
reads the few rows the buffer carries over and then only the row ranges from
its position on (strata.data.rows.read_rows reads just the row groups that hold
a range), whatever its position in the epoch.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from strata.data.rows import read_rows

if TYPE_CHECKING:
    from train.config import TrainConfig


@dataclass(frozen=True)
class ShardRef:
    path: str
    rows: int


@dataclass(frozen=True)
class Source:
    """One dataset a run trains on: its ref, its weight in the mixture, its training and validation shards."""

    name: str
    weight: float
    shards: tuple[ShardRef, ...]
    val_shards: tuple[ShardRef, ...]

    @classmethod
    def of(cls, version, weight: float) -> Source:
        """The source of a dataset version (strata.data.dataset.DatasetVersion) at `weight`."""
        def split(name):
            return tuple(ShardRef(version.file(s.path), s.rows) for s in version.shards if s.split == name)

        return cls(version.ref, weight, split("train"), split("validation"))


Reader = Callable[..., np.ndarray]
"""`read(path, start=0, stop=None)`: rows [start, stop) of a shard (strata.data.rows.read_rows)."""
READ_ROWS = 4096  # rows read at a time: four of a shard's row groups (pipelines/pack.py), never a whole shard


class ShardCache:
    """`read_rows` that keeps the shards it read, up to `max_rows` rows (the oldest go first): a sweep's
    trial process trains config after config on the same shards and reads each once."""

    def __init__(self, max_rows: int):
        self.max_rows, self.rows = max_rows, 0
        self.shards: OrderedDict[str, np.ndarray] = OrderedDict()

    def __call__(self, path: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self._whole(path)[start:stop]

    def _whole(self, path: str) -> np.ndarray:
        if (rows := self.shards.get(path)) is not None:
            self.shards.move_to_end(path)
            return rows
        rows = read_rows(path)
        while self.shards and self.rows + len(rows) > self.max_rows:
            self.rows -= len(self.shards.popitem(last=False)[1])
        if len(rows) <= self.max_rows:
            self.shards[path] = rows
            self.rows += len(rows)
        return rows


def open_batches(sources: list[Source], *, batch_size: int, rank: int, world_size: int, seed: int,
                 read: Reader = read_rows) -> TokenBatches | MixedBatches:
    """A rank's batch stream over a run's sources: the one data path of a run's workers and a sweep's trials
    (the same sources, batch, world and seed give the same batches in the same order)."""
    streams = [TokenBatches(list(src.shards), batch_size=1 if len(sources) > 1 else batch_size, rank=rank,
                            world_size=world_size, seed=seed, read=read) for src in sources]
    if len(sources) == 1:
        return streams[0]
    return MixedBatches(streams, [s.weight for s in sources], batch_size=batch_size)


class TokenBatches:
    def __init__(self, shards: list[ShardRef], *, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, shuffle_buffer: int = 4096, read: Reader = read_rows):
        self.shards, self.batch_size, self.read = shards, batch_size, read
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle_buffer = max(shuffle_buffer, batch_size)
        self.rows_per_rank = sum(s.rows for s in shards) // world_size
        self.steps_per_epoch = self.rows_per_rank // batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(f"{sum(s.rows for s in shards)} rows cannot give {world_size} worker(s) "
                             f"one batch of {batch_size}: use a smaller batch or a larger dataset")

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))

    def _rows(self, epoch: int, first: int = 0) -> Iterator[np.ndarray]:
        """This rank's rows for `epoch` in stream order from its `first`, as (n, seq_len + 1) arrays read
        READ_ROWS (or a shuffle buffer, if smaller) at a time, aligned to the shard's row groups."""
        piece = min(READ_ROWS, self.shuffle_buffer)
        lo, hi = self.rank * self.rows_per_rank + first, (self.rank + 1) * self.rows_per_rank
        start = 0
        for i in self._order(epoch):
            shard = self.shards[i]
            end = start + shard.rows
            if end > lo and start < hi:
                a, b = max(lo - start, 0), min(hi, end) - start
                while a < b:
                    stop = min(b, (a // piece + 1) * piece)
                    yield self.read(shard.path, a, stop)
                    a = stop
            start = end

    def _rows_at(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The rows at these positions of this rank's stream for `epoch`, each read on its own."""
        order = self._order(epoch)
        starts = np.cumsum([0] + [self.shards[i].rows for i in order])
        out = []
        for p in positions + self.rank * self.rows_per_rank:
            k = int(np.searchsorted(starts, p, side="right")) - 1
            at = int(p - starts[k])
            out.append(self.read(self.shards[order[k]].path, at, at + 1))
        return np.concatenate(out)

    def _seek(self, rng: np.random.Generator, skip: int) -> tuple[int, np.ndarray, int]:
        """Pass over the full shuffle buffers before batch `skip` without reading them: (buffers passed, the
        stream positions of the rows the last one carries over, the stream position after it). Each buffer
        holds the rows the previous one carried over, then the next rows of the stream; `rng` is left where
        reading them would have left it."""
        size, per = self.shuffle_buffer, self.shuffle_buffer // self.batch_size
        carried = size - per * self.batch_size
        full = 0 if self.rows_per_rank < size else 1 + (self.rows_per_rank - size) // (size - carried)
        left, at = np.zeros(0, dtype=np.int64), 0
        for _ in range(min(skip // per, full)):
            held = np.concatenate([left, np.arange(at, at + size - len(left))])
            at += size - len(left)
            left = held[rng.permutation(size)][per * self.batch_size:]
        return min(skip // per, full), left, at

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[np.ndarray]:
        """Batches (batch_size, seq_len + 1) of `epoch`, starting after `skip` batches."""
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        passed, left, at = self._seek(rng, skip)
        emitted = passed * (self.shuffle_buffer // self.batch_size)
        pending = self._rows_at(epoch, left) if len(left) else np.zeros((0, 0), dtype=np.int64)
        for rows in self._rows(epoch, at):
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


def validation_batches(shards: tuple[ShardRef, ...], cfg: TrainConfig, read: Reader = read_rows) -> list[np.ndarray]:
    """The fixed batches validation loss is measured on; a split smaller than a batch gives one smaller batch."""
    rows = sum(s.rows for s in shards)
    if not rows:
        return []
    val = TokenBatches(list(shards), batch_size=min(cfg.batch_size, rows), seed=cfg.seed,
                       shuffle_buffer=cfg.batch_size, read=read)
    return [b for _, b in zip(range(min(cfg.eval_batches, val.steps_per_epoch)), val.from_step(0), strict=False)]


class Prefetch:
    """Reads batches ahead in a thread (parquet decoding releases the GIL); counts time spent waiting."""

    def __init__(self, batches: Iterator[np.ndarray], depth: int = 4):
        self.q: queue.Queue = queue.Queue(depth)
        self.waited = self._taken = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(batches,), daemon=True)
        self.thread.start()

    def _fill(self, batches):
        try:
            for b in batches:
                while not self.stop.is_set():
                    try:
                        self.q.put(b, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # surfaces in the training thread
            self.q.put(e)

    def __next__(self) -> np.ndarray:
        t = time.perf_counter()
        item = self.q.get()
        self.waited += time.perf_counter() - t
        if isinstance(item, BaseException):
            raise item
        return item

    def take_waited(self) -> float:
        """Seconds waited since the last call."""
        waited, self._taken = self.waited - self._taken, self.waited
        return waited

    def close(self):
        self.stop.set()
