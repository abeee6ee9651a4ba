"""The cost ledger (strata/accounting/ledger.py): a model's whole cost from the records of the runs that made it, and a
dataset's, on local disk and on the S3 server."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

from strata.data.storage import Storage, join, list_files, read_bytes, write_bytes_atomic


def _ledger(root: str, *args: str) -> dict:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, "-m", "strata", "ledger", *args, "--storage", root, "--json"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _record(records: list[dict], part: dict) -> dict:
    kind, _, name = part["record"].partition("/")
    return next(r for r in records if (r["kind"], r["name"], r["started_at"]) == (kind, name, part["started_at"]))


@pytest.mark.slow("tier 1, a sweep and training, each a command")
def test_a_models_ledger_is_the_sum_of_the_records_it_names(local_ray, corpus, priced, tmp_path, s3_root,
                                                            monkeypatch, sweep_space):
    """Two dataset versions, a sweep on them, a run trained from its best config in two launches, a
    scoring run of it: the ledger names each record once, at the share the rules give (data: tokens read
    over tokens produced), and its totals are those shares' sums, in money, node-hours and by tier. The
    same records on the S3 server give the same ledger."""
    from infer.driver import ScoreConfig, score
    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from strata.accounting.records import list_records
    from train.__main__ import main as train_main
    from tune.config import SweepConfig
    from tune.driver import run as sweep

    root = str(tmp_path / "root")
    storage = Storage(root)
    monkeypatch.setenv("STRATA_STORAGE", root)  # train's root here; the session's comes back at teardown
    more = tmp_path / "more"
    shutil.copytree(corpus["path"], more)
    cfg = debug("books", read={"inputs": (corpus["path"],)}, pack={"validation_fraction": 0.3})
    preprocess(cfg, storage)
    with open(more / "extra.jsonl", "w") as f:  # a second version: new input
        f.writelines(json.dumps({"text": f"an extra document number {i} " * 20}) + "\n" for i in range(30))
    preprocess(debug("books", read={"inputs": (str(more),)}, pack={"validation_fraction": 0.3}), storage)
    sweep(SweepConfig(num_samples=2, steps=4, report_every=2, max_rows=32, eval_rows=8, scheduler="fifo",
                      space=sweep_space),
          dataset="books", model_preset="debug", sweep_name="books-sweep", storage=storage, progress=False)
    first = train_main(["--from-sweep", "books-sweep", "--run", "m", "--max-steps", "3", "--no-use-gpu"])
    second = train_main(["--from-sweep", "books-sweep", "--run", "m", "--max-steps", "6", "--no-use-gpu"])
    scored = score("m", [corpus["path"]], ScoreConfig(actors=1, docs_per_batch=16), storage, "m-scores")
    assert second["steps"] == 3 and scored["tokens"] > 0
    # An evaluation of an export of the model: its record names the directory, and the run it came from.
    from train.checkpoint import read_meta
    from train.export import export
    from train.sample import latest_checkpoint

    last = latest_checkpoint(storage.run("m"))
    export(last, str(tmp_path / "m-export"))
    ev = subprocess.run([sys.executable, "-m", "infer", "eval", "--model", str(tmp_path / "m-export"), "--task",
                         os.path.join(REPO, "infer", "tasks", "arithmetic.jsonl"), "--name", "m-eval"], cwd=REPO,
                        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, capture_output=True, text=True,
                        timeout=300)
    assert ev.returncode == 0, ev.stderr[-2000:]

    records = list_records(storage)
    book = _ledger(root, "m")
    kinds = [p["part"] for p in book["parts"]]
    assert kinds == ["training", "training", "data", "data", "sweep", "score", "eval"], kinds
    evaluated = _record(records, book["parts"][-1])["config"]
    assert evaluated["model"] == str(tmp_path / "m-export") and evaluated["origin"] == f"m@{read_meta(last)['step']}"
    named = [_record(records, p) for p in book["parts"]]
    assert len({(r["kind"], r["started_at"]) for r in named}) == len(named)  # each record once
    assert [r["figures"]["version"] for r in named[2:4]] == ["v0001", "v0002"]  # v0000: the empty table
    # Data: the run read every token it trained on from a snapshot of both versions' tokens.
    trained = first["tokens"] + second["tokens"]
    produced = sum(r["figures"]["tokens"] for r in named[2:4])
    assert book["tokens"]["trained"] == trained and trained > 0
    share = min(1.0, trained / produced)
    for p, r in zip(book["parts"], named, strict=True):
        assert p["share"] == pytest.approx(share if p["part"] == "data" else 1.0)
        assert r["cost"] > 0 and p["cost"] == pytest.approx(p["share"] * r["cost"])
        assert p["node_hours"] == pytest.approx(p["share"] * r["node_hours"])
    assert book["cost"] == pytest.approx(sum(p["share"] * r["cost"] for p, r in zip(book["parts"], named, strict=True)))
    assert book["node_hours"] == pytest.approx(sum(p["share"] * r["node_hours"] for p, r in zip(book["parts"], named,
                                                                                                 strict=True)))
    assert set(book["by_tier"]) == {"local"}
    assert book["by_tier"]["local"]["cost"] == pytest.approx(book["cost"])
    units = book["unit_costs"]
    assert units["per_trial"] == pytest.approx(named[4]["cost"] / named[4]["figures"]["trials"])
    assert units["per_million_scored_tokens"] == pytest.approx(named[5]["cost"] / scored["tokens"] * 1e6)
    assert units["per_trained_token"] == pytest.approx((named[0]["cost"] + named[1]["cost"]) / trained)
    assert units["per_kept_token"] == pytest.approx(share * (named[2]["cost"] + named[3]["cost"]) / (share * produced))

    # The dataset's own ledger: both versions whole, and the run's share of them.
    data = _ledger(root, "--dataset", "books")
    assert data["cost"] == pytest.approx(named[2]["cost"] + named[3]["cost"])
    assert data["readers"] == [{"run": "m", "cost": pytest.approx(share * data["cost"]), "node_hours": pytest.approx(
        share * data["node_hours"]), "share": pytest.approx(share)}]

    # The same records on the S3 server: the same ledger.
    for rel in list_files(storage.records()):
        write_bytes_atomic(join(s3_root, "records", rel), read_bytes(join(storage.records(), rel)))
    assert _ledger(s3_root, "m") == book

    # `strata report` shows it; a name with no training run is one line.
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    rep = subprocess.run([sys.executable, "-m", "strata", "report", "train/m", "--storage", root], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0 and "ledger of model m" in rep.stdout and "per trial" in rep.stdout, rep.stderr
    missing = subprocess.run([sys.executable, "-m", "strata", "ledger", "nope", "--storage", root], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no training run named 'nope'" in missing.stderr
