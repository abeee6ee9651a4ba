"""Sweeps on a local Ray: trials run, the best config is written."""

import json
import os

import pytest

from strata.storage import Storage
from tune.__main__ import run
from tune.sweep import SweepConfig


@pytest.mark.slow
def test_sweep_runs_trials_and_writes_the_best_config(local_ray, dataset):
    cfg = SweepConfig(num_samples=3, steps=4, report_every=2, max_rows=64, eval_rows=8, scheduler="fifo")
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="sw", storage=Storage.from_env())
    assert out["trials"] == 3 and out["completed"] == 3 and out["errors"] == 0
    assert out["iterations"] == 3 * 2  # fifo: every trial reports at steps 2 and 4
    with open(os.path.join(out["path"], "best.json")) as f:
        best = json.load(f)
    assert best["config"] == out["best"]["config"] and set(best["config"]) == {"lr", "batch_size"}
    with open(os.path.join(out["path"], "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert min(t["best"] for t in trials) == pytest.approx(out["best"]["metric"])
