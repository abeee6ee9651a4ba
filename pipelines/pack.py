"""The three passes of tier 1, each a Ray Data map step on the cpu tier.

1. `read_clean_sign`: a work unit's files -> records -> cleaned, filtered
   documents with their dedup keys in a work parquet file. Returns the unit's
   accounting. The dedup index is then built from these files.
2. `DedupTokenizePack` (actor: the tokenizer loads once per worker): a work
   file's documents -> drop duplicates -> tokenize -> split by document ->
   pack into rows of seq_len + 1 ids, each with a random sort key. What is
   left of each split, shorter than a row, is a tail: `pack_tails` then packs
   every unit's tails together, so at most one partial row per split per
   version is left over, and counted.
3. `shuffle` and `write_shards` (pipelines/shard.py): packed rows into shards.

Work files are named by a digest of what they hold, so a retried task rewrites
the same file instead of adding one.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.clean import CleanConfig, QualityFilter, normalize
from pipelines.dedup import DedupConfig, MinHasher, exact_key, hash64, shard_of
from pipelines.dedup import hasher_of as dedup_hasher
from pipelines.lineage import DocRuns, write_records, write_spans
from pipelines.stats import SAMPLES_PER_REASON, Output, Tally, audit_sample
from strata.cluster.connect import fetch_once
from strata.cluster.procs import peak_rss_mb
from strata.data.dataset import arrow_schema, token_dtype
from strata.data.digests import with_deferral
from strata.data.lineage import doc_key
from strata.data.sources import ReadConfig, read_file
from strata.data.storage import filesystem, join

SPLIT_IDS = {"train": 0, "validation": 1}
ROW_GROUP_ROWS = 1024


def digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def docs_name(unit: list[dict]) -> str:
    """Pass 1's work file for a unit: named by what the unit holds (a retried or resumed unit rewrites it)."""
    return f"docs-{digest(unit)}.parquet"


def packed_name(docs_file: str) -> str:
    """Pass 2's work file for the documents of `docs_file` (pass 1's name, or, fused, the unit's)."""
    return docs_file.replace("docs-", "packed-", 1)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: consecutive inputs to well-spread 64-bit keys (vectorized)."""
    with np.errstate(over="ignore"):
        x = x.astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def validation_split(doc_id: str, seed: int, fraction: float) -> bool:
    """Whether a document belongs to validation: a stable hash, so no document is in both."""
    h = hashlib.blake2b(f"{seed}:{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < fraction


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


# ---------------------------------------------------------------- pass 1

ORDER_POSITION_BITS = 40  # a record's position in its file (a byte offset, under 1 TiB); the file's place above


def docs_schema(bands: int) -> pa.Schema:
    """A work file of kept documents with their dedup keys (the index is rebuilt from these)."""
    return pa.schema([("doc_id", pa.string()), ("doc", pa.uint64()), ("exact", pa.uint64()),
                      ("bands", pa.list_(pa.uint64(), bands)), ("text", pa.large_string()), ("order", pa.uint64())])


def input_order(unit: list[dict]):
    """A document's place in the run's input order, as one number (its file's place in the input, then its
    record's position in the file): dedup keeps the first of a cluster's copies, as datatrove and a reader
    of the input would."""
    most = (1 << (64 - ORDER_POSITION_BITS)) - 1  # files past the 16,777,215th share the last place
    ordinal = {f["path"]: min(f.get("ordinal", 0), most) for f in unit}

    def order(doc_id: str) -> int:
        path, _, position = doc_id.rpartition(":")
        at = min(int(position), (1 << ORDER_POSITION_BITS) - 1) if position.isdigit() else 0
        return ordinal.get(path, 0) << ORDER_POSITION_BITS | at

    return order


class StageClock:
    """CPU seconds of this process (all its threads) by stage: `lap(stage)` charges the time since the
    last lap to `stage`. A lap costs well under a microsecond."""

    def __init__(self):
        self.cpu, self.last = Counter(), time.process_time()

    def lap(self, stage: str) -> None:
        now = time.process_time()
        self.cpu[stage] += now - self.last
        self.last = now

    def seconds(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.cpu.items()}


class Outcomes:
    """What reading and cleaning a unit's records came to: kept, or filtered or rejected with a reason
    (with a few examples per reason), and the quality rules' own tallies."""

    def __init__(self):
        self.counts: Counter = Counter()  # (status, reason) -> records
        self.samples: dict[str, list] = defaultdict(list)
        self.tallies: dict[str, dict] = {}

    def tally(self) -> Tally:
        by = {status: {r: n for (s, r), n in self.counts.items() if s == status} for status in ("filtered", "rejected")}
        return Tally(kept=self.counts[("kept", "")], filtered=by["filtered"], rejected=by["rejected"],
                     samples={k: tuple(v) for k, v in self.samples.items()},
                     languages=dict(self.tallies.get("language", {})),
                     contaminated_by=dict(self.tallies.get("contaminated", {})), pii=dict(self.tallies.get("pii", {})))


def clean_records(unit: list[dict], rcfg: ReadConfig, ccfg: CleanConfig, seen: Outcomes, clock: StageClock,
                  contamination: dict | None = None, forget: dict | None = None, hasher: MinHasher | None = None,
                  records: list | None = None) -> Iterator[tuple[str, str, np.ndarray | None, int]]:
    """(doc_id, text, its MinHash band keys or None, its exact key) of the unit's kept documents; every other
    record is counted by reason in `seen`. The exact key is computed once per document: dedup and lineage use
    the one the forget list was checked with unless --pii changed the text. A document the dataset's forget
    list names (its record key, its exact key: the same text in a new copy, or one of its band keys: an edited
    copy) is filtered as `forgotten`. The band keys are computed only for a list with near keys, by its
    parameters; with `hasher` (the run's) when they match, and then handed on, so no document is signed twice.
    A kept web page's record (URL, date, content type, WARC record id) goes into `records` as (doc_id, its
    JSON), for lineage."""
    quality = QualityFilter(ccfg, evaluation_index(contamination))
    forgotten = fetch_once(forget["ref"]) if forget else None
    near = None
    if forgotten is not None and len(forgotten["near"]):
        same = hasher is not None and forgotten["params"] == hasher.params
        near = hasher if same else dedup_hasher(forgotten["params"])
    for f in unit:
        for rec in read_file(f, rcfg):
            clock.lap("read")
            status, reason, bands, key = rec["status"], rec["reason"], None, None
            if status == "ok":
                text = normalize(rec["text"], ccfg)
                if forgotten is not None:
                    key = exact_key(text)
                listed = forgotten is not None and (_listed(forgotten["keys"], rec["doc_id"], key) or near is not None
                                                    and _holds(forgotten["near"], bands := near.band_keys(near.signature(text))))
                reason = "forgotten" if listed else quality.url_reason(rec.get("meta")) or quality.reason(text)
                status = "filtered" if reason else "kept"
                if status == "kept" and (formatted := quality.formatted(text)) != text:  # --pii: replaced
                    text, bands, key = formatted, None, None
                if near is not hasher:
                    bands = None  # another hasher's (or of the text before --pii): the run signs the document
            clock.lap("clean")
            if status == "kept":
                seen.counts[("kept", "")] += 1
                if records is not None and rec.get("meta"):
                    records.append((rec["doc_id"], json.dumps(rec["meta"], sort_keys=True)))
                yield rec["doc_id"], text, bands, exact_key(text) if key is None else key
                continue
            seen.counts[(status, reason)] += 1
            if len(examples := seen.samples[f"{status}:{reason}"]) < SAMPLES_PER_REASON:
                sample = "(taken down: not shown)" if reason == "forgotten" else rec["sample"] or rec["text"][:120]
                examples.append({"doc_id": rec["doc_id"], "sample": sample})
    seen.tallies = quality.tallies()  # the language rule's and decontamination's, beside the statuses


def _listed(keys: np.ndarray, doc_id: str, exact: int) -> bool:
    """Whether a sorted forget list holds the record's key or its text's exact key."""
    return _holds(keys, np.array([doc_key(doc_id), exact], dtype=np.uint64))


def _holds(keys: np.ndarray, wanted: np.ndarray) -> bool:
    """Whether sorted `keys` holds any of `wanted`."""
    i = np.minimum(np.searchsorted(keys, wanted), max(0, len(keys) - 1))
    return bool(len(keys)) and bool((keys[i] == wanted).any())


def evaluation_index(contamination: dict | None) -> dict | None:
    """The decontamination index the driver put in the object store ({"ref": ref}), fetched once per worker
    process; its arrays are read-only views of the node's shared copy."""
    return fetch_once(contamination["ref"]) if contamination else None


PROFILE_ENV = "STRATA_PROFILE_DIR"  # set: every pass's work unit is profiled (cProfile) into that directory


def profiled(fn):
    """`fn` as is, or, with $STRATA_PROFILE_DIR set, under cProfile, its stats dumped per call."""
    import functools
    import os

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        where = os.environ.get(PROFILE_ENV)
        if not where:
            return fn(*args, **kwargs)
        import cProfile

        prof = cProfile.Profile()
        try:
            return prof.runcall(fn, *args, **kwargs)
        finally:
            os.makedirs(where, exist_ok=True)
            prof.dump_stats(os.path.join(where, f"{fn.__qualname__}-{os.getpid()}-{time.time_ns()}.prof"))

    return wrapper


@profiled
def read_clean_sign(batch: dict, *, read: ReadConfig, clean: CleanConfig, dedup: DedupConfig, work_dir: str,
                    contamination: dict | None = None, forget: dict | None = None) -> dict:
    """Pass 1 over one work unit (Ray Data `map_batches`, batch_size=1); the configs travel typed."""
    unit = json.loads(batch["unit"][0])
    name = docs_name(unit)
    return {"out": [with_deferral(unit, read, lambda files: _read_clean_sign(files, read, clean, dedup, work_dir,
                                                                             name, contamination, forget))]}


def _read_clean_sign(unit: list[dict], rcfg: ReadConfig, ccfg: CleanConfig, dcfg: DedupConfig, work_dir: str,
                     name: str, contamination: dict | None, forget: dict | None = None) -> Output:
    seen = Outcomes()
    fs, path = filesystem(join(work_dir, "docs", name))
    hasher = MinHasher(dcfg) if dcfg.near_dedup else None
    n_bands = hasher.bands if hasher else 1  # arrow has no zero-width lists: a 0 placeholder
    schema = docs_schema(n_bands)
    kept, chars, pending = 0, 0, defaultdict(list)
    kept_by_path: Counter = Counter()  # what dedup may remove, per input file (audited per source)

    def flush(writer):
        bands = np.array(pending["bands"], dtype=np.uint64).reshape(-1)
        cols = [pa.array(pending["doc_id"], pa.string()), pa.array(pending["doc"], pa.uint64()),
                pa.array(pending["exact"], pa.uint64()),
                pa.FixedSizeListArray.from_arrays(pa.array(bands, pa.uint64()), n_bands),
                pa.array(pending["text"], pa.large_string()), pa.array(pending["order"], pa.uint64())]
        writer.write_table(pa.Table.from_arrays(cols, schema=schema))
        return len(pending["doc"])

    clock = StageClock()
    records: list = []
    order = input_order(unit)
    with pq.ParquetWriter(path, schema, filesystem=fs) as writer:
        for doc_id, text, bands, key in clean_records(unit, rcfg, ccfg, seen, clock, contamination, forget, hasher,
                                                      records):
            pending["doc_id"].append(doc_id)
            pending["doc"].append(hash64(doc_id))
            pending["exact"].append(key)  # pass 2's dedup (with --exact-dedup) and lineage read it
            pending["bands"].append(bands if bands is not None else hasher.band_keys(hasher.signature(text))
                                    if hasher else [0])
            pending["text"].append(text)
            pending["order"].append(order(doc_id))
            kept_by_path[doc_path(doc_id)] += 1
            chars += len(text)
            clock.lap("sign")
            if len(pending["doc"]) >= 1024 or chars >= 8 << 20:
                kept += flush(writer)
                pending, chars = defaultdict(list), 0
                clock.lap("write")
        if pending["doc"]:
            kept += flush(writer)
    write_records(work_dir, name, records)
    clock.lap("write")
    tally = seen.tally() + Tally(looked_at=dict(kept_by_path), nodes=frozenset([_node()]),
                                 peak_rss_mb=peak_rss_mb(), cpu_s=clock.seconds())
    return Output(tally=tally, docs_file=name, docs=kept)


def doc_path(doc_id: str) -> str:
    """The input file of a record id (`PATH:OFFSET`)."""
    return doc_id.rsplit(":", 1)[0]


# ---------------------------------------------------------------- pass 2


class DedupTokenizePack:
    """Pass 2 over one work file of documents (Ray Data `map_batches` actor, batch_size=1)."""

    def __init__(self, *, tokenizer: str, eot_token: str, definition: str | None, seq_len: int,
                 tokenizer_engine: str = "auto",
                 validation_fraction: float, seed: int, split_seed: int, dedup: DedupConfig, work_dir: str,
                 index: list, removed_dir: str = "", read: ReadConfig | None = None, clean: CleanConfig | None = None,
                 contamination: dict | None = None, quality: dict | None = None, forget: dict | None = None):
        import ray

        from strata.data.tokenizer import HFTokenizer, load_tokenizer

        self.tok = (HFTokenizer(definition, eot_token, tokenizer_engine) if definition
                    else load_tokenizer(tokenizer, eot_token, tokenizer_engine))
        self.row_len, self.fraction, self.seed, self.split_seed = seq_len + 1, validation_fraction, seed, split_seed
        self.dedup, self.work_dir, self.index = dedup, work_dir, index
        self.removed_dir = removed_dir
        # Fused mode (no dedup, so no global decision between reading and packing): read units directly.
        self.read, self.clean = read, clean
        self.contamination, self.forget = contamination, forget
        self.web_records: list = []  # fused mode: the unit's kept web pages' records, for lineage
        # With --quality-model: the exact keys (as int64) of the documents the scores drop (pipelines/quality.py).
        self.drop = ray.get(quality["ref"]) if quality else None
        self.schema = packed_schema(seq_len, token_dtype(self.tok.vocab_size))

    def _duplicates(self, docs: np.ndarray, exact_keys: np.ndarray, bands: np.ndarray) -> dict[str, np.ndarray]:
        """Per document: `exact` and `near` (it lost a key: a duplicate), the doc key of the `winner` it
        lost to (its exact key's, else its first lost band's), whether that is in an `earlier` version, and
        whether the --dedup-against dataset holds it (`against`, which counts as earlier)."""
        n = len(docs)
        out = {"exact": np.zeros(n, bool), "near": np.zeros(n, bool), "winner": np.zeros(n, np.uint64),
               "earlier": np.zeros(n, bool), "against": np.zeros(n, bool)}
        if self.dedup.near_dedup:
            width = bands.shape[1]
            winner, where = self._winners("band", bands.ravel())
            lost = ((where > 0) | (winner != np.repeat(docs, width))).reshape(n, width)
            first = lost.argmax(axis=1)
            out["near"] = lost.any(axis=1)
            out["winner"] = winner.reshape(n, width)[np.arange(n), first]
            where = where.reshape(n, width)[np.arange(n), first]
            out["earlier"], out["against"] = where > 0, where == 2
        if self.dedup.exact_dedup:
            winner, where = self._winners("exact", exact_keys)
            exact = (where > 0) | (winner != docs)
            out["exact"], out["near"] = exact, out["near"] & ~exact
            out["winner"] = np.where(exact, winner, out["winner"])
            out["earlier"] = np.where(exact, where > 0, out["earlier"])
            out["against"] = np.where(exact, where == 2, out["against"])
        return out

    def _winners(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        import ray

        owner = shard_of(keys, len(self.index))
        winner, earlier = np.zeros(len(keys), np.uint64), np.zeros(len(keys), np.uint8)
        refs = {s: self.index[s].winners.remote(table, keys[owner == s])
                for s in range(len(self.index)) if (owner == s).any()}
        for s, ref in refs.items():
            winner[owner == s], earlier[owner == s] = ray.get(ref)
        return winner, earlier

    def _chunks(self, batch: dict, seen: Outcomes, clock: StageClock):
        """(doc ids, texts, `_duplicates` of them) per chunk of up to 1024 documents."""
        if "unit" in batch:
            records = clean_records(json.loads(batch["unit"][0]), self.read, self.clean, seen, clock,
                                    self.contamination, self.forget, records=self.web_records)
            while chunk := list(islice(records, 1024)):
                none = np.zeros(len(chunk), dtype=bool)
                yield [c[0] for c in chunk], [c[1] for c in chunk], {
                    "exact": none, "near": none, "key": np.array([c[3] for c in chunk], dtype=np.uint64)}
            return
        fs, path = filesystem(join(self.work_dir, "docs", str(batch["docs_file"][0])))
        for chunk in pq.ParquetFile(fs.open_input_file(path)).iter_batches(batch_size=1024):
            ids, texts = chunk.column("doc_id").to_pylist(), chunk.column("text").to_pylist()
            bands = chunk.column("bands")
            bands = bands.flatten().to_numpy().reshape(len(ids), bands.type.list_size)
            docs = chunk.column("doc").to_numpy()
            clock.lap("read")
            dup = self._duplicates(docs, chunk.column("exact").to_numpy(), bands)
            clock.lap("dedup")
            yield ids, texts, {**dup, "doc": docs, "key": chunk.column("exact").to_numpy()}

    def _low_quality(self, keys: np.ndarray) -> np.ndarray:
        """Which documents the quality scores drop (by exact key)."""
        if self.drop is None or not len(self.drop):
            return np.zeros(len(keys), bool)
        return np.isin(keys.view(np.int64), self.drop)

    @profiled
    def __call__(self, batch: dict) -> dict:
        if "docs_file" in batch:
            return {"out": [self._pack(batch, str(batch["docs_file"][0]))]}
        unit = json.loads(batch["unit"][0])
        name = docs_name(unit)
        return {"out": [with_deferral(unit, self.read, lambda files: self._pack({"unit": [json.dumps(files)]}, name))]}

    def _pack(self, batch: dict, name: str) -> Output:
        started = time.perf_counter()
        out_name = packed_name(name)
        fs, out_path = filesystem(join(self.work_dir, "packed", out_name))
        stats, removed_by_path, clusters = Counter(), Counter(), Counter()  # stats: Tally's whole-number fields
        duplicate, split_tokens, split_rows, seen = Counter(), Counter(), Counter(), Outcomes()
        samples = seen.samples  # duplicates' examples beside the read's (a unit is read here when fused)
        removed_rows = {"doc_id": [], "kind": [], "kept": [], "earlier": []}
        pairs: tuple = ()
        carry = {s: np.zeros(0, dtype=np.uint32) for s in SPLIT_IDS}
        runs, spans = {s: DocRuns() for s in SPLIT_IDS}, []  # which document each carried token is of
        row_index = Counter()
        eot = np.array([self.tok.eot_id], dtype=np.uint32)
        tables, clock = [], StageClock()
        for ids, texts, dup in self._chunks(batch, seen, clock):
            low = self._low_quality(dup["key"])
            if low.any():  # counted filtered, not kept (pass 1 counted them kept) and never duplicates
                seen.counts[("filtered", "quality")] += int(low.sum())
                stats["kept"] -= int(low.sum())
                for i in np.flatnonzero(low)[: SAMPLES_PER_REASON - len(samples["filtered:quality"])]:
                    samples["filtered:quality"].append({"doc_id": ids[i], "sample": texts[i][:120]})
            exact, near = dup["exact"] & ~low, dup["near"] & ~low
            removed = np.flatnonzero(exact | near)
            removed_by_path.update(doc_path(ids[i]) for i in removed)
            if len(removed):
                removed_rows["doc_id"] += [ids[i] for i in removed]
                removed_rows["kind"] += ["exact" if exact[i] else "near" for i in removed]
                removed_rows["kept"] += dup["winner"][removed].tolist()
                removed_rows["earlier"] += dup["earlier"][removed].tolist()
                clusters.update(dup["winner"][removed].tolist())
                stats["removed_by_earlier_version"] += int((dup["earlier"] & ~dup["against"])[removed].sum())
                stats["removed_by_other_dataset"] += int(dup["against"][removed].sum())
                pairs = audit_sample(pairs + tuple(
                    {"removed": int(dup["doc"][i]), "kept": int(dup["winner"][i]),
                     "kind": "exact" if exact[i] else "near"} for i in removed if not dup["earlier"][i]))
            for kind, mask in (("exact", exact), ("near", near)):
                duplicate[kind] += int(mask.sum())
                for i in np.flatnonzero(mask)[: SAMPLES_PER_REASON - len(samples[f"duplicate:{kind}"])]:
                    samples[f"duplicate:{kind}"].append({"doc_id": ids[i], "sample": texts[i][:120]})
            keep = np.flatnonzero(~(exact | near | low))
            stats["packed"] += len(keep)
            streams = {s: [carry[s]] for s in SPLIT_IDS}
            clock.lap("dedup")
            checked = getattr(self.tok, "checked", 0)
            encoded = self.tok.encode_batch([texts[i] for i in keep])
            stats["tokenizer_checked"] += getattr(self.tok, "checked", 0) - checked
            clock.lap("tokenize")
            for i, tokens in zip(keep, encoded, strict=True):
                split = "validation" if validation_split(ids[i], self.split_seed, self.fraction) else "train"
                streams[split] += [tokens, eot]
                split_tokens[split] += len(tokens) + 1
                runs[split].add(ids[i], int(dup["key"][i]), len(tokens) + 1)
            for split, parts in streams.items():
                flat = np.concatenate(parts)
                n = len(flat) // self.row_len
                carry[split] = flat[n * self.row_len:]
                if n:
                    tables.append(packed_rows(self.schema, self.seed, out_name, split, row_index[split],
                                              flat[: n * self.row_len]))
                    spans.append(runs[split].cut(tables[-1]["key"].to_numpy(), self.row_len))
                    row_index[split] += n
                    split_rows[split] += n
            clock.lap("pack")
        # What is left of each split is shorter than a row: it is packed with the other units' in `pack_tails`.
        write_tails(join(self.work_dir, "tails", out_name), carry, runs)
        write_spans(self.work_dir, out_name, spans)
        write_records(self.work_dir, out_name, self.web_records)
        self.web_records.clear()
        table = pa.concat_tables(tables) if tables else self.schema.empty_table()
        pq.write_table(table, out_path, filesystem=fs)  # pass 3's shuffle reads it once, whole
        if removed_rows["doc_id"] and self.removed_dir:  # every removed document, for whoever audits dedup
            rfs, rpath = filesystem(join(self.removed_dir, out_name))
            pq.write_table(pa.table({**removed_rows, "kept": pa.array(removed_rows["kept"], pa.uint64())}), rpath,
                           filesystem=rfs)
        clock.lap("write")
        tally = seen.tally() + Tally(
            **stats, duplicate=dict(duplicate), removed=dict(removed_by_path), clusters=dict(clusters), pairs=pairs,
            tokens=dict(split_tokens), rows=dict(split_rows), encoded_by={self.tok.engine: stats["packed"]},
            cpu_s=clock.seconds(), nodes=frozenset([_node()]), peak_rss_mb=peak_rss_mb(),
            busy_s=time.perf_counter() - started)
        return Output(tally=tally, packed_file=out_name)


def packed_schema(seq_len: int, dtype: str) -> pa.Schema:
    return pa.schema([("key", pa.uint64()), ("split", pa.int8()), arrow_schema(seq_len, dtype).field(0)])


def packed_rows(schema: pa.Schema, seed: int, name: str, split: str, first: int, flat: np.ndarray) -> pa.Table:
    """Rows `first`, `first + 1`, ... of `split` in packed file `name`, each with its random sort key."""
    row_len = schema.field("tokens").type.list_size
    n = len(flat) // row_len
    keys = mix64(np.uint64(hash64(f"{seed}:{name}:{split}")) + np.arange(first, first + n, dtype=np.uint64))
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(flat, type=schema.field("tokens").type.value_type), row_len)
    return pa.Table.from_arrays([pa.array(keys), pa.array(np.full(n, SPLIT_IDS[split], np.int8)), tokens],
                                schema=schema)


TAILS_SCHEMA = pa.schema([("split", pa.int8()), ("tokens", pa.list_(pa.uint32())),
                          ("docs", pa.list_(pa.string())), ("exact", pa.list_(pa.uint64())),
                          ("lengths", pa.list_(pa.int64()))])
TAILS_FILE = "packed-tails.parquet"


def write_tails(path: str, carry: dict[str, np.ndarray], runs: dict[str, DocRuns]) -> None:
    """A unit's tails: per split, the tokens after its last full row, and the documents they are of."""
    splits = [s for s in SPLIT_IDS if len(carry[s])]
    fs, p = filesystem(path)
    cols = {"split": [SPLIT_IDS[s] for s in splits], "tokens": [carry[s] for s in splits]}
    for k in ("docs", "exact", "lengths"):
        cols[k] = [runs[s].to_columns()[k] for s in splits]
    pq.write_table(pa.Table.from_pydict(cols, schema=TAILS_SCHEMA), p, filesystem=fs)


def pack_tails(work_dir: str, names: list[str], *, seq_len: int, dtype: str, seed: int, eot_id: int,
               carried=None, final: bool = False, tails_out: str | None = None) -> Output:
    """The tails the previous version could not pack (`carried`, a tails file), first, then every unit's, in
    name order, packed together into `packed/packed-tails.parquet`: the same input always packs the same.

    What is left over is shorter than a row per split. With `final` it becomes a last row padded with the
    pad value (strata.data.dataset.pad_value; training leaves it out of the loss), so every kept document is in
    the version. Otherwise it goes to `tails_out`, for the next version to pack first: its documents are
    counted unpacked (carried). Returns the packed file (none when no row was made) and its Tally: rows,
    unpacked, padding and carried-in tokens per split, and unpacked, carried-in and carried-on documents.
    """
    from strata.data.dataset import pad_value

    cpu0 = time.process_time()
    schema, row_len = packed_schema(seq_len, dtype), seq_len + 1
    streams = {s: [np.zeros(0, dtype=np.uint32)] for s in SPLIT_IDS}
    runs, spans = {s: DocRuns() for s in SPLIT_IDS}, []
    out, tables = defaultdict(Counter), []  # Tally's fields: by split, or "" for documents
    for path, first in ([(carried, True)] if carried else []) + [(join(work_dir, "tails", n), False)
                                                                for n in sorted(names)]:
        for split, (tokens, docs) in read_tails(path).items():
            streams[split].append(tokens)
            runs[split].extend(docs)
            if first:
                out["carried_in_tokens"][split] += len(tokens)
                out["carried_in_documents"][""] += int((tokens == eot_id).sum())
    left = {}
    for split, parts in streams.items():
        flat = np.concatenate(parts)
        n = len(flat) // row_len
        left[split] = flat[n * row_len:]
        # This run's documents in what is left (the carried ones come first and were counted by their run).
        ours = left[split][max(0, out["carried_in_tokens"][split] - n * row_len):]
        if final and len(left[split]):  # the last row, padded: nothing is left over
            pad = np.full(row_len - len(left[split]), pad_value(dtype), dtype=np.uint32)
            out["padding_tokens"][split] = len(pad)
            flat, n, left[split] = np.concatenate([flat, pad]), n + 1, flat[:0]
            runs[split].add("", 0, len(pad))
        if n:
            tables.append(packed_rows(schema, seed, TAILS_FILE, split, 0, flat[: n * row_len]))
            spans.append(runs[split].cut(tables[-1]["key"].to_numpy(), row_len))
        out["rows"][split] = n
        out["unpacked_tokens"][split] = len(left[split])
        # Each document ends with an end-of-text id; one whose text is all in the rows may leave just its id.
        if len(left[split]):
            rest = left[split]
            out["unpacked_documents"][""] += int((ours == eot_id).sum()) - int(len(ours) == len(rest) and ours[0] == eot_id)
            out["carried_on_documents"][""] += int((rest == eot_id).sum()) - int(rest[0] == eot_id)
    if tails_out and any(len(t) for t in left.values()):
        write_tails(tails_out, left, runs)
    packed_file = ""
    if tables:
        write_spans(work_dir, TAILS_FILE, spans)
        fs, p = filesystem(join(work_dir, "packed", TAILS_FILE))
        pq.write_table(pa.concat_tables(tables), p, filesystem=fs)
        packed_file = TAILS_FILE
    figures = {k: v[""] if k.endswith("documents") else dict(v) for k, v in out.items()}
    return Output(tally=Tally(**figures, cpu_s={"pack": time.process_time() - cpu0}), packed_file=packed_file)


def read_tails(path) -> dict[str, tuple[np.ndarray, DocRuns]]:
    """A tails file's tokens by split, with the documents they are of (a file made before lineage has
    none: its tokens are of documents unknown, ""). `path`: a work file of this run's, or an earlier
    version's tails as its commit names them (strata.data.integrity.Named: checked against their digest)."""
    ids = {v: k for k, v in SPLIT_IDS.items()}
    if isinstance(path, str):
        fs, p = filesystem(path)
        t = pq.read_table(p, filesystem=fs)
    else:
        t = path.parquet()
    out = {}
    for i, (split, tokens) in enumerate(zip(t["split"].to_pylist(), t["tokens"].to_numpy(zero_copy_only=False),
                                            strict=True)):
        tokens = np.asarray(tokens, dtype=np.uint32)
        docs = DocRuns(t["docs"][i].as_py(), t["exact"][i].as_py(), t["lengths"][i].as_py()) \
            if "docs" in t.column_names else DocRuns([""], [0], [len(tokens)])
        out[ids[split]] = (tokens, docs)
    return out
