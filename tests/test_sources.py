"""Tolerant decoding: every input becomes document rows with a status and a reason."""

import gzip
import os

import pytest

from pipelines.pack import validation_split
from pipelines.sources import decode_file, list_inputs

KW = dict(text_field="text", min_chars=5, max_chars=1000)


def decode(path, data):
    return decode_file({"path": path, "bytes": data}, **KW)


def test_good_text_is_kept_and_normalised():
    [row] = decode("a.txt", "  cafe\u0301 au lait\r\nsecond line ".encode())
    assert row["status"] == "kept" and row["text"] == "caf\u00e9 au lait\nsecond line"


@pytest.mark.parametrize(("path", "data", "status", "reason"), [
    ("a.txt", b"\xff\xfe broken bytes", "rejected", "invalid-utf8"),
    ("a.txt", b"text with a \x00 NUL", "rejected", "binary"),
    ("a.txt.gz", gzip.compress(b"hello there world")[:-8], "rejected", "corrupt-compressed"),
    ("a.txt", b"hi", "filtered", "too-short"),
    ("a.txt", b"x" * 2000, "filtered", "too-long"),
])
def test_bad_input_is_accounted_for(path, data, status, reason):
    [row] = decode(path, data)
    assert (row["status"], row["reason"]) == (status, reason)


def test_jsonl_lines_each_get_a_status():
    data = b'{"text": "a good line of json"}\n{broken\n\n{"text": 5}\n["a list"]\n{"text": "another good one"}\n'
    rows = decode("x.jsonl", data)
    assert [(r["status"], r["reason"]) for r in rows] == [
        ("kept", ""), ("rejected", "malformed-json"), ("rejected", "missing-text-field"),
        ("rejected", "missing-text-field"), ("kept", "")]
    assert len({r["doc_id"] for r in rows}) == len(rows)


def test_gzip_is_decompressed():
    [row] = decode("a.txt.gz", gzip.compress(b"compressed but fine"))
    assert row["text"] == "compressed but fine"


def test_list_inputs_expands_dirs_and_globs_and_rejects_missing(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("d/a.txt", "d/b.txt", "c.jsonl", "d/.hidden"):
        (tmp_path / name).write_text("x")
    files = list_inputs([str(tmp_path / "d"), str(tmp_path / "*.jsonl"), str(tmp_path / "d" / "a.txt")])
    assert [os.path.basename(f["path"]) for f in files] == ["c.jsonl", "a.txt", "b.txt"]
    assert all(f["size"] == 1 and f["mtime"] for f in files)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_inputs([str(tmp_path / "nope")])
    with pytest.raises(FileNotFoundError, match="matches no file"):
        list_inputs([str(tmp_path / "*.parquet")])


def test_validation_split_is_stable_and_near_the_fraction():
    ids = [f"doc{i}" for i in range(4000)]
    val = [d for d in ids if validation_split(d, 0, 0.1)]
    assert val == [d for d in ids if validation_split(d, 0, 0.1)]
    assert 300 < len(val) < 500
    assert val != [d for d in ids if validation_split(d, 1, 0.1)]
