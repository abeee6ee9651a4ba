"""Decontamination: a document that shares an n-gram with an evaluation set is not trained on.

    python -m pipelines.preprocess ... --decontaminate evals/mmlu.jsonl --decontaminate evals/gsm8k.parquet

Every evaluation file (text, JSONL or parquet, read as tier 1 reads its input)
is cut into n-grams of normalised words (lowercase letters and digits;
`--decontaminate-n`, 13 by default, the usual choice). The driver hashes them
to 64 bits, sorts them once and puts the array in Ray's object store: every
worker reads the same shared, read-only copy (8 bytes an n-gram plus 2 for
its file: a million n-grams are 10 MB, once per node, not once per worker).
A document with any n-gram in the array is filtered as `contaminated`, and
the manifest counts the documents each evaluation file caught.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter

import numpy as np

WORD = re.compile(r"[^\W_]+")  # letters and digits of any script; punctuation and case do not matter
PRIME = np.uint64(1099511628211)  # FNV's 64-bit prime, to combine word hashes in order


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


_WORD_HASHES: dict[str, int] = {}


def _word_hash(w: str) -> int:
    h = _WORD_HASHES.get(w)
    if h is None:
        if len(_WORD_HASHES) > 1 << 20:  # bounded: a long tail of rare words would grow it forever
            _WORD_HASHES.clear()
        h = _WORD_HASHES[w] = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
    return h


def ngram_hashes(text: str, n: int) -> np.ndarray:
    """The 64-bit hashes of every run of n consecutive words of `text` (none if it has fewer words)."""
    ws = words(text)
    if len(ws) < n:
        return np.zeros(0, dtype=np.uint64)
    wh = np.fromiter((_word_hash(w) for w in ws), dtype=np.uint64, count=len(ws))
    m = len(ws) - n + 1
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic mod 2^64 on purpose
        for j in range(n):
            acc = acc * PRIME + wh[j: j + m]
    return acc


def build(paths: list[str], n: int) -> dict:
    """The index of the evaluation files' n-grams: sorted unique hashes, each with the file it came from."""
    from pipelines.sources import ReadConfig, list_inputs, read_file

    cfg = ReadConfig(inputs=tuple(paths))
    files = list_inputs(list(paths))
    hashes, owner, names = [], [], []
    for i, f in enumerate(files):
        names.append(f["path"])
        for rec in read_file({**f, "start": 0, "end": f["size"]}, cfg):  # the whole file
            if rec["status"] == "ok":
                h = ngram_hashes(rec["text"], n)
                hashes.append(h)
                owner.append(np.full(len(h), i, dtype=np.uint16))
    if not files:
        raise ValueError(f"--decontaminate {paths}: no evaluation files found")
    h = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    o = np.concatenate(owner) if owner else np.zeros(0, np.uint16)
    h, first = np.unique(h, return_index=True)  # sorted; an n-gram in two files is credited to the first
    return {"ngrams": h, "file": o[first], "names": names, "n": n}


class ContaminationRule:
    """Fails a document that shares an n-gram with the index; counts the documents each file caught (`tally`)."""

    def __init__(self, index: dict):
        self.ngrams, self.file, self.names, self.n = index["ngrams"], index["file"], index["names"], index["n"]
        self.tally: Counter = Counter()

    def match(self, text: str) -> str | None:
        """The evaluation file `text` shares an n-gram with, or None."""
        if not len(self.ngrams):
            return None
        h = ngram_hashes(text, self.n)
        at = np.minimum(np.searchsorted(self.ngrams, h), len(self.ngrams) - 1)
        hit = np.flatnonzero(self.ngrams[at] == h)
        return self.names[int(self.file[at[hit[0]]])] if len(hit) else None

    def __call__(self, d) -> bool:
        name = self.match(d.text)
        if name is not None:
            self.tally[name] += 1
        return name is not None
