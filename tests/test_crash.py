"""Crash safety of tier 1 on a simulated multi-node cluster (head + two cpu nodes on 127.0.0.1).

A worker node killed mid-run: the run completes with the same counts, and the
same shards, as an undisturbed run. The driver killed mid-run: no version is
visible, and rerunning the same command produces a correct version.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, kill_node, make_corpus, simulated_cluster

from pipelines.config import debug
from pipelines.driver import run
from strata.cluster import tiers
from strata.data.dataset import list_versions, resolve
from strata.data.storage import Storage


@pytest.fixture(scope="module")
def crash_env(storage_root, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("crash-corpus"))
    make_corpus(root, docs=1500, seed=3)
    # Its own cluster (the module's): its tests kill worker nodes and drivers.
    with simulated_cluster([((tiers.Tier.CPU,), 2), ((tiers.Tier.CPU,), 2)]) as (cluster, nodes):
        storage = Storage.from_env()
        reference = run(_cfg("undisturbed", root), storage)
        yield {"cluster": cluster, "nodes": nodes, "root": root, "storage": storage, "reference": reference}


def _cfg(name, root):
    return debug(name, read={"inputs": (root,), "split_bytes": 1 << 16})


def _shards(storage, summary):
    v = resolve(storage, f"{summary['dataset']}@{summary['version']}")
    out = {}
    for s in v.shards:
        with open(v.file(s.path), "rb") as f:
            out[os.path.basename(s.path)] = f.read()
    return out


def _wait_for_work(storage, name, timeout=120):
    """Block until the run has written its first work file (so it is mid-run)."""
    staging = os.path.join(storage.dataset(name), "_strata")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.isdir(staging):
            for d in os.listdir(staging):
                docs = os.path.join(staging, d, "_work", "docs")
                if os.path.isdir(docs) and os.listdir(docs):
                    return
        time.sleep(0.05)
    raise TimeoutError(f"run {name} wrote no work file in {timeout} s")


@pytest.mark.slow("kills a node of a simulated cluster mid-pass")
def test_a_killed_worker_node_changes_nothing(crash_env):
    storage, ref = crash_env["storage"], crash_env["reference"]
    result = {}
    worker = threading.Thread(target=lambda: result.update(run(_cfg("node-killed", crash_env["root"]), storage)))
    worker.start()
    _wait_for_work(storage, "node-killed")
    assert worker.is_alive(), "the run ended before the node could be killed"
    kill_node(crash_env["cluster"], crash_env["nodes"][1])  # mid-run
    worker.join(timeout=600)
    assert result, "the run did not finish"
    assert result["documents"] == ref["documents"] and result["stats"]["rows"] == ref["stats"]["rows"]
    assert result["tokens"] == ref["tokens"]
    assert _shards(storage, result) == _shards(storage, ref)  # the very same shards


def test_a_killed_driver_publishes_nothing_and_a_rerun_is_correct(crash_env):
    storage, ref, root = crash_env["storage"], crash_env["reference"], crash_env["root"]
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", root, "--dataset", "driver-killed",
           "--split-bytes", str(1 << 16), "--json"]
    # A short lease: the rerun below waits for the killed driver's lease to expire.
    env = {**os.environ, "RAY_ADDRESS": crash_env["cluster"].address, "STRATA_LEASE_TTL_S": "5"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        _wait_for_work(storage, "driver-killed")
        assert proc.poll() is None, "the driver ended before it could be killed"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert list_versions(storage, "driver-killed") == []  # nothing visible
    staged = os.listdir(os.path.join(storage.dataset("driver-killed"), "_strata"))
    assert staged, "the killed run should have left its (invisible) files behind"
    rerun = run(_cfg("driver-killed", root), storage)
    assert list_versions(storage, "driver-killed") == [rerun["version"]]
    assert rerun["documents"] == ref["documents"] and rerun["tokens"] == ref["tokens"]
    assert _shards(storage, rerun) == _shards(storage, ref)


@pytest.mark.parametrize("point", ["pass1:3", "pass2:2", "before-commit"])
@pytest.mark.slow("kills a run at a failpoint and reruns it")
def test_a_rerun_after_a_kill_redoes_only_the_unfinished_units(crash_env, point):
    """Killed (kill -9, by itself) at `point`, then rerun with the same arguments: it reuses the units the
    killed run finished and commits the very version an undisturbed run of the same input committed into
    another dataset."""
    storage, ref, root = crash_env["storage"], crash_env["reference"], crash_env["root"]
    name = f"killed-{point.replace(':', '-')}"
    env = {**os.environ, "RAY_ADDRESS": crash_env["cluster"].address, "STRATA_LEASE_TTL_S": "3",
           "STRATA_FAILPOINT": point}
    proc = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", root, "--dataset", name,
                           "--split-bytes", str(1 << 16)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert list_versions(storage, name) == []
    rerun = run(_cfg(name, root), storage)
    units = rerun["units"]
    assert units["total"] == ref["units"]["total"] >= 8 and ref["units"]["reused"] == 0
    expected = {"pass1:3": {"pass1": 3, "pass2": 0}, "pass2:2": {"pass1": units["total"], "pass2": 2},
                "before-commit": {"pass1": 0, "pass2": 0}}[point]  # the work files go just before the commit
    assert units["by_pass"] == expected and units["reused"] == expected["pass1"]
    assert rerun["documents"] == ref["documents"] and rerun["tokens"] == ref["tokens"]
    assert rerun["stats"]["rows"] == ref["stats"]["rows"]
    assert _shards(storage, rerun) == _shards(storage, ref)  # the very same rows, in the same shards
    files = resolve(storage, f"{name}@{rerun['version']}").manifest.files  # _strata/<tag>: no other run's files
    tag = files.removeprefix("_strata/")
    assert [f"{d}/{t}" for d in ("_strata", "data") for t in os.listdir(os.path.join(storage.dataset(name), d))
            if t != "openlineage"] == [files, f"data/{tag}"]
    # The killed run's OpenLineage events end at its START (no end: it was killed); the rerun's say COMPLETE.
    events = os.path.join(storage.dataset(name), "_strata", "openlineage")
    ends = sorted(json.loads(Path(events, f).read_text().splitlines()[-1])["eventType"] for f in os.listdir(events))
    assert ends == ["COMPLETE", "START"] and all(f.startswith(f"{tag}-") for f in os.listdir(events))
