"""Sweeps on a local Ray: trials run, the best config is written."""

import json
import os
import pickle
import re
import time

import pytest
from test_security import Payload

from strata.data.lease import Lease, LeaseBusy
from strata.data.signing import Untrusted
from strata.data.storage import Storage
from train.config import TrainConfig
from train.model import preset
from tune.config import SweepConfig
from tune.driver import run
from tune.sweep import SPACES, STATE_FILE


def test_a_second_sweep_in_the_same_process_is_refused_while_the_first_runs(local_ray, dataset, sweep_space):
    import threading

    from strata.commands.shell import StrataError
    from tune import driver

    storage, out = Storage.from_env(), {}
    cfg = SweepConfig(num_samples=2, steps=2, report_every=2, max_rows=64, eval_rows=8, scheduler="fifo",
                      space=sweep_space)
    first = threading.Thread(target=lambda: out.update(run(cfg, dataset=dataset["ref"], model_preset="debug",
                                                            sweep_name="first", storage=storage)))
    first.start()
    try:
        deadline = time.monotonic() + 60
        while not driver._ONE_SWEEP.locked() and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.is_alive(), "the first sweep ended before the second could start"
        with pytest.raises(StrataError, match="another sweep is running in this process"):
            run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="second", storage=storage)
        assert not os.path.exists(storage.sweep("second"))  # refused before it leased or wrote anything
    finally:
        first.join(300)
    assert out["trials"] == 2 and out["ended"] == 2  # the first went on undisturbed
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="second", storage=storage)
    assert out["ended"] == 2  # and one after it runs


def test_sweep_runs_trials_and_writes_the_best_config(local_ray, dataset, sweep_space):
    cfg = SweepConfig(num_samples=3, steps=4, report_every=2, max_rows=64, eval_rows=8, scheduler="fifo",
                      space=sweep_space)
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="sw", storage=Storage.from_env())
    assert out["trials"] == 3 and out["ended"] == 3 and out["errors"] == 0
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
    # Workers took the configs from the queue: its results are one file here, and no trial checkpointed.
    assert out["workers"] == 2 and out["tune_trials"] == 2  # the session's Ray has 2 CPUs
    assert os.listdir(os.path.join(out["path"], "results")) and len(os.listdir(os.path.join(out["path"], "results"))) <= 2
    kept = [os.path.join(d, f) for d, _, fs in os.walk(out["path"]) for f in fs]
    assert not [f for f in kept if f.endswith(("pack.json", STATE_FILE))]

    # Tune's experiment state, which a resume unpickles, is signed: the finished sweep resumes as is...
    files = set(os.listdir(out["path"]))
    assert {"tuner.pkl", "strata-signatures-tuner.json"} <= files and any(
        f.startswith("experiment_state-") for f in files) and any(f.startswith("strata-signatures-2") for f in files)
    again = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="sw", storage=Storage.from_env())
    assert again["resumed"] and again["best"] == out["best"]
    # ...and a pickle planted where Tune looks for its state is refused before Tune reads it, and never runs.
    marker = os.path.join(out["path"], "ran")
    for planted in ("basic-variant-state-2099-01-01_00-00-00.json", "tuner.pkl"):  # the newest searcher state
        with open(os.path.join(out["path"], planted), "wb") as f:
            pickle.dump(Payload(marker), f)
        with pytest.raises(Untrusted, match=re.escape(planted)):
            run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="sw", storage=Storage.from_env())
        os.remove(os.path.join(out["path"], planted))
    assert not os.path.exists(marker), "the planted pickle ran"

    # A sweep whose driver is alive (it holds the sweep's lease) cannot be resumed beside it.
    driver = Lease(out["path"], "sweep sw", purpose="tune").acquire(wait=False)
    try:
        with pytest.raises(LeaseBusy, match="sweep sw is in use by"):
            run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="sw", storage=Storage.from_env())
    finally:
        driver.release()


def test_a_trials_reports_do_not_throttle_it(local_ray, dataset):
    """A trial reports after every step here; were tune.report paced by a controller poll (as
    ray.train.report is, 2 s), nearly all of the trial's time would go to reporting."""
    cfg = SweepConfig(num_samples=2, steps=12, report_every=1, max_rows=64, eval_rows=8, scheduler="fifo")
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="chatty", storage=Storage.from_env())
    assert out["iterations"] == 2 * 12
    with open(os.path.join(out["path"], "trials.json")) as f:
        trials = json.load(f)["trials"]
    shares = [t["report_share"] for t in trials]
    assert len(shares) == 2 and all(0 < s < 0.5 for s in shares), shares


def test_max_concurrent_caps_the_trials_running_at_once(local_ray, dataset, sweep_space):
    """Random search hands Tune a BasicVariantGenerator, for which Tune ignores max_concurrent_trials:
    the limit must reach the generator. The session's Ray has 2 CPUs, so without it 2 trials run at once."""
    cfg = SweepConfig(num_samples=3, steps=2, report_every=2, max_rows=64, eval_rows=8, scheduler="fifo",
                      max_concurrent=1, space=sweep_space)
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="one-at-a-time",
              storage=Storage.from_env())
    assert out["ended"] == 3
    with open(os.path.join(out["path"], "progress.json")) as f:
        assert json.load(f)["peak_running"] == 1


def test_trials_table_ranks_trials_and_counts_statuses():
    from tune.driver import trials_table

    trials = [{"trial": "a", "config": {"lr": 0.01}, "iterations": 2, "best": 3.0, "status": "stopped early"},
              {"trial": "b", "config": {"lr": 0.001}, "iterations": 4, "best": 2.5, "status": "completed"},
              {"trial": "c", "config": {"lr": 0.1}, "iterations": 0, "best": None, "status": "error"}]
    lines = trials_table(trials, top=2).splitlines()
    assert "1 completed, 1 stopped early, 1 error" in lines[0]
    assert lines[2].startswith("2.5000") and lines[3].startswith("3.0000") and len(lines) == 4
    # The closing line and the JSON summary say the same: 'completed' ran to the end, 'ended' adds the ones
    # ASHA stopped.
    from tune.__main__ import outcome

    assert outcome({"trials": 8, "completed": 5, "stopped_early": 3, "errors": 0, "ended": 8}) == \
        "8 trials: 5 completed, 3 stopped early, 0 failed"


def test_search_spaces_by_name_or_file_are_checked(tmp_path):
    from train.config import with_hyperparameters
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


@pytest.mark.slow("a sweep, then training from its best")
def test_an_optuna_sweep_over_the_model_shape_and_training_from_its_best_config(local_ray, dataset):
    pytest.importorskip("optuna")
    from train.__main__ import main as train_main

    storage = Storage.from_env()
    cfg = SweepConfig(num_samples=3, steps=4, report_every=2, max_rows=64, eval_rows=8, space="small",
                      search="optuna", max_concurrent=2)
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="tpe", storage=storage)
    assert out["trials"] == 3 and out["ended"] == 3
    best = out["best"]["config"]
    assert set(best) == set(SPACES["small"])
    summary = train_main(["--from-sweep", "tpe", "--max-steps", "2", "--run", "from-tpe", "--json"])
    with open(os.path.join(summary["path"], "run.json")) as f:
        used = json.load(f)["config"]
    assert summary["dataset"] == dataset["ref"]
    for k in ("n_layer", "n_embd", "n_head", "dropout"):
        assert used["model"][k] == best[k]
    assert used["train"]["lr"] == pytest.approx(best["lr"]) and used["train"]["batch_size"] == best["batch_size"]


def test_queued_configs_are_sampled_by_index_and_asha_rule_keeps_the_better_half():
    from tune.queued import asha_keeps, rungs, sample

    space = SPACES["small"]
    assert sample(space, 0, 7) == sample(space, 0, 7) and sample(space, 0, 7) != sample(space, 0, 8)
    draws = [sample(space, 1, i) for i in range(300)]
    for key, dist in space.items():
        (name, args), = dist.items()
        values = [d[key] for d in draws]
        if name == "choice":
            assert set(values) == set(args)  # every choice drawn, nothing else
        else:
            assert all(args[0] <= v < args[1] for v in values) and len(set(values)) > 1
    assert rungs(8) == [2, 4] and rungs(2) == [] and rungs(1) == []
    assert asha_keeps([], 9.0)  # nothing to compare with yet
    recorded = [1.0, 2.0, 3.0, 4.0]
    assert asha_keeps(recorded, 2.0) and asha_keeps(recorded, 2.5) and not asha_keeps(recorded, 2.6)
    with pytest.raises(ValueError, match="one config per Tune trial"):
        SweepConfig(search="optuna", pack=8)
    assert SweepConfig().queued and SweepConfig(pack=8).queued  # random search takes configs from the queue
    assert not SweepConfig(pack=1).queued and not SweepConfig(search="optuna").queued  # a Tune trial per config


def test_a_queued_sweep_accounts_for_every_config_applies_asha_across_it_and_plots_it(local_ray, dataset):
    from tune.queued import asha_keeps, sample
    from tune.sweep import load_space

    cfg = SweepConfig(num_samples=7, pack=3, steps=8, report_every=2, max_rows=64, eval_rows=8, space="small", seed=3)
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="packed", storage=Storage.from_env())
    assert out["tune_trials"] == 2 and out["trials"] == 7 and out["errors"] == 0 and out["pack"] == 3
    with open(os.path.join(out["path"], "trials.json")) as f:
        trials = json.load(f)["trials"]
    by_index = {int(t["trial"].rsplit(":", 1)[1]): t for t in trials}
    assert sorted(by_index) == list(range(7))
    space = load_space("small")
    for i, t in by_index.items():
        assert t["config"] == sample(space, 3, i)  # the config is a function of its index
        assert t["iterations"] == {"completed": 4, "stopped early": 2}[t["status"]]  # rungs at 2 (and 4 = max_t)
        assert t["best"] == min(t["curve"]) and len(t["curve"]) == t["iterations"]
    assert out["iterations"] == sum(t["iterations"] for t in trials)
    # ASHA's rung at 2 reports is the sweep's: replayed in the order the queue met the configs there, each
    # config went on exactly when the rule kept it, whichever worker trained it.
    from strata.data.storage import read_jsonl

    logged = [r for d in os.listdir(os.path.join(out["path"], "trials"))
              for r in read_jsonl(os.path.join(out["path"], "trials", d, "metrics.jsonl")) if r["step"] == 4]
    assert sorted(r["asha"]["order"] for r in logged) == list(range(7))
    recorded = []
    for r in sorted(logged, key=lambda r: r["asha"]["order"]):
        assert (by_index[r["index"]]["status"] == "completed") == asha_keeps(recorded, r["val_loss"])
        recorded.append(r["val_loss"])
    assert len(recorded) == 7
    with open(os.path.join(out["path"], "progress.json")) as f:
        assert json.load(f)["done"] == 7
    for path in out["plots"]:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_mixture_trials_batches_follow_its_normalised_weights():
    import numpy as np

    from strata.data.tokenizer import ByteTokenizer
    from train.data import ShardRef, Source, open_batches
    from train.spec import RunSpec
    from tune.sweep import TrialSpec

    shards = {"a.parquet": np.zeros((10, 129), dtype=np.uint16), "b.parquet": np.ones((10, 129), dtype=np.uint16)}
    run_spec = RunSpec(model=preset("debug"), train=TrainConfig(batch_size=4), dataset="a@v0001:0.5,b@v0001:0.5",
                       sources=tuple(Source(f"{n}@v0001", 0.5, (ShardRef(f"{n}.parquet", 10),), ()) for n in "ab"),
                       tokenizer=ByteTokenizer().info(), tokenizer_definition=None, token_bytes=np.ones(257))
    spec = TrialSpec(run=run_spec, sweep=SweepConfig(), val_rows=np.zeros((0, 129)))
    assert [s.weight for s in spec.sources_for({"mix.a": 3.0, "mix.b": 1.0, "lr": 0.1})] == [0.75, 0.25]
    assert [s.weight for s in spec.sources_for({"lr": 0.1})] == [0.5, 0.5]  # none swept: the sweep's own
    data = open_batches(spec.sources_for({"mix.a": 3.0, "mix.b": 1.0}), batch_size=4, rank=0, world_size=1,
                        seed=0, read=lambda path, start=0, stop=None: shards[path][start:stop])
    batches = data.from_step(0)
    share = np.mean([next(batches)[:, 0].mean() for _ in range(500)])  # rows from b are ones
    assert abs(share - 0.25) < 0.01  # the mixture is exact to a row per split, not a draw


def test_a_sweep_over_mixture_weights_by_bits_per_byte_and_training_on_its_best_mixture(local_ray, dataset,
                                                                                      second_dataset, tmp_path):
    from train.__main__ import main as train_main

    space = tmp_path / "mix.yaml"
    space.write_text("lr: {loguniform: [0.001, 0.01]}\nmix.corpus: {uniform: [0.1, 1]}\nmix.code: {uniform: [0.1, 1]}\n")
    cfg = SweepConfig(num_samples=2, steps=4, report_every=2, max_rows=64, eval_rows=8, space=str(space),
                      scheduler="fifo", metric="val_bpb")
    both = f"{dataset['ref']},{second_dataset['ref']}"
    out = run(cfg, dataset=both, model_preset="debug", sweep_name="mixes", storage=Storage.from_env())
    assert out["trials"] == 2 and out["ended"] == 2 and out["best"]["metric_name"] == "val_bpb"
    with open(os.path.join(out["path"], "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert len({t["config"]["mix.code"] for t in trials}) == 2 and all(0 < t["best"] < 9 for t in trials)
    best = out["best"]["config"]
    summary = train_main(["--from-sweep", "mixes", "--max-steps", "2", "--run", "from-mixes", "--json"])
    w = best["mix.corpus"] / (best["mix.corpus"] + best["mix.code"])
    assert summary["dataset"] == f"{dataset['ref']}:{w:.6g},{second_dataset['ref']}:{1 - w:.6g}"
    with pytest.raises(ValueError, match="weighs web, which is not among the sweep's datasets"):
        space.write_text("mix.web: {uniform: [0, 1]}\n")
        run(cfg, dataset=both, model_preset="debug", sweep_name="mixes-bad", storage=Storage.from_env())


def test_a_fine_tuning_sweep_starts_every_trial_from_the_same_weights(local_ray, dataset, tmp_path):
    import ray
    from test_export import _hf_gpt2

    from strata.cluster.connect import fetch_once
    from train.pretrained import read_gpt2

    _hf_gpt2(tmp_path / "hf")
    cfg = SweepConfig(num_samples=4, pack=2, steps=2, report_every=2, max_rows=64, eval_rows=8, scheduler="fifo",
                      init_from=str(tmp_path / "hf"))
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name="tuned", storage=Storage.from_env())
    assert out["trials"] == 4 and out["ended"] == 4 and out["tune_trials"] == 2  # two worker actors
    with open(os.path.join(out["path"], "best.json")) as f:  # what train --from-sweep starts from
        assert json.load(f)["init_from"] == str(tmp_path / "hf")
    # A trial actor fetches the weights once and every later config reuses its copy.
    ref = ray.put(read_gpt2(str(tmp_path / "hf")).weights)
    assert fetch_once(ref) is fetch_once(ref)
    with pytest.raises(ValueError, match="the space cannot tune n_embd"):
        run(SweepConfig(space="small", init_from=str(tmp_path / "hf")), dataset=dataset["ref"], model_preset="debug",
            sweep_name="tuned-shape", storage=Storage.from_env())


def test_a_trial_and_the_run_it_recommends_train_on_the_same_batches(local_ray, dataset, tmp_path):
    """One fixed config swept for K steps, then `train --from-sweep --max-steps K`: the same loss at every
    step, because both resolve the config, build the model and read the data through the same code."""
    from strata.data.storage import read_jsonl
    from train.__main__ import main as train_main
    from tune.__main__ import main as tune_main

    k = 6
    space = tmp_path / "one.yaml"
    space.write_text("lr: {choice: [0.004]}\nbatch_size: {choice: [8]}\nwarmup_steps: {choice: [4]}\n")
    sweep = tune_main(["--dataset", dataset["ref"], "--sweep", "fixed", "--space", str(space), "--num-samples", "1",
                       "--steps", str(k), "--report-every", "3", "--scheduler", "fifo", "--seed", "7", "--json"])
    trials = os.path.join(sweep["path"], "trials")
    (log,) = [os.path.join(trials, d, "metrics.jsonl") for d in os.listdir(trials)]
    rows = read_jsonl(log)
    assert [r["step"] for r in rows] == [3, 6] and all(r["index"] == 0 for r in rows)
    swept = [x for r in rows for x in r["step_losses"]]

    run = train_main(["--from-sweep", "fixed", "--max-steps", str(k), "--log-every", "1", "--workers", "1",
                      "--no-use-gpu", "--run", "from-fixed", "--json"])
    trained = [r for r in read_jsonl(os.path.join(run["path"], "metrics.jsonl")) if "loss" in r]
    assert [r["step"] for r in trained] == list(range(1, k + 1))
    losses = [x for r in trained for x in r["step_losses"]]
    assert losses == pytest.approx(swept, abs=1e-6, rel=0)
    assert max(losses) - min(losses) > 1e-3  # not two runs that learn nothing


def test_an_accuracy_metric_is_maximised_and_goes_with_a_task_file():
    task = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infer", "tasks",
                        "arithmetic.jsonl")
    cfg = SweepConfig(metric="task_acc", eval_task=task)
    assert (cfg.mode, cfg.best([0.25, 0.5, 0.125])) == ("max", 0.5)
    assert SweepConfig().best([2.5, 2.0, 3.0]) == 2.0
    for bad in (dict(metric="task_acc"), dict(metric="val_loss", eval_task=task)):
        with pytest.raises(ValueError, match="go together"):
            SweepConfig(**bad)


@pytest.mark.parametrize("queued", [False, True])
def test_a_sweep_can_rank_configs_by_task_accuracy(local_ray, dataset, queued, sweep_space):
    """--metric task_acc: each report scores the task; the best config is the most accurate one, queued
    (strata's ASHA rule, signed) or a Tune trial per config (Tune's scheduler in max mode)."""
    from strata.data.storage import read_jsonl

    task = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "infer", "tasks",
                        "arithmetic.jsonl")
    cfg = SweepConfig(num_samples=4, steps=4, report_every=1, max_rows=64, eval_rows=8, metric="task_acc",
                      eval_task=task, pack=0 if queued else 1, scheduler="asha" if queued else "fifo",
                      space=sweep_space)
    out = run(cfg, dataset=dataset["ref"], model_preset="debug", sweep_name=f"acc-{int(queued)}",
              storage=Storage.from_env())
    with open(os.path.join(out["path"], "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert out["best"]["metric_name"] == "task_acc" and len(trials) == 4
    assert all(0 <= v <= 1 for t in trials for v in t["curve"])
    assert all(t["best"] == max(t["curve"]) for t in trials)  # a trial's best is its highest accuracy
    assert out["best"]["metric"] == max(t["best"] for t in trials)
    logged = [r for d in os.listdir(os.path.join(out["path"], "trials"))
              for r in read_jsonl(os.path.join(out["path"], "trials", d, "metrics.jsonl"))]
    assert sorted(r["task_acc"] for r in logged) == sorted(v for t in trials for v in t["curve"])
    # A config's own trial checkpoints its model at every report; once it ended, only its results stay.
    kept = [os.path.join(d, f) for d, _, fs in os.walk(out["path"]) for f in fs]
    assert sum(f.endswith("pack.json") for f in kept) >= (0 if queued else 4)
    assert not [f for f in kept if f.endswith(STATE_FILE)]
