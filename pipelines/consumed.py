"""The index of the input files a dataset's versions consumed, so a run reads only what is new
(`--incremental`) without reading every earlier version.

Each version adds a segment: its inputs' identities (path, size, mtime_ns) in one parquet file sorted by
path, in row groups of ROW_GROUP rows. The manifest lists the dataset's segments (`consumed`,
cumulative, as the dedup index is), and the newest INDEX_FAN_IN segments that cover as many versions
each merge into one, up to MOST_VERSIONS versions a segment: a merge reads at most INDEX_FAN_IN small
files (one request each), so no version pays for a long history's rewrite, and N versions have about
N / MOST_VERSIONS segments. A lookup reads nothing of a segment whose path range holds no candidate,
and of the others only the row groups whose range does: a scheduled run over a new prefix reads no
segment at all.
"""

from __future__ import annotations

import bisect

import pyarrow as pa
import pyarrow.parquet as pq

from strata.data.storage import filesystem, read_bytes

ROW_GROUP = 4096
MOST_VERSIONS = 64  # versions one segment covers at most (pipelines.dedup.compaction's `most`)
SCHEMA = pa.schema([("path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64())])

Identity = tuple[str, int, int]  # path, size, mtime_ns


def write(path: str, identities) -> dict:
    """A segment file of `identities`, sorted; its entry for the manifest (path, rows, first and last
    path)."""
    rows = sorted(set(identities))
    table = pa.table([pa.array([r[i] for r in rows], SCHEMA.field(i).type) for i in range(3)], schema=SCHEMA)
    fs, p = filesystem(path)
    pq.write_table(table, p, filesystem=fs, row_group_size=ROW_GROUP)
    return {"path": path, "rows": len(rows), "lo": rows[0][0] if rows else "", "hi": rows[-1][0] if rows else ""}


def _meets(paths: list[str], lo: str, hi: str) -> bool:
    """Whether some path of the sorted `paths` lies in [lo, hi]."""
    i = bisect.bisect_left(paths, lo)
    return i < len(paths) and paths[i] <= hi


def lookup(files: list[dict], candidates: list[Identity]) -> set[Identity]:
    """Which `candidates` the segment `files` (paths made whole) hold."""
    wanted = set(candidates)
    paths = sorted({c[0] for c in wanted})
    found = set()
    for f in files:
        if not f["rows"] or not _meets(paths, f["lo"], f["hi"]):
            continue
        with _opened(f) as source:  # checked against its commit's digest, whole (strata/data/integrity.py)
            pf = pq.ParquetFile(source)
            for g in range(pf.metadata.num_row_groups):
                stats = pf.metadata.row_group(g).column(0).statistics
                if stats is not None and stats.has_min_max and not _meets(paths, stats.min, stats.max):
                    continue
                t = pf.read_row_group(g)
                found.update(r for r in zip(*(t.column(i).to_pylist() for i in range(3)), strict=True) if r in wanted)
    return found


def _opened(f: dict):
    """A segment file to read: an earlier version's, checked against the digest its commit names (`named`);
    this run's own (a merge's input), as written."""
    import contextlib

    if (named := f.get("named")) is not None:
        return named.opened()
    return contextlib.nullcontext(pa.BufferReader(read_bytes(f["path"])))


def merge(files: list[dict], path: str) -> dict:
    """The segments' files as one (each input once)."""
    rows = []
    for f in files:
        if f["rows"]:
            with _opened(f) as source:  # small: one request
                t = pq.read_table(source)
            rows.extend(zip(*(t.column(i).to_pylist() for i in range(3)), strict=True))
    return write(path, rows)
