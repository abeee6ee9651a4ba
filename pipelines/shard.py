"""Pass 3 of tier 1: the packed rows into shards, each a random sample of the whole version.

A shard owns a slice of the 64-bit key space (`ShardPlan`); Ray Data's sort by (shard, key) reads every packed
file once and brings each shard's rows, in key order, to one writer (`write_shards`). Every shard is thus a
random sample of the whole version in random order, the same for the same seed, and the requests grow as
shards + work files, not their product.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.dedup import key_range
from pipelines.lineage import write_places
from pipelines.pack import ROW_GROUP_ROWS, SPLIT_IDS, _node, profiled
from pipelines.stats import Output, Tally
from strata.data.dataset import shard_schema
from strata.data.storage import filesystem, join, make_dirs, read_bytes


@dataclass(frozen=True)
class ShardPlan:
    """Where each packed row goes: shard i of a split owns the i-th of `n` equal slices of the 64-bit key
    space (a row's key is random, so a shard is a random sample of the split). For the shuffle the shards
    are numbered across splits in SPLIT_IDS order (`first_ids`: each split's first number)."""

    counts: tuple[tuple[str, int], ...]
    """(split, shards) of each split that has rows."""

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)

    def first_ids(self) -> dict[str, int]:
        at, out = 0, {}
        for split, n in self.counts:
            out[split], at = at, at + n
        return out

    def name(self, shard: int) -> tuple[str, int]:
        """The split of global shard number `shard`, and its number within the split."""
        for split, first in reversed(self.first_ids().items()):
            if shard >= first:
                return split, shard - first
        raise ValueError(shard)

    def assign(self, batch: pa.Table) -> pa.Table:
        """A batch of packed rows (key, split, tokens) with their global shard number in place of the split."""
        split, key = batch["split"].to_numpy(), batch["key"].to_numpy()
        shard = np.full(len(key), -1, np.int64)
        for name, first in self.first_ids().items():
            n = dict(self.counts)[name]
            lows = np.array([key_range(i, n)[0] for i in range(n)], dtype=np.uint64)
            mine = split == SPLIT_IDS[name]
            shard[mine] = first + np.searchsorted(lows, key[mine], side="right") - 1
        if (shard < 0).any():
            raise RuntimeError(f"packed rows of a split with no shards: {sorted(set(split[shard < 0].tolist()))}")
        return pa.table({"shard": shard, "key": batch["key"], "tokens": batch["tokens"]})


def read_packed(batch: dict, *, plan: ShardPlan) -> pa.Table:
    """One packed work file's rows, each with its shard number: the file is fetched whole (a HEAD and a
    GET; Ray Data's parquet reader made 10 requests per file and read 3.7x its bytes, planning the read)."""
    return plan.assign(pq.read_table(pa.BufferReader(read_bytes(str(batch["path"][0]))), columns=["key", "split", "tokens"]))


def shuffle(packed: list[str], plan: ShardPlan):
    """The packed rows in shards: Ray Data's own sort by (shard, key), its partitions cut at shard numbers.
    Each packed file is read once, each row travels through the object store once to its shard's reducer,
    and the shards come out with their rows in key order (the same order for the same seed)."""
    import ray

    ds = ray.data.from_items([{"path": p} for p in packed], override_num_blocks=len(packed))
    ds = ds.map_batches(read_packed, batch_size=1, fn_kwargs={"plan": plan})
    return ds.sort(["shard", "key"], boundaries=list(range(1, plan.total + 1)))


@profiled
def write_shards(batch: pa.Table, *, directory: str, plan: ShardPlan, dtype: str, work_dir: str) -> dict:
    """Pass 3's writer: the shards' rows of one sorted block (each shard's rows in key order) to a file per
    shard, in the table's schema (strata.data.dataset.shard_schema). A shard the shuffle cut into several
    blocks becomes several files, each named by its shard and its first key, so a rerun writes the same
    names; beside each, in `work_dir`, its rows' keys (for lineage). Each output says (name, split, rows,
    tokens, bytes)."""
    cpu0 = time.process_time()
    shard, out = batch["shard"].to_numpy(), []
    cuts = np.flatnonzero(np.diff(shard)) + 1
    schema = shard_schema(dtype)
    make_dirs(directory)
    for a, b in zip([0, *cuts], [*cuts, len(shard)], strict=True):
        split, number = plan.name(int(shard[a]))
        part = batch.slice(a, b - a)
        name = f"{split}-{number:05d}-{part['key'][0].as_py():016x}.parquet"
        fs, path = filesystem(join(directory, name))
        tokens = part.column("tokens").combine_chunks()
        row_len = tokens.type.list_size
        table = pa.Table.from_arrays([tokens.cast(schema.field(0).type)], schema=schema)
        # Row groups of ROW_GROUP_ROWS rows: a trainer reads (and a resume seeks to) a few of them, never a
        # whole shard (train/data.py).
        with fs.open_output_stream(path) as f:
            pq.write_table(table, f, row_group_size=ROW_GROUP_ROWS)
            size = f.tell()
        write_places(work_dir, name, part["key"].combine_chunks())
        out.append(Output(tally=Tally(), shard=(name, split, part.num_rows, part.num_rows * row_len, size)))
    if out:
        out[0] = Output(tally=Tally(nodes=frozenset([_node()]), cpu_s={"shuffle-write": time.process_time() - cpu0}),
                        shard=out[0].shard)
    return {"out": out}
