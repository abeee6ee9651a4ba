"""Tier 2 on a local Ray: TorchTrainer reads the dataset, checkpoints, and a rerun continues."""

import json
import math
import os

import pytest

from strata.dataset import DatasetError
from strata.storage import Storage
from train.__main__ import run
from train.loop import TrainConfig
from train.model import preset


def _cfg(max_steps):
    return TrainConfig(max_steps=max_steps, batch_size=4, warmup_steps=2, log_every=2, eval_every=4,
                       checkpoint_every=4, eval_batches=1)


@pytest.mark.slow
def test_ddp_run_checkpoints_and_a_rerun_continues(local_ray, dataset):
    storage = Storage.from_env()
    ref = dataset["ref"]
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    first = run(model, _cfg(6), dataset=ref, run_name="ddp", storage=storage, workers=2, use_gpu=False)
    assert (first["start_step"], first["steps"]) == (0, 6)
    assert math.isfinite(first["first_loss"]) and math.isfinite(first["last_loss"])
    assert first["val_loss"] is not None
    assert os.path.exists(os.path.join(first["checkpoint"], "state.pt"))
    with open(os.path.join(first["checkpoint"], "meta.json")) as f:
        assert json.load(f)["step"] == 6
    ranks = sorted(os.listdir(os.path.join(first["path"], "workers")))
    assert ranks == ["rank-0.json", "rank-1.json"]

    again = run(model, _cfg(10), dataset=ref, run_name="ddp", storage=storage, workers=2, use_gpu=False)
    assert (again["start_step"], again["steps"]) == (6, 4)
    with open(os.path.join(again["checkpoint"], "meta.json")) as f:
        assert json.load(f)["step"] == 10


def test_a_dataset_that_does_not_fit_the_model_is_refused(local_ray, dataset):
    with pytest.raises(DatasetError, match="seq_len is 128 but the model's is 64"):
        run(preset("debug", seq_len=64), _cfg(2), dataset=dataset["ref"], run_name="refused",
            storage=Storage.from_env())
    assert not os.path.exists(Storage.from_env().run("refused"))
