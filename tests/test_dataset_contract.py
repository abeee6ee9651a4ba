"""The versioned dataset contract: manifest last, atomic, immutable versions."""

import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from strata.dataset import (
    MANIFEST,
    DatasetError,
    DocumentCounts,
    Shard,
    arrow_schema,
    check_compatible,
    commit,
    list_versions,
    resolve,
    token_dtype,
)
from strata.storage import Storage, check_name, storage_root
from strata.tokenizer import ByteTokenizer


def _stage(storage: Storage, name: str, rows: int = 3, seq_len: int = 8) -> tuple[str, dict]:
    staging = storage.staging(name)
    os.makedirs(staging)
    ids = pa.array(range(rows * (seq_len + 1)), type=pa.uint16())
    table = pa.Table.from_arrays([pa.FixedSizeListArray.from_arrays(ids, seq_len + 1)],
                                 schema=arrow_schema(seq_len, "uint16"))
    pq.write_table(table, os.path.join(staging, "train-0.parquet"))
    fields = dict(tokenizer=ByteTokenizer().info(), seq_len=seq_len, dtype="uint16",
                  shards=[Shard(path="train-0.parquet", split="train", rows=rows, tokens=rows * (seq_len + 1))],
                  documents=DocumentCounts(read=2, kept=2), tokens=rows * (seq_len + 1), inputs=[], run={})
    return staging, fields


def test_commit_then_resolve_round_trips(tmp_path):
    storage = Storage(str(tmp_path))
    staging, fields = _stage(storage, "ds")
    v = commit(storage, "ds", staging, fields)
    assert v.manifest.version == "v0001" and not os.path.exists(staging)
    again = resolve(storage, "ds")
    assert again.manifest == v.manifest
    assert again.manifest.rows("train") == 3
    table = pq.read_table(again.shard_paths("train")[0])
    assert table.schema.field("tokens").type == pa.list_(pa.uint16(), 9)


def test_versions_are_numbered_and_immutable(tmp_path):
    storage = Storage(str(tmp_path))
    for _ in range(3):
        commit(storage, "ds", *_stage(storage, "ds"))
    assert list_versions(storage, "ds") == ["v0001", "v0002", "v0003"]
    assert resolve(storage, "ds").manifest.version == "v0003"
    assert resolve(storage, "ds@v0002").manifest.version == "v0002"
    with pytest.raises(DatasetError, match="no version 'v0009'"):
        resolve(storage, "ds@v0009")


def test_uncommitted_work_is_invisible(tmp_path):
    """A run that crashed while staging, or after the rename but before the manifest, shows nothing."""
    storage = Storage(str(tmp_path))
    _stage(storage, "ds")  # crashed while writing shards
    staging, _ = _stage(storage, "ds")
    os.rename(staging, os.path.join(storage.dataset("ds"), "v0001"))  # crashed before the manifest
    assert list_versions(storage, "ds") == []
    with pytest.raises(DatasetError, match="no committed version"):
        resolve(storage, "ds")
    # The next commit does not reuse the number of the half-made version.
    v = commit(storage, "ds", *_stage(storage, "ds"))
    assert v.manifest.version == "v0002"
    assert list_versions(storage, "ds") == ["v0002"]


def test_racing_commits_get_distinct_versions(tmp_path):
    storage = Storage(str(tmp_path))
    staged = [_stage(storage, "ds") for _ in range(4)]
    results = []
    threads = [threading.Thread(target=lambda s=s: results.append(commit(storage, "ds", *s))) for s in staged]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.manifest.version for r in results) == ["v0001", "v0002", "v0003", "v0004"]
    for r in results:
        assert os.path.exists(os.path.join(r.path, MANIFEST))


def test_incompatible_dataset_is_refused_with_reasons(tmp_path):
    storage = Storage(str(tmp_path))
    v = commit(storage, "ds", *_stage(storage, "ds", seq_len=8))
    check_compatible(v, vocab_size=320, seq_len=8)
    with pytest.raises(DatasetError, match="seq_len is 8 but the model's is 16"):
        check_compatible(v, vocab_size=320, seq_len=16)
    with pytest.raises(DatasetError, match="257 ids but the model's vocab_size is 100"):
        check_compatible(v, vocab_size=100, seq_len=8)


def test_token_dtype_is_the_smallest_that_fits():
    assert token_dtype(256) == "uint8"
    assert token_dtype(257) == "uint16"
    assert token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"


def test_names_and_storage_root(tmp_path, monkeypatch):
    for bad in ("", "../up", "a/b", ".hidden", "sp ace"):
        with pytest.raises(ValueError):
            check_name(bad)
    monkeypatch.setenv("STRATA_STORAGE", str(tmp_path / "x"))
    assert storage_root() == str(tmp_path / "x")
    assert storage_root("s3://bucket/root/") == "s3://bucket/root"
    assert Storage("s3://b/r").dataset("d") == "s3://b/r/datasets/d"
