"""Deduplication: exact (hash of the normalized text) and near (MinHash + LSH), global.

Pass 1 writes every kept document's keys beside its text; a sharded index of
Ray actors on the cpu tier then reads the keys it owns and reduces them to the
winner per key; pass 2 asks whether each document is the winner. The winner of a key is
the entry with the smallest (priority, doc key): entries loaded from earlier
versions (those in the window, `--dedup-window`) and from a `--dedup-against`
dataset have priority 0, so anything already there wins and a later run drops
its duplicates. The same input always keeps the same documents.

Near duplicates are documents sharing an LSH band (b bands of r rows of a
num_perm MinHash over word shingles), the standard candidate rule without a
Jaccard re-check: bands and rows are chosen for the threshold (`optimal_lsh`),
so pairs with similarity above it collide with high probability; the chance
at each similarity is `collision_probability` (the S-curve).
"""

from __future__ import annotations

import math
import re
import unicodedata
import zlib
from dataclasses import dataclass, field

import numpy as np

from strata.commands.cli import NON_NEGATIVE, check_fields
from strata.data.integrity import IntegrityError
from strata.data.lineage import doc_key

_WORD = re.compile(r"\w+", re.UNICODE)
_PLAIN_WORD = re.compile(r"[^\W_]+", re.UNICODE)  # a word without underscores (they split it)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)?")
_MARKS = None  # combining marks (regex's \p{Mn}), compiled when first needed
NORMALIZE = "numbers-accents-underscores-v1"  # what `shingle_normalize` does, as a dataset's params name it
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    exact_dedup: bool = True
    """Drop documents whose normalized text equals an earlier one's."""
    near_dedup: bool = True
    """Drop near duplicates found with MinHash + LSH."""
    shingle_words: int = 5
    """Words per shingle for MinHash."""
    shingle_normalize: bool = False
    """Normalize text before shingling as FineWeb's MinHash does (datatrove's defaults): each number (digits,
    with a decimal part) becomes 0, accents are dropped and `_` splits words, so pages that differ only in
    numbers (versions, dates, counts) are near duplicates. `--preset web` turns it on."""
    num_perm: int = 256
    """MinHash permutations (256: a sharper S-curve than 128, so one-word edits of 75-word documents are
    caught 99.7% of the time and pairs well below the threshold half as often, for 1.6x the signing CPU)."""
    bands: int = 0
    """LSH bands (0: bands and rows chosen for the threshold, see `optimal_lsh`)."""
    rows: int = 0
    """Rows per band, with `bands` (0: num_perm // bands); bands x rows <= num_perm."""
    threshold: float = 0.8
    """Jaccard similarity above which documents count as near duplicates."""
    false_negative_weight: float = 0.9
    """How much a missed duplicate above the threshold weighs against a false merge below it when
    bands and rows are chosen (0.5: equal). The default catches one-word edits of 100-word documents
    (Jaccard ~0.88) more than 99 times in 100; pairs below 0.5 merge at most 3 times in 100."""
    index_shards: int = 0
    """Dedup index actors (0: one per two cpu-tier CPUs)."""
    against_previous: bool = True
    """Also drop documents that duplicate anything in earlier versions of the dataset (within the window)."""
    window: str = field(default="24", metadata={"flag": "--dedup-window"})
    """Earlier versions to deduplicate against: the documents kept by the last N of them, or `all` (every
    earlier version, at a cost that grows with history). 24, as an hour a version is a day: FineWeb found
    dedup across crawls no better than none."""
    against: str = field(default="", metadata={"flag": "--dedup-against"})
    """Also drop documents another strata dataset holds, NAME[@VERSION], read through its own dedup index
    (e.g. keep a fine-tuning set free of the pretraining corpus)."""
    max_duplicate_fraction: float = 0.9
    """Refuse to commit when dedup removes more than this share of one input source's documents (a
    source is an input as given: a directory, glob, file or URI; sources of under 20 documents are not
    judged); 1 turns the guard off."""

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0 or self.num_perm < 2 or self.shingle_words < 1:
            raise ValueError("need 0 < threshold < 1, num_perm >= 2, shingle_words >= 1")
        if not 0.0 < self.max_duplicate_fraction <= 1.0:
            raise ValueError("need 0 < max_duplicate_fraction <= 1")
        if not 0.0 < self.false_negative_weight < 1.0:
            raise ValueError("need 0 < false_negative_weight < 1")
        check_fields(self, dict.fromkeys(("bands", "rows", "index_shards"), NON_NEGATIVE))
        if self.rows and not self.bands:
            raise ValueError("rows needs bands")
        if isinstance(self.window, int) and not isinstance(self.window, bool):
            object.__setattr__(self, "window", str(self.window))
        if not isinstance(self.window, str) or self.window != "all" and not (self.window.isdigit() and int(self.window) >= 1):
            raise ValueError(f"--dedup-window {self.window!r}: must be a number of versions >= 1, or all")
        if self.bands and self.bands * (self.rows or self.num_perm // self.bands) > self.num_perm or (
                self.bands and self.bands > self.num_perm):
            raise ValueError(f"bands x rows must be at most num_perm {self.num_perm}")

    def window_size(self) -> int | None:
        """The window in versions (None: every earlier version)."""
        return None if self.window == "all" else int(self.window)

    def lsh(self) -> tuple[int, int]:
        """(bands, rows): given, or `optimal_lsh` for the threshold."""
        if self.bands:
            return self.bands, self.rows or self.num_perm // self.bands
        return optimal_lsh(self.threshold, self.num_perm, self.false_negative_weight)

    def params(self) -> dict:
        """What must match for an earlier version's near-dup state to be comparable."""
        b, r = self.lsh()
        params = {"shingle_words": self.shingle_words, "num_perm": self.num_perm, "bands": b, "rows": r,
                  "hash": "crc32-words/multiply-shift-v1"}
        return {**params, "normalize": NORMALIZE} if self.shingle_normalize else params


def collision_probability(similarity, bands: int, rows: int):
    """The chance that two documents of this Jaccard similarity share at least one LSH band."""
    return 1.0 - (1.0 - np.asarray(similarity, dtype=float) ** rows) ** bands


def optimal_lsh(threshold: float, num_perm: int, false_negative_weight: float = 0.5) -> tuple[int, int]:
    """The (bands, rows), bands x rows <= num_perm, that minimise the weighted area of false positives
    (collisions below the threshold) and false negatives (misses above it) under the S-curve."""
    s = np.linspace(0.0, 1.0, 1001)
    below, step = s <= threshold, s[1] - s[0]
    best, best_cost = (1, num_perm), math.inf
    for b in range(1, num_perm + 1):
        rows = np.arange(1, num_perm // b + 1)
        p = collision_probability(s[None, :], b, rows[:, None])
        cost = step * ((1 - false_negative_weight) * np.where(below, p, 0).sum(axis=1)
                       + false_negative_weight * np.where(below, 0, 1 - p).sum(axis=1))
        i = int(cost.argmin())
        if cost[i] < best_cost:
            best, best_cost = (b, int(rows[i])), float(cost[i])
    return best


def hash64(data: str) -> int:
    """A string's 64-bit key: the one lineage keys record ids by (strata.data.lineage.doc_key)."""
    return doc_key(data)


def exact_key(text: str) -> int:
    """Key of the text up to case and whitespace."""
    return hash64(" ".join(text.casefold().split()))


class MinHasher:
    def __init__(self, cfg: DedupConfig, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.k = cfg.shingle_words
        self.normalize = cfg.shingle_normalize
        self.params = cfg.params()  # what a forget list's near keys must have been made with to be comparable
        self.bands, self.rows = cfg.lsh()
        self.a = rng.integers(1, 2**63, cfg.num_perm, dtype=np.uint64) | np.uint64(1)  # odd multipliers
        self.b = rng.integers(0, 2**63, cfg.num_perm, dtype=np.uint64)
        self.mix = rng.integers(1, 2**63, (self.bands, self.rows), dtype=np.uint64) | np.uint64(1)
        self.pow = rng.integers(1, 2**63, self.k, dtype=np.uint64) | np.uint64(1)

    def shingles(self, text: str) -> np.ndarray:
        """The uint64 hashes of the text's shingles of k consecutive words (a polynomial hash, mod 2^64)."""
        words = np.array([zlib.crc32(w.encode()) for w in self.words(text)] or [0], dtype=np.uint64)
        n = max(1, len(words) - self.k + 1)
        pad = np.concatenate([words, np.zeros(self.k, dtype=np.uint64)])
        shingles = np.zeros(n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(self.k):
                shingles += pad[j: j + n] * self.pow[j]
        return shingles

    def words(self, text: str) -> list[str]:
        """The words shingles are made of: lower case, and with `shingle_normalize` FineWeb's normalization."""
        text = text.lower()
        if not self.normalize:
            return _WORD.findall(text)
        text = _NUMBER.sub("0", text)
        if not text.isascii():  # accents: decomposed, then their marks dropped (regex's \p{Mn}: in C, not a loop)
            global _MARKS
            if _MARKS is None:
                import regex

                _MARKS = regex.compile(r"\p{Mn}+")
            text = _MARKS.sub("", unicodedata.normalize("NFD", text))
        return _PLAIN_WORD.findall(text)

    def signature(self, text: str) -> np.ndarray:
        """(num_perm,) uint32 MinHash of the text's word shingles (multiply-shift hashing)."""
        shingles = self.shingles(text)
        n = len(shingles)
        sig = np.full(len(self.a), np.iinfo(np.uint64).max, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(0, n, 4096):  # (P, chunk) at a time: bounded memory for long documents
                h = (self.a[:, None] * shingles[None, i: i + 4096] + self.b[:, None]) >> np.uint64(32)
                np.minimum(sig, h.min(axis=1), out=sig)
        return sig.astype(np.uint32)

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """(bands,) uint64 keys, one per band, each mixing the band's index and rows."""
        rows = sig[: self.bands * self.rows].reshape(self.bands, self.rows).astype(np.uint64)
        with np.errstate(over="ignore"):
            keys = (rows * self.mix).sum(axis=1) + np.arange(self.bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            keys ^= keys >> np.uint64(31)
            keys *= np.uint64(0xBF58476D1CE4E5B9)
            keys ^= keys >> np.uint64(29)
        return keys


def hasher_of(params: dict | None):
    """The MinHasher of a dataset's dedup parameters (its manifest's `dedup.params`), or None when they are
    not ones this code computes (another hash, or none recorded)."""
    if not params or params.get("hash") != DedupConfig().params()["hash"]:
        return None
    if params.get("normalize") not in (None, NORMALIZE):
        return None
    return MinHasher(DedupConfig(shingle_words=params["shingle_words"], num_perm=params["num_perm"],
                                 bands=params["bands"], rows=params["rows"], shingle_normalize="normalize" in params))


class DedupIndex:
    """One slice of the global index (a Ray actor): for each key of this run in its slice of the 64-bit key
    space, the winning doc key and whether an earlier version holds the key.

    It holds only this run's keys. Earlier versions' keys stay in the dataset's index segments (below),
    sorted by key, which it streams a row group at a time, reading just the row groups of its slice: its
    memory grows with the new data, not with history. It builds itself from files (this run's work files and
    the segments), so a restarted actor (its node died) rebuilds the same index, and pass 2 goes on. The
    winner of a key is the earlier versions' entry with the smallest doc key if there is one (anything
    already in the dataset wins), else this run's first in input order (its file's place in the input, then
    its position there; pipelines/pack.py `input_order`), as datatrove keeps a cluster's first copy and a reader
    of the input would expect: the same input keeps the same
    documents, whatever the number of actors. Segments marked `against` are another dataset's
    (--dedup-against): they count as earlier, and `winners` says which keys they hold.
    """

    def __init__(self, shard: int, shards: int, work_files: list[str], prior: dict[str, list[dict]],
                 tables: tuple[str, ...]):
        self.lo, self.hi = key_range(shard, shards)
        self.tables: dict[str, dict[str, np.ndarray]] = {}
        parts = {t: [] for t in tables}
        for path in work_files:
            t = _read(path, ["doc", "exact", "bands", "order"])
            docs, ranks = t.column("doc").to_numpy(), t.column("order").to_numpy()
            if "exact" in parts:
                parts["exact"].append((t.column("exact").to_numpy(), docs, ranks))
            if "band" in parts:
                bands = t.column("bands").combine_chunks()
                width = bands.type.list_size
                parts["band"].append((bands.flatten().to_numpy(), np.repeat(docs, width), np.repeat(ranks, width)))
        for table, entries in parts.items():
            keys, docs, ranks = (np.concatenate([e[i] for e in entries]).astype(np.uint64) if entries
                                 else np.zeros(0, np.uint64) for i in (0, 1, 2))
            mine = self.owns(keys)
            keys, docs, ranks = keys[mine], docs[mine], ranks[mine]
            order = np.lexsort((docs, ranks, keys))  # per key, the first document in input order
            keys, docs = keys[order], docs[order]
            first = np.ones(len(keys), dtype=bool)
            first[1:] = keys[1:] != keys[:-1]
            n = int(first.sum())
            self.tables[table] = {"keys": keys[first], "docs": docs[first], "earlier": np.zeros(n, bool),
                                  "against": np.zeros(n, bool),
                                  "earlier_docs": np.full(n, np.iinfo(np.uint64).max, np.uint64)}
            for segment in prior.get(table, []):
                try:
                    for keys, docs in segment_rows(segment, self.lo, self.hi):
                        self._mark_earlier(table, keys, docs, bool(segment.get("against")))
                except IntegrityError as e:  # said by the first call, as the error it is (an actor that died in
                    self.refused = e  # its creation would say only that it died)
                    return

    refused: Exception | None = None

    def owns(self, keys: np.ndarray) -> np.ndarray:
        return (keys >= np.uint64(self.lo)) & (keys <= np.uint64(self.hi - 1))

    def _mark_earlier(self, table: str, keys: np.ndarray, docs: np.ndarray, against: bool = False) -> None:
        t = self.tables[table]
        if not len(t["keys"]) or not len(keys):
            return
        i = np.minimum(np.searchsorted(t["keys"], keys), len(t["keys"]) - 1)
        hit = t["keys"][i] == keys
        t["earlier"][i[hit]] = True
        if against:
            t["against"][i[hit]] = True
        np.minimum.at(t["earlier_docs"], i[hit], docs[hit])

    def sizes(self) -> dict[str, int]:
        if self.refused is not None:
            raise self.refused
        return {t: len(v["keys"]) for t, v in self.tables.items()}

    def cpu_s(self) -> float:
        """CPU seconds of this actor's process: building the index and answering lookups."""
        import time

        return time.process_time()

    def peak_rss_mb(self) -> float:
        """The most memory this actor's process has held."""
        from strata.cluster.procs import peak_rss_mb

        return peak_rss_mb()

    def winners(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(doc key, where it is) of the winner of each key, where: 0 this run, 1 an earlier version, 2 the
        --dedup-against dataset (it holds the key); a (key, doc) of this run lost its key when the winner
        is another document or is not this run's."""
        t = self.tables[table]
        i = np.searchsorted(t["keys"], keys.astype(np.uint64))  # every key asked for was registered
        earlier = t["earlier"][i]
        where = earlier.astype(np.uint8) + t["against"][i].astype(np.uint8)
        return np.where(earlier, t["earlier_docs"][i], t["docs"][i]), where

    def save(self, table: str, path: str) -> dict:
        """Write the keys this run adds to the index (those no earlier version holds), sorted, for later runs;
        returns the file's entry in an index segment."""
        t = self.tables[table]
        new = ~t["earlier"]
        return write_index_file(path, t["keys"][new], t["docs"][new], self.lo, self.hi)

    def merge(self, table: str, segments: list[dict], path: str) -> dict:
        """Compaction: this slice of `segments` as one sorted file (the winner per key: its smallest doc key),
        read and written a bounded number of rows at a time."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from strata.data.integrity import HashingSink
        from strata.data.storage import filesystem

        fs, target = filesystem(path)
        rows = 0
        with fs.open_output_stream(target) as raw, pq.ParquetWriter(
                sink := HashingSink(raw), pa.schema([("key", pa.uint64()), ("doc", pa.uint64())])) as w:
            for lo, hi in _sub_ranges(segments, self.lo, self.hi):
                parts = [kd for segment in segments for kd in segment_rows(segment, lo, hi)]
                keys, docs = (np.concatenate([p[i] for p in parts]) if parts else np.zeros(0, np.uint64) for i in (0, 1))
                order = np.lexsort((docs, keys))
                keys, docs = keys[order], docs[order]
                first = np.ones(len(keys), dtype=bool)
                first[1:] = keys[1:] != keys[:-1]
                w.write_table(pa.table({"key": keys[first], "doc": docs[first]}), row_group_size=INDEX_ROW_GROUP)
                rows += int(first.sum())
        return {"path": path, "lo": self.lo, "hi": self.hi, "rows": rows, "sha256": sink.hexdigest()}


def _read(path: str, columns: list[str]):
    import pyarrow.parquet as pq

    from strata.data.storage import filesystem

    fs, p = filesystem(path)
    return pq.read_table(p, filesystem=fs, columns=columns)


INDEX_ROW_GROUP = 65536  # rows per row group of an index file: what an actor streams at a time
MERGE_ROWS = 1 << 20  # rows a compaction holds at a time, at most (about), per actor


def key_range(shard: int, shards: int) -> tuple[int, int]:
    """The slice [lo, hi) of the 64-bit key space that index actor `shard` of `shards` owns."""
    return shard * (1 << 64) // shards, (shard + 1) * (1 << 64) // shards


def shard_of(keys: np.ndarray, n: int) -> np.ndarray:
    """Which index actor owns each key (the one whose slice of the key space holds it)."""
    lows = np.array([key_range(s, n)[0] for s in range(n)], dtype=np.uint64)
    return np.searchsorted(lows, keys.astype(np.uint64), side="right") - 1


def write_index_file(path: str, keys: np.ndarray, docs: np.ndarray, lo: int, hi: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from strata.data.integrity import HashingSink
    from strata.data.storage import filesystem

    fs, target = filesystem(path)
    with fs.open_output_stream(target) as raw:
        sink = HashingSink(raw)
        pq.write_table(pa.table({"key": keys, "doc": docs}), sink, row_group_size=INDEX_ROW_GROUP)
    return {"path": path, "lo": lo, "hi": hi, "rows": len(keys), "sha256": sink.hexdigest()}


def segment_rows(segment: dict, lo: int, hi: int):
    """(keys, docs) of a segment's entries in [lo, hi), a row group at a time: only the files whose slice
    meets it, and in them only the row groups whose key statistics do."""
    import pyarrow.parquet as pq

    for f in segment["files"]:
        if f["hi"] <= lo or f["lo"] >= hi:
            continue
        with _opened(f) as source:
            pf = pq.ParquetFile(source)
            for g in range(pf.metadata.num_row_groups):
                stats = pf.metadata.row_group(g).column(0).statistics
                if stats is not None and stats.has_min_max and (stats.max < lo or stats.min >= hi):
                    continue
                t = pf.read_row_group(g, columns=["key", "doc"])
                keys, docs = t.column("key").to_numpy(), t.column("doc").to_numpy()
                mine = (keys >= np.uint64(lo)) & (keys <= np.uint64(hi - 1))
                yield keys[mine], docs[mine]


def segment_lookup(segment: dict, keys: np.ndarray) -> np.ndarray:
    """The docs of a segment's entries whose key is one of `keys` (sorted uint64): each file opened once, and
    in it only the row groups whose key statistics can hold one of them."""
    import pyarrow.parquet as pq

    out = []
    for f in segment["files"]:
        mine = keys[(keys >= np.uint64(f["lo"])) & (keys <= np.uint64(f["hi"] - 1))]
        if not len(mine):
            continue
        with _opened(f) as source:
            pf = pq.ParquetFile(source)
            for g in range(pf.metadata.num_row_groups):
                stats = pf.metadata.row_group(g).column(0).statistics
                if stats is not None and stats.has_min_max and not (
                        (mine >= np.uint64(stats.min)) & (mine <= np.uint64(stats.max))).any():
                    continue
                t = pf.read_row_group(g, columns=["key", "doc"])
                out.append(t.column("doc").to_numpy()[np.isin(t.column("key").to_numpy(), mine)])
    return np.concatenate(out) if out else np.zeros(0, np.uint64)


def _opened(f: dict):
    """An index file to read: checked against the digest its commit names (`named`, strata/data/integrity.py) when it
    is an earlier version's or another dataset's; this run's own, as it wrote it."""
    import contextlib

    from strata.data.storage import filesystem

    if (named := f.get("named")) is not None:
        return named.opened()
    fs, p = filesystem(f["path"])
    return contextlib.closing(fs.open_input_file(p))


def _sub_ranges(segments: list[dict], lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into slices of about MERGE_ROWS entries of `segments` each (keys are uniform)."""
    rows = sum(f["rows"] * (min(hi, f["hi"]) - max(lo, f["lo"])) // max(1, f["hi"] - f["lo"])
               for s in segments for f in s["files"] if f["hi"] > lo and f["lo"] < hi)
    n = max(1, -(-rows // MERGE_ROWS))
    return [(lo + (hi - lo) * i // n, lo + (hi - lo) * (i + 1) // n) for i in range(n)]


INDEX_FAN_IN = 4  # segments of a size merged into one (see `compaction`)


def in_window(segments: list[dict], versions: list[str]) -> list[dict]:
    """The segments that hold the keys of the window `versions` (oldest first), in their order: each
    segment names the newest version whose keys it holds (`last`), and goes once that version leaves.
    Segments made before windows name none: they fill the versions the named ones leave, newest first."""
    keep = set(versions)
    named = [s for s in segments if s.get("last") in keep]
    room = len(versions) - sum(s["versions"] for s in named)
    unnamed = set()
    for i in range(len(segments) - 1, -1, -1):
        if room <= 0:
            break
        if segments[i].get("last") is None:
            unnamed.add(i)
            room -= segments[i]["versions"]
    return [s for i, s in enumerate(segments) if s.get("last") in keep or i in unnamed]


def window_versions(listed: list[str] | None, parent: str | None, size: int | None) -> list[str] | None:
    """The versions a new version deduplicates against: the newest `size` of its parent's window and the
    parent itself (`listed`: the parent's window; None with `size` None: every earlier version)."""
    if size is None:
        return None
    return ([*(listed or []), parent] if parent else [])[-size:]


def legacy_segment(paths: list[str], params) -> dict:
    """A version's dedup files from before the index (keys of every slice in each) as one segment."""
    import pyarrow.parquet as pq

    from strata.data.storage import filesystem

    files = []
    for path in paths:
        fs, p = filesystem(path)
        files.append({"path": path, "lo": 0, "hi": 1 << 64, "rows": pq.ParquetFile(fs.open_input_file(p)).metadata.num_rows})
    return {"versions": 1, "params": params, "files": files}


def compaction(segments: list[dict], fan_in: int, most: int | None = None) -> int:
    """How many of the newest segments to merge into one: `fan_in` of them when they cover the same number
    of versions (a counter in base `fan_in`), else none. So a dataset of N versions has at most
    (fan_in - 1) x log_fan_in(N) + 1 segments per table, and each key is rewritten log_fan_in(N) times.
    With `most`, no merge makes a segment of more versions than that: merges stay small (a flat cost per
    version), and N versions have about N / most segments."""
    if len(segments) < fan_in:
        return 0
    last = segments[-fan_in:]
    if most is not None and sum(s["versions"] for s in last) > most:
        return 0
    return fan_in if len({s["versions"] for s in last}) == 1 else 0


def suggested_shards(cpus: float, new_bytes: int) -> int:
    """Index actors: one per two cpu-tier CPUs, and at most one per INDEX_BYTES of new input, so a bigger
    cluster does not cut the same input's index into more files."""
    return max(1, min(math.floor(cpus / 2), -(-new_bytes // INDEX_BYTES)))


INDEX_BYTES = 256 << 20


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """The Jaccard similarity of two sets of shingle hashes."""
    a, b = np.unique(a), np.unique(b)
    union = len(np.union1d(a, b))
    return len(np.intersect1d(a, b, assume_unique=True)) / union if union else 1.0


def size_histogram(sizes) -> dict[str, int]:
    """Cluster sizes in power-of-two bins: `2`, `3-4`, `5-8`, ..."""
    bins: dict[str, int] = {}
    for n in sorted(sizes):
        hi = 2
        while hi < n:
            hi *= 2
        label = "2" if hi == 2 else f"{hi // 2 + 1}-{hi}"
        bins[label] = bins.get(label, 0) + 1
    return bins


def audit_pairs(docs_paths: list[str], pairs: list[dict], winners: list[int], cfg: DedupConfig) -> dict:
    """The texts behind sampled duplicate pairs, from pass 1's work files (a cpu-tier task).

    `pairs` are {removed, kept, kind} by doc key; returns them with their doc ids, the Jaccard
    similarity their MinHash signatures estimate and their true one, and the doc ids of `winners`
    (the largest clusters' kept documents). Only the row groups holding a wanted key are read.
    """
    import pyarrow.parquet as pq

    from strata.data.storage import filesystem

    wanted = {p["removed"] for p in pairs} | {p["kept"] for p in pairs} | set(winners)
    texts, ids = {}, {}
    for path in docs_paths:
        fs, p = filesystem(path)
        f = pq.ParquetFile(fs.open_input_file(p))
        for g in range(f.num_row_groups):
            docs = f.read_row_group(g, columns=["doc"]).column(0).to_numpy()
            if not np.isin(docs, np.fromiter(wanted, np.uint64, len(wanted))).any():
                continue
            t = f.read_row_group(g, columns=["doc", "doc_id", "text"])
            for doc, doc_id, text in zip(*(t.column(c).to_pylist() for c in ("doc", "doc_id", "text")), strict=True):
                if doc in wanted:
                    texts[doc], ids[doc] = text, doc_id
    hasher = MinHasher(cfg)
    out = []
    for pair in pairs:
        a, b = texts.get(pair["removed"]), texts.get(pair["kept"])
        if a is None or b is None:
            continue
        out.append({"kind": pair["kind"], "removed": ids[pair["removed"]], "kept": ids[pair["kept"]],
                    "estimated_jaccard": round(float((hasher.signature(a) == hasher.signature(b)).mean()), 4),
                    "true_jaccard": round(jaccard(hasher.shingles(a), hasher.shingles(b)), 4)})
    return {"pairs": out, "winner_ids": {str(w): ids.get(w, "") for w in winners}}
