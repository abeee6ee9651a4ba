"""Sweeps on a simulated multi-node cluster (a head and two 1-CPU spot nodes on 127.0.0.1):
the driver killed mid-sweep resumes when rerun, and a lost spot node's configs run again elsewhere."""

import glob
import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO, kill_node, simulated_cluster, wait_for

from strata.cluster import tiers
from strata.data.storage import Storage
from tune.config import SweepConfig
from tune.driver import run


@pytest.fixture(scope="module")
def spot_cluster(dataset, storage_root, sweep_space):
    # Its own cluster (the module's): its tests kill a spot node and a sweep's driver.
    with simulated_cluster([((tiers.Tier.SPOT,), 1)] * 2) as (cluster, nodes):
        yield {"cluster": cluster, "nodes": list(nodes), "dataset": dataset["ref"], "storage": Storage.from_env(),
               "space": sweep_space}


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


def _parts(sweep_dir) -> dict[str, list[int]]:
    """The config indices in each results part the sweep's queue has written."""
    out = {}
    for path in glob.glob(os.path.join(sweep_dir, "results", "part-*.jsonl")):
        with open(path) as f:
            out[os.path.basename(path)] = [json.loads(line)["index"] for line in f if line.strip()]
    return out


@pytest.mark.slow("kills a sweep's driver and reruns it")
def test_a_killed_driver_resumes_the_sweep_when_the_command_is_rerun(spot_cluster):
    storage = spot_cluster["storage"]
    sweep_dir = storage.sweep("killed")
    cmd = [sys.executable, "-m", "tune", "--dataset", spot_cluster["dataset"], "--sweep", "killed",
           "--num-samples", "8", "--steps", "40", "--report-every", "10", "--max-rows", "64", "--eval-rows", "8",
           "--space", spot_cluster["space"], "--json"]
    env = {**os.environ, "RAY_ADDRESS": spot_cluster["cluster"].address, "STRATA_SWEEP_FLUSH_S": "0.5"}
    first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: sum(map(len, _parts(sweep_dir).values())) >= 2 or first.poll() is not None,
                 "two configs on record")
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert _progress(sweep_dir)["done"] < 8 and glob.glob(os.path.join(sweep_dir, "experiment_state-*.json"))
    finally:
        first.kill()  # SIGKILL: no cleanup, as when the laptop or head process dies
        first.communicate()
    before = _parts(sweep_dir)
    workers = set(glob.glob(os.path.join(sweep_dir, "work_*")))
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert "resuming sweep killed" in again.stderr and summary["resumed"]
    assert f"{sum(map(len, before.values()))} of 8 configs are on record from before" in again.stderr
    assert set(glob.glob(os.path.join(sweep_dir, "work_*"))) == workers and len(workers) == 2  # one per spot slot
    assert summary["trials"] == 8 and summary["errors"] == 0
    # Every config has one result, and none the first driver had on record ran again.
    after = _parts(sweep_dir)
    new = [i for name, indices in after.items() if name not in before for i in indices]
    assert sorted(new + [i for indices in before.values() for i in indices]) == list(range(8))
    with open(os.path.join(sweep_dir, "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert all(t["status"] in ("completed", "stopped early") and t["best"] is not None for t in trials)


@pytest.mark.slow("a spot node lost mid-sweep")
def test_a_lost_spot_node_costs_the_sweep_only_the_configs_it_was_running(spot_cluster):
    import ray

    from tune.driver import queue_name

    storage = spot_cluster["storage"]
    sweep_dir = storage.sweep("lost-node")
    cfg = SweepConfig(num_samples=8, steps=40, report_every=10, max_rows=64, eval_rows=8, scheduler="fifo",
                      space=spot_cluster["space"])
    result = {}
    thread = threading.Thread(target=lambda: result.update(run(
        cfg, dataset=spot_cluster["dataset"], model_preset="debug", sweep_name="lost-node", storage=storage,
        progress=False)), daemon=True)
    thread.start()

    def progress() -> dict:
        try:
            return ray.get(ray.get_actor(queue_name(sweep_dir)).progress.remote())
        except ValueError:  # not made yet, or gone
            return {}

    wait_for(lambda: (progress().get("done", 0) >= 2 and progress()["running"] == 2) or not thread.is_alive(),
             "two configs done, both workers busy")
    assert thread.is_alive()
    victim = spot_cluster["nodes"][0]
    kill_node(spot_cluster["cluster"], victim)
    thread.join(timeout=600)
    assert not thread.is_alive() and result, "the sweep did not finish"
    assert result["trials"] == 8 and result["errors"] == 0 and result["ended"] == 8
    with open(os.path.join(sweep_dir, "trials.json")) as f:
        trials = json.load(f)["trials"]
    assert sorted(int(t["trial"].rsplit(":", 1)[1]) for t in trials) == list(range(8))
    assert all(t["iterations"] == 4 for t in trials)  # fifo: every config ran to the end
    # The lost worker held one config (a config here is more than TAKE_S of work): at most that one ran again,
    # on the surviving node; no config that had finished did.
    rerun = [t for t in trials if t["restores"]]
    assert len(rerun) <= 1 and result["requeued"] == len(rerun) == result["restores"]
    victim_id = victim.node_id
    assert all(t["node_id"] != victim_id for t in rerun)
