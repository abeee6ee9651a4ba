"""Evaluations during training (--eval-task): on saved checkpoints, off the training workers, at the step
they belong to; one that dies is recorded failed and training goes on."""

import os
import pathlib

import pytest
from conftest import REPO
from conftest import train_run as run

from strata.accounting.runlog import read_log
from strata.data.storage import Storage
from train.config import TrainConfig
from train.model import preset
from train.tasks import EVENT, TaskError, evaluate, load_task

TASK = os.path.join(REPO, "infer", "tasks", "arithmetic.jsonl")


def test_task_evaluations_land_at_their_steps_and_a_dead_one_never_stops_training(local_ray, dataset, monkeypatch):
    from train.sample import load

    storage = Storage.from_env()
    # The evaluation of step 4 dies as the out-of-memory killer would kill it (SIGKILL in its worker).
    monkeypatch.setenv("STRATA_FAILPOINT", "task-eval:4")
    cfg = TrainConfig(max_steps=8, batch_size=4, warmup_steps=2, log_every=2, eval_every=2, eval_batches=1,
                      checkpoint_every_s=0, keep_checkpoints=8, eval_task=TASK)
    out = run(preset("debug", n_layer=1, n_embd=32, n_head=2), cfg, dataset=dataset["ref"], run_name="task-evals",
              storage=storage, workers=1, use_gpu=False, cpus_per_worker=1)
    assert (out["start_step"], out["steps"]) == (0, 8)  # training went to the end
    by_step = {r["step"]: r for r in out["task_evals"]}
    assert sorted(by_step) == [2, 4, 6, 8]
    assert by_step[4]["status"] == "failed" and by_step[4]["error"].startswith("WorkerCrashedError")
    rows = {r["step"]: r for r in read_log(out["path"]).events(EVENT)}
    assert sorted(rows) == [2, 4, 6, 8] and rows[4]["status"] == "failed"
    items = load_task(TASK)
    for step in (2, 6, 8):  # each result is its own checkpoint's, evaluated here again
        assert rows[step]["status"] == "ok" and rows[step]["items"] == len(items)
        model, tok, at = load(os.path.join(out["path"], f"checkpoint-{step:08d}"))
        again = evaluate(model, tok, items)
        assert at == step and rows[step]["acc"] == pytest.approx(again["acc"])
        assert rows[step]["acc_norm"] == pytest.approx(again["acc_norm"])
    events = [p for p in pathlib.Path(out["path"], "tensorboard").rglob("*task-evals*")]
    assert events and any(b"task/acc" in p.read_bytes() for p in events)
    from strata.commands.report import report

    _, page = report("train/task-evals", storage)
    assert "Task accuracy (evaluations during training)" in pathlib.Path(page).read_text()


def test_a_bad_task_file_is_refused_before_the_run_starts(tmp_path, local_ray, dataset):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "1+1=", "choices": ["2"], "gold": 0}\n')  # one choice: not a task
    storage = Storage.from_env()
    with pytest.raises(TaskError, match="at least two"):
        run(preset("debug", n_layer=1, n_embd=32, n_head=2),
            TrainConfig(max_steps=2, batch_size=4, eval_task=str(bad)), dataset=dataset["ref"],
            run_name="bad-task", storage=storage, workers=1, use_gpu=False)
    assert not os.path.exists(storage.run("bad-task"))
