"""What the suite checks of itself (conftest.py installs it):

- **Nothing outlives its test run.** Every process the suite starts carries PYTEST_STRATA_SESSION in its
  environment (children inherit it). A watcher reads the process table twice a second and notes each of
  them, and the temp dir of every Ray it sees start (from its GCS server's `--session-dir`). When the
  session ends, after the shared Ray is stopped, a process of the session still alive, or a Ray temp dir
  still there, fails the run, naming it (and the process is killed).
- **Marks say what a test needs** (docs/tests.md): `ray` (it starts or uses a Ray: an embedded one, a
  simulated cluster, a head, or a command that starts one), `s3` (the S3 API server: set here from the
  fixtures it uses), `serve` (a server), `hosts` (the cluster of hosts in network namespaces), and
  `slow(reason)` (more than the 120 s every test is given: its reason is required, and it gets 600 s). A
  test that is seen to start a Ray or a server without the mark fails, saying which mark to add, so
  `make test-quick` (`-m quick`'s complement) never starts one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

import pytest

from strata.cluster.procs import cmdline

MARKER = "PYTEST_STRATA_SESSION"
SESSION = os.environ[MARKER] = uuid.uuid4().hex  # each pytest process (each xdist worker) its own
SLOW_TIMEOUT_S = 600
# The fixtures that start a Ray or connect to the shared one: a test using one is marked `ray` for it.
RAY_FIXTURES = {"local_ray", "dataset", "second_dataset", "head", "spot_cluster", "train_cluster", "crash_env",
                "tiered_cluster"}
SERVE_FIXTURES = {"server"}  # `python -m infer serve` for a module: it starts a Ray too


def _ours(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARKER}={SESSION}".encode() in f.read().split(b"\0")
    except OSError:
        return False


class Watcher(threading.Thread):
    """The session's processes, seen twice a second: what they are, the Rays and servers among them."""

    def __init__(self):
        super().__init__(name="strata-test-watcher", daemon=True)
        self.seen: dict[int, str] = {}  # pid -> its command line, for every process of the session
        self.during: dict[int, str] = {}  # pid -> the test running when it was first seen
        self.ray_dirs: dict[str, str] = {}  # a Ray's temp dir -> the test running when it was first seen
        self.test: str | None = None  # the test running now
        self.started: dict[str, set[str]] = {}  # test -> what it was seen to start ("ray", "serve")
        self.stop = threading.Event()
        self.me = os.getpid()

    def run(self):
        while not self.stop.wait(0.5):
            self.look()

    def look(self) -> None:
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == self.me or int(d) in self.seen and not self._new(int(d)):
                continue
            pid = int(d)
            if not _ours(pid):
                continue
            cmd = cmdline(pid)
            self.seen[pid] = " ".join(cmd)[:300]
            self.during[pid] = self.test or "between tests"
            kinds = set()
            if any(a.endswith(("gcs_server", "raylet")) for a in cmd[:1]):
                kinds.add("ray")
                for a in cmd:
                    if a.startswith("--session-dir="):
                        self.ray_dirs.setdefault(os.path.dirname(a.split("=", 1)[1]), self.test or "between tests")
            if "-m" in cmd and "infer" in cmd and "serve" in cmd:
                kinds.add("serve")
            if kinds and self.test:
                self.started.setdefault(self.test, set()).update(kinds)

    def _new(self, pid: int) -> bool:
        """A pid seen before but now another process (reused): look again."""
        return " ".join(cmdline(pid))[:300] != self.seen.get(pid)

    def alive(self) -> dict[int, str]:
        """The session's processes alive now (zombies aside), but this one and its ancestors."""
        mine = {self.me, *_ancestors(self.me)}
        out = {}
        for pid, cmd in self.seen.items():
            if pid in mine or not os.path.exists(f"/proc/{pid}") or not _ours(pid):
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:
                continue
            out[pid] = cmd
        return out


def _ancestors(pid: int) -> list[int]:
    out = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            break
        out.append(pid)
    return out


WATCHER = Watcher()


def configure(config) -> None:
    config.addinivalue_line("markers", "ray: starts or uses a Ray (embedded, a simulated cluster, a head, a command)")
    config.addinivalue_line("markers", "s3: uses the S3 API server on loopback (set from the fixtures it uses)")
    config.addinivalue_line("markers", "serve: starts a server (python -m infer serve, Ray Serve)")
    config.addinivalue_line("markers", "hosts: runs on the cluster of hosts in network namespaces (one xdist worker)")
    config.addinivalue_line("markers", "slow(reason): needs more than the 120 s every test gets; it gets 600 s")


def modify_items(items) -> None:
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        names = set(item.fixturenames)
        if {"s3_server", "s3_root"} & names or params.get("any_root") == "s3":  # any_root: local or s3
            item.add_marker(pytest.mark.s3)
        if SERVE_FIXTURES & names:
            item.add_marker(pytest.mark.serve)
        if RAY_FIXTURES & names or item.get_closest_marker("hosts") \
                or item.get_closest_marker("serve"):
            item.add_marker(pytest.mark.ray)
        slow = item.get_closest_marker("slow")
        if slow is not None:
            reason = slow.args[0] if slow.args else slow.kwargs.get("reason")
            if not isinstance(reason, str) or not reason.strip():
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.slow needs its reason: slow(\"why it needs "
                                        "more than 120 s\")")
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def uses(kind: str) -> None:
    """The running test uses `kind` (a fixture of a server that runs in this process says so)."""
    if WATCHER.test:
        WATCHER.started.setdefault(WATCHER.test, set()).add(kind)


def setup_begins(item) -> None:
    """From here on what starts is the test's (its module's fixtures, set up before any autouse one, too)."""
    WATCHER.test = item.nodeid


@pytest.fixture(autouse=True)
def marks_are_true(request):
    """A test seen to start a Ray or a server, or to use the S3 server, must say so with its mark."""
    yield
    WATCHER.look()  # what started in the last half second
    WATCHER.test = None
    started = WATCHER.started.pop(request.node.nodeid, set())
    missing = sorted(k for k in started if request.node.get_closest_marker(k) is None)
    if missing and (report := os.environ.get("STRATA_TEST_MARK_REPORT")):
        with open(report, "a") as f:  # for a person fixing marks: every test's at once
            f.write(f"{request.node.nodeid}\t{','.join(missing)}\n")
    if missing:
        pytest.fail(f"this test started or used {' and '.join(missing)} but is not marked "
                    f"{' and '.join(f'@pytest.mark.{k}' for k in missing)} (docs/tests.md)", pytrace=False)


def end_of_session(wait_s: float = 60.0) -> list[str]:
    """What the session left behind, once the shared Ray is stopped: its processes still alive (killed now,
    after `wait_s` for them to go), and the Ray temp dirs still there. [] when nothing."""
    import signal

    deadline = time.time() + wait_s
    WATCHER.look()
    while (left := WATCHER.alive()) and time.time() < deadline:
        time.sleep(0.5)
    problems = [f"process {pid} (first seen during {WATCHER.during.get(pid)}) outlived the tests: {cmd}"
                for pid, cmd in sorted(left.items())]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    problems += [f"Ray temp dir (first seen during {test}) left behind: {d}"
                 for d, test in sorted(WATCHER.ray_dirs.items()) if os.path.isdir(d)]
    WATCHER.stop.set()
    return problems
