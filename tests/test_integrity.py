"""One integrity rule for what strata reads back from a dataset (issue 57): a file is trusted only when the
commit that names it names its SHA-256 (strata/data/integrity.py). Each test is a red-team repro that acted on a
crafted or swapped file before; now the file is refused in one line, before anything changes."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import REPO, make_corpus

from strata.data.storage import Storage, exists, list_files, read_bytes


def _datasets(root: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipelines.datasets", "--storage", root, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def _rows(v) -> int:
    return sum(s.rows for s in v.shards)


def test_a_crafted_lineage_file_turns_no_takedown_into_mass_deletion(local_ray, tmp_path):
    """Finding 4: `forget --purge` of one 2-row document, whose lineage file was rewritten to place it in every row,
    removed 1,216 rows of 10 other documents and deleted two versions' shards. The lineage file no longer matches
    the digest its commit names: the takedown is refused, and nothing changes."""
    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from strata.data.dataset import resolve
    from strata.data.lineage import read, write

    root = str(tmp_path / "root")
    storage = Storage(root)
    make_corpus(str(tmp_path / "in"), docs=16, seed=11)
    preprocess(debug("takedown", read={"inputs": (str(tmp_path / "in"),)}), storage)
    v1 = resolve(storage, "takedown")
    spans = read(v1.file(v1.manifest.lineage["file"]))
    doc = spans.slice(0, 1).to_pylist()[0]
    row_len = v1.manifest.seq_len + 1
    every_row = [{**doc, "shard": s.path, "row": r, "start": 0, "length": row_len} for s in v1.added
                 for r in range(s.rows)]
    others = spans.filter(pa.array([k != doc["doc"] for k in spans["doc"].to_pylist()]))
    write(pa.concat_tables([others, pa.Table.from_pylist(every_row, schema=spans.schema)]),
          v1.file(v1.manifest.lineage["file"]), row_len)
    ids = tmp_path / "ids"
    ids.write_text(f"{doc['source']}:{doc['position']}\n")
    out = _datasets(root, "forget", "takedown", "--doc-ids", str(ids), "--reason", "a claim", "--purge")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "does not match the SHA-256 its commit names" in out.stderr.strip().splitlines()[-1]
    assert resolve(storage, "takedown").ref == v1.ref and all(exists(v1.file(s.path)) for s in v1.added)
    assert v1.manifest.lineage["file"] in v1.manifest.digests


def test_spans_a_document_cannot_have_are_refused():
    """Defense in depth for a takedown: spans outside the shards the version added, past a shard's rows or a row's
    end, or in more rows than the document's tokens fill, are one line each."""
    from strata.data.dataset import Shard
    from strata.data.lineage import SCHEMA, LineageError, check_spans

    v = SimpleNamespace(ref="d@v0001", manifest=SimpleNamespace(seq_len=7, lineage={"file": "l.parquet"}),
                        added=(Shard(path="data/a/s0.parquet", split="train", rows=4, tokens=32),))

    def spans(*rows):
        return pa.Table.from_pylist([{"doc": 1, "exact": 2, "source": "f", "position": 0, "shard": s, "row": r,
                                      "start": a, "length": n} for s, r, a, n in rows], schema=SCHEMA)

    check_spans(v, spans(("data/a/s0.parquet", 0, 4, 4), ("data/a/s0.parquet", 1, 0, 3)))
    for bad, said in (((("data/b/s9.parquet", 0, 0, 8),), "did not add"), ((("data/a/s0.parquet", 4, 0, 8),), "holds 4 rows"),
                      ((("data/a/s0.parquet", 0, 6, 3),), "holds 4 rows"),
                      ((("data/a/s0.parquet", 0, 7, 1), ("data/a/s0.parquet", 1, 7, 1), ("data/a/s0.parquet", 2, 7, 1)),
                       "of 3 tokens in 3 rows")):
        with pytest.raises(LineageError, match=said):
            check_spans(v, spans(*bad))


def test_a_lineage_footer_missing_a_field_is_one_line(tmp_path):
    """Finding 6: a footer without `shards` was a KeyError's traceback, and the purge stopped half way."""
    from strata.data.lineage import META, SCHEMA, LineageError, lookup, read, write

    path = str(tmp_path / "lineage.parquet")
    write(pa.Table.from_pylist([{"doc": 1, "exact": 2, "source": "f", "position": 0, "shard": "data/a/s.parquet",
                                 "row": 0, "start": 0, "length": 5}], schema=SCHEMA), path, 9)
    f = pq.ParquetFile(path)
    meta = json.loads(f.schema_arrow.metadata[META])
    for field, value in (("shards", None), ("first", [["f", "zero"]]), ("row_len", "9"), ("shards", [["s", -3]])):
        crafted = {**meta, field: value} if value is not None else {k: v for k, v in meta.items() if k != field}
        table = pq.read_table(path)
        out = str(tmp_path / f"crafted-{field}.parquet")
        pq.write_table(table.replace_schema_metadata({META: json.dumps(crafted)}), out)
        for reading in (lambda p=out: read(p), lambda p=out: lookup(p, doc_ids=["f:0"])):
            with pytest.raises(LineageError, match="crafted"):
                reading()


def test_a_swapped_index_segment_of_another_dataset_drops_nothing(local_ray, tmp_path):
    """Finding 4: `--dedup-against` trusted the other dataset's index segments as they were: a swapped segment file
    made a dataset drop a document it never held. Now the other dataset's files must match its commit."""
    from pipelines.config import debug
    from pipelines.dedup import write_index_file
    from pipelines.driver import run as preprocess
    from strata.data.dataset import DatasetError, resolve
    from strata.data.integrity import IntegrityError
    from strata.data.lineage import read

    root = str(tmp_path / "root")
    storage = Storage(root)
    make_corpus(str(tmp_path / "a"), docs=8, seed=1)
    make_corpus(str(tmp_path / "b"), docs=8, seed=2)
    (tmp_path / "b" / "mine.txt").write_text(" ".join(f"only-in-b{i % 13} text" for i in range(150)))
    preprocess(debug("a", read={"inputs": (str(tmp_path / "a"),)}), storage)
    b = preprocess(debug("b", read={"inputs": (str(tmp_path / "b"),)}, dedup={"against": "a"}), storage)
    assert "duplicate:other-dataset" not in b["reasons"]
    vb = resolve(storage, "b")
    mine = next(r for r in read(vb.file(vb.manifest.lineage["file"])).to_pylist() if r["source"].endswith("mine.txt"))
    va = resolve(storage, "a")
    seg = next(f for f in va.manifest.dedup["index"]["exact"][-1]["files"])
    lo, hi = seg["lo"], seg["hi"]
    keys = pq.read_table(va.file(seg["path"]))["key"].to_numpy()
    write_index_file(va.file(seg["path"]), np.sort(np.append(keys, np.uint64(mine["exact"]))),
                     np.zeros(len(keys) + 1, np.uint64), lo, hi)
    with pytest.raises((IntegrityError, DatasetError), match=r"a@v0001: _strata/.*does not match the SHA-256"):
        preprocess(debug("b2", read={"inputs": (str(tmp_path / "b"),)}, dedup={"against": "a"}), storage)


def test_what_a_run_carries_on_is_checked_and_a_purge_cut_short_is_finished(local_ray, tmp_path):
    """The tails, the forget list and the consumed index a run reads from its parent are checked against the
    parent's commit (each swapped file is refused, naming it, and nothing is committed); and a purge killed after
    its commit is finished by the next forget, from the plan its commit recorded."""
    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from strata.data.dataset import resolve
    from strata.data.integrity import IntegrityError
    from strata.data.lineage import read

    root = str(tmp_path / "root")
    storage = Storage(root)
    inputs = tmp_path / "in"
    make_corpus(str(inputs), docs=16, seed=4)
    cfg = debug("takedown", read={"inputs": (str(inputs),), "incremental": True})
    preprocess(cfg, storage)
    v1 = resolve(storage, "takedown")
    spans = read(v1.file(v1.manifest.lineage["file"])).to_pylist()
    doc = next(f"{r['source']}:{r['position']}" for r in spans if r["source"].endswith(".txt"))
    ids = tmp_path / "ids"
    ids.write_text(doc + "\n")
    assert _datasets(root, "forget", "takedown", "--doc-ids", str(ids), "--reason", "first").returncode == 0
    v2 = resolve(storage, "takedown")
    (inputs / "new.txt").write_text(" ".join(f"new{i % 11} words here" for i in range(100)))
    assert v2.manifest.tails and v2.manifest.forgotten["list"] and v2.manifest.consumed
    for rel in (v2.manifest.forgotten["list"], v2.manifest.consumed[-1]["files"][-1]["path"], v2.manifest.tails):
        path = v2.file(rel)
        good = read_bytes(path)
        changed = bytearray(good)
        changed[len(good) // 2] ^= 0x01  # one byte: a token id, a key, a path
        with open(path, "wb") as f:
            f.write(bytes(changed))
        with pytest.raises(IntegrityError, match=f"takedown@v0002: {rel} does not match the SHA-256 its commit names"):
            preprocess(cfg, storage)
        if rel == v2.manifest.forgotten["list"]:  # as a user sees it: one line, exit 1, never a traceback
            cli = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--preset", "debug", "--input",
                                  str(inputs), "--dataset", "takedown", "--incremental", "--storage", root], cwd=REPO,
                                 capture_output=True, text=True, timeout=300,
                                 env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
            assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr[-3000:]
            assert "does not match the SHA-256 its commit names" in cli.stderr.strip().splitlines()[-1]
        with open(path, "wb") as f:
            f.write(good)
        assert resolve(storage, "takedown").ref == v2.ref
    assert preprocess(cfg, storage)["version"] == "v0003"
    v3 = resolve(storage, "takedown")  # every file under the run's own folder that strata reads back is named
    own = {f"{v3.manifest.files}/{f}" for f in list_files(v3.file(v3.manifest.files))} - {
        f"{v3.manifest.files}/{n}" for n in ("run.json", "record.json")}
    assert own and own <= set(v3.manifest.digests), own - set(v3.manifest.digests)

    # A purge killed after its commit, part way through its deletions: the next forget finishes it.
    v3 = resolve(storage, "takedown")
    other = next(f"{r['source']}:{r['position']}" for r in read(v3.file(v3.manifest.lineage["file"])).to_pylist())
    ids.write_text(other + "\n")
    cut = _datasets(root, "forget", "takedown", "--doc-ids", str(ids), "--reason", "second", "--purge",
                    env={"STRATA_FAILPOINT": "purge:1"})
    assert cut.returncode != 0
    v4 = resolve(storage, "takedown")
    plan = v4.manifest.forgotten["forgets"][-1]["purge"]
    assert v4.manifest.version == "v0004" and len(plan["delete"]) >= 2
    assert [exists(v4.file(p)) for p in plan["delete"]].count(False) == 1  # one deleted, then the kill
    again = _datasets(root, "forget", "takedown", "--doc-ids", str(ids), "--reason", "second", "--purge", "--json")
    assert again.returncode == 0, again.stderr
    out = json.loads(again.stdout)
    assert out["finished"] == ["v0004"] and out["version"] == "v0004"  # nothing more to forget: no new version
    assert not any(exists(v4.file(p)) for p in plan["delete"])
    for rel, s in plan["scrub"].items():
        from strata.data.integrity import file_sha256

        assert file_sha256(v4.file(rel)) == s["sha256"]


def test_the_move_lock_is_a_lease_a_dead_holder_cannot_keep(local_ray):
    """Issue 57, 6: the detached move lock of a served RUN@latest could wedge following for good (a replica that
    died holding it). It is a lease now: a holder that stops renewing loses it; a release hands it on at once."""
    import ray

    from infer.replicas import _mover

    lock = _mover()
    try:
        ray.get(lock.acquire.remote("replica-a", 0.5))  # a takes it and dies without releasing it
        ray.get(lock.acquire.remote("replica-b", 60), timeout=60)  # b gets it once a's lease runs out
        waiting = lock.acquire.remote("replica-c", 60)
        assert ray.wait([waiting], timeout=1)[0] == []  # b's lease holds (60 s) while b lives
        ray.get(lock.release.remote("replica-a"))  # a stale holder's release frees nothing
        assert ray.wait([waiting], timeout=1)[0] == []
        ray.get(lock.release.remote("replica-b"))
        ray.get(waiting, timeout=60)
    finally:
        ray.kill(lock)
