"""Deduplication: exact (hash of the normalized text) and near (MinHash + LSH), global.

Pass 1 writes every kept document's keys beside its text; a sharded index of
Ray actors on the cpu tier then reads the keys it owns and reduces them to the
winner per key; pass 2 asks whether each document is the winner. The winner of a key is
the entry with the smallest (priority, doc key): entries loaded from earlier
versions have priority 0, so anything already in the dataset wins and a later
run drops its duplicates. The same input always keeps the same documents.

Near duplicates are documents sharing an LSH band (b bands of r rows of a
num_perm MinHash over word shingles), the standard candidate rule without a
Jaccard re-check: bands and rows are chosen for the threshold (`optimal_lsh`),
so pairs with similarity above it collide with high probability; the chance
at each similarity is `collision_probability` (the S-curve).
"""

from __future__ import annotations

import hashlib
import math
import re
import zlib
from dataclasses import dataclass

import numpy as np

from strata.cli import NON_NEGATIVE, check_fields

_WORD = re.compile(r"\w+", re.UNICODE)
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, kw_only=True)
class DedupConfig:
    exact_dedup: bool = True
    """Drop documents whose normalized text equals an earlier one's."""
    near_dedup: bool = True
    """Drop near duplicates found with MinHash + LSH."""
    shingle_words: int = 5
    """Words per shingle for MinHash."""
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
    """Also drop documents that duplicate anything in earlier versions of the dataset."""
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
        if self.bands and self.bands * (self.rows or self.num_perm // self.bands) > self.num_perm or (
                self.bands and self.bands > self.num_perm):
            raise ValueError(f"bands x rows must be at most num_perm {self.num_perm}")

    def lsh(self) -> tuple[int, int]:
        """(bands, rows): given, or `optimal_lsh` for the threshold."""
        if self.bands:
            return self.bands, self.rows or self.num_perm // self.bands
        return optimal_lsh(self.threshold, self.num_perm, self.false_negative_weight)

    def params(self) -> dict:
        """What must match for an earlier version's near-dup state to be comparable."""
        b, r = self.lsh()
        return {"shingle_words": self.shingle_words, "num_perm": self.num_perm, "bands": b, "rows": r,
                "hash": "crc32-words/multiply-shift-v1"}


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
    return int.from_bytes(hashlib.blake2b(data.encode(), digest_size=8).digest(), "little")


def exact_key(text: str) -> int:
    """Key of the text up to case and whitespace."""
    return hash64(" ".join(text.casefold().split()))


class MinHasher:
    def __init__(self, cfg: DedupConfig, seed: int = 1):
        rng = np.random.default_rng(seed)
        self.k = cfg.shingle_words
        self.bands, self.rows = cfg.lsh()
        self.a = rng.integers(1, 2**63, cfg.num_perm, dtype=np.uint64) | np.uint64(1)  # odd multipliers
        self.b = rng.integers(0, 2**63, cfg.num_perm, dtype=np.uint64)
        self.mix = rng.integers(1, 2**63, (self.bands, self.rows), dtype=np.uint64) | np.uint64(1)
        self.pow = rng.integers(1, 2**63, self.k, dtype=np.uint64) | np.uint64(1)

    def shingles(self, text: str) -> np.ndarray:
        """The uint64 hashes of the text's shingles of k consecutive words (a polynomial hash, mod 2^64)."""
        words = np.array([zlib.crc32(w.encode()) for w in _WORD.findall(text.lower())] or [0], dtype=np.uint64)
        n = max(1, len(words) - self.k + 1)
        pad = np.concatenate([words, np.zeros(self.k, dtype=np.uint64)])
        shingles = np.zeros(n, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for j in range(self.k):
                shingles += pad[j: j + n] * self.pow[j]
        return shingles

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


class DedupIndex:
    """One shard of the global index: key -> winning (priority, doc key). A Ray actor.

    It builds itself from files: the work files of this run (priority 1) and the
    saved state of earlier versions (priority 0). So a restarted actor (its node
    died) rebuilds the same index, and pass 2 goes on.
    """

    def __init__(self, shard: int, shards: int, work_files: list[str], prior: dict[str, list[str]],
                 tables: tuple[str, ...]):
        self.shard, self.shards = shard, shards
        self.parts = {t: [] for t in tables}
        self.tables: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for table in tables:
            for path in prior.get(table, []):
                t = _read(path, ["key", "doc"])
                self.register(table, t.column("key").to_numpy(), t.column("doc").to_numpy(), 0)
        for path in work_files:
            t = _read(path, ["doc", "exact", "bands"])
            docs = t.column("doc").to_numpy()
            if "exact" in self.parts:
                self.register("exact", t.column("exact").to_numpy(), docs, 1)
            if "band" in self.parts:
                bands = t.column("bands").combine_chunks()
                self.register("band", bands.flatten().to_numpy(), np.repeat(docs, bands.type.list_size), 1)
        self.finalize()

    def register(self, table: str, keys: np.ndarray, docs: np.ndarray, priority: int) -> None:
        """Keep the entries this shard owns."""
        keys, docs = keys.astype(np.uint64), docs.astype(np.uint64)
        mine = shard_of(keys, self.shards) == self.shard
        self.parts[table].append((keys[mine], docs[mine], np.full(int(mine.sum()), priority, dtype=np.uint8)))

    def finalize(self) -> dict:
        """Reduce each table to one winner per key; sorted for binary search."""
        sizes = {}
        for table, parts in self.parts.items():
            if parts:
                keys, docs, prio = (np.concatenate(x) for x in zip(*parts, strict=True))
            else:
                keys = docs = np.zeros(0, np.uint64)
                prio = np.zeros(0, np.uint8)
            order = np.lexsort((docs, prio, keys))
            keys, docs, prio = keys[order], docs[order], prio[order]
            first = np.ones(len(keys), dtype=bool)
            first[1:] = keys[1:] != keys[:-1]
            self.tables[table] = (keys[first], docs[first], prio[first])
            sizes[table] = int(first.sum())
        self.parts = {t: [] for t in self.parts}
        return sizes

    def sizes(self) -> dict[str, int]:
        return {t: len(v[0]) for t, v in self.tables.items()}

    def cpu_s(self) -> float:
        """CPU seconds of this actor's process: building the index and answering lookups."""
        import time

        return time.process_time()

    def peak_rss_mb(self) -> float:
        """The most memory this actor's process has held (its index is held in memory, whole)."""
        from strata.procs import peak_rss_mb

        return peak_rss_mb()

    def winners(self, table: str, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(doc key, from an earlier version) of the winner of each key; a (key, doc) of this run lost
        its key when the winner is another document or an earlier version's."""
        k, d, p = self.tables[table]
        i = np.searchsorted(k, keys.astype(np.uint64))  # every key asked for was registered
        return d[i], p[i] != 1

    def save(self, table: str, path: str) -> int:
        """Write the entries this run added (priority 1 winners) for later runs to load."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        from strata.storage import filesystem

        k, d, p = self.tables[table]
        new = p == 1
        fs, target = filesystem(path)
        pq.write_table(pa.table({"key": k[new], "doc": d[new]}), target, filesystem=fs)
        return int(new.sum())


def _read(path: str, columns: list[str]):
    import pyarrow.parquet as pq

    from strata.storage import filesystem

    fs, p = filesystem(path)
    return pq.read_table(p, filesystem=fs, columns=columns)


def shard_of(keys: np.ndarray, n: int) -> np.ndarray:
    """Which index shard owns each key."""
    return (keys.astype(np.uint64) % np.uint64(n)).astype(np.int64)


def suggested_shards(cpus: float) -> int:
    return max(1, math.floor(cpus / 2))


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

    from strata.storage import filesystem

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
