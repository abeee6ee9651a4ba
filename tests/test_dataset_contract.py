"""The versioned dataset contract: cumulative snapshots committed as Delta Lake commits (one
conditional create of a log entry), on local disk and on an S3 API server; one writer at a time
through a lease in storage."""

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, edit_manifest, wait_for

from strata.data.commit import abandoned_runs, commit, delete_run, delete_version
from strata.data.dataset import (
    DatasetError,
    DocumentCounts,
    Shard,
    check_compatible,
    list_versions,
    resolve,
    shard_schema,
    token_dtype,
)
from strata.data.lease import Lease, LeaseBusy, LeaseLost
from strata.data.rows import read_rows
from strata.data.storage import (
    JsonlWriter,
    Storage,
    check_name,
    create_exclusive,
    exists,
    filesystem,
    join,
    list_dir,
    make_dirs,
    read_bytes,
    read_jsonl,
    storage_root,
    write_json_atomic,
)
from strata.data.tokenizer import ByteTokenizer


def _stage(storage: Storage, name: str, rows: int = 3, seq_len: int = 8, gen: int = 0, first: int = 0):
    """A run's tag and manifest fields, its one train shard written (its first token is `first`, to tell
    shards apart), and a file of its own."""
    tag = f"g{gen:08d}-{uuid.uuid4().hex[:8]}"
    ids = pa.array([first + i for i in range(rows * (seq_len + 1))], type=pa.uint16())
    rows_ = pa.FixedSizeListArray.from_arrays(ids, seq_len + 1).cast(shard_schema("uint16").field(0).type)
    make_dirs(storage.run_shards(name, tag), storage.run_files(name, tag))
    fs, p = filesystem(join(storage.run_shards(name, tag), "train-0.parquet"))
    pq.write_table(pa.Table.from_arrays([rows_], schema=shard_schema("uint16")), p, filesystem=fs)
    write_json_atomic(join(storage.run_files(name, tag), "run.json"), {})
    size = fs.get_file_info(p).size
    fields = dict(tokenizer=ByteTokenizer().info(), seq_len=seq_len, dtype="uint16",
                  shards=[Shard(path="train-0.parquet", split="train", rows=rows, tokens=rows * (seq_len + 1),
                                bytes=size)],
                  documents=DocumentCounts(read=2, kept=2), tokens=rows * (seq_len + 1), inputs=[], run={})
    return tag, fields


def test_commit_then_resolve_round_trips(any_root):
    storage = Storage(any_root)
    v = commit(storage, "ds", *_stage(storage, "ds"))
    assert v.manifest.version == "v0001" and v.manifest.parent == ""
    again = resolve(storage, "ds")
    assert again.manifest == v.manifest and again.path == v.path and again.added == v.added
    assert again.rows("train") == 3 and again.shards == list(v.added)
    fs, path = filesystem(again.shard_paths("train")[0])
    table = pq.read_table(path, filesystem=fs)
    assert table.schema.field("tokens").type == pa.list_(pa.field("element", pa.int32(), nullable=False))


def test_versions_are_cumulative_snapshots(any_root):
    """Each version holds the previous one's shards (referenced, not copied) plus its own."""
    storage = Storage(any_root)
    for i in range(3):
        commit(storage, "ds", *_stage(storage, "ds", rows=2 + i, first=100 * i))
    assert list_versions(storage, "ds") == ["v0001", "v0002", "v0003"]
    v3, v2 = resolve(storage, "ds"), resolve(storage, "ds@v0002")
    assert v3.manifest.version == "v0003" and v3.manifest.parent == "v0002"
    assert [s.version for s in v3.shards] == ["v0001", "v0002", "v0003"]
    assert v3.shards[:2] == v2.shards  # the same files, not copies
    assert v3.rows("train") == 2 + 3 + 4 and v2.rows("train") == 2 + 3
    assert v3.manifest.totals["rows"]["train"] == 9 and v3.manifest.totals["documents"]["kept"] == 6
    assert [s.rows for s in v3.added] == [4]
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
    tag, fields = _stage(storage, "ds", gen=2)
    assert abandoned_runs(storage, "ds", before_gen=2) == [crashed]
    delete_run(storage, "ds", crashed)  # as a run does before its commit (pipelines/driver.py run_tag)
    commit(storage, "ds", tag, fields)
    live, _ = _stage(storage, "ds", gen=3)  # a writer at work now
    assert abandoned_runs(storage, "ds", before_gen=3) == []
    assert tag not in abandoned_runs(storage, "ds", before_gen=9)
    killed, _ = _stage(storage, "ds", gen=4)
    assert abandoned_runs(storage, "ds", before_gen=5) == sorted([live, killed])


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
    for r in results:  # each commit names its own shard, and its manifest is its own
        again = resolve(storage, r.ref)
        assert again.added == r.added and again.manifest == r.manifest


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
    assert not exists(v2.file(v2.manifest.files)) and not exists(v2.file(v2.added[0].path))
    assert exists(v1.file(v1.added[0].path))
    newest = resolve(storage, "ds")
    assert newest.manifest == v1.manifest and newest.shards == list(v1.added)
    with pytest.raises(DatasetError, match="no version 'v0002'"):
        resolve(storage, "ds@v0002")
    v3 = commit(storage, "ds", *_stage(storage, "ds"))  # the delete was Delta commit 3: the next is 4
    assert v3.manifest.version == "v0004" and v3.manifest.parent == "v0001"
    assert list_versions(storage, "ds") == ["v0001", "v0004"] and len(resolve(storage, "ds").shards) == 2


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
        from strata.data.commit import commit
        from strata.data.lease import Lease
        from strata.data.storage import Storage
        storage = Storage({any_root!r})
        lease = Lease(storage.dataset("ds"), "dataset ds", ttl_s=2).acquire()
        files, fields = _stage(storage, "ds", gen=lease.gen)
        print(files, flush=True)
        os.environ["STRATA_FAILPOINT"] = "before-commit"
        commit(storage, "ds", files, fields, lease=lease)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    tag = proc.stdout.strip()
    storage = Storage(any_root)
    assert exists(join(storage.run_shards("ds", tag), "train-0.parquet")) and list_versions(storage, "ds") == []
    lease = Lease(storage.dataset("ds"), "dataset ds").acquire(poll_s=0.2, timeout_s=30)
    assert abandoned_runs(storage, "ds", lease.gen) == [tag]
    lease.release()


def test_jsonl_appends_in_bounded_parts(any_root, monkeypatch):
    import strata.data.storage as st

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
    from strata.data.dataset import pad_value

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

    def plant(files):  # the manifest is in the commit's log entry
        edit_manifest(v.path, v.number, lambda m: m.update(files=files))

    for planted in ("../../../precious", "/etc", "s3://elsewhere/x", "data/../../../../precious"):
        plant(planted)
        with pytest.raises(DatasetError, match="refused to delete anything"):
            delete_version(storage, "ds", "v0001")
        assert (outside / "keep.txt").read_text() == "mine"
    os.symlink(outside, os.path.join(v.root, "_strata", "escape"))  # a link inside the dataset, to outside
    plant("_strata/escape")
    with pytest.raises(DatasetError, match="does not say this version committed run 'escape'"):
        delete_version(storage, "ds", "v0001")
    plant(v.manifest.files)
    own = v.file(v.manifest.files)
    shutil.rmtree(own)
    os.symlink(outside, own)  # the run's own directory swapped for a link out
    with pytest.raises(DatasetError, match="leads outside"):
        delete_version(storage, "ds", "v0001")
    assert (outside / "keep.txt").read_text() == "mine"
    assert list_versions(storage, "ds") == ["v0001"]  # refused before its commit, too


def test_a_lease_survives_storage_errors_and_its_holder_stops_when_it_cannot_renew(tmp_path, monkeypatch):
    """One failed listing (the red team's case) does not end renewal; a holder whose renewals fail until
    its lease runs out has lost it, and says so before it commits."""
    import strata.data.lease as lease_mod

    d = str(tmp_path / "ds")
    real_list, real_write = lease_mod.list_dir, lease_mod.write_json_atomic
    failures = {"list": 1, "write": 0}

    def flaky_list(path):
        if failures["list"] > 0:
            failures["list"] -= 1
            raise OSError("connection reset by peer (injected)")
        return real_list(path)

    renewed = []

    def flaky_write(path, obj):
        if failures["write"] > 0:
            raise OSError("service unavailable (injected)")
        real_write(path, obj)
        if failures["list"] == 0:
            renewed.append(obj["expires_at"])

    held = Lease(d, "dataset ds", ttl_s=1.2).acquire()
    monkeypatch.setattr(lease_mod, "list_dir", flaky_list)
    monkeypatch.setattr(lease_mod, "write_json_atomic", flaky_write)
    wait_for(lambda: len(renewed) >= 2, "two renewals after the failed listing", 60)
    assert failures["list"] == 0 and held.check() and held._thread.is_alive()
    with pytest.raises(LeaseBusy):
        Lease(d, "dataset ds").acquire(wait=False)  # still held: nobody else gets in
    failures["write"] = 1  # from now on every renewal fails
    wait_for(lambda: not held._thread.is_alive(), "the holder to stop renewing", 60)
    with pytest.raises(LeaseLost, match="renewal kept failing: OSError: service unavailable"):
        held.check()
    held.release()


def test_lease_generations_have_no_width_limit_and_a_lost_race_backs_off(tmp_path, monkeypatch):
    """m7: a lease file g99999999.json overflowed the 8-digit generation, and waiting writers spun without
    sleeping (a LIST storm on S3)."""
    import json as _json

    import strata.data.lease as lease_mod
    from strata.data.lease import Lease, _generations, _path

    d = str(tmp_path / "ds")
    create_exclusive(_path(d, 99_999_999), _json.dumps({"released": True}).encode())
    first = Lease(d, "dataset ds").acquire(wait=False)
    assert first.gen == 100_000_000 and _generations(d)[-1] == 100_000_000
    with pytest.raises(LeaseBusy):
        Lease(d, "dataset ds").acquire(wait=False)
    first.release()
    lost, pauses = [0], []
    real = lease_mod.create_exclusive

    def racing(path, data):  # another writer takes each generation first, five times
        if lost[0] < 5:
            lost[0] += 1
            return False
        return real(path, data)

    monkeypatch.setattr(lease_mod, "create_exclusive", racing)
    monkeypatch.setattr(lease_mod, "_pause", pauses.append)
    second = Lease(d, "dataset ds").acquire(wait=False)
    assert second.gen == 100_000_001 and len(pauses) == 5 and all(p > 0 for p in pauses)
    assert pauses == sorted(pauses) or max(pauses) <= 2.0
    second.release()
