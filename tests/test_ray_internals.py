"""The private Ray internals strata relies on, each where no public API does the job (the reason is written
beside each use). Any Ray upgrade fails here first, loudly, with the list to check again; a shape that
moved fails with the use it breaks."""

import contextlib
import importlib
import inspect
import os
import subprocess
import sys
import tempfile
import textwrap

import pytest
import ray
from conftest import REPO

from strata.cluster.connect import remove_ray_dir

RAY_SERIES = "2.60."  # pyproject pins ray==2.60.*

USES = {
    "strata.cluster.connect._use_loopback": "ray._private.ray_constants.ENABLE_RAY_CLUSTER, read at import",
    "strata.cluster.connect.stop_monitor": "ray._private.worker._global_node.all_processes[PROCESS_TYPE_MONITOR]",
    "train.placement.max_gpus": "ray._private.state.state.get_max_resources_from_cluster_config()",
    "tune.trust._newest_staging": "ray.train._internal.storage._get_ray_train_session_dir()",
    "train.checkpoint.registered_checkpoints / train.committed.forget_missing": "Ray Train's checkpoint_manager_snapshot.json",
    "strata.accounting.cost.detection_bound_s": "ray._raylet.Config: gRPC keepalive and the GCS's health-check settings",
}


def test_ray_is_the_series_these_internals_were_checked_against():
    listed = "\n".join(f"  {where}: {what}" for where, what in USES.items())
    assert ray.__version__.startswith(RAY_SERIES), (
        f"Ray {ray.__version__} is not {RAY_SERIES}x: check each private use against its source, then move "
        f"RAY_SERIES:\n{listed}")


@pytest.mark.parametrize(("module", "attribute"), [
    ("ray._private.ray_constants", "ENABLE_RAY_CLUSTER"),
    ("ray._private.ray_constants", "PROCESS_TYPE_MONITOR"),
    ("ray._private.worker", "_global_node"),
    ("ray._private.state", "state"),
    ("ray.train._internal.storage", "_get_ray_train_session_dir"),
    ("ray._raylet", "Config"),
])
def test_each_private_name_strata_uses_is_still_there(module, attribute):
    assert hasattr(importlib.import_module(module), attribute), f"{module}.{attribute} is gone"


def test_the_shapes_strata_calls_are_unchanged():
    from ray._private.node import Node
    from ray._private.state import GlobalState
    from ray.train._internal.storage import _get_ray_train_session_dir

    assert "all_processes" in inspect.getsource(Node.__init__)
    assert list(inspect.signature(GlobalState.get_max_resources_from_cluster_config).parameters) == ["self"]
    assert list(inspect.signature(_get_ray_train_session_dir).parameters) == []
    from strata.accounting.cost import detection_bound_s

    assert detection_bound_s() == pytest.approx(435.0)  # Ray's defaults: 300 + 120 s keepalive, 5 x 3 s checks


def test_ray_trains_checkpoint_record_has_the_fields_strata_reads_and_rewrites():
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import (
        _CheckpointManagerState,
        _TrainingResultState,
    )

    from train.checkpoint import SNAPSHOT

    assert SNAPSHOT == CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    assert {"checkpoint_results", "checkpoint_report_indices", "latest_checkpoint_result",
            "validated_checkpoint_dir_names", "timed_out_validation_checkpoint_dir_names",
            "failed_validation_checkpoint_dir_names"} <= set(_CheckpointManagerState.model_fields)
    assert "checkpoint_dir_name" in _TrainingResultState.model_fields


def test_the_state_api_finds_the_embedded_ray_from_inside_it(local_ray):
    """Ray Train's placement-group cleaner asks the state API, from inside the cluster, whether the controller
    lives; an embedded Ray is found only through RAY_API_SERVER_ADDRESS (strata.cluster.connect sets it), else each
    ask waits out its timeout and every run's end waited 12 s."""

    @local_ray.remote(num_cpus=0)
    class Asker:
        def state_of(self, actor_id: str) -> str:
            from ray.util.state import get_actor

            return get_actor(actor_id, timeout=5).state

    asker = Asker.remote()
    assert local_ray.get(asker.state_of.remote(asker._actor_id.hex()), timeout=60) == "ALIVE"


@pytest.mark.ray
def test_without_a_dashboard_the_state_api_refuses_at_once(tmp_path):
    """A training run's embedded Ray starts without its dashboard (strata.cluster.connect, dashboard=False): the
    state API is then named at a port where nothing answers, so the placement-group cleaner's ask is
    refused at once instead of waiting out its 10 s timeout (12 s at every run's end)."""
    script, temp = tmp_path / "ask.py", tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # a short socket path
    script.write_text(textwrap.dedent(f"""
        import time
        import ray
        from ray.util.state.exception import RayStateApiException
        from strata.cluster.connect import connect, shutdown

        connect(dashboard=False, num_cpus=1, temp_dir={temp!r}, quiet=True)

        @ray.remote(num_cpus=0)
        class Asker:
            def ask(self, actor_id):
                from ray.util.state import get_actor
                try:
                    get_actor(actor_id, timeout=10)
                    return "answered"
                except RayStateApiException as e:
                    return "refused" if "Failed to connect" in str(e) else f"other: {{e}}"
                except Exception as e:
                    return f"{{type(e).__name__}}: {{e}}"

        asker = Asker.remote()
        print(ray.get(asker.ask.remote(asker._actor_id.hex())))
        shutdown()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        remove_ray_dir(temp)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "refused", out.stdout[-2000:]


@pytest.mark.ray
def test_a_ray_started_from_a_thread_outlives_the_start():
    """Ray starts GCS and the raylet with PR_SET_PDEATHSIG, which Linux fires when the *thread* that started
    them ends: strata.cluster.connect.connect_early keeps its thread for the life of the process."""
    temp = tempfile.mkdtemp(prefix="strata-ray-early-")
    script = os.path.join(temp, "early.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""
        import threading
        import ray
        from strata.cluster.connect import connect, connect_early, shutdown

        connect_early(dashboard=False, num_cpus=1, temp_dir={temp!r}, quiet=True)
        print(connect(), flush=True)  # waits for the start in the thread
        # The kernel kills GCS and the raylet the moment their starting thread ends: that thread is still
        # there (below), and they answer.
        print(ray.get(ray.remote(lambda: "answered").remote(), timeout=60), flush=True)
        print([t.name for t in threading.enumerate()], flush=True)
        shutdown()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    try:
        out = subprocess.run([sys.executable, script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        remove_ray_dir(temp)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("started embedded local Ray") and lines[1] == "answered", out.stdout[-2000:]
    assert "strata-connect" in lines[2], lines[2]  # the thread that started Ray is still there


@pytest.mark.ray
@pytest.mark.slow("waits out Ray's fixed 30 s for a raylet to register")
def test_an_embedded_start_that_times_out_is_started_again_and_leaves_nothing_behind():
    """Ray gives a new node's raylet 30 s to register and then raises, its processes left running (a test
    run's subprocess failed so on 2 busy cores). Here the first raylet is stopped (SIGSTOP) until that
    time is out: connect kills that start's processes, starts again, and the Ray it returns answers."""
    import signal
    import threading

    from strata.cluster.procs import cmdline, kill_naming, processes

    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # a short socket path
    script = os.path.join(temp, "slow.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""
        import ray
        from strata.cluster.connect import connect, shutdown
        from strata.commands.shell import log

        log("test")  # strata's lines on stderr, as in a command
        print(connect(dashboard=False, num_cpus=1, temp_dir={temp!r}, quiet=True), flush=True)
        print(ray.get(ray.remote(lambda: "answered").remote(), timeout=60), flush=True)
        shutdown()
    """))
    stopped: list[int] = []
    done = threading.Event()

    def stop_first_raylet():
        while not done.is_set() and not stopped:
            for pid, proc in processes().items():
                if temp in proc.cmdline and "raylet" in proc.cmdline.split(" ", 1)[0]:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                    break
            done.wait(0.05)

    watcher = threading.Thread(target=stop_first_raylet, daemon=True)
    watcher.start()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    try:
        out = subprocess.run([sys.executable, script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
    finally:
        done.set()
        watcher.join()
        kill_naming(temp)  # whatever a failed run left
        remove_ray_dir(temp)
    assert stopped, "no raylet was seen to stop"
    assert not cmdline(stopped[0]), "the stopped raylet outlived the start"
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[ray] Ray's start timed out (its raylet did not register in 30 s); starting it again" in out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("started embedded local Ray") and lines[1] == "answered", out.stdout[-2000:]


@pytest.mark.ray
def test_an_embedded_rays_shutdown_leaves_no_process_of_it_behind():
    """Ray's shutdown stops its daemons, and each worker exits once it sees its raylet gone: a worker that
    cannot run then outlives its Ray (a test run found a tier-1 `ray::MapWorker` alive a minute after its Ray
    was shut down). Here an actor's worker is stopped (SIGSTOP) as the Ray shuts down: strata's shutdown
    ends it, and a process the worker forked, after a grace period."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # a short socket path
    script = os.path.join(temp, "stuck.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(f"""
        import os, signal, time
        import ray
        from strata.cluster.connect import connect, shutdown

        connect(dashboard=False, num_cpus=1, temp_dir={temp!r}, quiet=True)

        @ray.remote(num_cpus=0)
        class Stuck:
            def fork(self):
                pid = os.fork()
                if pid == 0:  # the child: the worker's title, and no Ray of its own
                    time.sleep(600)
                    os._exit(0)
                return pid, os.getpid()

        child, worker = ray.get(Stuck.remote().fork.remote())
        print(child, worker, flush=True)
        os.kill(worker, signal.SIGSTOP)
        shutdown()
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    pids, left = [], {}
    try:
        out = subprocess.run([sys.executable, script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
        pids = [int(p) for p in out.stdout.split()[-2:]]
        from strata.cluster.procs import cmdline

        left = {pid: cmdline(pid) for pid in pids if cmdline(pid)}
    finally:
        import signal

        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        remove_ray_dir(temp)
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(pids) == 2 and not left, f"alive after shutdown: {left}"
