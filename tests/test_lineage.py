"""Lineage: which rows a training step learned from (train/lineage.py)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO, train_run

from strata.accounting.runlog import read_log
from strata.data.rows import read_rows
from strata.data.storage import Storage


def _logged_losses(run_dir: str) -> dict[int, float]:
    """Each step's loss as the loop logged it (averaged over the workers), the newest launch's."""
    out = {}
    for row in read_log(run_dir).steps:
        for i, loss in enumerate(reversed(row.get("step_losses") or [])):
            out[row["step"] - i] = loss
    return out


@pytest.mark.slow("trains, kills and resumes")
def test_a_steps_rows_are_the_ones_the_loop_trained_on_across_a_resume(local_ray, dataset, storage_root, tmp_path,
                                                                      joined):
    """Two workers, 4 steps, then continued to 8 (a resume). For a step of each launch, the rows lineage
    names, under the checkpoint saved just before the step, give the very loss the loop logged for it:
    they are the rows it trained on, each worker's."""
    import torch

    from train.checkpoint import read_meta
    from train.committed import committed_checkpoints
    from train.config import TrainConfig
    from train.lineage import step_rows
    from train.model import preset
    from train.sample import load
    from train.step import to_xy

    storage = Storage.from_env()
    model = preset("debug", n_layer=2, n_embd=64, n_head=4)

    def cfg(steps):
        return TrainConfig(max_steps=steps, batch_size=4, warmup_steps=1, log_every=1, eval_every=100,
                           eval_batches=1, checkpoint_every=2, checkpoint_every_s=0, keep_checkpoints=10)

    for steps in (4, 8):
        out = train_run(model, cfg(steps), dataset=dataset["ref"], run_name="lineage", storage=storage, workers=2,
                        use_gpu=False)
    run_dir = out["path"]
    logged = _logged_losses(run_dir)
    checkpoints = {read_meta(c)["step"]: c for c in committed_checkpoints(run_dir)}
    for step in (3, 7):  # one of each launch
        rows = step_rows(storage, "lineage", step)
        assert rows["world_size"] == 2 and rows["micro_batch"] == 4 and rows["grad_accum"] == 1
        net = load(checkpoints[step - 1])[0]
        losses = []
        with torch.no_grad():
            for rank in rows["ranks"]:
                assert len(rank["rows"]) == 4
                batch = np.concatenate([read_rows(r["shard"], r["row"], r["row"] + 1) for r in rank["rows"]])
                x, y = to_xy(batch, torch.device("cpu"))
                losses.append(net(x, y)[1].item())
        assert np.mean(losses) == pytest.approx(logged[step], rel=1e-4), (step, losses, logged[step])
    assert step_rows(storage, "lineage", 3)["ranks"] != step_rows(storage, "lineage", 7)["ranks"]
    # Each row's documents: the spans of its tokens, start to end (rows of this debug version are full).
    for step in (3, 7):
        for rank in step_rows(storage, "lineage", step)["ranks"]:
            for r in rank["rows"]:
                ends = [0] + [d["start"] + d["length"] for d in r["documents"]]
                assert [d["start"] for d in r["documents"]] == ends[:-1] and ends[-1] == 129, r
                assert all(d["doc_id"] == f"{d['source']}:{d['position']}" for d in r["documents"])

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    cli = subprocess.run([sys.executable, "-m", "strata", "lineage", "step", "lineage", "7", "--json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout) == step_rows(storage, "lineage", 7)
    past = subprocess.run([sys.executable, "-m", "strata", "lineage", "step", "lineage", "9"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert past.returncode == 1 and "run lineage has trained steps 1 to 8: no step 9" in past.stderr
    missing = subprocess.run([sys.executable, "-m", "strata", "lineage", "step", "no-such-run", "1"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no training run named 'no-such-run'" in missing.stderr

    # lineage doc: a document of step 7's batch. The first step the run trained on it is the first step whose
    # rows (step_rows, checked against the losses above) hold one of its rows; checkpoints from then on, and
    # an export of the last, are listed, the earlier ones not.
    from strata.data.dataset import resolve
    from strata.data.lineage import read
    from train.export import export

    v = resolve(storage, dataset["ref"])
    spans = read(v.file(v.manifest.lineage["file"])).to_pylist()
    picked = step_rows(storage, "lineage", 7)["ranks"][1]["rows"][2]
    doc = next(f"{r['source']}:{r['position']}" for r in spans if (r["shard"], r["row"]) == (picked["file"], picked["row"]))
    mine = {(r["shard"], r["row"]) for r in spans if f"{r['source']}:{r['position']}" == doc}
    expected = next(s for s in range(1, 9) if any((row["file"], row["row"]) in mine
                                                  for rank in step_rows(storage, "lineage", s)["ranks"] for row in rank["rows"]))
    export(checkpoints[8], str(tmp_path / "exported"))
    # Evaluations of the export (the run it came from is in its record) and of step 2's checkpoint: the first
    # learned from the document, the second only if the run had trained on it by step 2.
    task = os.path.join(REPO, "infer", "tasks", "arithmetic.jsonl")
    for model, name in ((str(tmp_path / "exported"), "ev-export"), ("lineage@2", "ev-early")):
        ev = subprocess.run([sys.executable, "-m", "infer", "eval", "--model", model, "--task", task, "--name", name],
                            cwd=REPO, env={**env, **joined}, capture_output=True, text=True, timeout=300)
        assert ev.returncode == 0, ev.stderr[-2000:]
    cli = subprocess.run([sys.executable, "-m", "strata", "lineage", "doc", "--doc-id", doc, "--json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert [d["doc_id"] for d in out["documents"]] == [doc]
    assert {(r["shard"], r["row"]) for h in out["versions"] if h["ref"] == v.ref for r in h["rows"]} == mine
    run = next(r for r in out["runs"] if r["run"] == "lineage")
    assert run["first_step"] == expected <= 7 and run["first_step_by_document"] == {doc: expected}
    assert [c["step"] for c in run["checkpoints"]] == [s for s in sorted(checkpoints) if s >= expected]
    assert [e["step"] for e in run["exports"]] == [8] and run["exports"][0]["path"] == str(tmp_path / "exported")
    assert [(u["kind"], u["name"]) for u in run["used_by"]] == [("eval", "ev-export")] + (
        [("eval", "ev-early")] if expected <= 2 else [])
    text = subprocess.run([sys.executable, "-m", "strata", "lineage", "doc", "--doc-id", doc], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert f"run lineage read {v.ref}: first trained on them at step {expected}" in text.stdout, text.stdout


def _source_text(source: str, position: int) -> str:
    """A record's text read straight from its input file (the test's own reader): a .jsonl line at a byte
    offset, or a whole text file."""
    if source.endswith(".jsonl"):
        with open(source, "rb") as f:
            f.seek(position)
            return json.loads(f.readline())["text"]
    with open(source) as f:
        return f.read()


def test_each_row_names_the_documents_it_holds_and_their_places_in_the_inputs(dataset):
    """Every token of every row of a version is one document's, by lineage; the span's tokens are that
    document's text, read back from the input file and offset lineage names; and a document's spans add up
    to its tokens."""
    import pyarrow.parquet as pq

    from strata.data.dataset import resolve
    from strata.data.lineage import read

    v = resolve(Storage.from_env(), dataset["ref"])
    info = v.manifest.lineage
    table = read(v.file(info["file"])).to_pylist()
    assert info["spans"] == len(table) and info["documents"] == len({r["doc"] for r in table}) > 0
    stored = pq.read_table(v.file(info["file"]), columns=["source", "position"]).to_pylist()
    assert len(stored) == info["documents"]  # a row a document, sorted: a lookup reads the row group that may hold it
    assert stored == sorted(stored, key=lambda r: (r["source"], r["position"]))
    row_len = v.manifest.seq_len + 1
    covered = {s.path: np.zeros((s.rows, row_len), np.int32) for s in v.shards}
    by_doc: dict[int, int] = {}
    for r in table:
        tokens = read_rows(v.file(r["shard"]), r["row"], r["row"] + 1)[0][r["start"]: r["start"] + r["length"]]
        covered[r["shard"]][r["row"], r["start"]: r["start"] + r["length"]] += 1
        text = _source_text(r["source"], r["position"])
        part = bytes(t for t in tokens.tolist() if t < 256)
        # A span is a stretch of its document's bytes, or only its end-of-text token when that spills alone
        # into the next row (bytes, not text: a row may end inside a character).
        alone_eot = tokens.tolist() == [256] and r["start"] == 0
        assert (part and part in " ".join(text.split()).encode()) or alone_eot, (r, part[:60])
        by_doc[(r["source"], r["position"])] = by_doc.get((r["source"], r["position"]), 0) + r["length"]
    whole = {k: len(" ".join(_source_text(*k).split()).encode()) + 1 for k in by_doc}
    # Documents cut at the version's end go on into the next version's rows (tails): never more than whole.
    assert all(n <= whole[k] for k, n in by_doc.items())
    assert sum(n == whole[k] for k, n in by_doc.items()) >= len(by_doc) - 2
    padding = v.manifest.stats.get("padding_tokens", {})
    for path, c in covered.items():
        assert c.max() == 1, path  # no token is two documents'
    assert sum(int(c.sum()) for c in covered.values()) == sum(s.rows for s in v.shards) * row_len - sum(
        padding.values() if isinstance(padding, dict) else [0])
    # Each input's digest is its sha256 (small files: one part), here and in what `lineage doc` says of a document.
    import hashlib

    from strata.data.lineage import find

    for f in v.manifest.inputs:
        with open(f["path"], "rb") as fh:
            assert f["digest"] == "sha256:" + hashlib.sha256(fh.read()).hexdigest(), f["path"]
    some = f"{table[0]['source']}:{table[0]['position']}"
    [doc] = find(Storage.from_env(), [some])["documents"]
    assert doc["file"]["digest"] == next(f["digest"] for f in v.manifest.inputs if f["path"] == table[0]["source"])


def _cut_stream(seed: int, docs: int, row_len: int, shards: int):
    """Spans (strata.data.lineage.SCHEMA) of `docs` documents packed into one stream of `row_len`-token rows by
    pass 2's own cutter, the rows then scattered over `shards` shard files at random, as pass 3 does."""
    import pyarrow as pa

    from pipelines.lineage import DocRuns
    from strata.data.lineage import SCHEMA, doc_key

    rng = np.random.default_rng(seed)
    runs = DocRuns()
    for i in range(docs):
        runs.add(f"/in/part-{i % 3}.jsonl:{i * 1000}", int(rng.integers(1, 2**63)), int(rng.integers(1, 5 * row_len)))
    rows = sum(runs.lengths) // row_len
    spans = runs.cut(np.arange(rows, dtype=np.uint64), row_len)
    place = rng.permutation(rows)[spans["key"].to_numpy().astype(np.int64)]
    ids = spans["doc_id"].to_pylist()
    source, _, position = zip(*(i.rpartition(":") for i in ids), strict=True)
    return pa.Table.from_arrays([pa.array([doc_key(i) for i in ids], pa.uint64()), spans["exact"],
                                 pa.array(source), pa.array([int(p) for p in position], pa.int64()),
                                 pa.array([f"data/s-{p % shards}.parquet" for p in place]),
                                 pa.array((place // shards).astype(np.int32)), spans["start"], spans["length"]],
                                schema=SCHEMA)


def _ordered(table):
    return table.sort_by([("doc", "ascending"), ("shard", "ascending"), ("row", "ascending")])


def test_the_lineage_file_keeps_every_span_and_a_lookup_reads_only_the_row_group_holding_a_record(tmp_path):
    """Format 2 stores a row a document and no span lengths: read back, every span is there as pass 2 cut
    it. Looking records up reads only the row groups that hold them (of 3); by source glob, only groups
    with a match. A format-1 file (a row a span) still reads."""
    import pyarrow.parquet as pq

    from strata.data.lineage import LOOKUP_ROWS, lookup, read, write

    spans = _cut_stream(1, 2 * LOOKUP_ROWS + 500, 33, 3)
    path = str(tmp_path / "lineage.parquet")
    write(spans, path, 33)
    assert pq.ParquetFile(path).metadata.num_row_groups == 3
    assert _ordered(read(path)).equals(_ordered(spans))
    ids = sorted({f"{s}:{p}" for s, p in zip(spans["source"].to_pylist(), spans["position"].to_pylist(), strict=True)})
    picked = [ids[7], ids[-3], "/in/part-0.jsonl:5", "not-an-id"]  # one in the first group, one in the last, two absent
    found, groups = lookup(path, picked)
    want = [r for r in spans.to_pylist() if f"{r['source']}:{r['position']}" in picked]
    assert sorted(map(str, found.to_pylist())) == sorted(map(str, want)) and want and groups == 2
    assert lookup(path, ["/in/part-9.jsonl:0"])[0].num_rows == 0
    by_source, groups = lookup(path, source="*/part-2.jsonl")
    order = sorted({(s, p) for s, p in zip(spans["source"].to_pylist(), spans["position"].to_pylist(), strict=True)})
    holding = {i // LOOKUP_ROWS for i, (s, _) in enumerate(order) if s == "/in/part-2.jsonl"}
    assert set(by_source["source"].to_pylist()) == {"/in/part-2.jsonl"} and groups == len(holding) < 3
    assert by_source.num_rows == sum(s == "/in/part-2.jsonl" for s in spans["source"].to_pylist())
    write(spans.slice(0, 0), str(tmp_path / "empty.parquet"), 33)  # a version whose rows hold no document's tokens
    assert read(str(tmp_path / "empty.parquet")).num_rows == 0 and lookup(str(tmp_path / "empty.parquet"), picked)[1] == 0
    old = str(tmp_path / "format1.parquet")
    pq.write_table(spans, old)
    assert _ordered(read(old)).equals(_ordered(spans))
    assert sorted(map(str, lookup(old, picked)[0].to_pylist())) == sorted(map(str, want))


def test_a_document_whose_tokens_are_not_one_stretch_is_refused(tmp_path):
    """Two spans of one document that both end inside their rows cannot come from one token stream: the
    writer refuses them (a bug upstream) rather than store lengths it would read back wrong."""
    from strata.data.lineage import LineageError, write

    spans = _cut_stream(2, 40, 33, 2)
    first = spans["doc"][0].as_py()
    rows = spans.to_pylist()
    mine = [r for r in rows if r["doc"] == first]
    mine[0]["length"] = 33 - mine[0]["start"] - 1  # its first span now ends inside the row
    broken = [*mine, *(r for r in rows if r["doc"] != first)] if len(mine) > 1 else None
    if broken is None:  # a one-span document: give it a second short span
        broken = [*mine, {**mine[0], "row": mine[0]["row"] + 1, "start": 0, "length": 3}, *rows[len(mine):]]
    import pyarrow as pa

    with pytest.raises(LineageError, match="not one stretch"):
        write(pa.Table.from_pylist(broken, schema=spans.schema), str(tmp_path / "l.parquet"), 33)


def test_a_damaged_lineage_file_is_one_error_naming_it(tmp_path):
    """Junk where a lineage file should be, or a footer whose format is not one this strata writes: a
    LineageError naming the file, for `lineage doc` and `forget` to print in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from strata.data.lineage import META, LineageError, lookup, read

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(LineageError, match=f"{junk} is not a readable lineage file"):
        lookup(str(junk), ["/in/a.jsonl:0"])
    odd = tmp_path / "odd.parquet"
    pq.write_table(pa.table({"source": ["a"]}).replace_schema_metadata({META: b"[7]"}), odd)
    with pytest.raises(LineageError, match=f"{odd}: lineage format"):
        read(str(odd))
