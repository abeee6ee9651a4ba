"""Sweeps on a local Ray: trials run, the best config is written."""

import json
import os

import pytest

from strata.storage import Storage
from tune.__main__ import run
from tune.sweep import SPACES, SweepConfig


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
    assert [t["status"] for t in trials] == ["completed"] * 3  # fifo stops nothing
    import csv

    with open(os.path.join(out["path"], "trials.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [float(r["best_val_loss"]) for r in rows] == sorted(t["best"] for t in trials)
    assert {r["trial"] for r in rows} == {t["trial"] for t in trials} and len(rows) == 3
    assert set(rows[0]) == {"trial", "status", "iterations", "best_val_loss", "lr", "batch_size"}


def test_trials_table_ranks_trials_and_counts_statuses():
    from tune.__main__ import trials_table

    trials = [{"trial": "a", "config": {"lr": 0.01}, "iterations": 2, "best": 3.0, "status": "stopped early"},
              {"trial": "b", "config": {"lr": 0.001}, "iterations": 4, "best": 2.5, "status": "completed"},
              {"trial": "c", "config": {"lr": 0.1}, "iterations": 0, "best": None, "status": "error"}]
    lines = trials_table(trials, top=2).splitlines()
    assert "1 completed, 1 stopped early, 1 error" in lines[0]
    assert lines[2].startswith("2.5000") and lines[3].startswith("3.0000") and len(lines) == 4


def test_search_spaces_by_name_or_file_are_checked(tmp_path):
    from train.loop import TrainConfig, with_hyperparameters
    from train.model import preset
    from tune.sweep import SPACES, load_space

    assert load_space("small") == SPACES["small"]
    f = tmp_path / "space.yaml"
    f.write_text("lr: {loguniform: [0.0001, 0.01]}\nn_layer: {choice: [1, 2]}\ndropout: {uniform: [0.0, 0.2]}\n")
    assert set(load_space(str(f))) == {"lr", "n_layer", "dropout"}
    bad = {
        "momentum: {choice: [0.9]}": "cannot tune 'momentum'",
        "lr: {normal: [0, 1]}": "needs one of",
        "lr: {uniform: [1]}": r"takes \[low, high\]",
        "n_layer: {randint: [1, 4]}": "must be a choice list",
        "n_embd: {choice: [64, 96]}\nn_head: {choice: [64]}": "n_embd 96 is not divisible by n_head 64",
    }
    for text, message in bad.items():
        f.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_space(str(f))
    with pytest.raises(ValueError, match="neither a name"):
        load_space("nonsense")
    with pytest.raises(ValueError, match="does not exist"):
        load_space(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="search must be random or optuna"):
        SweepConfig(search="grid")
    model, train = with_hyperparameters({"n_layer": 1, "lr": 0.5}, preset("debug"), TrainConfig())
    assert (model.n_layer, train.lr) == (1, 0.5)


@pytest.mark.slow
def test_an_optuna_sweep_over_the_model_shape_and_training_from_its_best_config(local_ray, dataset):
    pytest.importorskip("optuna")
    from train.__main__ import main as train_main

    storage = Storage.from_env()
    cfg = SweepConfig(num_samples=3, steps=4, report_every=2, max_rows=64, eval_rows=8, space="small",
                      search="optuna", max_concurrent=2)
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="tpe", storage=storage)
    assert out["trials"] == 3 and out["completed"] == 3
    best = out["best"]["config"]
    assert set(best) == set(SPACES["small"])
    summary = train_main(["--from-sweep", "tpe", "--max-steps", "2", "--run", "from-tpe", "--json"])
    with open(os.path.join(summary["path"], "run.json")) as f:
        used = json.load(f)["config"]
    assert summary["dataset"] == dataset["ref"]
    for k in ("n_layer", "n_embd", "n_head", "dropout"):
        assert used["model"][k] == best[k]
    assert used["train"]["lr"] == pytest.approx(best["lr"]) and used["train"]["batch_size"] == best["batch_size"]
