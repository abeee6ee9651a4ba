"""One way to get a Ray: join a cluster when `RAY_ADDRESS` is set, else start an
embedded local Ray on loopback whose node satisfies every tier selector."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time

from strata.cluster import tiers
from strata.errors import stop_on_sigterm

# Makes every Ray process bind to and talk on 127.0.0.1. Only for the embedded
# local Ray: in a real cluster it would cut nodes off from each other.
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


RAY_DATA_QUIET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray-data-logging.yaml")


class QuietConsole(logging.Filter):
    """Ray Data's console filter (records marked hidden stay off it), less its notice that progress bars
    are off: strata turns them off and says what runs itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "hide", False) and "Progress bars disabled" not in record.getMessage()


def quiet_ray_libraries() -> None:
    """Ray's libraries keep their INFO lines to their log files (strata's own lines say what runs):
    Ray Data's executor lines and progress bars, Ray Tune's experiment box. Ray Data reads its logging
    config when it is imported, so both the variable it reads then and, if it is already imported, its
    console handler are set; Tune's new output engine prints its box whatever `verbose` says, so the
    legacy engine (silent at verbose 0) is chosen."""
    os.environ.setdefault("RAY_DATA_LOGGING_CONFIG", RAY_DATA_QUIET)
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if "ray.data" in sys.modules:
        for h in logging.getLogger("ray.data").handlers:
            if not isinstance(h, logging.FileHandler) and type(h).__name__ != "SessionFileHandler":
                h.setLevel(logging.WARNING)
                h.addFilter(QuietConsole())
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False


_CORE_LOG = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [IWE] \d+ \d+\] ")
_stderr_filter: list = []  # (thread, saved fd 2) while filter_core_logs is in place


def filter_core_logs() -> None:
    """Keep Ray's C++ log lines (the driver's core worker writes INFO, WARNING and ERROR lines such as
    `E core_worker.cc:2465 ... max_restarts > 0`, which Ray Data's own actors set off, ray#53727) off the
    console; they are in the driver's log file too. Fd 2 goes through a pipe that a thread copies to the
    real stderr, less those lines; every other line passes as it is, and `unfilter` (at exit) drains it.
    Installed after Ray's processes start, so none of them inherits the pipe."""
    if _stderr_filter:
        return
    read, write = os.pipe()
    saved = os.dup(2)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)

    def copy():
        with os.fdopen(read, "rb", buffering=0) as src:
            pending = b""
            while chunk := src.read(65536):
                *lines, pending = (pending + chunk).split(b"\n")
                _write_all(saved, b"".join(line + b"\n" for line in lines if not _CORE_LOG.match(line)))
            if not _CORE_LOG.match(pending):
                _write_all(saved, pending)

    thread = threading.Thread(target=copy, name="strata-stderr", daemon=True)
    thread.start()
    _stderr_filter.append((thread, saved))
    atexit.register(unfilter_core_logs)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def unfilter_core_logs() -> None:
    """Put fd 2 back and wait for the copy of what was written before."""
    if not _stderr_filter:
        return
    thread, saved = _stderr_filter.pop()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os.dup2(saved, 2)  # the pipe's last writer goes: the thread reads to its end
    thread.join(timeout=5)


def _use_loopback() -> None:
    """Keep the embedded Ray on 127.0.0.1, even if `ray` was imported already.

    Ray reads the variable when `ray._private.ray_constants` is imported; the
    environment carries it to the raylet and workers this process starts. No public API sets it once
    `ray` is imported, so the constant is set too (private: pinned by tests/test_ray_internals.py).
    """
    os.environ.update(LOOPBACK_ENV)
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


_STARTED: set[str] = set()  # GCS addresses of the embedded Rays this process started
API_SERVER_ENV = "RAY_API_SERVER_ADDRESS"  # where Ray's state and job clients find the dashboard


# Idle workers a node keeps, per CPU (Ray's default: one). A pass's actors count against the limit, so with
# Ray's default the job's idle task workers were stopped while pass 2's actors ran, and the step after it waited
# about 1 s for a new worker to start and import (measured on 2 cores: tier 1's tails task and pass 3).
WORKERS_PER_CPU = 2


def worker_pool_config(num_cpus: int | None = None) -> dict:
    """The Ray system config strata starts a node with (an embedded Ray, `strata head start`)."""
    return {"num_workers_soft_limit": WORKERS_PER_CPU * (num_cpus or os.cpu_count() or 1)}


def warm_workers(modules: tuple[str, ...], count: int, **options) -> None:
    """Start `count` of this job's workers (Ray `options`: where) importing `modules`, and return at once: on
    a cluster this process joined, a job's workers start with its first tasks, so the first pass waited for
    them; these start while the driver still plans. An embedded Ray's idle workers preload instead."""
    import ray

    task = ray.remote(_import_modules).options(num_cpus=0, **options)
    for _ in range(count):
        task.remote(modules)


def _import_modules(modules: tuple[str, ...]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)


_CALLERS: list[bool] = [False]  # whether the last connect() found a Ray its caller had connected


def callers_ray() -> bool:
    """Whether the Ray this process is connected to was there before the last `connect()`: a command run
    in-process (a notebook or a test calling its `main` after `ray.init`) leaves that Ray up at its end."""
    import ray

    return ray.is_initialized() and _CALLERS[0]


def embedded() -> bool:
    """Whether this process is connected to an embedded local Ray it started (not a cluster it joined)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().gcs_address in _STARTED


def dashboard_port(preferred: int = 8265) -> int:
    """Ray's usual dashboard port if it is free on 127.0.0.1, else any free one (two embedded Rays on
    one machine, e.g. two demos or a test run beside a notebook, must not collide)."""
    for port in (preferred, 0):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port on 127.0.0.1")


_early: tuple[threading.Event, dict] | None = None  # a connect begun by connect_early: done, and its outcome


def connect_early(**kwargs) -> None:
    """Begin `connect(**kwargs)` now, in a background thread, and return: Ray's processes start while this
    process goes on importing and checking what its job needs (on 2 cores a sweep's trials start 1-2 s
    sooner). The next `connect()` waits for it and returns its line or raises its error; `shutdown()` waits
    for it too. For a command that is about to connect anyway, from the main thread.

    The thread lives as long as the process: Ray starts its processes with PR_SET_PDEATHSIG, which Linux
    fires when the *thread* that started them ends (measured: GCS and raylet killed the moment a thread
    that had returned from ray.init ended). Ray sets its SIGTERM handler (exit, so that an embedded Ray is
    stopped) only when started from the main thread: the same handler is set here instead."""
    global _early
    import ray

    if _early is not None or ray.is_initialized():
        return
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))
    stop_on_sigterm()  # a strata command: SIGTERM stops it as Ctrl-C does
    done, box = threading.Event(), {}

    def start():
        try:
            with _quiet_thread_notice():
                box["line"] = connect(**kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller of connect()
            box["error"] = e
        done.set()
        threading.Event().wait()  # never returns: the processes it started die with this thread

    _early = (done, box)
    threading.Thread(target=start, name="strata-connect", daemon=True).start()


def _join_early() -> dict | None:
    """Wait for a connect begun by `connect_early`; its outcome ({"line"} or {"error"}), None if none."""
    global _early
    if _early is None or threading.current_thread().name == "strata-connect":
        return None
    done, box = _early
    done.wait()
    _early = None
    return box


def _join_auth() -> None:
    """A driver joining a cluster by address speaks token auth when it holds a token and nothing says
    otherwise (RAY_AUTH_MODE): RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or the one `strata head
    start` made (~/.strata/ray-token). Without it a head with token auth answers only after Ray's 20 s of
    retries, with an error (measured: `RAY_ADDRESS=... python -m pipelines.preprocess` against `strata head`)."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    if os.environ.get("RAY_AUTH_TOKEN", "").strip() or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        os.environ["RAY_AUTH_MODE"] = "token"
    elif os.path.isfile(path := os.path.expanduser("~/.strata/ray-token")):
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=path)
    else:
        return
    # Ray reads its config from the environment when it is imported: read it again (as Ray's own tests do).
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def connect(*, address: str | None = None, num_cpus: int | None = None,
            temp_dir: str | None = None, log_to_driver: bool = True, dashboard: bool = True,
            preload: tuple[str, ...] = (), quiet: bool = False) -> str:
    """Connect to Ray once per process and return a one-line description.

    `address` (or `RAY_ADDRESS`) joins an existing cluster, which is how a job
    submitted with `ray job submit` finds its cluster. Without one, an embedded
    local Ray starts on loopback with its own temp dir and every tier label.
    `dashboard=False` starts it without its dashboard (1-2 s sooner on 2 cores, and none of its nine
    module processes competing for the cores while the job starts): for a command that ends with its one
    job. Ray's state API then answers nowhere, at once (see `state_api_at`). `preload`
    names modules the embedded Ray's idle workers import while the driver is
    still starting, so that the first tasks and actors do not wait for them. `quiet` keeps Ray's own
    start-up lines (its INFO banner, the token-auth notice of an embedded Ray) off the console: the
    command says what it started.
    """
    import ray

    if quiet:
        quiet_ray_libraries()
    if (early := _join_early()) is not None:
        if "error" in early:
            raise early["error"]
        return early["line"]
    _CALLERS[0] = ray.is_initialized()
    if _CALLERS[0]:
        return "already connected"
    address = address or os.environ.get("RAY_ADDRESS")
    from strata.data import signing

    if address:
        # The cluster's key is a file provisioned on its nodes (never sent in a runtime env, which every token
        # holder reads): a driver that finds none refuses, rather than sign with a key nobody else holds.
        signing.require_key(f"the Ray cluster at {address}")
        _join_auth()
        ray.init(address=address, log_to_driver=log_to_driver,
                 logging_level=logging.WARNING if quiet else logging.INFO)
        stop_on_sigterm()
        if quiet:
            filter_core_logs()
        return f"joined Ray cluster at {address}"
    _use_loopback()
    signing.ensure_local_key()  # this machine's own Ray: its key is this user's (made on first use)
    if temp_dir is None:  # its own: private, and removed when this process is done with Ray
        temp_dir = tempfile.mkdtemp(prefix="strata-ray-")  # 0700
        _OWN_TEMP.append(temp_dir)
        if len(_OWN_TEMP) == 1:
            # Ray registers its own shutdown when it is imported, so at exit this runs first: it shuts Ray down
            # itself, then removes the dir. (Run after Ray's, it found Ray still up and left the dir behind for
            # every command that ended in sys.exit: seen as strata-ray-* dirs outliving test_faults' runs.)
            atexit.register(_shutdown_at_exit)
    # Two strata commands started at the same moment (two cron slots, a notebook beside a CLI) would both
    # see port 8265 free and both bind it. Starts on one machine take turns: once the first has bound its
    # ports, the second's probe sees them taken and picks free ones.
    with _start_lock(), _quiet_token_notice(quiet), _daemons_in_own_groups():
        for attempt in range(3):
            port = dashboard_port()
            try:
                with state_api_at(port):  # without the dashboard, the free port: nothing answers there
                    ray.init(
                        address="local",  # never attach to somebody else's cluster by accident
                        num_cpus=num_cpus,
                        labels=tiers.local_node_labels(),
                        include_dashboard=dashboard,
                        dashboard_host="127.0.0.1",
                        dashboard_port=port,
                        log_to_driver=log_to_driver,
                        logging_level=logging.WARNING if quiet else logging.INFO,
                        _temp_dir=temp_dir,
                        _system_config={**worker_pool_config(num_cpus),
                                        **({"preload_python_modules": list(preload)} if preload else {})},
                    )
                _STARTED.add(ray.get_runtime_context().gcs_address)
                _EMBEDDED_TEMP[:] = [temp_dir]
                if quiet:
                    filter_core_logs()
                if temp_dir in _OWN_TEMP:
                    os.chmod(temp_dir, 0o700)  # Ray makes its temp dir 0777: others keep out of its sockets and logs
                stop_on_sigterm()  # ray.init installed its own SIGTERM handler
                atexit.register(stop_monitor)  # runs before Ray's own exit handler, registered earlier
                break
            except Exception as e:
                ray.shutdown()
                # A port taken between the probe and the bind by something else; or a raylet that did not
                # register within Ray's fixed 30 s (a machine busy with other work: seen on 2 cores under the
                # test suite). Ray leaves a timed-out start's processes running: they go before the next try.
                timed_out = "timed out during startup" in str(e)
                if timed_out:
                    from strata.cluster.procs import kill_naming

                    kill_naming(temp_dir)
                    logging.getLogger("strata.ray").warning("Ray's start timed out (its raylet did not register in "
                                                            "30 s); starting it again")
                if ("port" not in str(e) and not timed_out) or attempt == 2:
                    raise
    return f"started embedded local Ray ({ray.cluster_resources().get('CPU', 0):.0f} CPUs, temp {temp_dir})"


@contextlib.contextmanager
def _daemons_in_own_groups():
    """While an embedded Ray starts, each daemon it starts leads a process group of its own (its workers join
    their raylet's). A SIGTERM to the command's process group (systemd, a container runtime, `kill -- -PGID`)
    then reaches the command alone, which stops as on Ctrl-C and shuts its Ray down itself; before, the
    signal killed Ray's daemons under it, and the command failed where it should have drained and kept its
    work. A daemon still dies with the command (Ray's fate-sharing), and shutdown's reaping follows
    parentage, not groups."""
    from ray._private import services

    plain = services.ConsolePopen

    class OwnGroup(plain):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("process_group", 0)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnGroup
    try:
        yield
    finally:
        services.ConsolePopen = plain


@contextlib.contextmanager
def state_api_at(port: int | None):
    """While Ray's processes start, name loopback `port` (None: none) as where Ray's state API is: the
    dashboard's, or, for a Ray started without one, a free port where nothing answers.

    Ray Train's placement-group cleaner asks the state API, from inside the cluster, whether the controller
    lives, and finds a Ray started from Python (not `ray start`) only through RAY_API_SERVER_ADDRESS:
    without it each ask waits out its 10 s timeout, and every run's end took 12 s more. Pointed at a port
    nothing listens on, each ask fails at once and the cleaner says so in its own log (an embedded Ray's
    placement groups go with its processes anyway). The raylet and every worker inherit the variable from
    the environment they start with; this process's own job and state clients keep finding what they are
    pointed at, so it is set only while the nodes start."""
    before = os.environ.get(API_SERVER_ENV)
    if port is not None:
        os.environ[API_SERVER_ENV] = f"http://127.0.0.1:{port}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(API_SERVER_ENV, None)
        else:
            os.environ[API_SERVER_ENV] = before


@contextlib.contextmanager
def _drop_lines(logger: str, text: str, on: bool = True):
    """While inside, `logger`'s records whose message holds `text` are dropped (when `on`)."""
    log = logging.getLogger(logger)
    drop = logging.Filter()
    drop.filter = lambda record: text not in record.getMessage()
    if on:
        log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


def _quiet_thread_notice():
    """Ray warns that it sets no SIGTERM handler when started from a thread; connect_early sets it."""
    return _drop_lines("ray._private.worker", "SIGTERM handler is not set")


def _quiet_token_notice(quiet: bool):
    """An embedded Ray turns token auth on and says so at WARNING on every start; it listens on loopback
    only, so a quiet command leaves the notice out (Ray's logger, during ray.init)."""
    return _drop_lines("ray._private.authentication.authentication_token_setup",
                       "Token authentication is enabled for this Ray cluster", quiet)


def shutdown() -> None:
    """`ray.shutdown()`, an embedded Ray's monitor stopped first (see `stop_monitor`); a connect begun by
    `connect_early` is waited for first."""
    import ray

    _join_early()
    if ray.is_initialized():
        stop_monitor()
        ours = _embedded_processes()
        ray.shutdown()
        _reap(ours)
    _remove_own_temp()


_EMBEDDED_TEMP: list[str] = []  # the temp dir of the embedded Ray this process started last


def _embedded_processes() -> set[int]:
    """The processes of the embedded Ray this process is connected to, if it started it: the daemons it
    started (its children that name the Ray's temp dir) and every process they started, workers included."""
    if not embedded() or not _EMBEDDED_TEMP:
        return set()
    from strata.cluster.procs import processes, tree

    procs, me = processes(), os.getpid()
    out: set[int] = set()
    for p in procs.values():
        if p.ppid == me and _EMBEDDED_TEMP[0] in p.cmdline:
            out |= tree(p.pid, procs)
    return out


def _reap(pids: set[int], grace_s: float = 5.0) -> None:
    """Wait up to `grace_s` for `pids` to exit, then SIGKILL those left. Ray's shutdown stops its daemons, and
    its workers exit when their raylet goes; a process a worker started does not, and neither does a worker
    that missed it: a test run found a `ray::MapWorker` of tier 1's scorer alive a minute after its embedded
    Ray was shut down (last turn one ran on for 18 minutes)."""
    from strata.cluster.procs import cmdline

    deadline = time.monotonic() + grace_s
    while (left := [pid for pid in pids if cmdline(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


_OWN_TEMP: list[str] = []  # the temp dirs of embedded Rays this process started


def _shutdown_at_exit() -> None:
    with contextlib.suppress(Exception):  # at exit: whatever Ray's state, the process ends
        shutdown()
    _remove_own_temp()


def _remove_own_temp() -> None:
    """Remove the temp dirs of the embedded Rays this process started and has shut down."""
    import ray

    if ray.is_initialized():
        return
    while _OWN_TEMP:
        remove_ray_dir(_OWN_TEMP.pop())


def remove_ray_dir(temp: str, timeout: float = 30.0) -> bool:
    """Remove a stopped Ray's temp dir; True once it is gone. Ray's shutdown returns before every worker it
    stopped has gone, and one still writing its log makes a single rmtree leave the dir behind ("Directory
    not empty"; seen under load, in a simulated cluster's Serve replicas too): try until it is gone."""
    import shutil

    deadline = time.monotonic() + timeout
    while True:
        shutil.rmtree(temp, ignore_errors=True)
        if not os.path.lexists(temp):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def stop_monitor(node=None) -> None:
    """Stop the autoscaler monitor of a Ray head this process started (the embedded one by default)
    before Ray's shutdown does; a local Ray has nothing to scale.

    Ray stops GCS first; the monitor's SIGTERM handler then reports to GCS and hangs until Ray kills it a
    second later (measured: shutdown 1.42 s, 0.19 s with the monitor gone first). No public API
    names the head's processes: this reads Ray's node (private: pinned by tests/test_ray_internals.py).
    """
    from ray._private import ray_constants, worker

    node = node or getattr(worker, "_global_node", None)
    for info in (node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []) if node else []):
        with contextlib.suppress(OSError):
            info.process.kill()


def private_dir() -> str:
    """This user's own folder in the system temp dir (0700), for what strata keeps there. A path of that
    name that is a link, or someone else's, is refused: the temp dir is shared, and a planted link would
    make strata write where another user chose."""
    import stat

    path = os.path.join(tempfile.gettempdir(), f"strata-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(f"{path} is not a private folder of this user (a link, another user's, or open to others): "
                      "remove it and run again")
    return path


@contextlib.contextmanager
def _start_lock():
    """An exclusive lock across this user's processes on this machine (released when the holder exits), in
    a file of this user's private folder, never through a link."""
    import fcntl

    fd = os.open(os.path.join(private_dir(), "ray-start.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


_FETCHED: dict[str, object] = {}  # object-store values this process fetched, by object id (a few at a time)


def fetch_once(ref, convert=None):
    """`ray.get(ref)` (then `convert` of it) once per process: later calls with the same ref reuse it.
    Numpy arrays in it stay read-only views of the node's shared copy unless `convert` copies them."""
    key = ref.hex()
    if key not in _FETCHED:
        import ray

        if len(_FETCHED) >= 4:
            _FETCHED.pop(next(iter(_FETCHED)))
        value = ray.get(ref)
        _FETCHED[key] = convert(value) if convert else value
    return _FETCHED[key]
