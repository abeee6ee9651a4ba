"""Datasets are Delta Lake tables: read by readers strata did not write, by version number, with a log
whose reads stay bounded however long the history; and a dataset of the format before converts."""

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO
from test_dataset_contract import _stage

from bench.s3proxy import ResettingProxy
from strata.data.commit import commit
from strata.data.dataset import CHECKPOINT_INTERVAL, DatasetError, list_versions, resolve
from strata.data.rows import read_rows
from strata.data.storage import Storage, delta_options, exists


def _sorted_rows(rows) -> list[tuple]:
    return sorted(tuple(int(x) for x in r) for r in rows)


def test_other_readers_read_a_version_without_strata(dataset, local_ray):
    """Delta's own engine (DataFusion SQL) and Ray Data's `read_delta` see the version's rows, by split
    and by the version that added them, and the table's properties name the tokenizer."""
    import ray
    from deltalake import DeltaTable, QueryBuilder

    v = resolve(Storage.from_env(), dataset["ref"])
    table = DeltaTable(v.path, version=v.number)
    conf = table.metadata().configuration
    assert conf["strata.tokenizer.hash"] == v.manifest.tokenizer.hash and conf["strata.seqLen"] == "128"
    counts = QueryBuilder().register("t", table).execute(
        "select split, version, count(*) as n, min(array_length(tokens)) as lo, max(array_length(tokens)) as hi "
        "from t group by split, version").read_all()
    got = {(r["split"], r["version"]): (r["n"], r["lo"], r["hi"]) for r in pa.table(counts).to_pylist()}
    assert got == {(s, v.number): (v.rows(s), 129, 129) for s in ("train", "validation")}
    ours = np.concatenate([read_rows(p) for s in ("train", "validation") for p in v.shard_paths(s)])
    theirs = ray.data.read_delta(v.path, version=v.number).to_arrow_refs()
    theirs = pa.concat_tables(ray.get(theirs)).column("tokens").to_pylist()
    assert _sorted_rows(theirs) == _sorted_rows(ours)


def test_every_version_is_read_by_number_and_the_log_is_checkpointed(tmp_path):
    storage = Storage(str(tmp_path))
    made = [commit(storage, "ds", *_stage(storage, "ds", rows=1 + i % 3, first=i)) for i in range(CHECKPOINT_INTERVAL + 3)]
    from deltalake import DeltaTable

    for v in made:  # time travel: each version's snapshot, by its number, to strata and to delta-rs
        again = resolve(storage, f"ds@{v.number}")
        assert again.manifest == v.manifest and again.rows("train") == sum(m.added[0].rows for m in made[:v.number])
        assert DeltaTable(again.path, version=v.number).to_pyarrow_table().num_rows == again.rows("train")
    log = os.listdir(os.path.join(storage.dataset("ds"), "_delta_log"))
    assert [n for n in log if n.endswith(".checkpoint.parquet")] and "_last_checkpoint" in log


def test_opening_the_newest_version_costs_the_same_requests_after_a_longer_history(s3_root, monkeypatch):
    """Resolving the newest version and listing its shards reads a checkpoint and the log entries after it:
    as many requests at 25 versions as at 15 (Delta log checkpoints; the version's manifest is one read)."""
    upstream = os.environ["AWS_ENDPOINT_URL"].rsplit("/", 1)[1].split(":")
    proxy = ResettingProxy((upstream[0], int(upstream[1])), every=0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    storage = Storage(s3_root)
    counts = {}
    try:
        for n in range(1, 26):
            commit(storage, "ds", *_stage(storage, "ds", first=n))
            if n in (5, 15, 25):  # as far from a checkpoint each (delta-rs makes one at 9, 19, ...)
                before = len(proxy.log)
                v = resolve(storage, "ds")
                assert len(v.shards) == n
                counts[n] = len(proxy.log) - before
    finally:
        proxy.close()
    assert counts[25] <= counts[15], counts  # 5 versions after a checkpoint, 1 or 2 checkpoints before


def test_a_dataset_of_the_format_before_delta_lake_is_refused_by_name_and_migrates(tmp_path):
    storage = Storage(str(tmp_path))
    root = storage.dataset("old")
    versions = _legacy_dataset(root)
    with pytest.raises(DatasetError, match="python -m strata migrate old"):
        resolve(storage, "old")
    env = {**os.environ, "STRATA_STORAGE": str(tmp_path)}
    listing = subprocess.run([sys.executable, "-m", "pipelines.datasets", "list"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0 and "python -m strata migrate old" in listing.stdout, listing
    proc = subprocess.run([sys.executable, "-m", "strata", "migrate", "old"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert list_versions(storage, "old") == ["v0001", "v0002"]
    assert not [n for n in os.listdir(root) if n.startswith("v")]  # the old manifests are gone
    for number, (old, _) in enumerate(versions, 1):
        v = resolve(storage, f"old@v{number:04d}")
        assert v.manifest.documents.kept == old["documents"]["kept"] and v.manifest.inputs == old["inputs"]
        assert v.manifest.totals == old["totals"] and v.manifest.parent == (f"v{number - 1:04d}" if number > 1 else "")
        got = np.concatenate([read_rows(p) for p in v.shard_paths("train")])
        assert _sorted_rows(got) == _sorted_rows(np.concatenate([r for _, r in versions[:number]]))  # where they were
        for rel in (v.manifest.rejects, v.manifest.tails, *(f["path"] for seg in v.manifest.dedup["index"]["exact"]
                                                             for f in seg["files"])):
            assert rel.startswith("_strata/") and exists(v.file(rel)), rel  # its own files, moved beside
    tag = versions[0][0]["files"].split("/")[1]
    assert sorted(os.listdir(os.path.join(root, "data", tag))) == ["train-00000.parquet"]  # only the shard is left
    from deltalake import DeltaTable

    assert DeltaTable(root).to_pyarrow_table().num_rows == sum(len(r) for _, r in versions)
    again = subprocess.run([sys.executable, "-m", "strata", "migrate", "old"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 1 and "nothing to migrate" in again.stderr
    # Versions made before lineage cannot be searched, and say so; a takedown still commits its forget list.
    found = subprocess.run([sys.executable, "-m", "strata", "lineage", "doc", "--source", "/in/*"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert "not searched (made before lineage): old@v0001, old@v0002" in found.stdout, found.stdout
    (tmp_path / "ids.txt").write_text("/in/1.txt:0\n")
    forget = subprocess.run([sys.executable, "-m", "pipelines.datasets", "forget", "old", "--doc-ids",
                             str(tmp_path / "ids.txt"), "--reason", "test", "--json"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
    assert forget.returncode == 0, forget.stderr
    done = json.loads(forget.stdout)
    assert done["not_searched"] == ["old@v0001", "old@v0002"] and done["rows_removed"] == 0
    assert done["not_in_any_version"] == ["/in/1.txt:0"] and "2 version(s) were made before lineage" in forget.stderr
    assert resolve(storage, "old").manifest.forgotten and resolve(storage, "old").manifest.version == "v0003"


def _legacy_dataset(root: str) -> list[tuple[dict, np.ndarray]]:
    """Two versions in the manifest format (schema version 2), as strata wrote them before Delta Lake:
    fixed-size uint16 rows, each run's files under data/<run>/, a cumulative dedup index."""
    out, shards, index = [], [], []
    for i in range(2):
        tag, version = f"g{i + 1:08d}-{i:016x}", f"v{i + 1:04d}"
        run = os.path.join(root, "data", tag)
        os.makedirs(os.path.join(run, "dedup"))
        rows = np.arange(3 * 9, dtype=np.uint16).reshape(3, 9) + 1000 * i + 60000 * (i == 1)
        pq.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), 9)}),
                       os.path.join(run, "train-00000.parquet"))
        pq.write_table(pa.table({"key": pa.array([i], pa.uint64())}), os.path.join(run, "dedup", "exact-0000.parquet"))
        pq.write_table(pa.table({"split": pa.array([0], pa.int8()), "tokens": pa.array([[1, 2]], pa.list_(pa.uint32()))}),
                       os.path.join(run, "tails.parquet"))  # the tails of the train split, as pass 2 wrote them
        with open(os.path.join(run, "rejects.json"), "w") as f:
            json.dump({"counts": {}, "samples": {}}, f)
        shards.append({"path": f"data/{tag}/train-00000.parquet", "split": "train", "rows": 3, "tokens": 27,
                       "version": version})
        index.append({"versions": 1, "params": {}, "files": [{"path": f"data/{tag}/dedup/exact-0000.parquet",
                                                              "lo": 0, "hi": 2**64 - 1, "rows": 1}]})
        manifest = {"dataset": "old", "version": version, "created_at": 1.0 + i, "seq_len": 8, "dtype": "uint16",
                    "tokenizer": {"kind": "bytes", "vocab_size": 257, "eot_id": 256, "hash": "h", "file": ""},
                    "shards": list(shards), "documents": {"read": 5, "kept": 4 - i, "filtered": 1 + i},
                    "tokens": 40, "inputs": [{"path": f"/in/{i}.txt", "size": 9, "mtime_ns": 1}], "run": {},
                    "parent": f"v{i:04d}" if i else "", "totals": {"versions": i + 1, "rows": {"train": 3 * (i + 1)}},
                    "files": f"data/{tag}", "stats": {}, "rejects": f"data/{tag}/rejects.json", "run_id": "",
                    "tails": f"data/{tag}/tails.parquet", "dedup": {"params": {}, "index": {"exact": list(index)}},
                    "schema_version": 2}
        os.makedirs(os.path.join(root, version))
        with open(os.path.join(root, version, "manifest.json"), "w") as f:
            json.dump(manifest, f)
        out.append((manifest, rows))
    return out


def test_delta_options_reach_the_same_store(s3_root):
    options = delta_options(f"{s3_root}/datasets/x")
    assert options["AWS_ENDPOINT_URL"] == os.environ["AWS_ENDPOINT_URL"] and options["AWS_ALLOW_HTTP"] == "true"
    assert delta_options("/local/path") is None
