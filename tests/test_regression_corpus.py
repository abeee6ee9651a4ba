"""A regression corpus: every kind of damage tier 1 has met, mixed with good documents that carry unique
markers. The shards are decoded: every good document is there exactly once (or counted unpacked), and
every bad record is counted with its reason.

Every document that can survive is 255 ASCII bytes, so with --seq-len 511 a row holds exactly two whole
documents and their end-of-text ids: each piece of a row between end-of-text ids is a whole document.
Transient read faults and inputs missing on a node are in tests/test_faults.py and tests/test_sources.py.
"""

import gzip
import json
import random
import re
import zlib
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from pipelines.config import debug
from pipelines.driver import run
from strata.data.dataset import resolve
from strata.data.rows import read_rows
from strata.data.storage import Storage
from strata.data.tokenizer import ByteTokenizer

DOC_BYTES, CAP = 255, 64 << 10
MARK = re.compile(r"<g(\d{5})>", re.IGNORECASE)


class Corpus:
    """Writes the files, and keeps what a correct run must report."""

    def __init__(self, root, seed=7):
        self.root, self.rng = root, random.Random(seed)
        self.variants: dict[int, set[str]] = {}  # marker -> the texts that may stand for it (one must)
        self.reasons = Counter()  # status:reason -> records
        self.records = 0

    def doc(self) -> str:
        n = len(self.variants)
        words = []
        while len(" ".join(words)) < DOC_BYTES:
            words.append("".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(self.rng.randint(3, 8))))
        text = f"<g{n:05d}> " + " ".join(words)
        text = text[: DOC_BYTES - 1].rstrip() + "."
        text = text.ljust(DOC_BYTES - 1, "x")[: DOC_BYTES - 1] + "." if len(text) < DOC_BYTES else text
        assert len(text) == DOC_BYTES
        self.variants[n] = {text}
        return text

    def bad(self, reason: str, n: int = 1) -> None:
        self.reasons[reason] += n
        self.records += n

    def good_lines(self, n: int) -> list[bytes]:
        self.records += n
        return [json.dumps({"text": self.doc()}).encode() + b"\n" for _ in range(n)]

    def write(self, name: str, data: bytes) -> None:
        (self.root / name).write_bytes(data)


def make(root) -> Corpus:
    c = Corpus(root)
    # Plain jsonl, cut into several work units (tails at their ends), with every kind of bad line, and a
    # line longer than --max-record-bytes that spans byte ranges.
    for part in range(2):
        lines = c.good_lines(150)
        bad = [b"{not json\n", b'{"id": 1}\n', b'{"text": 5}\n', b'{"text": "caf\xe9 au lait, not utf-8"}\n',
               b'{"text": "a lone surrogate \\ud800 here and more words"}\n', b'{"text": "nul \\u0000 inside it"}\n',
               b'{"text": "tiny"}\n', json.dumps({"text": "long " * (3 * CAP // 5)}).encode() + b"\n"]
        for reason in ("rejected:malformed-json", "rejected:missing-text-field", "rejected:missing-text-field",
                       "rejected:invalid-utf8", "rejected:invalid-unicode", "rejected:binary", "filtered:too-short",
                       "rejected:record-too-large"):
            c.bad(reason)
        for i, line in enumerate(bad):
            lines.insert(10 + i * 17, line)
        c.write(f"plain-{part}.jsonl", b"".join(lines))
    # Compressed: zstd frames concatenated, gzip members concatenated, gzip padded with zeros.
    c.write("frames.jsonl.zst", b"".join(zstandard.ZstdCompressor().compress(b"".join(c.good_lines(20)))
                                         for _ in range(3)))
    c.write("members.jsonl.gz", b"".join(gzip.compress(b"".join(c.good_lines(20))) for _ in range(3)))
    c.write("padded.jsonl.gz", gzip.compress(b"".join(c.good_lines(20))) + b"\0" * 4096)
    # Decompression bombs: a line of 8 MB of zeros (a few KB compressed), then good records.
    bomb = b"\0" * (8 << 20) + b"\n"
    c.bad("rejected:record-too-large", 2)
    c.write("bomb.jsonl.zst", zstandard.ZstdCompressor().compress(bomb + b"".join(c.good_lines(10))))
    c.write("bomb.jsonl.gz", gzip.compress(bomb + b"".join(c.good_lines(10))))
    # Truncated: the records that decode whole before the cut are kept (found here with zlib itself),
    # the rest is one reject.
    first = len(c.variants)
    data = gzip.compress(b"".join(c.good_lines(60)))[:-900]
    c.records -= 60
    prefix = zlib.decompressobj(wbits=31).decompress(data)
    whole = prefix[: prefix.rfind(b"\n") + 1].count(b"\n")
    assert 5 < whole < 60
    for n in range(first + whole, first + 60):
        del c.variants[n]
    c.records += whole
    c.bad("rejected:truncated-compressed")
    c.write("truncated.jsonl.gz", data)
    # Parquet: a binary text column with bad values row by row, and a column that is not text at all.
    values = [c.doc().encode() for _ in range(30)] + [b"caf\xe9", None, b"x" * (CAP + 1), b"nul\0byte"]
    c.records += 30
    for reason in ("rejected:invalid-utf8", "rejected:missing-text-field", "rejected:record-too-large",
                   "rejected:binary"):
        c.bad(reason)
    pq.write_table(pa.table({"text": pa.array(values, pa.binary())}), root / "values.parquet")
    pq.write_table(pa.table({"text": pa.array([1, 2, 3], pa.int64())}), root / "ints.parquet")
    c.bad("rejected:missing-text-field", 3)
    # Text files: one document each.
    for _ in range(10):
        c.records += 1
        c.write(f"doc-{len(c.variants)}.txt", c.doc().encode())
    for name, data, reason in (("latin1.txt", b"caf\xe9 " * 10, "rejected:invalid-utf8"),
                               ("nul.txt", b"\0\1\2" * 20, "rejected:binary"), ("empty.txt", b"", "rejected:empty-file"),
                               ("short.txt", b"tiny", "filtered:too-short")):
        c.write(name, data)
        c.bad(reason)
    # Duplicates: an exact copy up to case, and one-word edits of the same length (near), in other files.
    originals = sorted(c.variants)[:: 25]
    exact, near = [], []
    for i, n in enumerate(originals):
        text = next(iter(c.variants[n]))
        if i % 2:
            copy = text.upper()
            exact.append(copy)
        else:
            last = text[:-1].rsplit(" ", 1)[1]
            copy = text[: -1 - len(last)] + "q" * len(last) + "."
            near.append(copy)
        c.variants[n].add(copy)
    c.write("copies.jsonl", b"".join(json.dumps({"text": t}).encode() + b"\n" for t in exact + near))
    c.records += len(exact) + len(near)
    c.reasons["duplicate:exact"], c.reasons["duplicate:near"] = len(exact), len(near)
    return c


def test_every_good_document_is_in_the_shards_once_and_every_bad_record_is_counted(local_ray, tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    c = make(root)
    out = run(debug("regress", read={"inputs": (str(root),), "split_bytes": 64 << 10, "max_record_bytes": CAP},
                    pack={"seq_len": 2 * (DOC_BYTES + 1) - 1}), Storage.from_env())
    d = out["documents"]
    assert {k: v for k, v in out["reasons"].items() if k != "unpacked:carried"} == dict(c.reasons)
    assert d["read"] == c.records
    assert d["kept"] + d["unpacked"] == len(c.variants)

    v = resolve(Storage.from_env(), f"regress@{out['version']}")
    tok = ByteTokenizer()
    rows = np.concatenate([read_rows(p) for p in v.shard_paths("train") + v.shard_paths("validation")])
    found = Counter()
    for row in rows:
        ends = np.flatnonzero(row == tok.eot_id)
        assert ends.tolist() == [DOC_BYTES, 2 * DOC_BYTES + 1]  # two whole documents, nothing cut
        for piece in (row[:DOC_BYTES], row[DOC_BYTES + 1: -1]):
            text = tok.decode(piece)
            n = int(MARK.match(text).group(1))
            assert text in c.variants[n]  # the document itself, or one of its duplicates
            found[n] += 1
    assert set(found.values()) == {1}  # none twice
    assert len(found) == d["kept"]  # every document counted kept is in a shard ...
    missing = set(c.variants) - set(found)
    assert len(missing) == d["unpacked"] <= 2  # ... and the others are the last partial row of each split
