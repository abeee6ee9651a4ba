"""Tier 1 on a local Ray: every document accounted for, dedup across versions,
deterministic global shuffle, tokenizers, mixed and compressed inputs."""

import gzip
import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute  # noqa: F401  (pa.compute)
import pyarrow.parquet as pq
import pytest
import zstandard
from conftest import REPO, make_corpus

from pipelines.config import debug
from pipelines.driver import run
from strata.data.dataset import list_versions, resolve
from strata.data.rows import read_rows
from strata.data.storage import Storage
from strata.data.tokenizer import ByteTokenizer

_rows = read_rows


def test_every_document_is_accounted_for(dataset, corpus):
    d = dataset["documents"]
    assert d["read"] == d["kept"] + d["filtered"] + d["duplicate"] + d["rejected"] + d["unpacked"]
    assert d["kept"] + d["unpacked"] == len(corpus["good"])  # unpacked: they end in a last partial row
    assert (d["rejected"], d["filtered"], d["duplicate"]) == tuple(
        sum(corpus[k].values()) for k in ("rejected", "filtered", "duplicate"))
    assert dataset["reasons"] == {**{f"{kind}:{k}": v for kind in ("rejected", "filtered", "duplicate")
                                     for k, v in corpus[kind].items()},
                                  **({"unpacked:carried": d["unpacked"]} if d["unpacked"] else {})}
    assert dataset["stats"]["duplicate"] == corpus["duplicate"]


def test_version_is_committed_with_a_complete_manifest(dataset, corpus):
    v = resolve(Storage.from_env(), f"{dataset['dataset']}@{dataset['version']}")
    m = v.manifest
    assert m.seq_len == 128 and m.dtype == "uint16" and m.tokenizer.kind == "bytes"
    assert m.documents.balanced() and len(m.inputs) == corpus["files"]
    assert m.run["config"]["pack"]["seq_len"] == 128 and m.run["code_version"] and m.run["libraries"]["ray"]
    assert m.stats["tokens"] == m.tokens and m.stats["shards"] == len(v.shards) == len(v.added)
    assert m.stats["mb_per_s_per_cpu"] > 0 and m.stats["tokens_per_s_per_cpu"] > 0
    # Where the time went: CPU seconds of each stage the run went through, wall seconds of each step.
    stages = m.stats["cpu_s_by_stage"]
    assert {"read", "clean", "sign", "dedup", "tokenize", "pack", "write", "shuffle-write", "dedup-index",
            "driver", "ray-daemons"} <= set(stages) and stages["dedup-index"] > 0 and stages["driver"] > 0
    steps = dict(m.stats["wall_s_by_step"])
    assert list(steps)[:2] == ["start-up", "pass 1: read, clean, sign"] and all(v >= 0 for v in steps.values())
    assert sum(steps.values()) == pytest.approx(m.stats["seconds"], abs=0.05)
    # A Delta table: its log, the shards under data/<run>, strata's own files under _strata/<run> (vacuum
    # leaves `_` directories alone), the lease.
    tag = m.files.removeprefix("_strata/")
    assert set(os.listdir(v.path)) <= {"_delta_log", "data", "_strata", "_lease"} and m.files == f"_strata/{tag}"
    tails = [os.path.basename(m.tails)] if m.tails else []  # what the rows could not hold, for the next version
    assert sorted(os.listdir(v.file(m.files))) == sorted(["run.json", "rejects.json", "dedup", "dedup-audit.json", "removed",
                                                          "record.json", "consumed", "lineage.parquet"] + tails)  # no work files
    assert [f["rows"] for seg in m.consumed for f in seg["files"]] == [corpus["files"]]  # the inputs it consumed
    assert sorted(os.listdir(v.file(f"data/{tag}"))) == sorted(os.path.basename(s.path) for s in v.shards)
    for shard in v.shards:
        table = pq.read_table(v.file(shard.path))
        t = table.schema.field("tokens").type
        assert table.num_rows == shard.rows and table.column_names == ["tokens"] and shard.version == m.version
        assert os.path.getsize(v.file(shard.path)) == shard.bytes
        assert pa.types.is_list(t) and t.value_type == pa.int32()  # Delta's types: no fixed size, no unsigned
        assert set(pa.compute.list_value_length(table.column("tokens")).to_pylist()) == {129}
        assert _rows(v.file(shard.path)).dtype == np.uint16  # the ids' own type, from the file's metadata
    with open(v.file(m.rejects)) as f:
        rejects = json.load(f)
    assert rejects["counts"] == dataset["reasons"]
    assert set(rejects["samples"]) == set(dataset["reasons"]) - {"unpacked:carried"}  # every reject has samples
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
    d = out["documents"]
    assert (d["read"], d["kept"] + d["unpacked"], d["filtered"], d["duplicate"], d["rejected"]) == (2, 1, 0, 1, 0)
    assert out["version"] not in before and list_versions(storage, "corpus") == before + [out["version"]]
    m = resolve(storage, f"corpus@{out['version']}").manifest
    assert sorted(os.path.basename(f["path"]) for f in m.inputs) == ["new.txt", "old-again.txt"]
    full = run(debug("corpus", read={"inputs": (str(tmp_path),), "incremental": False},
                     dedup={"max_duplicate_fraction": 1.0}), storage)  # a source all duplicates: allowed here
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
    assert third["documents"]["kept"] + third["documents"]["unpacked"] == 1
    assert third["version"] not in (None, first["version"])


@pytest.fixture(scope="module")
def split_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("split")
    made = make_corpus(str(root), docs=120, seed=7)
    return str(root), made


def _shuffled(storage, name, root, seed):
    out = run(debug(name, read={"inputs": (root,), "split_bytes": 1 << 16},
                    pack={"seed": seed, "shard_bytes": 8 << 10}), storage)
    v = resolve(storage, f"{name}@{out['version']}")
    return out, {os.path.basename(s.path): _rows(v.file(s.path)) for s in v.shards}


def test_shuffle_is_global_deterministic_and_bounded(local_ray, split_corpus):
    storage = Storage.from_env()
    root, made = split_corpus
    a, rows_a = _shuffled(storage, "shuf-a", root, seed=0)
    b, rows_b = _shuffled(storage, "shuf-b", root, seed=0)
    c, rows_c = _shuffled(storage, "shuf-c", root, seed=1)
    assert a["documents"]["kept"] + a["documents"]["unpacked"] == len(made["good"]) and len(rows_a) >= 4
    assert rows_a.keys() == rows_b.keys() and all(np.array_equal(rows_a[k], rows_b[k]) for k in rows_a)
    flat = lambda rs: np.concatenate([rs[k] for k in sorted(rs)])  # noqa: E731
    assert not np.array_equal(flat(rows_a), flat(rows_c))  # another seed, another order ...
    assert sorted(map(bytes, flat(rows_a))) == sorted(map(bytes, flat(rows_c)))  # ... of the same rows
    per_shard = (8 << 10) // (129 * 2)
    assert max(len(r) for r in rows_a.values()) < 2 * per_shard
    assert len([k for k in rows_a if k.startswith("train-")]) == -(-a["stats"]["rows"]["train"] // per_shard)


def test_mixed_compressed_inputs_and_a_trained_tokenizer(local_ray, tmp_path, tmp_path_factory):
    texts = [f"document {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(80)) for i in range(60)]
    lines = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[:20])
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[20:40])))
    pq.write_table(pa.table({"text": texts[40:]}), tmp_path / "c.parquet")
    storage = Storage.from_env()
    out = run(debug("mixed", read={"inputs": (str(tmp_path),)}, pack={"tokenizer": "train:300", "seq_len": 32},
                    dedup={"near_dedup": False}), storage)
    d = out["documents"]
    assert (d["read"], d["kept"] + d["unpacked"], d["filtered"], d["duplicate"], d["rejected"]) == (60, 60, 0, 0, 0)
    v = resolve(storage, f"mixed@{out['version']}")
    tok = v.manifest.tokenizer
    assert tok.kind == "hf" and tok.file.endswith("/tokenizer.json") and tok.vocab_size <= 300
    assert os.path.exists(v.file(tok.file)) and v.tokenizer_definition()
    rows = np.concatenate([_rows(p) for p in v.shard_paths("train")])
    assert rows.max() < tok.vocab_size and (rows == tok.eot_id).any()
    assert out["tokens"] < sum(len(t) for t in texts) / 2  # BPE compresses this text well
    # That tokenizer.json through each engine: the fast one where it can, and the same rows either way.
    tok_file = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok_file.write_text(v.tokenizer_definition())
    rows_by = {}
    for engine in ("auto", "hf"):
        o = run(debug(f"mixed-{engine}", read={"inputs": (str(tmp_path),)}, dedup={"near_dedup": False},
                      pack={"tokenizer": str(tok_file), "seq_len": 32,
                            "tokenizer_engine": engine}), storage)
        w = resolve(storage, f"mixed-{engine}@{o['version']}")
        rows_by[engine] = np.concatenate([_rows(p) for s in ("train", "validation") for p in w.shard_paths(s)])
        assert sum(o["stats"]["documents_by_tokenizer_engine"].values()) == o["documents"]["kept"] + \
            o["documents"]["unpacked"]
        rows_by[engine + "-stats"] = o["stats"]
    assert set(rows_by["auto-stats"]["documents_by_tokenizer_engine"]) == {"tiktoken"}
    assert rows_by["auto-stats"]["tokenizer_checked"] >= 1
    assert set(rows_by["hf-stats"]["documents_by_tokenizer_engine"]) == {"hf"}
    assert np.array_equal(rows_by["auto"], rows_by["hf"])


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
    assert d["kept"] + d["unpacked"] == len(corpus["good"]) + len(corpus["variants"]) and d["duplicate"] == 0
    assert (d["rejected"], d["filtered"]) == (sum(corpus["rejected"].values()), sum(corpus["filtered"].values()))
    assert d["read"] == d["kept"] + d["filtered"] + d["rejected"] + d["unpacked"]
    v = resolve(Storage.from_env(), f"fused@{out['version']}")
    assert v.manifest.dedup["index"] == {"exact": [], "band": []}  # no keys: nothing deduplicated
    assert sum(len(_rows(p)) for p in v.shard_paths("train") + v.shard_paths("validation")) == out["sequences"]


def test_packing_keeps_every_kept_document(local_ray, tmp_path):
    """Every unit's tail (shorter than a row) is packed with the others: a document counted kept is
    whole in the shards; the only ones that are not are counted unpacked. Every document here is 63
    bytes and its end-of-text id, a quarter of a row, so rows hold whole documents and each can be
    found by its text."""
    import random

    rng, words = random.Random(3), ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    corpus, texts = tmp_path / "units", []
    corpus.mkdir()
    for f in range(4):  # each file > 64 KiB: it is cut into work units of 64 KiB
        with open(corpus / f"part-{f}.jsonl", "w") as out:
            for _ in range(1200):
                n, body = len(texts), " ".join(rng.choice(words) for _ in range(12))
                texts.append(f"<s{n:05d}> {body[:45].ljust(45, 'z')} <e{n:05d}>")
                out.write(json.dumps({"text": texts[-1]}) + "\n")
    assert {len(t) for t in texts} == {63}
    out = run(debug("tails", read={"inputs": (str(corpus),), "split_bytes": 64 << 10}, pack={"seq_len": 255}),
              Storage.from_env())
    d, n = out["documents"], len(texts)
    assert d["read"] == n and d["kept"] + d["unpacked"] == n and d["filtered"] == d["duplicate"] == 0
    v = resolve(Storage.from_env(), f"tails@{out['version']}")
    rows = np.concatenate([read_rows(p) for p in v.shard_paths("train") + v.shard_paths("validation")])
    tok = ByteTokenizer()
    docs = [doc for row in rows for doc in np.split(row, np.flatnonzero(row == tok.eot_id) + 1) if len(doc)]
    assert all(doc[-1] == tok.eot_id for doc in docs)  # rows are whole documents
    pieces = [tok.decode(doc[:-1]) for doc in docs]
    found = set(pieces)
    assert len(found) == len(pieces)  # none twice
    assert found <= set(texts) and len(found) == d["kept"]  # every kept document is whole in a shard ...
    assert d["unpacked"] < 2 * 4  # ... the others fit in the last partial row of each split
    unpacked = v.manifest.stats["tokens_unpacked"]
    assert unpacked["train"] + unpacked["validation"] == 64 * d["unpacked"]
    assert rows.size + 64 * d["unpacked"] == v.manifest.tokens  # no token lost either


def test_tails_pack_together_and_the_leftover_is_counted(tmp_path):
    """pack_tails on tails that cut documents anywhere: the rows are the tails' stream in order, and
    the documents counted unpacked are those with text in what is left."""
    from pipelines.dedup import hash64
    from pipelines.lineage import DocRuns
    from pipelines.pack import TAILS_FILE, mix64, pack_tails, write_tails

    eot, row_len, rng = 0, 17, np.random.default_rng(5)
    for d in ("tails", "packed", "lineage"):
        (tmp_path / d).mkdir()
    stream, doc_ends, owner = [], [], []  # the train stream, where each document's text ends, whose each token is
    for unit in range(5):
        parts = [rng.integers(1, 9, rng.integers(1, 12)) for _ in range(rng.integers(1, 4))]
        if unit % 2:  # an odd unit's tail opens with the rest of a document begun in its rows
            parts.insert(0, rng.integers(1, 9, 3))
        tail = np.concatenate([np.append(p, eot) for p in parts]).astype(np.uint32)
        runs = DocRuns([f"u{unit}:{i}" for i in range(len(parts))], range(len(parts)), [len(p) + 1 for p in parts])
        owner += [f"u{unit}:{i}" for i, p in enumerate(parts) for _ in range(len(p) + 1)]
        for i in np.flatnonzero(tail == eot):
            doc_ends.append(len(stream) + i)
        stream.extend(tail.tolist())
        write_tails(str(tmp_path / "tails" / f"packed-{unit}.parquet"),
                    {"train": tail, "validation": np.zeros(0, np.uint32)}, {"train": runs, "validation": DocRuns()})
    out = pack_tails(str(tmp_path), [f"packed-{u}.parquet" for u in range(5)], seq_len=row_len - 1,
                     dtype="uint16", seed=0, eot_id=eot)
    n = len(stream) // row_len
    assert out.tally.rows["train"] == n and out.tally.unpacked_tokens["train"] == len(stream) - n * row_len
    # Each document's text ends just before its end-of-text id: it has text left over if that is at or past
    # the cut, unless the id alone is left (its text ends in a row).
    assert out.tally.unpacked_documents == sum(1 for e in doc_ends if e > n * row_len)
    table = pq.read_table(tmp_path / "packed" / TAILS_FILE)
    order = {int(k): i for i, k in enumerate(mix64(np.uint64(hash64(f"0:{TAILS_FILE}:train")) +
                                                   np.arange(n, dtype=np.uint64)))}
    rows = sorted(zip(table["key"].to_pylist(), table["tokens"].to_pylist(), strict=True), key=lambda r: order[r[0]])
    assert np.concatenate([r[1] for r in rows]).tolist() == stream[: n * row_len]
    # Lineage: the spans name, token by token, the document each packed token is of.
    spans = pq.read_table(tmp_path / "lineage" / TAILS_FILE).to_pylist()
    named = [None] * (n * row_len)
    for sp in spans:
        at = order[sp["key"]] * row_len + sp["start"]
        named[at: at + sp["length"]] = [sp["doc_id"]] * sp["length"]
    assert named == owner[: n * row_len]


def _shingle_jaccard(a: str, b: str, k: int = 5) -> float:
    """The Jaccard similarity of two texts' k-word shingle sets (the test's own, not strata's)."""
    sets = [{tuple(w[i: i + k]) for i in range(max(1, len(w) - k + 1))} for w in (a.lower().split(), b.lower().split())]
    return len(sets[0] & sets[1]) / len(sets[0] | sets[1])


def test_dedup_is_audited_per_source_and_a_source_wiped_out_is_refused(local_ray, tmp_path):
    """Per input source, the documents dedup looked at and removed are in the manifest; a run that would
    remove more than --max-duplicate-fraction of one source commits nothing and names the source. Beside
    each version, the audit: duplicate-cluster sizes and sampled pairs with estimated and true Jaccard."""
    import random

    from strata.data.dataset import DatasetError
    from strata.data.storage import read_json

    rng, words = random.Random(4), [f"w{i}" for i in range(500)]
    texts = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(40)]
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    # b: the same documents (one with a word changed), two of its own, the first copied twice over and
    # the second with one word changed: clusters of 2 (40 of them against a, one near) and of 3.
    own = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(2)]
    edited = own[1].split()
    edited[30] = "edited"
    copies = texts[:-1] + [texts[-1].replace(texts[-1].split()[3], "changed", 1)] + own + [
        own[0], "  " + own[0].upper(), " ".join(edited)]
    for i, part in enumerate((copies[:20], copies[20:])):  # a source of two files
        (b / f"part-{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    storage = Storage.from_env()
    first = run(debug("audit", read={"inputs": (str(a),)}), storage)
    assert first["stats"]["dedup_by_source"] == {str(a): {"documents": 40, "removed": 0, "share": 0.0}}
    n, dups = len(copies), len(copies) - 2
    with pytest.raises(DatasetError, match=f"remove {dups} of {n} documents \\({dups / n:.1%}\\) of source '{b}'"):
        run(debug("audit", read={"inputs": (str(a), str(b))}), storage)
    assert list_versions(storage, "audit") == [first["version"]]  # nothing committed
    second = run(debug("audit", read={"inputs": (str(a), str(b))}, dedup={"max_duplicate_fraction": 0.96}),
                 storage)
    assert second["stats"]["dedup_by_source"] == {str(b): {"documents": n, "removed": dups,
                                                           "share": round(dups / n, 6)}}
    assert second["documents"]["duplicate"] == dups
    v = resolve(storage, f"audit@{second['version']}")
    audit = read_json(v.file(v.manifest.dedup["audit"]))
    assert audit["by_source"] == second["stats"]["dedup_by_source"]
    assert audit["cluster_sizes"] == {"2": 41, "3-4": 1} and audit["removed_by_earlier_version"] == 40
    assert audit["largest_clusters"][0] == {"size": 3, "kept": next(
        p["kept"] for p in audit["sampled_pairs"] if p["kind"] == "exact")}
    pairs = sorted(audit["sampled_pairs"], key=lambda p: p["kind"])
    assert [p["kind"] for p in pairs] == ["exact", "exact", "near"]  # pairs within the run only
    line = {r: json.loads(x)["text"] for f in sorted(b.iterdir()) for r, x in
            ((f"{f}:{o}", ln) for o, ln in _offsets(f.read_text()))}
    for p in pairs:
        true = _shingle_jaccard(line[p["removed"]], line[p["kept"]])
        assert p["true_jaccard"] == pytest.approx(true, abs=1e-3)
        assert abs(p["estimated_jaccard"] - true) < 0.2
    assert pairs[0]["true_jaccard"] == 1.0 and pairs[2]["true_jaccard"] < 1.0
    # Every removed document is listed beside the version, with its kind and the document it lost to.
    removed = pq.read_table(v.file(v.manifest.dedup["removed"])).to_pylist()
    assert len({r["doc_id"] for r in removed}) == len(removed) == dups
    assert {r["doc_id"] for r in removed} <= set(line) and sum(r["earlier"] for r in removed) == 40
    assert Counter(r["kind"] for r in removed) == {"exact": second["stats"]["duplicate"]["exact"],
                                                   "near": second["stats"]["duplicate"]["near"]}


def _offsets(text: str):
    """(byte offset, line) of each line of a jsonl file's text (ASCII here)."""
    at = 0
    for ln in text.splitlines(keepends=True):
        yield at, ln
        at += len(ln)


LANGUAGE_DOCS = {
    "en": ["The committee met on Tuesday to discuss the budget for next year. Most members agreed that the library "
           "should stay open longer in the evenings during the winter.",
           "After the storm passed, the fishermen returned to the harbour and began repairing the nets that the "
           "waves had torn apart during the night.",
           "She had never seen the mountains before, so the long train journey through the valleys felt like "
           "a small adventure of its own.",
           "Please remember to water the plants while we are away, and leave the spare key with the neighbours "
           "downstairs if you go out of town."],
    "de": ["Der Ausschuss traf sich am Dienstag, um den Haushalt für das nächste Jahr zu besprechen. Die meisten "
           "Mitglieder waren sich einig, dass die Bibliothek im Winter abends länger geöffnet bleiben sollte.",
           "Nachdem der Sturm vorübergezogen war, kehrten die Fischer in den Hafen zurück und begannen, die Netze "
           "zu flicken, die die Wellen in der Nacht zerrissen hatten.",
           "Sie hatte die Berge noch nie gesehen, deshalb kam ihr die lange Zugfahrt durch die Täler wie ein "
           "kleines Abenteuer vor."],
    "fr": ["Le comité s'est réuni mardi pour discuter du budget de l'année prochaine. La plupart des membres ont "
           "convenu que la bibliothèque devrait rester ouverte plus tard le soir pendant l'hiver.",
           "Après le passage de la tempête, les pêcheurs sont retournés au port et ont commencé à réparer les "
           "filets que les vagues avaient déchirés pendant la nuit.",
           "Elle n'avait jamais vu les montagnes, alors le long voyage en train à travers les vallées lui a "
           "semblé une petite aventure."],
}


EVAL_PASSAGE = ("Question: a farmer has seventeen sheep and all but nine run away through a hole in the fence; "
                "how many sheep does the farmer have left at the end of the day? Answer: nine.")


def test_languages_and_decontamination_filter_and_count_by_language_and_by_evaluation_file(local_ray, tmp_path):
    src, evals = tmp_path / "lang", tmp_path / "evals"
    src.mkdir()
    evals.mkdir()
    docs = [(lang, f"{text} ({lang}{i})") for lang, texts in LANGUAGE_DOCS.items() for i, text in enumerate(texts)]
    # Two English documents quote 13 words of the evaluation passage (one in other case and punctuation),
    # one shares only 12 consecutive words with it.
    quote = " ".join(EVAL_PASSAGE.split()[4:17])
    leaked = [f"Here is a riddle from school: {quote} I never solved it.",
              f"Forum post. {quote.upper().replace(' ', ', ')}!! Any ideas?"]
    near = f"Not quite the riddle: {' '.join(EVAL_PASSAGE.split()[4:16])} and then something else entirely happened."
    docs += [("contaminated", t) for t in leaked] + [("en", near)]
    (src / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for _, t in docs))
    (evals / "riddles.jsonl").write_text(json.dumps({"text": EVAL_PASSAGE}) + "\n")
    pq.write_table(pa.table({"text": ["An unrelated evaluation item about the boiling point of water at sea level "
                                      "measured in degrees on the Celsius scale."]}), evals / "science.parquet")
    out = run(debug("lang", read={"inputs": (str(src),)},
                    clean={"languages": "en,de", "decontaminate": (str(evals),)}), Storage.from_env())
    n = Counter(lang for lang, _ in docs)
    docs_out = out["documents"]
    assert docs_out["kept"] + docs_out["unpacked"] == n["en"] + n["de"]  # unpacked: in the last, partial row
    assert out["stats"]["filtered_by_rule"] == {"language": n["fr"], "contaminated": 2}
    assert out["stats"]["contaminated_by_file"] == {str(evals / "riddles.jsonl"): 2}
    # The language rule comes after the others: it scored every document they kept.
    assert out["stats"]["documents_by_language"] == {"en": n["en"], "de": n["de"], "fr": n["fr"]}
    v = resolve(Storage.from_env(), f"lang@{out['version']}")
    assert v.manifest.stats["documents_by_language"] == out["stats"]["documents_by_language"]
    with pytest.raises(ValueError, match="ISO 639 codes"):
        debug("lang", clean={"languages": "en;de"})


def test_decontamination_index_scales_to_a_million_ngrams(tmp_path):
    import random

    from pipelines.decontam import ContaminationRule, build

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(50_000)]
    text = " ".join(rng.choice(vocab) for _ in range(1_000_012))
    (tmp_path / "big.txt").write_text(text)
    index = build([str(tmp_path / "big.txt")], 13)
    ngrams, owner = index["grams"][13]
    assert len(ngrams) == 1_000_000 and ngrams.nbytes + owner.nbytes == 10_000_000
    rule = ContaminationRule(index)
    ws = text.split()
    assert rule.match("intro " + " ".join(ws[500_000:500_013]) + " outro") == str(tmp_path / "big.txt")
    assert rule.match(" ".join(ws[500_000:500_012])) is None  # 12 words are not an n-gram of 13


def test_the_memory_figure_counts_the_dedup_index_actors(dataset):
    """The index actors hold every key of every version: their peak is in the run's memory figure."""
    stats = dataset["stats"]
    assert stats["peak_index_rss_mb"] > 0
    assert stats["peak_worker_rss_mb"] >= stats["peak_index_rss_mb"]


def test_unit_tallies_add_field_by_field():
    """Work units report a typed Tally each; the driver adds them: counts add key by key, the examples per
    reason stay capped, the peak is the largest, nodes are a union and the audit pairs a fixed sample."""
    from pipelines.stats import AUDIT_PAIRS, SAMPLES_PER_REASON, Tally, accounting

    rng = np.random.default_rng(3)
    units = []
    for u in range(6):
        filtered = {rule: int(rng.integers(0, 5)) for rule in ("too-short", "c4-bad-phrase")}
        kept = int(rng.integers(5, 20))
        dup = int(rng.integers(0, kept))
        units.append(Tally(kept=kept, filtered=filtered, packed=kept - dup, duplicate={"exact": dup},
                           samples={"filtered:too-short": tuple({"doc_id": f"{u}:{i}"} for i in range(2))},
                           peak_rss_mb=float(rng.integers(50, 500)), nodes=frozenset({f"n{u % 2}"}),
                           pairs=tuple({"removed": int(k), "kept": 0, "kind": "near"} for k in rng.integers(0, 1000, 5)),
                           cpu_s={"read": 0.5, "clean": float(u)}))
    total = Tally.total(units)
    assert total.kept == sum(t.kept for t in units)
    assert total.filtered == {r: sum(t.filtered[r] for t in units) for r in ("too-short", "c4-bad-phrase")}
    assert total.cpu_s == {"read": 3.0, "clean": 15.0}
    assert len(total.samples["filtered:too-short"]) == SAMPLES_PER_REASON
    assert total.peak_rss_mb == max(t.peak_rss_mb for t in units) and total.nodes == {"n0", "n1"}
    every = sorted(p["removed"] for t in units for p in t.pairs)
    assert [p["removed"] for p in total.pairs] == every[:AUDIT_PAIRS]
    docs = accounting(total)
    assert docs.read == docs.kept + docs.filtered + docs.duplicate + docs.rejected == total.read()
    with pytest.raises(RuntimeError, match="does not balance"):  # a unit that lost a document is a bug
        accounting(total + Tally(kept=1))


def test_dedup_keeps_the_first_copy_in_input_order(local_ray, tmp_path):
    """Of a cluster of copies (exact, case and spacing, or near), the one kept is the first in the input: the
    first file in the input's order, then the first record in it, as datatrove keeps a cluster's first copy.
    Each of 24 clusters has its copies scattered over the files after the original's."""
    import random

    from pipelines.dedup import hash64

    rng, words = random.Random(7), [f"w{i}" for i in range(800)]
    originals = [" ".join(rng.choice(words) for _ in range(200)) for _ in range(24)]
    lines: list[list[tuple[int, str]]] = [[], [], []]  # per file: (cluster, text)
    for c, text in enumerate(originals):
        near = text.split()
        near[100] = "edited"
        at = rng.randrange(2)
        lines[at].append((c, text))  # the original, in an earlier file than any of its copies ...
        for copy in (text, "  " + text.upper(), " ".join(near)):
            lines[rng.randrange(at + 1, 3)].append((c, copy))
    for f in lines:  # ... shuffled within its file, so it is first only by its file's place
        rng.shuffle(f)
    first: dict[int, str] = {}
    for i, f in enumerate(lines):
        path = tmp_path / "in" / f"part-{i}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with open(path, "w") as out:
            for c, text in f:
                first.setdefault(c, f"{path}:{out.tell()}")  # the record's id: its file and byte offset
                out.write(json.dumps({"text": text}) + "\n")
    storage = Storage.from_env()
    s = run(debug("first-copy", read={"inputs": (str(tmp_path / "in"),)}, dedup={"max_duplicate_fraction": 1}),
            storage)
    v = resolve(storage, f"first-copy@{s['version']}")
    removed = pq.read_table(v.file(v.manifest.dedup["removed"])).to_pylist()
    assert len(removed) == sum(map(len, lines)) - len(originals)  # every copy, and no original
    assert not {r["doc_id"] for r in removed} & set(first.values())
    assert {r["kept"] for r in removed} == {hash64(d) for d in first.values()}
