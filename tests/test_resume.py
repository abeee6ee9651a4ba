"""Tier 2 on a simulated multi-node cluster (head + gpu-tier nodes on 127.0.0.1, CPU training):
a node lost mid-run, and a node drained for preemption, both resume exactly.

"Exactly" is checked the strict way: after the resume, every step's loss equals
the loss of an uninterrupted run with the same seed, which holds only if the
same model, optimizer state and batches come back (no sequence repeated or
skipped).
"""

import json
import os
import threading
import time

import pytest
from conftest import kill_node, simulated_cluster, wait_for
from conftest import train_run as run

from strata.accounting.runlog import read_metrics
from strata.cluster import tiers
from strata.data.storage import Storage
from train.checkpoint import read_meta
from train.committed import committed_checkpoints
from train.config import TrainConfig
from train.model import preset

MODEL = preset("debug", n_layer=2, n_embd=64, n_head=4)
STEPS = 60


def _cfg(**kw):
    return TrainConfig(**{**dict(max_steps=STEPS, batch_size=8, warmup_steps=5, log_every=5, eval_every=STEPS,
                                 eval_batches=1, checkpoint_every=10, checkpoint_every_s=0), **kw})


def _run(env, name, cfg):
    return run(MODEL, cfg, dataset=env["dataset"], run_name=name, storage=env["storage"], workers=2,
               use_gpu=False, max_failures=3)


@pytest.fixture(scope="module")
def train_cluster(dataset, storage_root):
    os.environ["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = "0.5"  # Ray Train's drain watcher, every node
    try:
        # Its own cluster (the module's): its tests kill and drain nodes mid-run.
        with simulated_cluster([((tiers.Tier.GPU,), 1)] * 3) as (cluster, nodes):
            env = {"cluster": cluster, "nodes": list(nodes), "storage": Storage.from_env(), "dataset": dataset["ref"]}
            straight = _run(env, "straight", _cfg())
            env["reference"] = _step_losses(straight["path"])
            yield env
    finally:
        os.environ.pop("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", None)


def _start(env, name, cfg):
    result = {}
    thread = threading.Thread(target=lambda: result.update(_run(env, name, cfg)), daemon=True)
    thread.start()
    return thread, result


def _node_of_rank(env, run_dir, rank):
    with open(os.path.join(run_dir, "workers", f"rank-{rank}.json")) as f:
        node_id = json.load(f)["node_id"]
    return next(n for n in env["nodes"] if n.node_id == node_id)


def _steps_done(run_dir):
    return max((m["step"] for m in read_metrics(run_dir)), default=0) if os.path.exists(run_dir) else 0


def _starts(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if m.get("event") == "start"]


def _step_losses(run_dir):
    """Every step's loss (mean over ranks); a replayed step's later value wins."""
    losses = {}
    for m in read_metrics(run_dir):
        losses.update({m["step"] - len(m["step_losses"]) + 1 + i: v for i, v in enumerate(m["step_losses"])})
    return losses


def _assert_matches_reference(env, run_dir, resumed_at):
    losses = _step_losses(run_dir)
    assert sorted(env["reference"]) == list(range(1, STEPS + 1))
    after = [s for s in sorted(losses) if s > resumed_at]
    assert after == list(range(resumed_at + 1, STEPS + 1))
    for s in after:
        assert losses[s] == pytest.approx(env["reference"][s], rel=1e-5, abs=1e-6), f"step {s}"


@pytest.mark.slow("kills a node mid-run and resumes")
def test_a_lost_node_resumes_from_the_latest_checkpoint_exactly(train_cluster):
    env = train_cluster
    run_dir = env["storage"].run("node-lost")
    thread, result = _start(env, "node-lost", _cfg())
    wait_for(lambda: committed_checkpoints(run_dir) and _steps_done(run_dir) >= 15, "a checkpoint and step 15")
    victim = _node_of_rank(env, run_dir, 1)
    killed_at = _steps_done(run_dir)
    kill_node(env["cluster"], victim)
    env["nodes"].remove(victim)
    thread.join(timeout=600)
    assert result.get("steps") is not None, "the run did not finish"
    starts = _starts(run_dir)
    assert len(starts) == 2, "expected one restart"
    resumed_at = starts[1]["start_step"]
    assert resumed_at % 10 == 0 and 10 <= resumed_at <= killed_at + 10
    assert starts[1]["resumed_from"].endswith(f"checkpoint-{resumed_at:08d}")
    _assert_matches_reference(env, run_dir, resumed_at)


@pytest.mark.slow("drains a node of a simulated cluster mid-run")
def test_a_drained_node_checkpoints_before_it_goes_and_the_run_resumes_from_it(train_cluster):
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    env = train_cluster
    env["nodes"].append(env["cluster"].add_node(num_cpus=1, labels=tiers.node_labels(tiers.Tier.GPU),
                                                object_store_memory=100 << 20))  # the spare
    env["cluster"].wait_for_nodes()
    run_dir = env["storage"].run("drained")
    # No periodic checkpoints at all; the run is short, so it asks about drains at every log point.
    thread, result = _start(env, "drained", _cfg(checkpoint_every=0, drain_check_every_s=0))
    wait_for(lambda: _steps_done(run_dir) >= 10, "step 10")
    victim = _node_of_rank(env, run_dir, 1)
    accepted, why = GcsClient(address=env["cluster"].gcs_address).drain_node(
        victim.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), "spot reclaim (test)",
        int(time.time() * 1000) + 60_000)
    assert accepted, why
    wait_for(lambda: committed_checkpoints(run_dir), "the preemption checkpoint")
    meta = read_meta(committed_checkpoints(run_dir)[0])
    assert meta["reason"] == "preemption" and meta["step"] < STEPS
    kill_node(env["cluster"], victim)  # the reclaim
    env["nodes"].remove(victim)
    thread.join(timeout=600)
    assert result.get("steps") is not None, "the run did not finish"
    starts = _starts(run_dir)
    assert [s["start_step"] for s in starts] == [0, meta["step"]]
    _assert_matches_reference(env, run_dir, meta["step"])
