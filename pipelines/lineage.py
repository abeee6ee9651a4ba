"""Row provenance: which documents each packed row holds, and where each came from.

Pass 2 knows, as it packs, which document each token of a split's stream belongs to (`DocRuns`); when it
cuts rows it writes their spans, keyed by each row's random sort key, to a work file. Pass 3 knows where
each key landed (a shard file and a row in it) and writes that beside the shard. `build` joins the two
into the version's lineage file (strata/data/lineage.py: its columns and how it is looked up).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from strata.data.lineage import FILE, SCHEMA, write
from strata.data.storage import filesystem, join, list_dir

__all__ = ["FILE", "DocRuns", "build", "write_places", "write_records", "write_spans"]

SPANS_DIR, PLACES_DIR, RECORDS_DIR = "lineage", "places", "records"  # under a run's _work

SPANS = pa.schema([("key", pa.uint64()), ("doc_id", pa.string()), ("exact", pa.uint64()),
                   ("start", pa.int32()), ("length", pa.int32())])


class DocRuns:
    """The documents of one split's token stream that are not yet in a row, in stream order: (record id,
    exact key, tokens). Tokens that belong to no document (a version made before lineage carried them in)
    have the id ""."""

    def __init__(self, ids=(), exact=(), lengths=()):
        self.ids, self.exact, self.lengths = list(ids), list(exact), list(lengths)

    def add(self, doc_id: str, exact: int, tokens: int) -> None:
        self.ids.append(doc_id)
        self.exact.append(exact)
        self.lengths.append(tokens)

    def extend(self, other: DocRuns) -> None:
        self.ids += other.ids
        self.exact += other.exact
        self.lengths += other.lengths

    def cut(self, keys: np.ndarray, row_len: int) -> pa.Table:
        """The spans of the first len(keys) rows of the stream (row i has key keys[i]); what the rows do not
        hold stays, the part of a document cut in two included."""
        n, total = len(keys), len(keys) * row_len
        lengths = np.asarray(self.lengths, dtype=np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        inside = np.flatnonzero((starts < total) & (lengths > 0))
        first = starts[inside] // row_len
        last = (np.minimum(ends[inside], total) - 1) // row_len
        count = last - first + 1
        doc = np.repeat(inside, count)
        row = np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count))
        lo = np.maximum(starts[doc], row * row_len)
        hi = np.minimum(np.minimum(ends[doc], (row + 1) * row_len), total)
        ids = pa.array(self.ids, pa.string()).take(pa.array(doc)) if len(doc) else pa.array([], pa.string())
        table = pa.Table.from_arrays(
            [pa.array(np.asarray(keys, dtype=np.uint64)[row] if n else np.zeros(0, np.uint64)), ids,
             pa.array(np.asarray(self.exact, dtype=np.uint64)[doc] if len(doc) else np.zeros(0, np.uint64)),
             pa.array((lo - row * row_len).astype(np.int32)), pa.array((hi - lo).astype(np.int32))], schema=SPANS)
        # What stays: the documents that end after the rows, the first of them shortened to its rest.
        rest = np.flatnonzero(ends > total)
        kept_lengths = (ends[rest] - np.maximum(starts[rest], total)).tolist()
        self.ids = [self.ids[i] for i in rest]
        self.exact = [self.exact[i] for i in rest]
        self.lengths = kept_lengths
        return table.filter(pc.not_equal(table["doc_id"], "")) if table.num_rows else table

    def to_columns(self) -> dict:
        return {"docs": self.ids, "exact": self.exact, "lengths": self.lengths}


def write_spans(work_dir: str, name: str, tables: list[pa.Table]) -> None:
    """A packed work file's spans (`DocRuns.cut`'s tables), as `_work/lineage/<name>`."""
    fs, path = filesystem(join(work_dir, SPANS_DIR, name))
    pq.write_table(pa.concat_tables(tables) if tables else SPANS.empty_table(), path, filesystem=fs)


def write_records(work_dir: str, name: str, records: list[tuple[str, str]]) -> None:
    """The web records (doc_id, JSON of URL, date, content type and WARC record id) of a unit's kept pages,
    as `_work/records/<name>`; nothing for a unit that has none."""
    if records:
        fs, path = filesystem(join(work_dir, RECORDS_DIR, name))
        ids, values = zip(*records, strict=True)
        pq.write_table(pa.table({"doc_id": pa.array(ids, pa.string()), "record": pa.array(values, pa.string())}),
                       path, filesystem=fs)


def write_places(work_dir: str, shard: str, keys: pa.Array) -> None:
    """Where pass 3 put each key: row i of shard file `shard` (its name in the run's directory)."""
    fs, path = filesystem(join(work_dir, PLACES_DIR, shard))
    pq.write_table(pa.table({"key": keys, "row": pa.array(np.arange(len(keys), dtype=np.int32))}), path,
                   filesystem=fs)


def _read_all(directory: str, name_column: str | None = None) -> pa.Table | None:
    parts = []
    for name, is_dir in sorted(list_dir(directory)):
        if is_dir:
            continue
        fs, path = filesystem(join(directory, name))
        t = pq.read_table(fs.open_input_file(path))
        if name_column:
            t = t.append_column(name_column, pa.array([name] * t.num_rows, pa.string()))
        parts.append(t)
    return pa.concat_tables(parts) if parts else None


def build(work_dir: str, shard_prefix: str, out: str, row_len: int) -> dict:
    """The version's lineage file (a cpu-tier task): pass 2's spans joined with pass 3's places on the row
    key. `shard_prefix` is the shard directory's path in the dataset; rows hold `row_len` tokens. Returns its
    figures: documents, spans, bytes, and the spans no place was found for (none, or a bug)."""
    spans = _read_all(join(work_dir, SPANS_DIR))
    places = _read_all(join(work_dir, PLACES_DIR), "shard")
    if spans is None or places is None:
        spans, places = SPANS.empty_table(), pa.table({"key": pa.array([], pa.uint64()), "row": pa.array([], pa.int32()),
                                                       "shard": pa.array([], pa.string())})
    joined = spans.join(places, "key", join_type="inner").combine_chunks()
    ids = joined["doc_id"].combine_chunks().dictionary_encode()  # a document's id once, not once a span
    source, _, position = zip(*(i.rpartition(":") for i in ids.dictionary.to_pylist()), strict=True) \
        if len(ids.dictionary) else ((), (), ())
    table = pa.Table.from_arrays([
        pa.nulls(joined.num_rows, pa.uint64()), joined["exact"], pa.array(source, pa.string()).take(ids.indices),
        pa.array([int(p) if p.isdigit() else -1 for p in position], pa.int64()).take(ids.indices),
        pc.binary_join_element_wise(pa.scalar(shard_prefix), joined["shard"], "/"),
        joined["row"], joined["start"], joined["length"]], schema=SCHEMA)  # `doc`: write() keys by source, position
    records = _read_all(join(work_dir, RECORDS_DIR))
    if records is not None:  # web pages: each document's record, by its id
        found = records.join(pa.table({"doc_id": ids.dictionary}), "doc_id", join_type="right outer")
        by_id = dict(zip(found["doc_id"].to_pylist(), found["record"].to_pylist(), strict=True))
        table = table.append_column("record", pa.array([by_id.get(i) for i in ids.dictionary.to_pylist()],
                                                       pa.string()).take(ids.indices))
    size, sha = write(table, out, row_len)
    return {"documents": len(ids.dictionary), "spans": table.num_rows, "bytes": size, "sha256": sha,
            "unplaced": spans.num_rows - joined.num_rows}
