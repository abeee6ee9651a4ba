"""Decontamination: a document that shares an n-gram with an evaluation set is not trained on.

    python -m pipelines.preprocess ... --decontaminate evals/mmlu.jsonl --decontaminate evals/gsm8k.parquet

Evaluation sets ship as records of several fields, not as a `text` column: MMLU
has `question` and `choices`, GSM8K `question` and `answer`, HellaSwag `ctx`
and `endings`, ARC `question` and `choices.text`. So every string a record
holds counts, in nested fields and lists too, each cut into n-grams of its own
(an n-gram never spans two fields); `--decontaminate-fields question,choices`
keeps only those fields (a dotted path names a nested one: `choices.text`).
A plain text file is one string, read whole.

Words are lowercase letters and digits; an n-gram is `--decontaminate-n` (13)
consecutive words. An item shorter than that (many multiple-choice answers)
is still checked: with at least `--decontaminate-min-words` (8) words, its
whole text is matched as one n-gram of its own length. The driver hashes the
n-grams to 64 bits, sorts them once and puts the arrays in Ray's object store:
every worker reads the same shared, read-only copy (8 bytes an n-gram plus 2
for its file: a million n-grams are 10 MB, once per node). A document with any
of them is filtered as `contaminated`; the summary and the manifest give, per
evaluation file, its records, its n-grams and the documents it caught. A file
that yields no n-gram is an error that names it and the fields it has: a check
that checks nothing is never silent.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator

import numpy as np

WORD = re.compile(r"[^\W_]+")  # letters and digits of any script; punctuation and case do not matter
PRIME = np.uint64(1099511628211)  # FNV's 64-bit prime, to combine word hashes in order
MIN_WORDS = 8  # the default --decontaminate-min-words


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


def word_hashes(text: str) -> np.ndarray:
    ws = words(text)
    return np.fromiter((_word_hash(w) for w in ws), dtype=np.uint64, count=len(ws))


def windows(wh: np.ndarray, n: int) -> np.ndarray:
    """The 64-bit hashes of every run of n consecutive words (none if there are fewer)."""
    m = len(wh) - n + 1
    if m < 1:
        return np.zeros(0, dtype=np.uint64)
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic mod 2^64 on purpose
        for j in range(n):
            acc = acc * PRIME + wh[j: j + m]
    return acc


def ngram_hashes(text: str, n: int) -> np.ndarray:
    return windows(word_hashes(text), n)


# ---------------------------------------------------------------- evaluation files


def strings(obj, fields: tuple[str, ...] = (), path: str = "") -> Iterator[tuple[str, str]]:
    """(field path, string) for every string a record holds, nested fields and lists included (a list is
    transparent: `choices.text` names the `text` of every choice). With `fields`, only the strings at or
    under one of those paths."""
    if isinstance(obj, str):
        if not fields or any(path == f or path.startswith(f + ".") for f in fields):
            yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from strings(value, fields, f"{path}.{key}" if path else str(key))
    elif isinstance(obj, list | tuple):
        for value in obj:
            yield from strings(value, fields, path)


def records(path: str) -> Iterator[object]:
    """One evaluation file's records: JSONL lines, a JSON array (or object), parquet rows (nested columns as
    dicts and lists), or a text file's whole text. A line that is not JSON is skipped (and counted by the
    caller as no strings)."""
    from strata.data.sources import describe, open_stream

    kind, _ = describe(path)
    if kind == "parquet":
        import pyarrow.parquet as pq

        from strata.data.storage import filesystem

        fs, p = filesystem(path)
        for batch in pq.ParquetFile(fs.open_input_file(p)).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    with open_stream(path) as stream:
        if kind == "jsonl":
            for line in stream:
                yield _json(line) if line.strip() else None
            return
        data = stream.read()
    if kind == "json":
        loaded = _json(data)
        yield from loaded if isinstance(loaded, list) else [loaded]
    else:
        yield data.decode("utf-8", errors="replace")


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def build(paths: list[str], n: int, fields: tuple[str, ...] = (), min_words: int = MIN_WORDS) -> dict:
    """The index of the evaluation files' n-grams: sorted unique hashes of n words, each with the file it
    came from; and, per shorter length k >= min_words, the whole items of k words. Raises ValueError, naming
    the file and the fields it found, for a file that yields none."""
    from strata.data.inputs import list_inputs

    files = list_inputs(list(paths))
    if len(files) > np.iinfo(np.uint16).max:
        raise ValueError(f"--decontaminate: {len(files)} evaluation files, more than {np.iinfo(np.uint16).max}")
    grams: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
    names, per_file = [], {}
    for i, f in enumerate(files):
        names.append(f["path"])
        count, made, short = 0, 0, 0
        for rec in records(f["path"]):
            count += 1
            for _, text in strings(rec, fields):
                wh = word_hashes(text)
                if len(wh) >= n:
                    h = windows(wh, n)
                elif len(wh) >= min_words:
                    h, short = windows(wh, len(wh)), short + 1
                else:
                    continue
                grams.setdefault(min(len(wh), n), []).append((h, np.full(len(h), i, dtype=np.uint16)))
                made += len(h)
        if not made:
            raise ValueError(
                f"evaluation file {f['path']} yields no {n}-gram and no item of {min_words} words or more "
                f"({count:,} records; the fields with text it has: {', '.join(_fields(f['path'])) or 'none'}"
                f"{'; --decontaminate-fields ' + ','.join(fields) if fields else ''}): nothing would be checked. "
                "Name its text fields with --decontaminate-fields, or lower --decontaminate-min-words")
        per_file[f["path"]] = {"records": count, "ngrams": made, "short_items": short}
    if not files:
        raise ValueError(f"--decontaminate {paths}: no evaluation files found")
    index = {}
    for k, parts in grams.items():
        h = np.concatenate([p[0] for p in parts])
        o = np.concatenate([p[1] for p in parts])
        h, first = np.unique(h, return_index=True)  # sorted; an n-gram in two files is credited to the first
        index[k] = (h, o[first])
    return {"grams": index, "names": names, "n": n, "files": per_file}


def _fields(path: str) -> list[str]:
    """The field paths of a file's first records that hold text (for the message of a file that yields nothing)."""
    from itertools import islice

    return sorted({field or "(text)" for rec in islice(records(path), 100) for field, _ in strings(rec)})


def size(index: dict) -> int:
    """n-grams (and short items) in the index."""
    return sum(len(h) for h, _ in index["grams"].values())


class ContaminationRule:
    """Fails a document that shares an n-gram (or contains a whole short item) with the index; counts the
    documents each file caught (`tally`)."""

    def __init__(self, index: dict):
        self.grams, self.names = index["grams"], index["names"]
        self.tally: Counter = Counter()

    def match(self, text: str) -> str | None:
        """The evaluation file `text` shares an n-gram with, or None."""
        wh = word_hashes(text)
        for k, (ngrams, file) in self.grams.items():
            if len(wh) < k or not len(ngrams):
                continue
            h = windows(wh, k)
            at = np.minimum(np.searchsorted(ngrams, h), len(ngrams) - 1)
            hit = np.flatnonzero(ngrams[at] == h)
            if len(hit):
                return self.names[int(file[at[hit[0]]])]
        return None

    def __call__(self, d) -> bool:
        name = self.match(d.text)
        if name is not None:
            self.tally[name] += 1
        return name is not None
