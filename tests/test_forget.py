"""Takedown (pipelines/forget.py): a document found by lineage, forgotten in one commit, kept out of every
later run; on local disk and on the S3 server."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, make_corpus, train_run

from strata.data.storage import Storage, exists, join, list_dir, read_bytes


def _forget(root: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(env or {})}
    return subprocess.run([sys.executable, "-m", "pipelines.datasets", "--storage", root, "forget", "takedown", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _spans(v) -> list[dict]:
    from strata.data.lineage import read

    return read(v.file(v.manifest.lineage["file"])).to_pylist() if v.manifest.lineage else []


def _text_docs(v) -> dict[tuple[str, int], str]:
    """(shard, row) -> a text-file document (one a file) lineage puts in that row."""
    return {(r["shard"], r["row"]): f"{r['source']}:{r['position']}" for r in _spans(v) if r["source"].endswith(".txt")}


@pytest.mark.slow("tier 1, training and a takedown, on local disk and S3")
def test_a_takedown_removes_a_document_from_the_newest_version_and_every_later_run(local_ray, any_root, tmp_path,
                                                                                  monkeypatch):
    """A run trains on a version and is scored; a document of its first step is forgotten (after a forget killed before
    its commit changed nothing). The next version lacks exactly that document's rows, its other rows in
    their order, only the shards that held them rewritten; the commit says why and which; the output names
    the run, the step and its checkpoints. The old version still reads, but training on it is refused; a
    rerun with the document copied under a new name does not ingest it. A purge makes the old version say
    why it cannot be read, and the takedown cannot be deleted."""
    from infer.driver import ScoreConfig, score
    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from pipelines.pack import read_tails
    from strata.data.commit import delete_version
    from strata.data.dataset import DatasetError, history, resolve
    from strata.data.rows import read_rows
    from train.config import TrainConfig
    from train.lineage import documents, step_rows
    from train.model import preset

    storage = Storage(any_root)
    monkeypatch.setenv("STRATA_STORAGE", any_root)
    inputs = tmp_path / "in"
    make_corpus(str(inputs), docs=24, seed=3)
    cfg = debug("takedown", read={"inputs": (str(inputs),)}, pack={"validation_fraction": 0.3})
    preprocess(cfg, storage)
    v1 = resolve(storage, "takedown")
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    tcfg = TrainConfig(max_steps=4, batch_size=4, warmup_steps=1, log_every=1, eval_every=100, eval_batches=1,
                       checkpoint_every=2, checkpoint_every_s=0)
    train_run(model, tcfg, dataset=v1.ref, run_name="reader", storage=storage, workers=1, use_gpu=False)
    score("reader", [str(inputs)], ScoreConfig(actors=1, docs_per_batch=16), storage, "reader-scores")
    first = step_rows(storage, "reader", 1)["ranks"][0]["rows"]
    docs = _text_docs(v1)
    doc = next(docs[(r["file"], r["row"])] for r in first if (r["file"], r["row"]) in docs)
    held = {(r["shard"], r["row"]) for r in _spans(v1) if f"{r['source']}:{r['position']}" == doc}
    ids = tmp_path / "ids.txt"
    ids.write_text(doc + "\n")

    crashed = _forget(any_root, "--doc-ids", str(ids), "--reason", "erasure request 17",
                      env={"STRATA_FAILPOINT": "before-commit"})
    assert crashed.returncode == -9, crashed.stderr
    assert resolve(storage, "takedown").manifest.version == v1.manifest.version  # nothing committed

    out = _forget(any_root, "--doc-ids", str(ids), "--reason", "erasure request 17", "--json")
    assert out.returncode == 0, out.stderr
    done = json.loads(out.stdout)
    assert done["version"] == "v0002" and done["documents"] == [doc] and done["rows_removed"] == len(held)
    reader = next(r for r in done["runs"] if r["run"] == "reader")
    assert reader["first_step"] == 1 and [c["step"] for c in reader["checkpoints"]] == [2, 4]
    assert [(u["kind"], u["name"]) for u in reader["used_by"]] == [("score", "reader-scores")]

    v2 = resolve(storage, "takedown")
    assert v2.manifest.version == "v0002"
    assert sum(s.rows for s in v2.shards) == sum(s.rows for s in v1.shards) - len(held)
    touched = {shard for shard, _ in held}
    old, new = {s.path: s for s in v1.shards}, {s.path: s for s in v2.shards}
    assert {p for p in old if p not in new} == touched  # only the shards that held it were rewritten
    for path in touched:
        rewritten = next(p for p in new if p not in old and p.rsplit("/", 1)[1] == path.rsplit("/", 1)[1])
        before = read_rows(v1.file(path))
        keep = np.ones(len(before), bool)
        keep[[row for shard, row in held if shard == path]] = False
        assert np.array_equal(read_rows(v2.file(rewritten)), before[keep])  # the other rows, in their order
    entry = read_bytes(join(any_root, "datasets", "takedown", "_delta_log", f"{2:020d}.json")).decode()
    info = next(json.loads(line)["commitInfo"] for line in entry.splitlines() if "commitInfo" in line)
    forget = json.loads(info["strata"])["manifest"]["forget"]
    assert forget["reason"] == "erasure request 17" and forget["doc_ids"] == [doc]
    assert doc not in json.dumps(_spans(v2))  # the new version's lineage does not name it
    found = documents(storage, [doc])
    assert [h["ref"] for h in found["versions"]] == [v1.ref]  # only the old version holds it

    # Time travel still reads the old rows; training on them is refused, in one line.
    old_v1 = resolve(storage, v1.ref)
    assert sum(len(read_rows(p)) for p in old_v1.shard_paths("train")) == v1.rows("train")
    with pytest.raises(DatasetError, match=r"takedown@v0001 holds rows of documents forgotten at takedown@v0002 "
                                           r"\(reason: erasure request 17\)"):
        train_run(model, TrainConfig(max_steps=6, batch_size=4, warmup_steps=1, checkpoint_every_s=0),
                  dataset=v1.ref, run_name="reader", storage=storage, workers=1, use_gpu=False)

    # A new copy of the file, under another name, is not ingested again; the crashed forget's files are gone.
    source = doc.rpartition(":")[0]
    copies = tmp_path / "copies"
    copies.mkdir()
    shutil.copy(source, copies / "renamed.txt")
    words = Path(source).read_text().split()
    words[len(words) // 2] = "edited"  # an edited copy: one word changed, so its exact key is another
    (copies / "edited.txt").write_text(" ".join(words))
    (copies / "fresh.txt").write_text(" ".join(f"fresh{i % 17} words" for i in range(120)))  # and one new document
    v3 = preprocess(debug("takedown", read={"inputs": (str(inputs), str(copies))},
                          pack={"validation_fraction": 0.3}), storage)
    assert v3["version"] == "v0003" and v3["reasons"].get("filtered:forgotten") == 2, v3["reasons"]
    assert documents(storage, [f"{copies}/renamed.txt:0", f"{copies}/edited.txt:0"])["documents"] == []
    v3v = resolve(storage, "takedown")
    report = json.loads(read_bytes(v3v.file(v3v.manifest.rejects)))  # the copies are named, their text not shown
    assert sorted(x["doc_id"] for x in report["samples"]["filtered:forgotten"]) == [f"{copies}/edited.txt:0",
                                                                                    f"{copies}/renamed.txt:0"]
    assert " ".join((copies / "renamed.txt").read_text().split()[:8]) not in json.dumps(report)
    tags = [t for t, _ in list_dir(join(any_root, "datasets", "takedown", "_strata"))]
    assert [t for t in tags if "-forget-" in t] == [v2.manifest.files.rpartition("/")[2]]  # the crashed one's went

    # --purge: every old file holding their tokens goes (the shards the first takedown left for time travel
    # too), the rejects reports lose their samples of them and of the copies dedup removed in their favour,
    # and the versions that held them say why they cannot be read.
    other = next(d for (shard, _), d in sorted(_text_docs(v1).items()) if shard not in touched and d != doc)
    newest = resolve(storage, "takedown")
    tails = read_tails(newest.file(newest.manifest.tails))  # what the next version would pack first
    in_tails = next(d for _, runs in tails.values() for d in runs.ids if d and d != other)
    dup = f"{inputs}/doc000.txt:0"  # exact-dup.txt is a copy: one of the two was removed, with a sample
    reports = {v.manifest.rejects for v in history(storage, "takedown") if v.manifest.rejects}

    def sampled():
        return {x["doc_id"] for r in reports for xs in json.loads(read_bytes(v1.file(r)))["samples"].values() for x in xs}

    copy = f"{inputs}/exact-dup.txt:0"
    assert {dup, copy} & sampled()
    held_by = {r["shard"] for h in documents(storage, [doc, other])["versions"] for r in h["rows"]}
    assert touched <= held_by and all(exists(v1.file(p)) for p in held_by)
    ids.write_text("\n".join([other, in_tails, doc, dup]) + "\n")
    purged = _forget(any_root, "--doc-ids", str(ids), "--reason", "copyright claim 3", "--purge", "--json")
    assert purged.returncode == 0, purged.stderr
    out = json.loads(purged.stdout)
    # (`in_tails` may be wholly in the tails, in no row lineage knows: whether depends on the layout the temp
    # path's hash gives, so it is checked below by what the tails hold, not by lineage.)
    assert {other, doc} <= set(out["documents"]) and out["purged"] and out["scrubbed"]
    assert not any(exists(v1.file(p)) for p in held_by)  # every shard file that held them, in any version
    assert not {dup, copy} & sampled()
    with pytest.raises(DatasetError, match=r"takedown@v0001 cannot be read: `forget --purge` at takedown@v0004"):
        resolve(storage, v1.ref)
    assert documents(storage, [other])["versions"] and all(
        h["ref"] != "takedown@v0004" for h in documents(storage, [other])["versions"])
    v4 = resolve(storage, "takedown")
    left = read_tails(v4.file(v4.manifest.tails))
    gone = {other, in_tails}  # (`other` may end in the tails too)
    assert not gone & {d for _, runs in left.values() for d in runs.ids}  # their tokens left the tails too
    assert sum(len(t) for t, _ in left.values()) == sum(len(t) for t, _ in tails.values()) - sum(
        n for _, runs in tails.values() for d, n in zip(runs.ids, runs.lengths, strict=True) if d in gone)
    for v in history(storage, "takedown"):  # and no earlier tails file that is left holds them
        if v.manifest.tails and exists(v.file(v.manifest.tails)):
            assert not gone & {d for _, runs in read_tails(v.file(v.manifest.tails)).values() for d in runs.ids}
    with pytest.raises(DatasetError, match="is a takedown"):
        delete_version(storage, "takedown", "v0004")


def test_a_forget_while_a_run_builds_on_the_dataset_waits_for_no_one_and_changes_nothing(local_ray, tmp_path,
                                                                                         monkeypatch):
    """A run holding the dataset's lease (a preprocess building the next version) makes a forget exit at once
    with EXIT_BUSY and one line naming the holder; nothing is committed, and once the run is done the same
    forget goes through."""
    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from strata.commands.shell import EXIT_BUSY
    from strata.data.dataset import resolve
    from strata.data.lease import Lease

    root = str(tmp_path / "root")
    storage = Storage(root)
    monkeypatch.setenv("STRATA_STORAGE", root)
    make_corpus(str(tmp_path / "in"), docs=12, seed=5)
    preprocess(debug("takedown", read={"inputs": (str(tmp_path / "in"),)}), storage)
    v1 = resolve(storage, "takedown")
    doc = next(f"{r['source']}:{r['position']}" for r in _spans(v1))
    with Lease(storage.dataset("takedown"), "dataset takedown", purpose="preprocess").acquire(wait=False):
        busy = _forget(root, "--reason", "erasure", "--source", doc.rpartition(":")[0])
    assert busy.returncode == EXIT_BUSY, busy.stderr
    assert busy.stderr.strip().count("\n") == 0 and "in use by" in busy.stderr, busy.stderr
    assert resolve(storage, "takedown").ref == v1.ref
    done = _forget(root, "--reason", "erasure", "--source", doc.rpartition(":")[0])
    assert done.returncode == 0, done.stderr
    assert resolve(storage, "takedown").manifest.version == "v0002"
