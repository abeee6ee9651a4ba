"""Tier 1 on a local Ray: every document accounted for, dedup across versions,
deterministic global shuffle, tokenizers, mixed and compressed inputs."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import REPO, make_corpus

from pipelines.preprocess import debug, run
from strata.dataset import list_versions, read_rows, resolve
from strata.storage import Storage
from strata.tokenizer import ByteTokenizer

_rows = read_rows


def test_every_document_is_accounted_for(dataset, corpus):
    d = dataset["documents"]
    assert d["read"] == d["kept"] + d["filtered"] + d["duplicate"] + d["rejected"]
    assert d["kept"] == len(corpus["good"])
    assert (d["rejected"], d["filtered"], d["duplicate"]) == tuple(
        sum(corpus[k].values()) for k in ("rejected", "filtered", "duplicate"))
    assert dataset["reasons"] == {f"{kind}:{k}": v for kind in ("rejected", "filtered", "duplicate")
                                  for k, v in corpus[kind].items()}
    assert dataset["stats"]["duplicate"] == corpus["duplicate"]


def test_version_is_committed_with_a_complete_manifest(dataset, corpus):
    v = resolve(Storage.from_env(), f"{dataset['dataset']}@{dataset['version']}")
    m = v.manifest
    assert m.seq_len == 128 and m.dtype == "uint16" and m.tokenizer.kind == "bytes"
    assert m.documents.balanced() and len(m.inputs) == corpus["files"]
    assert m.run["config"]["pack"]["seq_len"] == 128 and m.run["code_version"] and m.run["libraries"]["ray"]
    assert m.stats["tokens"] == m.tokens and m.stats["shards"] == len(m.shards)
    assert m.stats["mb_per_s_per_cpu"] > 0 and m.stats["tokens_per_s_per_cpu"] > 0
    assert os.listdir(v.path) == ["manifest.json"] and m.files.startswith("data/")
    assert sorted(os.listdir(v.file(m.files))) == sorted(["run.json", "rejects.json", "dedup"]
                                                         + [os.path.basename(s.path) for s in m.shards])  # no work files
    for shard in m.shards:
        table = pq.read_table(v.file(shard.path))
        t = table.schema.field("tokens").type
        assert table.num_rows == shard.rows and table.column_names == ["tokens"]
        assert pa.types.is_fixed_size_list(t) and t.list_size == 129 and t.value_type == pa.uint16()
    with open(v.file(m.rejects)) as f:
        rejects = json.load(f)
    assert rejects["counts"] == dataset["reasons"]
    assert set(rejects["samples"]) == set(dataset["reasons"])  # every reason has samples
    assert all(s["doc_id"].startswith(corpus["path"]) for v_ in rejects["samples"].values() for s in v_)


def test_rows_decode_back_to_the_source_text(dataset, corpus):
    """Packing keeps the bytes: every piece between end-of-text ids is text of a kept document."""
    tok = ByteTokenizer()
    v = resolve(Storage.from_env(), f"{dataset['dataset']}@{dataset['version']}")
    whole = "\x00".join(corpus["good"] + corpus["variants"])  # either copy of a duplicate may win
    tokens = 0
    for path in v.shard_paths("train") + v.shard_paths("validation"):
        rows = _rows(path)
        tokens += rows.size
        for row in rows:
            ends = [-1, *np.flatnonzero(row == tok.eot_id), len(row)]
            for a, b in zip(ends, ends[1:], strict=False):
                assert tok.decode(row[a + 1: b]) in whole
    assert dataset["tokens"] == sum(len(t.encode()) + 1 for t in corpus["good"])
    assert tokens == dataset["sequences"] * 129 <= dataset["tokens"]


def test_rerun_processes_only_new_files_and_dedups_against_earlier_versions(local_ray, dataset, corpus, tmp_path):
    storage = Storage.from_env()
    before = list_versions(storage, "corpus")
    again = run(debug("corpus", read={"inputs": (corpus["path"],)}), storage)
    assert again["version"] is None and again["documents"]["read"] == 0  # nothing new: no version
    assert list_versions(storage, "corpus") == before
    new_doc = "a brand new document about shards, tokens and clusters that nobody has seen. " * 4
    (tmp_path / "new.txt").write_text(new_doc)
    (tmp_path / "old-again.txt").write_text(corpus["good"][5])  # new file, old content
    out = run(debug("corpus", read={"inputs": (corpus["path"], str(tmp_path))}), storage)
    assert out["documents"] == {"read": 2, "kept": 1, "filtered": 0, "duplicate": 1, "rejected": 0}
    assert out["version"] not in before and list_versions(storage, "corpus") == before + [out["version"]]
    m = resolve(storage, f"corpus@{out['version']}").manifest
    assert sorted(os.path.basename(f["path"]) for f in m.inputs) == ["new.txt", "old-again.txt"]
    full = run(debug("corpus", read={"inputs": (str(tmp_path),), "incremental": False}), storage)
    assert full["version"] is None and full["documents"]["duplicate"] == 2  # reread, all seen before


def test_run_id_makes_a_run_idempotent(local_ray, corpus, tmp_path):
    storage = Storage.from_env()
    (tmp_path / "a.txt").write_text(corpus["good"][0])
    first = run(debug("slots", read={"inputs": (str(tmp_path),)}), storage, run_id="2026-11-30T02")
    (tmp_path / "b.txt").write_text(corpus["good"][1])  # even with new input, the slot ran already
    second = run(debug("slots", read={"inputs": (str(tmp_path),)}), storage, run_id="2026-11-30T02")
    assert (first["already_existed"], second["already_existed"]) == (False, True)
    assert second["version"] == first["version"] and list_versions(storage, "slots") == [first["version"]]
    third = run(debug("slots", read={"inputs": (str(tmp_path),)}), storage, run_id="2026-11-30T03")
    assert third["documents"]["kept"] == 1 and third["version"] != first["version"]


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    made = make_corpus(str(root), docs=120, seed=7)
    return str(root), made


def _shuffled(storage, name, root, seed):
    out = run(debug(name, read={"inputs": (root,), "split_bytes": 1 << 16},
                    pack={"seed": seed, "shard_bytes": 8 << 10}), storage)
    v = resolve(storage, f"{name}@{out['version']}")
    return out, {os.path.basename(s.path): _rows(v.file(s.path)) for s in v.manifest.shards}


@pytest.mark.slow
def test_shuffle_is_global_deterministic_and_bounded(local_ray, split_corpus):
    storage = Storage.from_env()
    root, made = split_corpus
    a, rows_a = _shuffled(storage, "shuf-a", root, seed=0)
    b, rows_b = _shuffled(storage, "shuf-b", root, seed=0)
    c, rows_c = _shuffled(storage, "shuf-c", root, seed=1)
    assert a["documents"]["kept"] == len(made["good"]) and len(rows_a) >= 4
    assert rows_a.keys() == rows_b.keys() and all(np.array_equal(rows_a[k], rows_b[k]) for k in rows_a)
    flat = lambda rs: np.concatenate([rs[k] for k in sorted(rs)])  # noqa: E731
    assert not np.array_equal(flat(rows_a), flat(rows_c))  # another seed, another order ...
    assert sorted(map(bytes, flat(rows_a))) == sorted(map(bytes, flat(rows_c)))  # ... of the same rows
    per_shard = (8 << 10) // (129 * 2)
    assert max(len(r) for r in rows_a.values()) < 2 * per_shard
    assert len([k for k in rows_a if k.startswith("train-")]) == -(-a["stats"]["rows"]["train"] // per_shard)


@pytest.mark.slow
def test_mixed_compressed_inputs_and_a_trained_tokenizer(local_ray, tmp_path):
    texts = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(80)) for i in range(60)]
    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[:20])
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[20:40])))
    pq.write_table(pa.table({"text": texts[40:]}), tmp_path / "c.parquet")
    storage = Storage.from_env()
    out = run(debug("mixed", read={"inputs": (str(tmp_path),)}, pack={"tokenizer": "train:300", "seq_len": 32},
                    dedup={"near_dedup": False}), storage)
    assert out["documents"] == {"read": 60, "kept": 60, "filtered": 0, "duplicate": 0, "rejected": 0}
    v = resolve(storage, f"mixed@{out['version']}")
    tok = v.manifest.tokenizer
    assert tok.kind == "hf" and tok.file.endswith("/tokenizer.json") and tok.vocab_size <= 300
    assert os.path.exists(v.file(tok.file)) and v.tokenizer_definition()
    rows = np.concatenate([_rows(p) for p in v.shard_paths("train")])
    assert rows.max() < tok.vocab_size and (rows == tok.eot_id).any()
    assert out["tokens"] < sum(len(t) for t in texts) / 2  # BPE compresses this text well


def test_datasets_cli_lists_and_shows_versions(dataset):
    env = {**os.environ}
    out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "list", "corpus"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and dataset["version"] in out.stdout
    out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "show", f"corpus@{dataset['version']}",
                          "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(out.stdout)["documents"]["kept"] == dataset["documents"]["kept"]
    out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "show", f"corpus@{dataset['version']}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    by_version = out.stdout.split("shards by version", 1)[1].splitlines()[1].split()
    assert by_version[0] == dataset["version"] and int(by_version[1]) == dataset["shards"]
    out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "show", "corpus@v0999"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no version 'v0999'" in out.stderr


def test_without_dedup_one_fused_pass_keeps_the_accounting(local_ray, corpus):
    out = run(debug("fused", read={"inputs": (corpus["path"],)},
                    dedup={"exact_dedup": False, "near_dedup": False}), Storage.from_env())
    d = out["documents"]
    assert d["kept"] == len(corpus["good"]) + len(corpus["variants"]) and d["duplicate"] == 0
    assert (d["rejected"], d["filtered"]) == (sum(corpus["rejected"].values()), sum(corpus["filtered"].values()))
    assert d["read"] == d["kept"] + d["filtered"] + d["rejected"]
    v = resolve(Storage.from_env(), f"fused@{out['version']}")
    assert v.manifest.dedup["files"] == {"exact": [], "band": []}
    assert sum(len(_rows(p)) for p in v.shard_paths("train") + v.shard_paths("validation")) == out["sequences"]
