"""Tier placement on a simulated multi-node cluster (all on 127.0.0.1).

Head (no tier, no CPUs) + a cpu node + a gpu-labelled node + a spot node. Each
stage records the node its work actually ran on (read inside the task, actor
or trial itself); the test compares that with the nodes' labels.
"""

import json
import os

import pytest
from conftest import simulated_cluster

from strata.cluster import tiers
from strata.data.dataset import resolve
from strata.data.storage import Storage


@pytest.fixture(scope="module")
def tiered_cluster(storage_root):
    tiers_ = (tiers.Tier.CPU, tiers.Tier.GPU, tiers.Tier.SPOT)
    # Its own cluster (the module's): nodes of each tier, to see where each tier's work ran.
    with simulated_cluster([((tiers.Tier.CPU,), 2), ((tiers.Tier.GPU,), 1), ((tiers.Tier.SPOT,), 2)]) as (c, nodes):
        yield {"cluster": c, **{t: n.node_id for t, n in zip(tiers_, nodes, strict=True)}}


def _labels_of(node_id):
    import ray

    return next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)


@pytest.mark.slow("a simulated cluster of tiers, each tier's work on it")
def test_each_tier_runs_only_on_its_nodes(tiered_cluster, corpus):
    from conftest import train_run as train

    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from train.config import TrainConfig
    from train.model import preset
    from tune.config import SweepConfig
    from tune.driver import run as sweep

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


def _node(gpus=0, model=None, tier=tiers.Tier.GPU, alive=True):
    res = {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {}), **({f"accelerator_type:{model}": 1.0} if model else {})}
    return {"Alive": alive, "Resources": res, "Labels": tiers.node_labels(tier)}


def test_the_placement_plan():
    from train.placement import PlacementError, plan

    cpu_only = [_node(tier=tiers.Tier.CPU), _node()]
    assert plan(cpu_only, embedded=False) is None  # a cluster: wait for GPUs, never fall back
    assert plan(cpu_only, embedded=False, use_gpu=True) is None
    p = plan(cpu_only, embedded=True)
    assert (p.workers, p.use_gpu) == (1, False) and "embedded local Ray has no GPU" in p.why
    p = plan(cpu_only, embedded=False, use_gpu=False, workers=2)
    assert (p.workers, p.use_gpu) == (2, False) and "as asked" in p.why
    with pytest.raises(PlacementError, match="at least one worker"):
        plan(cpu_only, embedded=True, workers=0)
    mixed = [_node(8, "H100"), _node(4, "A100"), _node(8, "H100", alive=False), _node(2, "L4", tiers.Tier.CPU)]
    p = plan(mixed, embedded=False)
    assert (p.workers, p.use_gpu, p.accelerator) == (8, True, "H100")
    assert plan(mixed, embedded=False, workers=4).accelerator == "H100"
    with pytest.raises(PlacementError, match="span GPU models .*8x H100, 4x A100"):
        plan(mixed, embedded=False, workers=12)
    p = plan(mixed, embedded=False, workers=12, allow_mixed=True)
    assert (p.workers, p.accelerator) == (12, None)
    assert plan(mixed, embedded=False, workers=16, allow_mixed=True) is None  # wait for more


def _announce_gpu_node_type(gpus: int) -> None:
    """What an autoscaler reports to GCS at start: its node types (here one with `gpus` GPUs, up to 2 nodes)."""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.experimental.internal_kv import _internal_kv_put

    config = autoscaler_pb2.ClusterConfig(node_group_configs=[autoscaler_pb2.NodeGroupConfig(
        name="gpu-1x", resources={"CPU": 8, **({"GPU": gpus} if gpus else {})}, min_count=0, max_count=2)])
    _internal_kv_put(ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), config.SerializeToString(),
                     namespace=ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode())


@pytest.mark.ray
def test_a_cold_cluster_waits_for_gpus_and_never_trains_on_cpu_silently(tiered_cluster, capfd):
    """The simulated cluster's gpu-tier node has no GPU. Without an autoscaler that could start one, training
    fails at once naming --no-use-gpu; with one, it waits, says what ends the wait, then fails, saying so.
    Nodes that declare GPUs (a resource; no CUDA is touched) are placed by model."""
    from train.placement import PlacementError, max_gpus, place

    assert max_gpus() is None  # `ray.cluster_utils.Cluster` runs no autoscaler
    with pytest.raises(PlacementError, match="can never have them: none up, and no autoscaler config.*--no-use-gpu"):
        place(embedded=False, workers=None, use_gpu=None, allow_mixed=False, wait_s=900, poll_s=0.2)
    assert "waiting" not in capfd.readouterr().err
    _announce_gpu_node_type(0)
    with pytest.raises(PlacementError, match="no node type with GPUs"):
        place(embedded=False, workers=None, use_gpu=None, allow_mixed=False, wait_s=900, poll_s=0.2)
    _announce_gpu_node_type(1)
    assert max_gpus() == 2
    with pytest.raises(PlacementError, match="no 1 GPU.*after 1 s .*Train on CPU with --no-use-gpu"):
        place(embedded=False, workers=None, use_gpu=None, allow_mixed=False, wait_s=1, poll_s=0.2)
    err = capfd.readouterr().err
    assert err.count("waiting") == 1, err  # one line, then one a minute
    assert ("waiting for 1 GPU(s) on the gpu tier (none up): the autoscaler can start up to 2; the wait ends when "
            "they join, or fails after --gpu-wait-s 1 s (--no-use-gpu trains on CPU instead)") in err
    cluster = tiered_cluster["cluster"]
    for gpus, model in ((2, "H100"), (1, "A100")):
        cluster.add_node(num_cpus=1, num_gpus=gpus, resources={f"accelerator_type:{model}": 1},
                         labels=tiers.node_labels(tiers.Tier.GPU), object_store_memory=100 << 20)
    cluster.wait_for_nodes()
    p = place(embedded=False, workers=None, use_gpu=None, allow_mixed=False, wait_s=30, poll_s=0.2)
    assert (p.workers, p.use_gpu, p.accelerator) == (2, True, "H100")
    with pytest.raises(PlacementError, match="span GPU models"):
        place(embedded=False, workers=3, use_gpu=True, allow_mixed=False, wait_s=30, poll_s=0.2)
