"""A dataset version's lineage file: which documents each row it added holds, and where each came from.

One parquet file per version, `lineage.parquet` in its run's own directory, named by the version's Delta
commit (the manifest's `lineage`). Tier 1 writes it (pipelines/lineage.py); `strata lineage doc`
(train/lineage.py) and `forget` (pipelines/forget.py) read it, always through `read` and `lookup`, which
give one row per (document, packed row) the document's tokens touch (SCHEMA):

`doc` (`doc_key` of the record id, `PATH:POSITION`), `exact` (the text's exact-dedup key: a forget list
holds it, so a new copy of a forgotten file is known), `source` (the input file), `position` (the record's
place in it: a line's byte offset, a parquet row or a JSON array index), `shard` (the file's path in the
dataset), `row`, `start` and `length` (the tokens of the row that are the document's, its end-of-text id
included).

On disk (format 2) a row is a document, sorted by (source, position), in row groups of LOOKUP_ROWS:
`source`, `position`, `exact`, `tokens` (its tokens in the version's rows), `place` (each row it touches,
numbered across the version's shards; the footer names the shards) and `start` (where in that row its
tokens start). A row's tokens are a stretch of one token stream, so every span of a document but the one
holding its end runs to the end of its row: spans are stored with that one last and their lengths are not
stored. A version made from web pages also stores each document's `record` (JSON: the WARC record's URL,
date, content type and record id; `position` is the record's byte offset). The footer also holds each row group's first (source, position), so a lookup reads only the one
row group that can hold a record. Measured on bench.scale's 2 MB versions of 128-token rows: 137.7 KB of
lineage in format 1 (a row per span, doc keys stored), 73 KB in format 2. A format-1 file still reads.
"""

from __future__ import annotations

import bisect
import fnmatch
import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from strata.data.storage import Storage, filesystem, list_dir

FILE = "lineage.parquet"
FORMAT = 2
LOOKUP_ROWS = 8192  # documents per row group
META = b"strata.lineage"
SCHEMA = pa.schema([("doc", pa.uint64()), ("exact", pa.uint64()), ("source", pa.string()),
                    ("position", pa.int64()), ("shard", pa.string()), ("row", pa.int32()),
                    ("start", pa.int32()), ("length", pa.int32())])
STORED = pa.schema([("source", pa.string()), ("position", pa.int64()), ("exact", pa.uint64()),
                    ("tokens", pa.int32()), ("place", pa.list_(pa.int32())), ("start", pa.list_(pa.int32()))])
RECORD = pa.field("record", pa.string())  # web pages only: the WARC record's URL, date, content type and id (JSON)


class LineageError(ValueError):
    """A lineage file that does not hold what its format says."""


def write(table: pa.Table, path: str, row_len: int) -> tuple[int, str]:
    """A lineage file at `path` of the spans `table` (SCHEMA, any order; rows of `row_len` tokens); returns
    its size and SHA-256 (its version's commit names it). A document whose spans do not all run to their row's
    end but one is a bug upstream: refused."""
    web = "record" in table.column_names
    t = table.select(["source", "position", "exact", "shard", "row", "start", "length"] + (["record"] if web else []))
    by_shard = t.group_by("shard").aggregate([("row", "max")]).sort_by("shard")
    shards = by_shard["shard"].to_pylist()
    bases = np.concatenate([[0], np.cumsum(by_shard["row_max"].to_numpy().astype(np.int64) + 1)])[:len(shards)]
    place = bases[pc.index_in(t["shard"], pa.array(shards, pa.string())).to_numpy(zero_copy_only=False)] \
        + t["row"].to_numpy()
    short = (pc.add(t["start"], t["length"]).to_numpy() < row_len).astype(np.int8)  # holds the end, inside a row
    t = t.append_column("place", pa.array(place.astype(np.int32))).append_column("short", pa.array(short))
    t = t.sort_by([("source", "ascending"), ("position", "ascending"), ("short", "ascending"), ("place", "ascending")])
    n = t.num_rows
    new = np.ones(n, bool)
    if n > 1:  # where a document's spans begin
        new[1:] = pc.or_(pc.not_equal(t["source"].slice(1), t["source"].slice(0, n - 1)),
                         pc.not_equal(t["position"].slice(1), t["position"].slice(0, n - 1))).to_numpy(zero_copy_only=False)
    firsts = np.flatnonzero(new)
    if n and (np.add.reduceat(t["short"].to_numpy().astype(np.int64), firsts) > 1).any():
        raise LineageError(f"{path}: a document has two spans that end inside a row; its tokens are not one stretch")
    offsets = pa.array(np.append(firsts, n).astype(np.int32))
    tokens = np.add.reduceat(t["length"].to_numpy().astype(np.int64), firsts) if n else np.zeros(0, np.int64)
    docs = t.take(pa.array(firsts))
    out = pa.Table.from_arrays([docs["source"], docs["position"], docs["exact"], pa.array(tokens.astype(np.int32)),
                                pa.ListArray.from_arrays(offsets, t["place"].combine_chunks()),
                                pa.ListArray.from_arrays(offsets, t["start"].combine_chunks())], schema=STORED)
    if web:
        out = out.append_column(RECORD, docs["record"])
    firsts_of_groups = docs.select(["source", "position"]).take(pa.array(np.arange(0, len(firsts), LOOKUP_ROWS)))
    meta = {"format": FORMAT, "row_len": row_len, "shards": [[s, int(b)] for s, b in zip(shards, bases, strict=True)],
            "first": [[r["source"], r["position"]] for r in firsts_of_groups.to_pylist()]}
    from strata.data.integrity import HashingSink

    fs, p = filesystem(path)
    with fs.open_output_stream(p) as f:
        sink = HashingSink(f)
        with pq.ParquetWriter(sink, out.schema.with_metadata({META: json.dumps(meta)}), compression="zstd",
                              use_dictionary=["source", "start.list.element"],
                              column_encoding={"position": "DELTA_BINARY_PACKED", "tokens": "DELTA_BINARY_PACKED",
                                               "place.list.element": "BYTE_STREAM_SPLIT", "exact": "PLAIN"}) as w:
            for i in range(0, out.num_rows, LOOKUP_ROWS):  # one row group each: the footer's `first` says so
                w.write_table(out.slice(i, LOOKUP_ROWS), row_group_size=LOOKUP_ROWS)
        return sink.tell(), sink.hexdigest()


def _spans(stored: pa.Table, meta: dict) -> pa.Table:
    """Format 2's documents as SCHEMA's spans."""
    if not stored.num_rows:
        return SCHEMA.empty_table()
    row_len, shards = meta["row_len"], meta["shards"]
    counts = pc.list_value_length(stored["place"]).to_numpy().astype(np.int64)
    doc = np.repeat(np.arange(stored.num_rows), counts)
    place = pc.list_flatten(stored["place"]).to_numpy().astype(np.int64)
    start = pc.list_flatten(stored["start"]).to_numpy().astype(np.int64)
    length = row_len - start
    last = np.cumsum(counts) - 1
    length[last] = 0
    length[last] = stored["tokens"].to_numpy() - np.add.reduceat(length, last - counts + 1)
    bases = np.array([b for _, b in shards], dtype=np.int64)
    which = np.searchsorted(bases, place, side="right") - 1
    names = pa.array([s for s, _ in shards], pa.string())
    src, pos = stored["source"].to_pylist(), stored["position"].to_pylist()
    keys = np.array([doc_key(f"{s}:{p}") for s, p in zip(src, pos, strict=True)], dtype=np.uint64)
    idx = pa.array(doc)
    spans = pa.Table.from_arrays([pa.array(keys[doc]), stored["exact"].take(idx), stored["source"].take(idx),
                                  stored["position"].take(idx), names.take(pa.array(which)),
                                  pa.array((place - bases[which]).astype(np.int32)), pa.array(start.astype(np.int32)),
                                  pa.array(length.astype(np.int32))], schema=SCHEMA)
    return spans.append_column(RECORD, stored["record"].take(idx)) if RECORD.name in stored.column_names else spans


def _open(src) -> tuple[pq.ParquetFile, dict | None]:
    """A lineage file and its footer's meta (None: format 1). `src`: a version's lineage as its commit names it
    (strata.data.integrity.Named: read whole and checked against its digest first), or a path (a run's own)."""
    if isinstance(src, str):
        path = src
        fs, p = filesystem(src)
        source = fs.open_input_file(p)
    else:
        path, source = src.what, pa.BufferReader(src.read())
    try:
        f = pq.ParquetFile(source)
        raw = (f.schema_arrow.metadata or {}).get(META)
        meta = json.loads(raw) if raw is not None else None
    except (pa.ArrowInvalid, ValueError, OSError) as e:  # damaged, or not parquet: one line naming the file
        raise LineageError(f"{path} is not a readable lineage file: {e}") from None
    if meta is None:
        if f.schema_arrow.names != SCHEMA.names:
            raise LineageError(f"{path} is not a lineage file (columns {f.schema_arrow.names})")
        return f, None  # format 1: SCHEMA's spans as they are
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else meta
        raise LineageError(f"{path}: lineage format {found!r}; this strata reads formats 1 and {FORMAT}")
    _check_footer(path, meta, f)
    return f, meta


def _pair(x, kinds) -> bool:
    return (isinstance(x, list) and len(x) == 2 and isinstance(x[0], kinds[0]) and isinstance(x[1], kinds[1])
            and not isinstance(x[1], bool))


def _check_footer(path: str, meta: dict, f: pq.ParquetFile) -> None:
    """Every field format 2's footer must hold, with its type: a damaged or crafted one is one line."""
    row_len, shards, first = meta.get("row_len"), meta.get("shards"), meta.get("first")
    if isinstance(row_len, bool) or not isinstance(row_len, int) or row_len < 2:
        raise LineageError(f"{path}: its footer has no row length (row_len {row_len!r})")
    if not isinstance(shards, list) or not all(_pair(x, (str, int)) for x in shards):
        raise LineageError(f"{path}: its footer's shards are not [name, first row] pairs")
    bases = [b for _, b in shards]
    if bases != sorted(bases) or (bases and bases[0] != 0):
        raise LineageError(f"{path}: its footer's shards do not number rows in order")
    if not isinstance(first, list) or not all(_pair(x, (str, int)) for x in first):
        raise LineageError(f"{path}: its footer's row-group index is not [source, position] pairs")
    if len(first) != f.metadata.num_row_groups:
        raise LineageError(f"{path}: its footer names {len(first)} row groups, the file has "
                           f"{f.metadata.num_row_groups}")
    if f.schema_arrow.names not in (STORED.names, [*STORED.names, RECORD.name]):
        raise LineageError(f"{path} is not a lineage file of format {FORMAT} (columns {f.schema_arrow.names})")


def read(src) -> pa.Table:
    """Every span of lineage file `src` (a path, or a version's file as its commit names it: SCHEMA)."""
    f, meta = _open(src)
    try:
        return f.read() if meta is None else _spans(f.read(), meta)
    except (pa.ArrowInvalid, ValueError, IndexError, TypeError) as e:
        raise LineageError(f"{getattr(src, 'what', src)}: its spans do not read ({type(e).__name__}: {e})") from None


def doc_key(doc_id: str) -> int:
    """A record id's 64-bit key (the same as tier 1's dedup keys: blake2b, 8 bytes, little-endian)."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "little")


def _split_id(doc_id: str) -> tuple[str, int] | None:
    source, _, position = doc_id.rpartition(":")
    return (source, int(position)) if source and position.isdigit() else None


def lookup(path, doc_ids: list[str] | None = None, source: str | None = None) -> tuple[pa.Table, int]:
    """The spans (SCHEMA) in lineage file `path` of records `doc_ids`, or of input files matching the glob
    `source`, and how many row groups were read: by id, only the row group whose range holds each (the
    footer says); by source, the `source` column, then only the row groups holding a match."""
    f, meta = _open(path)
    if meta is None:
        return _lookup_format1(f, doc_ids, source)
    if doc_ids is not None:
        wanted = {k for k in map(_split_id, doc_ids) if k is not None}
        firsts = [tuple(x) for x in meta["first"]]
        groups = sorted({g for k in wanted if (g := bisect.bisect_right(firsts, k) - 1) >= 0})
        if not groups:
            return SCHEMA.empty_table(), 0
        t = f.read_row_groups(groups)
        hit = [(s, p) in wanted for s, p in zip(t["source"].to_pylist(), t["position"].to_pylist(), strict=True)]
        return _spans(t.filter(pa.array(hit, pa.bool_())), meta), len(groups)
    names = f.read(columns=["source"])["source"].combine_chunks().dictionary_encode()  # a file's name once
    matches = np.array([fnmatch.fnmatchcase(s, source) for s in names.dictionary.to_pylist()], bool)
    match = matches[names.indices.to_numpy(zero_copy_only=False)] if len(names) else np.zeros(0, bool)
    ends = np.cumsum([f.metadata.row_group(g).num_rows for g in range(f.metadata.num_row_groups)])
    groups = sorted(set(np.searchsorted(ends, np.flatnonzero(match), side="right").tolist()))
    if not groups:
        return SCHEMA.empty_table(), 1
    rows = np.concatenate([np.arange(ends[g] - f.metadata.row_group(g).num_rows, ends[g]) for g in groups])
    t = f.read_row_groups(groups, columns=[c for c in f.schema_arrow.names if c != "source"])  # read just above
    t = t.append_column("source", names.dictionary.take(names.indices.take(pa.array(rows))))
    return _spans(t.filter(pa.array(match[rows])), meta), len(groups)


def _lookup_format1(f: pq.ParquetFile, doc_ids, source) -> tuple[pa.Table, int]:
    t = f.read()
    if doc_ids is not None:
        return t.filter(pc.is_in(t["doc"], pa.array([doc_key(d) for d in doc_ids], pa.uint64()))), f.metadata.num_row_groups
    match = pa.array([fnmatch.fnmatchcase(s, source) for s in t["source"].to_pylist()], pa.bool_())
    return t.filter(match), f.metadata.num_row_groups


def lookup_keys(path, exact=None, docs=None) -> tuple[list[str], int]:
    """The record ids in lineage file `path` of the documents whose exact key is one of `exact`, or whose
    record key (`doc_key` of the id) is one of `docs`, and the row groups read. By exact key: the `exact`
    column, then only the row groups holding a match (exact keys are not in (source, position) order, so
    the column is read whole: 8 bytes a document). By record key: each document's id, hashed."""
    f, meta = _open(path)
    if meta is None:
        t = f.read(columns=["doc", "exact", "source", "position"])
        hit = pc.is_in(t["exact" if exact is not None else "doc"], pa.array(sorted(exact if exact is not None else docs),
                                                                           pa.uint64()))
        t = t.filter(hit)
        ids = {f"{s}:{p}" for s, p in zip(t["source"].to_pylist(), t["position"].to_pylist(), strict=True)}
        return sorted(ids), f.metadata.num_row_groups
    if exact is not None:
        keys = np.array(sorted(exact), dtype=np.uint64)
        hit = np.flatnonzero(np.isin(f.read(columns=["exact"])["exact"].to_numpy(), keys))
    else:
        t = f.read(columns=["source", "position"])
        keys = np.array(sorted(docs), dtype=np.uint64)
        own = np.array([doc_key(f"{s}:{p}") for s, p in zip(t["source"].to_pylist(), t["position"].to_pylist(),
                                                             strict=True)], dtype=np.uint64)
        hit = np.flatnonzero(np.isin(own, keys))
    if not len(hit):
        return [], 1
    ends = np.cumsum([f.metadata.row_group(g).num_rows for g in range(f.metadata.num_row_groups)])
    groups = sorted(set(np.searchsorted(ends, hit, side="right").tolist()))
    starts = ends - np.array([f.metadata.row_group(g).num_rows for g in range(len(ends))])
    t = f.read_row_groups(groups, columns=["source", "position"])
    rows = np.concatenate([np.arange(starts[g], ends[g]) for g in groups])
    take = np.flatnonzero(np.isin(rows, hit))
    src, pos = t["source"].take(pa.array(take)).to_pylist(), t["position"].take(pa.array(take)).to_pylist()
    return sorted({f"{s}:{p}" for s, p in zip(src, pos, strict=True)}), len(groups) + 1


def find_keys(storage: Storage, exact=None, docs=None, dataset: str | None = None) -> dict:
    """Every document, in every version of every dataset (or `dataset`) with lineage, whose exact key is one
    of `exact` (the same text, up to case and spacing, under any path), or whose record key is one of
    `docs`: {"doc_ids", "row_groups_read"}. Lineage is read as each version's commit names it."""
    from strata.data.dataset import DatasetError, history

    names = [dataset] if dataset else [n for n, d in list_dir(storage.datasets()) if d]
    ids, groups = set(), 0
    for name in names:
        try:
            versions = history(storage, name)
        except DatasetError:
            continue
        for v in versions:
            if v.manifest.lineage.get("file"):
                found, n = lookup_keys(v.named(v.manifest.lineage["file"], legacy_ok=True), exact, docs)
                ids.update(found)
                groups += n
    return {"doc_ids": sorted(ids), "row_groups_read": groups}


def find(storage: Storage, doc_ids: list[str] | None = None, source: str | None = None,
         dataset: str | None = None, verified_only: bool = False) -> dict:
    """Where documents are, by record id or input-file glob, in every dataset (or `dataset`): each
    document's place in its input (file size, mtime and digest from the manifest of the version that added it) and
    every version whose snapshot holds one of its rows: {"documents", "versions": [{"dataset", "version",
    "ref", "rows": [{"doc_id", "shard", "row", "start", "length", "split"}]}], "row_groups_read",
    "without_lineage": versions made before lineage (and, `verified_only`, before file digests: a takedown acts
    only on lineage whose commit names its digest)}. Every document's spans are checked against the version
    that added it (`check_spans`): a lineage file that names more than its documents can hold is an error."""
    from strata.data.dataset import DatasetError, history

    if (doc_ids is None) == (source is None):
        raise DatasetError("name the documents: record ids (PATH:POSITION) or --source GLOB")
    names = [dataset] if dataset else [n for n, d in list_dir(storage.datasets()) if d]
    docs, holders, row_groups, missing = {}, [], 0, []
    for name in names:
        try:
            versions = history(storage, name)
        except DatasetError:
            if dataset:
                raise
            continue  # a dataset that does not read (its own commands say why)
        found = []
        for v in versions:
            if not v.manifest.lineage.get("file") or (verified_only and not v.manifest.digests):
                missing.append(v.ref)
                continue
            table, groups = lookup(v.named(v.manifest.lineage["file"], legacy_ok=not verified_only), doc_ids, source)
            check_spans(v, table)
            row_groups += groups
            inputs = {f["path"]: f for f in v.manifest.inputs}
            for r in table.to_pylist():
                doc_id = f"{r['source']}:{r['position']}"
                f = inputs.get(r["source"], {})
                docs.setdefault(doc_id, {"doc_id": doc_id, "source": r["source"], "position": r["position"],
                                         "exact": r["exact"], "file": {k: f.get(k) for k in ("size", "mtime_ns", "digest")},
                                         "added_in": v.ref, **_record(r.get("record"))})
                found.append({**r, "doc_id": doc_id})
        if not found:
            continue
        for v in versions:
            shards = {sh.path: sh.split for sh in v.shards}
            rows = [{k: r[k] for k in ("doc_id", "shard", "row", "start", "length")} | {"split": shards[r["shard"]]}
                    for r in found if r["shard"] in shards]
            if rows:
                holders.append({"dataset": name, "version": v.manifest.version, "ref": v.ref, "rows": rows})
    return {"documents": sorted(docs.values(), key=lambda d: d["doc_id"]), "versions": holders,
            "row_groups_read": row_groups, "without_lineage": missing}


def _record(raw: str | None) -> dict:
    """A web page's record as lineage keeps it ({"record": {url, date, content_type, record_id}}), or nothing."""
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        record = None
    return {"record": record} if isinstance(record, dict) else {}


def check_spans(v, spans: pa.Table) -> None:
    """Refuse (LineageError, one line) spans that version `v`'s documents cannot have: each lies in a shard `v`
    added, in a row that shard holds, within the row; and a document touches no more rows than its tokens fill
    (ceil(tokens / row length) + 1). What a takedown removes is then what its documents and the documents
    packed beside them in the same rows explain, never more."""
    if not spans.num_rows:
        return
    row_len = v.manifest.seq_len + 1
    added = {sh.path: sh.rows for sh in v.added}
    where = f"{v.ref}: lineage {v.manifest.lineage.get('file')}"
    per_doc: dict[int, list] = {}
    for r in spans.select(["doc", "shard", "row", "start", "length"]).to_pylist():
        if r["shard"] not in added:
            raise LineageError(f"{where} places a document in {r['shard']}, which {v.ref} did not add; refused")
        if not (0 <= r["row"] < added[r["shard"]] and 0 <= r["start"] < row_len and 0 < r["length"] <= row_len - r["start"]):
            raise LineageError(f"{where} places a document at row {r['row']} ({r['start']}+{r['length']} tokens) of "
                               f"{r['shard']}, which holds {added[r['shard']]} rows of {row_len} tokens; refused")
        per_doc.setdefault(r["doc"], []).append(r["length"])
    for lengths in per_doc.values():
        if len(lengths) > -(-sum(lengths) // row_len) + 1:
            raise LineageError(f"{where} places a document of {sum(lengths)} tokens in {len(lengths)} rows; refused")


def row_documents(storage: Storage, version, rows: set[tuple[str, int]]) -> dict[tuple[str, int], list[dict]]:
    """The documents each of `rows` ((shard path in the dataset, row)) of `version`'s snapshot holds, in the
    row's order: {"doc_id", "source", "position", "start", "length"}. Read from the lineage files of the
    versions that added those shards (a row of a version made before lineage has none)."""
    from strata.data.dataset import resolve

    added_in = {s.path: s.version for s in version.shards}
    out: dict[tuple[str, int], list[dict]] = {r: [] for r in rows}
    name = version.manifest.dataset
    for label in sorted({added_in[shard] for shard, _ in rows if shard in added_in}):
        owner = resolve(storage, f"{name}@{label}") if label != version.manifest.version else version
        if not (rel := owner.manifest.lineage.get("file")):
            continue
        table = read(owner.named(rel, legacy_ok=True))
        shards = pa.array(sorted({shard for shard, _ in rows if added_in.get(shard) == label}))
        for r in table.filter(pc.is_in(table["shard"], shards)).to_pylist():
            if (key := (r["shard"], r["row"])) in out:
                out[key].append({"doc_id": f"{r['source']}:{r['position']}", "source": r["source"],
                                 "position": r["position"], "start": r["start"], "length": r["length"]})
    for spans in out.values():
        spans.sort(key=lambda d: d["start"])
    return out


def document_tokens(version, rows: list[dict]) -> dict[str, np.ndarray]:
    """The tokens of each document of `rows` (`find`'s rows of `version`: doc_id, shard, row, start, length, a
    document's spans in the lineage's order, the one holding its end last) in `version`'s shards: what tier 1
    packed of it (normalized text, tokenized; its end-of-text id included when packed). What a takedown's
    near keys are computed from, the original file being gone or another's."""
    from strata.data.rows import read_rows

    by_shard: dict[str, list[dict]] = {}
    for r in rows:
        by_shard.setdefault(r["shard"], []).append(r)
    pieces: dict[str, list[tuple[int, int, np.ndarray]]] = {}
    order = {id(r): i for i, r in enumerate(rows)}
    for shard, spans in sorted(by_shard.items()):
        table = read_rows(version.file(shard))
        for r in spans:
            pieces.setdefault(r["doc_id"], []).append(
                (order[id(r)], r["start"], table[r["row"], r["start"]: r["start"] + r["length"]]))
    out = {}
    for doc_id, parts in pieces.items():
        *before, last = sorted(parts, key=lambda x: x[0])
        # The span that starts inside its row is the document's first (its row began with another's end);
        # full rows come between, in an order lineage does not keep.
        before.sort(key=lambda x: x[1] == 0)
        out[doc_id] = np.concatenate([t for _, _, t in [*before, last]]).astype(np.int64)
    return out
