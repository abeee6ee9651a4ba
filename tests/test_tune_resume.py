"""Sweeps on a simulated multi-node cluster (a head and two 1-CPU spot nodes on 127.0.0.1):
the driver killed mid-sweep resumes when rerun, and a lost spot node's trials resume elsewhere."""

import glob
import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO, simulated_cluster, wait_for

from strata import tiers
from strata.storage import Storage
from tune.driver import run
from tune.sweep import SweepConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def spot_cluster(dataset, storage_root):
    with simulated_cluster([((tiers.Tier.SPOT,), 1)] * 2) as (cluster, nodes):
        yield {"cluster": cluster, "nodes": list(nodes), "dataset": dataset["ref"], "storage": Storage.from_env()}


def _progress(sweep_dir) -> dict:
    try:
        with open(os.path.join(sweep_dir, "progress.json")) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def test_a_sweep_driver_on_a_spot_node_is_refused_and_on_the_head_is_not(spot_cluster):
    import ray

    from tune.driver import check_driver_node

    @ray.remote(num_cpus=1, label_selector=tiers.selector(tiers.Tier.SPOT))
    def from_a_spot_node():
        try:
            check_driver_node()
        except ValueError as e:
            return str(e)

    assert "driver is on a spot node" in ray.get(from_a_spot_node.remote())
    check_driver_node()  # this process is attached to the head, which serves no tier


def test_a_killed_driver_resumes_the_sweep_when_the_command_is_rerun(spot_cluster):
    storage = spot_cluster["storage"]
    sweep_dir = storage.sweep("killed")
    cmd = [sys.executable, "-m", "tune", "--dataset", spot_cluster["dataset"], "--sweep", "killed",
           "--num-samples", "4", "--steps", "40", "--report-every", "10", "--max-rows", "64", "--eval-rows", "8",
           "--json"]
    env = {**os.environ, "RAY_ADDRESS": spot_cluster["cluster"].address}
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: _progress(sweep_dir).get("done", 0) >= 1 or first.poll() is not None, "a finished trial")
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert _progress(sweep_dir)["done"] < 4 and glob.glob(os.path.join(sweep_dir, "experiment_state-*.json"))
        before = set(glob.glob(os.path.join(sweep_dir, "trial_*")))
    finally:
        first.kill()  # SIGKILL: no cleanup, as when the laptop or head process dies
        first.communicate()
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert "resuming sweep killed" in again.stderr and summary["resumed"]
    after = set(glob.glob(os.path.join(sweep_dir, "trial_*")))
    assert before <= after and len(after) == 4  # the same four trials, none started over as new ones
    assert summary["trials"] == 4 and summary["errors"] == 0
    with open(os.path.join(sweep_dir, "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert all(t["status"] in ("completed", "stopped early") and t["best"] is not None for t in trials)


def test_a_lost_spot_node_costs_its_trials_only_the_work_since_their_checkpoint(spot_cluster):
    storage = spot_cluster["storage"]
    sweep_dir = storage.sweep("lost-node")
    cfg = SweepConfig(num_samples=6, pack=3, steps=40, report_every=10, max_rows=64, eval_rows=8,
                      checkpoint_every_s=0, scheduler="fifo")
    result = {}
    thread = threading.Thread(target=lambda: result.update(run(
        cfg, dataset=spot_cluster["dataset"], model_preset="debug", sweep_name="lost-node", storage=storage,
        progress=False)), daemon=True)
    thread.start()

    def checkpointed() -> int:  # packs with at least one config done and on record (a pack keeps every checkpoint)
        return len({os.path.dirname(os.path.dirname(p))
                    for p in glob.glob(os.path.join(sweep_dir, "trial_*", "checkpoint_*", "pack.json"))})

    wait_for(lambda: checkpointed() >= 2 or not thread.is_alive(), "both packs to checkpoint")
    assert thread.is_alive()
    victim = spot_cluster["nodes"][0]
    spot_cluster["cluster"].remove_node(victim, allow_graceful=False)
    thread.join(timeout=600)
    assert not thread.is_alive() and result, "the sweep did not finish"
    assert result["trials"] == 6 and result["errors"] == 0 and result["completed"] == 6
    with open(os.path.join(sweep_dir, "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert sorted(int(t["trial"].rsplit(":", 1)[1]) for t in trials) == list(range(6))
    assert all(t["iterations"] == 4 for t in trials)  # fifo: every config ran to the end
    # The victim's pack came back from its checkpoint (on the surviving node) instead of from scratch.
    restored = [t for t in trials if t["restores"]]
    assert restored and result["restores"] >= 1
