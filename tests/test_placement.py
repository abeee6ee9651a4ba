"""Tier placement on a simulated multi-node cluster (all on 127.0.0.1).

Head (no tier, no CPUs) + a cpu node + a gpu-labelled node + a spot node. Each
stage records the node its work actually ran on (read inside the task, actor
or trial itself); the test compares that with the nodes' labels.
"""

import json
import os

import pytest
from conftest import simulated_cluster

from strata import tiers
from strata.dataset import resolve
from strata.storage import Storage


@pytest.fixture(scope="module")
def tiered_cluster(storage_root):
    tiers_ = (tiers.Tier.CPU, tiers.Tier.GPU, tiers.Tier.SPOT)
    with simulated_cluster([((tiers.Tier.CPU,), 2), ((tiers.Tier.GPU,), 1), ((tiers.Tier.SPOT,), 2)]) as (_, nodes):
        yield {t: n.node_id for t, n in zip(tiers_, nodes, strict=True)}


def _labels_of(node_id):
    import ray

    return next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)


@pytest.mark.slow
def test_each_tier_runs_only_on_its_nodes(tiered_cluster, corpus):
    from pipelines.preprocess import debug
    from pipelines.preprocess import run as preprocess
    from train.__main__ import run as train
    from train.loop import TrainConfig
    from train.model import preset
    from tune.__main__ import run as sweep
    from tune.sweep import SweepConfig

    storage = Storage.from_env()

    pre = preprocess(debug("placed", read={"inputs": (corpus["path"],)}), storage)
    work_nodes = resolve(storage, f"placed@{pre['version']}").manifest.run["work_nodes"]
    assert work_nodes and set(work_nodes) == {tiered_cluster[tiers.Tier.CPU]}
    assert all(tiers.tiers_of(_labels_of(n)) == {tiers.Tier.CPU} for n in work_nodes)

    tr = train(preset("debug", n_layer=1, n_embd=32, n_head=2),
               TrainConfig(max_steps=2, batch_size=4, log_every=1, checkpoint_every=2, eval_batches=1),
               dataset="placed", run_name="placed", storage=storage, workers=1, use_gpu=False)
    with open(os.path.join(tr["path"], "workers", "rank-0.json")) as f:
        assert json.load(f)["node_id"] == tiered_cluster[tiers.Tier.GPU]

    sw = sweep(SweepConfig(num_samples=2, steps=2, report_every=1, max_rows=32, eval_rows=4, scheduler="fifo"),
               dataset="placed", model_preset="debug", sweep_name="placed", storage=storage)
    with open(os.path.join(sw["path"], "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert len(trials) == 2
    assert {t["node_id"] for t in trials} == {tiered_cluster[tiers.Tier.SPOT]}
