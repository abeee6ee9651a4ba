"""The whole path on an object store: STRATA_STORAGE=s3://… against moto's S3 server on 127.0.0.1.

preprocess (a real CLI process), a rerun with nothing new, an incremental run that
extends the snapshot, train and continue on the snapshot, sample, export, a small
sweep and training from it, `strata runs` and `strata report`. Every path that a
summary, record or report names must be a usable s3:// URI.
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, ensure_local_ray, make_corpus
from conftest import train_run as train

from pipelines.config import debug
from pipelines.driver import run as preprocess
from strata.accounting.records import list_records
from strata.data.dataset import resolve
from strata.data.storage import Storage, exists, is_uri, list_files, read_jsonl
from train.config import TrainConfig
from train.model import preset


def _paths(obj, bucket: str):
    """Every string in a summary or record that names something in the bucket."""
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _paths(v, bucket)
    elif isinstance(obj, list):
        for v in obj:
            yield from _paths(v, bucket)
    elif isinstance(obj, str) and bucket in obj:
        yield obj


def _assert_uris(obj, bucket: str) -> None:
    for p in _paths(obj, bucket):
        assert p.startswith(f"s3://{bucket}/"), f"not a usable URI: {p!r}"
        assert exists(p), f"names nothing: {p!r}"


@pytest.mark.ray
@pytest.mark.slow("tier 1, training, a sweep and inference on S3")
def test_the_whole_path_on_s3(s3_root, tmp_path, monkeypatch, capsys, sweep_space):
    bucket = s3_root.split("/")[2]
    monkeypatch.setenv("STRATA_STORAGE", s3_root)
    monkeypatch.chdir(tmp_path)
    storage = Storage.from_env()
    raw = tmp_path / "raw"
    made = make_corpus(str(raw), docs=40, seed=11)

    # 1. A fresh process, as cron or `ray job submit` would start it: its own embedded Ray, whose workers
    # reach the S3 server through the AWS_* variables alone.
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", str(raw), "--dataset", "web",
           "--incremental", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads(proc.stdout.strip().splitlines()[-1])
    assert first["version"] == "v0001" and first["path"] == f"{s3_root}/datasets/web"
    assert first["documents"]["kept"] + first["documents"]["unpacked"] == len(made["good"])
    _assert_uris(first, bucket)

    ensure_local_ray()
    cfg = debug("web", read={"inputs": (str(raw),), "incremental": True})
    again = preprocess(cfg, storage)
    assert again["version"] is None and again["note"] == "nothing new"
    extra = tmp_path / "raw" / "more"
    os.makedirs(extra)
    for i in range(6):
        (extra / f"new{i}.txt").write_text(" ".join(f"fresh{i} words{j % 17} here" for j in range(60)))
    second = preprocess(cfg, storage)
    assert second["version"] == "v0002" and second["parent"] == "v0001"
    survived = lambda d: d["kept"] + d["unpacked"]  # noqa: E731
    assert survived(second["documents"]) == 6 and survived(second["snapshot"]["documents"]) == len(made["good"]) + 6
    v2 = resolve(storage, "web")
    assert v2.rows("train") == (resolve(storage, "web@v0001").rows("train")
                                + sum(s.rows for s in v2.added if s.split == "train"))
    assert all(exists(p) for p in v2.shard_paths("train") + v2.shard_paths("validation"))
    _assert_uris(second, bucket)
    # Nothing half-written is left: every file under the dataset belongs to a committed version.
    files = list_files(storage.dataset("web"))
    assert not [f for f in files if "_work" in f or ".tmp-" in f], files

    # 2. Train on the whole snapshot, then continue the run.
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    tcfg = TrainConfig(max_steps=4, batch_size=4, warmup_steps=1, log_every=2, eval_every=2, checkpoint_every=2,
                       eval_batches=1)
    run1 = train(model, tcfg, dataset="web", run_name="r", storage=storage, use_gpu=False)
    assert run1["dataset"] == "web@v0002" and run1["checkpoint"] == f"{s3_root}/runs/r/checkpoint-00000004"
    _assert_uris(run1, bucket)
    run2 = train(model, TrainConfig(**{**vars(tcfg), "max_steps": 6}), dataset="web", run_name="r",
                 storage=storage, use_gpu=False)
    assert (run2["start_step"], run2["steps"]) == (4, 2) and run2["checkpoint"].endswith("checkpoint-00000006")
    assert [m["step"] for m in read_jsonl(f"{s3_root}/runs/r/metrics.jsonl") if "loss" in m] == [1, 2, 4, 5, 6]

    # 3. Sample and export read the checkpoint from the object store.
    from train.export import main as export
    from train.sample import main as sample

    out = sample(["--run", "r", "--tokens", "8", "--json"])
    assert out["checkpoint"] == run2["checkpoint"] and len(out["samples"]) == 1
    exported = export(["--run", "r", "--out", str(tmp_path / "hf")])
    assert exported["step"] == 6 and (tmp_path / "hf" / "model.safetensors").exists()

    # 4. A small sweep, and training with its best config.
    from tune.config import SweepConfig
    from tune.driver import run as sweep

    sw = sweep(SweepConfig(num_samples=2, steps=4, report_every=2, max_rows=64, eval_rows=8, scheduler="fifo",
                           space=sweep_space),
               dataset="web", model_preset="debug", sweep_name="s", storage=storage, progress=False)
    assert sw["ended"] == 2 and sw["dataset"] == "web@v0002"
    _assert_uris(sw, bucket)
    kept = list_files(sw["path"])  # the queue's results, a part; no worker checkpointed a model
    assert [f for f in kept if f.startswith("results/part-")] and not [f for f in kept if f.endswith(("state.pt",
                                                                                                      "pack.json"))]
    from train.__main__ import main as train_main

    best = train_main(["--from-sweep", "s", "--run", "best", "--max-steps", "2", "--no-use-gpu"])
    assert best["dataset"] == "web@v0002" and best["steps"] == 2

    # 5. Runs and reports read their records from the object store.
    from strata.commands.report import main as report

    records = list_records(storage)
    assert {(r["kind"], r["name"]) for r in records} >= {("preprocess", "web"), ("train", "r"), ("sweep", "s"),
                                                          ("train", "best")}
    for r in records:
        _assert_uris(r, bucket)
    capsys.readouterr()
    assert report(["runs"]) == 0 and "train" in capsys.readouterr().out
    assert report(["report", "train/r", "--json"]) == 0
    page = json.loads(capsys.readouterr().out)["report"]
    assert is_uri(page) and page.startswith(f"{s3_root}/runs/r/") and exists(page)
