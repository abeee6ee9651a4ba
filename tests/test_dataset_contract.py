"""The versioned dataset contract: cumulative snapshots committed in one conditional create,
on local disk and on an S3 API server; one writer at a time through a lease in storage."""

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO

from strata.dataset import (
    MANIFEST,
    DatasetError,
    DocumentCounts,
    Shard,
    abandoned_run_files,
    arrow_schema,
    check_compatible,
    commit,
    delete_version,
    list_versions,
    read_rows,
    resolve,
    token_dtype,
)
from strata.lease import Lease, LeaseBusy, LeaseLost
from strata.storage import (
    JsonlWriter,
    Storage,
    check_name,
    create_exclusive,
    exists,
    filesystem,
    join,
    list_dir,
    read_bytes,
    read_jsonl,
    storage_root,
)
from strata.tokenizer import ByteTokenizer


def _stage(storage: Storage, name: str, rows: int = 3, seq_len: int = 8, gen: int = 0, first: int = 0):
    """A run's files with one train shard whose first token is `first` (to tell shards apart)."""
    files = storage.run_files(name, f"g{gen:08d}-{uuid.uuid4().hex[:8]}")
    ids = pa.array([first + i for i in range(rows * (seq_len + 1))], type=pa.uint16())
    table = pa.Table.from_arrays([pa.FixedSizeListArray.from_arrays(ids, seq_len + 1)],
                                 schema=arrow_schema(seq_len, "uint16"))
    fs, p = filesystem(join(files, "train-0.parquet"))
    if not files.startswith("s3://"):
        os.makedirs(os.path.dirname(p), exist_ok=True)
    pq.write_table(table, p, filesystem=fs)
    fields = dict(tokenizer=ByteTokenizer().info(), seq_len=seq_len, dtype="uint16",
                  shards=[Shard(path="train-0.parquet", split="train", rows=rows, tokens=rows * (seq_len + 1))],
                  documents=DocumentCounts(read=2, kept=2), tokens=rows * (seq_len + 1), inputs=[], run={})
    return files, fields


def test_commit_then_resolve_round_trips(any_root):
    storage = Storage(any_root)
    v = commit(storage, "ds", *_stage(storage, "ds"))
    assert v.manifest.version == "v0001" and v.manifest.parent == ""
    again = resolve(storage, "ds")
    assert again.manifest == v.manifest and again.path == v.path
    assert again.manifest.rows("train") == 3
    fs, path = filesystem(again.shard_paths("train")[0])
    table = pq.read_table(path, filesystem=fs)
    assert table.schema.field("tokens").type == pa.list_(pa.uint16(), 9)


def test_versions_are_cumulative_snapshots(any_root):
    """Each version holds the previous one's shards (referenced, not copied) plus its own."""
    storage = Storage(any_root)
    for i in range(3):
        commit(storage, "ds", *_stage(storage, "ds", rows=2 + i, first=100 * i))
    assert list_versions(storage, "ds") == ["v0001", "v0002", "v0003"]
    v3, v2 = resolve(storage, "ds"), resolve(storage, "ds@v0002")
    assert v3.manifest.version == "v0003" and v3.manifest.parent == "v0002"
    assert [s.version for s in v3.manifest.shards] == ["v0001", "v0002", "v0003"]
    assert v3.manifest.shards[:2] == v2.manifest.shards  # the same files, not copies
    assert v3.manifest.rows("train") == 2 + 3 + 4 and v2.manifest.rows("train") == 2 + 3
    assert v3.manifest.totals["rows"]["train"] == 9 and v3.manifest.totals["documents"]["kept"] == 6
    assert [s.rows for s in v3.manifest.added()] == [4]
    assert [int(read_rows(p)[0, 0]) for p in v3.shard_paths("train")] == [0, 100, 200]
    with pytest.raises(DatasetError, match="no version 'v0009'"):
        resolve(storage, "ds@v0009")


def test_a_snapshot_refuses_other_token_ids(any_root):
    storage = Storage(any_root)
    commit(storage, "ds", *_stage(storage, "ds", seq_len=8))
    with pytest.raises(DatasetError, match="extends the previous one"):
        commit(storage, "ds", *_stage(storage, "ds", seq_len=16))


def test_uncommitted_work_is_invisible_and_cleaned_up(any_root):
    """Files written without a commit show nothing, and only abandoned ones are collected."""
    storage = Storage(any_root)
    crashed, _ = _stage(storage, "ds", gen=1)
    assert list_versions(storage, "ds") == []
    with pytest.raises(DatasetError, match="no committed version"):
        resolve(storage, "ds")
    committed = commit(storage, "ds", *_stage(storage, "ds", gen=2))
    live, _ = _stage(storage, "ds", gen=3)  # a writer at work now
    assert abandoned_run_files(storage, "ds", before_gen=3) == [crashed]
    assert committed.manifest.files not in str(abandoned_run_files(storage, "ds", before_gen=9))
    assert live in abandoned_run_files(storage, "ds", before_gen=4)


@pytest.mark.parametrize("writers", [8])
def test_racing_commits_get_distinct_versions_and_lose_nothing(any_root, writers):
    storage = Storage(any_root)
    staged = [_stage(storage, "ds", first=i) for i in range(writers)]
    results, errors = [], []

    def go(s):
        try:
            results.append(commit(storage, "ds", *s))
        except Exception as e:  # noqa: BLE001 - collected and asserted on below
            errors.append(e)

    threads = [threading.Thread(target=go, args=(s,)) for s in staged]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(r.manifest.version for r in results) == [f"v{i:04d}" for i in range(1, writers + 1)]
    newest = resolve(storage, "ds")
    # The newest snapshot holds every writer's shard exactly once: none overwrote another.
    assert sorted(int(read_rows(p)[0, 0]) for p in newest.shard_paths("train")) == list(range(writers))
    for r in results:
        assert exists(join(r.path, MANIFEST))


def test_create_exclusive_has_one_winner(any_root):
    path = join(any_root, "x", "claim.json")
    wins = []
    threads = [threading.Thread(target=lambda i=i: wins.append((i, create_exclusive(path, str(i).encode()))))
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in wins if won]
    assert len(winners) == 1 and read_bytes(path) == str(winners[0]).encode()
    assert [n for n, _ in list_dir(join(any_root, "x"))] == ["claim.json"]  # no temp files left


def test_delete_only_the_newest_version(any_root):
    storage = Storage(any_root)
    v1 = commit(storage, "ds", *_stage(storage, "ds"))
    v2 = commit(storage, "ds", *_stage(storage, "ds"))
    with pytest.raises(DatasetError, match="part of the later snapshots v0002"):
        delete_version(storage, "ds", "v0001")
    delete_version(storage, "ds", "v0002")
    assert list_versions(storage, "ds") == ["v0001"]
    assert not exists(v2.file(v2.manifest.files)) and exists(v1.file(v1.manifest.shards[0].path))


def test_lease_one_holder_waits_and_expires(any_root):
    d = join(any_root, "datasets", "ds")
    first = Lease(d, "dataset ds", ttl_s=4).acquire()
    with pytest.raises(LeaseBusy, match="dataset ds is in use by .*pid"):
        Lease(d, "dataset ds").acquire(wait=False)
    said = []
    t = time.time()
    threading.Timer(1.0, first.release).start()
    second = Lease(d, "dataset ds").acquire(poll_s=0.2, log=said.append)
    assert time.time() - t >= 0.9 and said and "waiting for" in said[0]
    second.release()
    # A holder that stops renewing (crashed) loses the lease after its ttl; it then cannot commit.
    stale = Lease(d, "dataset ds", ttl_s=1).acquire()
    stale._stop.set()  # as if the process froze: no more renewals
    taker = Lease(d, "dataset ds").acquire(poll_s=0.2, timeout_s=10, log=said.append)
    with pytest.raises(LeaseLost):
        stale.check()
    taker.release()


def test_killed_writer_leaves_nothing_visible_and_the_next_run_cleans_up(any_root, tmp_path):
    """A writer killed (SIGKILL) between shard upload and commit: no version; its lease expires;
    the next writer deletes its files."""
    script = textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = [{REPO!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
        from test_dataset_contract import _stage
        from strata.dataset import commit
        from strata.lease import Lease
        from strata.storage import Storage
        storage = Storage({any_root!r})
        lease = Lease(storage.dataset("ds"), "dataset ds", ttl_s=2).acquire()
        files, fields = _stage(storage, "ds", gen=lease.gen)
        print(files, flush=True)
        os.environ["STRATA_FAILPOINT"] = "before-commit"
        commit(storage, "ds", files, fields, lease=lease)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    files = proc.stdout.strip()
    storage = Storage(any_root)
    assert exists(join(files, "train-0.parquet")) and list_versions(storage, "ds") == []
    lease = Lease(storage.dataset("ds"), "dataset ds").acquire(poll_s=0.2, timeout_s=30)
    assert abandoned_run_files(storage, "ds", lease.gen) == [files]
    lease.release()


def test_jsonl_appends_in_bounded_parts(any_root, monkeypatch):
    import strata.storage as st

    monkeypatch.setattr(st, "PART_LINES", 3)
    path = join(any_root, "runs", "r", "metrics.jsonl")
    w = JsonlWriter(path)
    for i in range(7):
        w.append({"i": i})
    later = JsonlWriter(path)  # a second writer (a restarted rank 0) appends after the first
    later.append({"i": 7})
    assert [r["i"] for r in read_jsonl(path)] == list(range(8))
    if any_root.startswith("s3://"):
        parts = list_dir(path)
        assert len(parts) == 4 and all(len(read_bytes(join(path, n)).splitlines()) <= 3 for n, _ in parts)
    assert read_jsonl(join(any_root, "nothing.jsonl")) == []


def test_incompatible_dataset_is_refused_with_reasons(tmp_path):
    storage = Storage(str(tmp_path))
    v = commit(storage, "ds", *_stage(storage, "ds", seq_len=8))
    check_compatible(v, vocab_size=320, seq_len=8)
    with pytest.raises(DatasetError, match="seq_len is 8 but the model's is 16"):
        check_compatible(v, vocab_size=320, seq_len=16)
    with pytest.raises(DatasetError, match="257 ids but the model's vocab_size is 100"):
        check_compatible(v, vocab_size=100, seq_len=8)


def test_token_dtype_is_the_smallest_that_fits_the_ids_and_the_pad():
    from strata.dataset import pad_value

    assert token_dtype(255) == "uint8" and token_dtype(256) == "uint16"  # id 255 would be the pad
    assert token_dtype(257) == "uint16"
    assert token_dtype(65535) == "uint16" and token_dtype(65536) == "uint32"
    for vocab in (255, 257, 50257, 65535, 65536):
        assert pad_value(token_dtype(vocab)) >= vocab  # above every id


def test_names_and_storage_root(tmp_path, monkeypatch):
    for bad in ("", "../up", "a/b", ".hidden", "sp ace", "caf\u00e9", "\uff46\uff55\uff4c\uff4c", "\u0661\u0662"):
        with pytest.raises(ValueError, match="ASCII"):
            check_name(bad)
    assert check_name("web-2026.12_v1") == "web-2026.12_v1"
    monkeypatch.setenv("STRATA_STORAGE", str(tmp_path / "x"))
    assert storage_root() == str(tmp_path / "x")
    assert storage_root("s3://bucket/root/") == "s3://bucket/root"
    assert Storage("s3://b/r").dataset("d") == "s3://b/r/datasets/d"


def test_delete_waits_for_no_run_and_a_run_whose_parent_went_commits_nothing(any_root):
    """`datasets delete` under a run building on the newest version is refused; a run whose parent version
    disappears anyway (deleted by an older strata, by hand) commits nothing instead of losing documents."""
    storage = Storage(any_root)
    commit(storage, "ds", *_stage(storage, "ds"))
    run = Lease(storage.dataset("ds"), "dataset ds", purpose="preprocess").acquire()
    with pytest.raises(LeaseBusy, match="dataset ds is in use by .*preprocess"):
        delete_version(storage, "ds", "v0001")
    assert list_versions(storage, "ds") == ["v0001"]
    files, fields = _stage(storage, "ds", gen=run.gen)
    run.release()
    delete_version(storage, "ds", "v0001")  # now nobody holds it
    with pytest.raises(DatasetError, match="ds@v0001, the version this run deduplicated against, was deleted"):
        commit(storage, "ds", files, fields, built_on="v0001")
    assert list_versions(storage, "ds") == []


def test_a_manifest_naming_paths_outside_its_dataset_is_refused_before_anything_is_deleted(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    v = commit(storage, "ds", *_stage(storage, "ds"))
    manifest = join(v.path, MANIFEST)
    import json

    for planted in ("../../../precious", "/etc", "s3://elsewhere/x", "data/../../../../precious"):
        with open(manifest) as f:
            m = json.load(f)
        m["files"] = planted
        with open(manifest, "w") as f:
            json.dump(m, f)
        with pytest.raises(DatasetError, match="not a path inside the dataset|leads outside the dataset"):
            delete_version(storage, "ds", "v0001")
        assert (outside / "keep.txt").read_text() == "mine"
    os.symlink(outside, os.path.join(v.root, "data", "escape"))  # a link inside the dataset, to outside
    m["files"] = "data/escape"
    with open(manifest, "w") as f:
        json.dump(m, f)
    with pytest.raises(DatasetError, match="leads outside the dataset"):
        delete_version(storage, "ds", "v0001")
    assert (outside / "keep.txt").read_text() == "mine"


def test_a_lease_survives_storage_errors_and_its_holder_stops_when_it_cannot_renew(tmp_path, monkeypatch):
    """One failed listing (the red team's case) does not end renewal; a holder whose renewals fail until
    its lease runs out has lost it, and says so before it commits."""
    import strata.lease as lease_mod

    d = str(tmp_path / "ds")
    real_list, real_write = lease_mod.list_dir, lease_mod.write_json_atomic
    failures = {"list": 1, "write": 0}

    def flaky_list(path):
        if failures["list"] > 0:
            failures["list"] -= 1
            raise OSError("connection reset by peer (injected)")
        return real_list(path)

    def flaky_write(path, obj):
        if failures["write"] > 0:
            raise OSError("service unavailable (injected)")
        return real_write(path, obj)

    held = Lease(d, "dataset ds", ttl_s=1.2).acquire()
    monkeypatch.setattr(lease_mod, "list_dir", flaky_list)
    monkeypatch.setattr(lease_mod, "write_json_atomic", flaky_write)
    time.sleep(2.5)  # two ttls: renewal must have gone on after the failed listing
    assert failures["list"] == 0 and held.check() and held._thread.is_alive()
    with pytest.raises(LeaseBusy):
        Lease(d, "dataset ds").acquire(wait=False)  # still held: nobody else gets in
    failures["write"] = 1  # from now on every renewal fails
    time.sleep(2.0)
    assert not held._thread.is_alive()
    with pytest.raises(LeaseLost, match="renewal kept failing: OSError: service unavailable"):
        held.check()
    held.release()
