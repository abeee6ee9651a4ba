"""Filtering by a reference model's score in tier 1 (--quality-model): the rule, the threshold, the
accounting, and the scores cached with the dataset and reused by the next version."""

import math
import os
import shutil

import numpy as np
import pyarrow as pa
import pytest
from conftest import make_corpus

from pipelines.quality import QualityConfig, _decide, parse_keep, read_scores, write_scores


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"quality_model": "m"}, "needs one of --keep"),
    ({"quality_model": "m", "keep": "bpb<=1", "keep_fraction": 0.5}, "needs one of --keep"),
    ({"keep": "bpb<=1"}, "need --quality-model"),
    ({"keep_fraction": 0.5}, "need --quality-model"),
    ({"quality_model": "m", "keep": "perplexity<=3"}, "METRIC OP VALUE"),
    ({"quality_model": "m", "keep": "bpb<=x"}, "METRIC OP VALUE"),
    ({"quality_model": "m", "keep": "bpb<=1.2.3"}, "not a number"),
    ({"quality_model": "m", "keep_fraction": 1.5}, "--keep-fraction"),
])
def test_a_bad_quality_rule_is_refused_with_what_to_write(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QualityConfig(**kwargs)


def test_keep_parses_each_operator():
    assert parse_keep("bpb <= 1.5") == ("bpb", "<=", 1.5)
    assert parse_keep("loss>2e-1") == ("loss", ">", 0.2)


def _rows_and_scores(rng, n):
    keys = rng.choice(2**40, n, replace=False).astype(np.int64)
    counts = rng.integers(1, 4, n)
    bpb = rng.random(n) * 3
    bpb[: n // 10] = np.round(bpb[: n // 10], 1)  # ties
    rows = pa.table({"key": keys, "count": counts})
    scores = pa.table({"key": keys, "tokens": np.ones(n, np.int64), "loss": bpb * 2, "bpb": bpb}).sort_by("key")
    return keys, counts, bpb, rows, scores


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.8, 1.0])
def test_keep_fraction_keeps_the_best_scored_share_of_documents_counted_with_their_copies(fraction):
    keys, counts, bpb, rows, scores = _rows_and_scores(np.random.default_rng(int(fraction * 10)), 200)
    d = _decide(QualityConfig(quality_model="m", keep_fraction=fraction), rows, scores)
    per_doc = np.repeat(bpb, counts)  # every document, copies included, by its score
    kept = per_doc[per_doc <= d.figures["threshold"]]
    assert len(kept) >= math.ceil(fraction * len(per_doc))  # at least the share asked for ...
    assert (per_doc < d.figures["threshold"]).sum() < math.ceil(fraction * len(per_doc))  # ... and no more but ties
    assert set(d.drop.tolist()) == set(keys[bpb > d.figures["threshold"]].tolist())
    assert d.figures["filtered"] == int(counts[bpb > d.figures["threshold"]].sum())
    assert d.figures["documents"] == int(counts.sum())


@pytest.mark.parametrize("rule", ["bpb<=1.5", "bpb>1", "loss<2.5", "loss>=4"])
def test_a_threshold_drops_exactly_the_documents_that_fail_it_and_keeps_the_unscored(rule):
    keys, counts, bpb, rows, scores = _rows_and_scores(np.random.default_rng(7), 100)
    unknown = pa.table({"key": np.array([-5], np.int64), "count": np.array([2])})  # not scored: kept
    d = _decide(QualityConfig(quality_model="m", keep=rule), pa.concat_tables([rows, unknown]), scores)
    metric, op, value = parse_keep(rule)
    values = bpb if metric == "bpb" else bpb * 2
    passes = {"<=": values <= value, "<": values < value, ">=": values >= value, ">": values > value}[op]
    assert set(d.drop.tolist()) == set(keys[~passes].tolist())
    assert d.figures["unscored"] == 2 and d.figures["threshold"] == value


def _corpus_texts(root):
    from pipelines.clean import normalize
    from pipelines.config import debug

    clean = debug("x", read={"inputs": (root,)}).clean
    out = {}
    for name in sorted(os.listdir(root)):
        if name.startswith("doc"):
            with open(os.path.join(root, name)) as f:
                out[name] = normalize(f.read(), clean)
    return out


@pytest.mark.slow("trains a scorer, then two tier-1 versions")
def test_preprocess_filters_by_score_and_the_next_version_reuses_the_scores(tmp_path, local_ray, exported_model,
                                                                            any_root, capfd):
    """Version 1 keeps the best half of its documents by bits per byte under the model; the scores it
    cached equal the model's own; version 2, over new documents and a copy of old ones, scores only the
    new and reuses the rest. On local disk and on the S3 server."""
    from infer.model import resolve
    from infer.score import score_ids
    from pipelines.config import debug
    from pipelines.dedup import exact_key
    from pipelines.driver import run
    from strata.data.dataset import latest
    from strata.data.storage import Storage

    storage = Storage(any_root)
    root = str(tmp_path / "in1")
    make_corpus(root, docs=30, seed=11)
    quality = {"quality_model": exported_model, "keep_fraction": 0.5}
    out = run(debug("q", read={"inputs": (root,)}, dedup={"exact_dedup": False, "near_dedup": False},
                    quality=quality), storage)
    q = out["stats"]["quality"]
    assert out["reasons"]["filtered:quality"] == q["filtered"] > 0
    assert q["reused"] == 0
    assert q["filtered"] <= q["documents"] - math.ceil(0.5 * q["documents"])  # at least half kept
    docs = out["documents"]
    assert docs["read"] == docs["kept"] + docs["filtered"] + docs["duplicate"] + docs["rejected"] + docs["unpacked"]

    # The cached scores are the model's: each corpus document scored here, in-process, by its exact key.
    v1 = latest(storage, "q")
    assert v1.manifest.quality["model_id"] == q["model_id"]
    cache = read_scores([v1.file(f) for f in v1.manifest.quality["scores"]]).to_pylist()
    assert len(cache) == q["scored"] == q["documents"] - 1  # each distinct document scored once: doc000 twice
    by_key = {r["key"]: r for r in cache}
    model, tok = resolve(exported_model, storage).build()
    texts = _corpus_texts(root)
    some = sorted(texts)[:4]
    mine = score_ids(model, [tok.encode(texts[n]) for n in some], tok.eot_id, stride=16, batch_tokens=8192)
    for name, s in zip(some, mine, strict=True):
        row = by_key[int(np.uint64(exact_key(texts[name])).view(np.int64))]  # the key as the cache stores it
        assert row["loss"] == pytest.approx(s.loss(), abs=1e-5)
        assert row["bpb"] == pytest.approx(s.nll / math.log(2) / len(texts[name].encode()), abs=1e-5)
    # Exactly the documents above the threshold were dropped: exact-dup.txt is doc000 a second time.
    key = lambda text: int(np.uint64(exact_key(text)).view(np.int64))  # noqa: E731
    copies = {r["key"]: 1 for r in cache} | {key(texts["doc000.txt"]): 2}
    assert q["filtered"] == sum(copies[r["key"]] for r in cache if r["bpb"] > q["threshold"])

    # Version 2: new documents, and copies of three old ones under new names.
    root2 = str(tmp_path / "in2")
    make_corpus(root2, docs=10, seed=12)
    for name in some[:3]:
        shutil.copy(os.path.join(root, name), os.path.join(root2, f"copy-{name}"))
    out2 = run(debug("q", read={"inputs": (root2,)}, dedup={"exact_dedup": False, "near_dedup": False},
                     quality=quality), storage)
    q2 = out2["stats"]["quality"]
    # Reused: the three copies and lines.jsonl's two documents (make_corpus writes them in every corpus);
    # scored: the rest, each distinct document once (exact-dup.txt is this corpus's doc000 again).
    assert q2["reused"] == 5 and q2["scored"] + q2["reused"] == q2["documents"] - 1
    assert q2["model_id"] == q["model_id"]
    v2 = latest(storage, "q")
    assert len(read_scores([v2.file(f) for f in v2.manifest.quality["scores"]])) == len(cache) + q2["scored"]
    # A version made without the model carries the cache on, for a later one with it.
    root3 = str(tmp_path / "in3")
    make_corpus(root3, docs=3, seed=13)
    run(debug("q", read={"inputs": (root3,)}, dedup={"exact_dedup": False, "near_dedup": False}), storage)
    assert latest(storage, "q").manifest.quality == v2.manifest.quality

    # A cache is only a cache (m1, m2): one file's scores planted (every document "perfect"), the other
    # damaged; neither is used, the next run says so, scores those documents again, and decides as before.
    from strata.data.storage import write_bytes_atomic

    planted, damaged = [v2.file(f) for f in v2.manifest.quality["scores"]][:2]
    table = read_scores([planted])
    write_scores(planted, table.set_column(3, "bpb", pa.array([0.0] * table.num_rows)))
    write_bytes_atomic(damaged, b"PAR1 not parquet")
    root4 = str(tmp_path / "in4")
    os.makedirs(root4)
    for name in some[:3]:
        shutil.copy(os.path.join(root, name), os.path.join(root4, f"again-{name}"))
    capfd.readouterr()
    out4 = run(debug("q", read={"inputs": (root4,)}, dedup={"exact_dedup": False, "near_dedup": False},
                     quality=quality), storage)
    said = capfd.readouterr().err
    assert said.count("does not match the digest in its manifest") == 2, said
    q4 = out4["stats"]["quality"]
    assert q4["reused"] == 0 and q4["scored"] == 3

    # The cache follows the dedup window: under --dedup-window 1 a version carries no file but its own,
    # so what version 4 scored is scored again two versions on.
    window = {"exact_dedup": False, "near_dedup": False, "window": 1}
    root5 = str(tmp_path / "in5")
    make_corpus(root5, docs=3, seed=14)
    run(debug("q", read={"inputs": (root5,)}, dedup=window, quality=quality), storage)
    v5 = latest(storage, "q")
    assert len(v5.manifest.quality["scores"]) == 1 and v5.manifest.quality["scores"][0].startswith(v5.manifest.files)
    root6 = str(tmp_path / "in6")
    os.makedirs(root6)
    for name in some[:3]:
        shutil.copy(os.path.join(root, name), os.path.join(root6, f"later-{name}"))
    q6 = run(debug("q", read={"inputs": (root6,)}, dedup=window, quality=quality), storage)["stats"]["quality"]
    assert q6["reused"] == 0 and q6["scored"] == 3


@pytest.mark.slow("scores, is killed, and reruns")
def test_a_run_killed_after_scoring_is_rerun_without_scoring_again(tmp_path, local_ray, exported_model):
    """Killed (kill -9, by itself) in pass 2, after the scores were written: the rerun of the same work
    reuses every score and keeps exactly the documents the undisturbed rule keeps."""
    import signal
    import subprocess
    import sys

    from conftest import REPO

    from pipelines.config import debug
    from pipelines.driver import run
    from strata.data.dataset import list_versions
    from strata.data.storage import Storage

    storage = Storage(str(tmp_path / "storage"))
    root = str(tmp_path / "in")
    make_corpus(root, docs=20, seed=21)
    args = ["--input", root, "--dataset", "killed", "--quality-model", exported_model, "--keep-fraction", "0.6",
            "--no-exact-dedup", "--no-near-dedup"]
    env = {**os.environ, "RAY_ADDRESS": local_ray.get_runtime_context().gcs_address, "STRATA_LEASE_TTL_S": "3",
           "STRATA_FAILPOINT": "pass2:1", "STRATA_STORAGE": storage.root}
    proc = subprocess.run([sys.executable, "-m", "pipelines.preprocess", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert " scored and 0 reused" in proc.stderr  # it scored before it died
    assert list_versions(storage, "killed") == []
    cfg = debug("killed", read={"inputs": (root,)}, dedup={"exact_dedup": False, "near_dedup": False},
                quality={"quality_model": exported_model, "keep_fraction": 0.6})
    rerun = run(cfg, storage)
    q = rerun["stats"]["quality"]
    assert q["scored"] == 0 and q["reused"] == q["documents"] - 1  # all reused (exact-dup.txt is doc000 again)
    fresh = run(debug("fresh", read={"inputs": (root,)}, dedup={"exact_dedup": False, "near_dedup": False},
                      quality={"quality_model": exported_model, "keep_fraction": 0.6}), storage)
    assert rerun["documents"] == fresh["documents"] and rerun["tokens"] == fresh["tokens"]
    assert rerun["stats"]["quality"]["threshold"] == fresh["stats"]["quality"]["threshold"]
