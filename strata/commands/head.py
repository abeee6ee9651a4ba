"""A Ray head on this machine for `strata submit`, started and stopped by strata's own record of it:

    python -m strata head start [--port 6379] [--dashboard-port 8265] [--agent-port 52365]
                                [--client-port 10001] [--metrics-port N] [--num-cpus N]
    python -m strata head status
    python -m strata head stop

`start` first checks that every port the head will use is free (GCS, dashboard, job agent, Ray Client,
metrics), naming whoever holds one. It then runs `ray start --head --block` in a session of its own:
loopback only (every Ray process binds and talks on 127.0.0.1), token auth on (the token is
`RAY_AUTH_TOKEN`, or the private file `RAY_AUTH_TOKEN_PATH` names, or `~/.strata/ray-token`, made 0600 if
there is none; a token file others can read is refused), this machine's signing key as a file its jobs read
(strata.data.signing), every tier's label, a private temp dir. It records the process (`~/.strata/head.json`)
and says "head up" only once the dashboard answers and every one of its ports is held by the head's own
processes.

`stop` stops that process, and only it: SIGTERM to the recorded `ray start --block` if it is still that
process and leads its own group (which it stops with it), then, after a grace period, SIGKILL to what is
left of that group. It never stops another Ray on the machine, as Ray's own stop command does (it stops
every Ray process of the machine, other users' embedded ones included).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request

from strata.cluster import tiers
from strata.cluster.connect import worker_pool_config
from strata.cluster.procs import cmdline
from strata.commands.shell import Command, Parser, StrataError, log

_log = log("head")
RECORD = "~/.strata/head.json"
TOKEN_FILE = "~/.strata/ray-token"
AGENT_PORT = 52365  # Ray's default job agent port
RAY_CLIENT_PORT = 10001  # Ray's default Ray Client port
START_WAIT_S = 120
STOP_WAIT_S = 60


def _record_path() -> str:
    return os.path.expanduser(RECORD)


def read_record() -> dict | None:
    try:
        with open(_record_path()) as f:
            rec = json.load(f)
    except (FileNotFoundError, ValueError):
        return None
    return rec if isinstance(rec, dict) and isinstance(rec.get("pid"), int) else None


def ours(rec: dict) -> bool:
    """Whether the recorded process is alive and still the `ray start --block` strata started (a pid can be
    reused by anything once its process is gone)."""
    cmd = cmdline(rec["pid"])
    return "start" in cmd and "--block" in cmd and f"--temp-dir={rec.get('temp')}" in cmd


def _leader(pid: int) -> bool:
    """Whether live process `pid` leads its own process group (as the head start made does)."""
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _own_temp(path: str) -> bool:
    """Whether `path` is a temp dir `start` made: strata-head-* directly in the system temp dir, this user's."""
    import stat

    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (os.path.dirname(os.path.abspath(path)) == os.path.abspath(tempfile.gettempdir())
            and os.path.basename(path).startswith("strata-head-") and stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.getuid())


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (the head's own session)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getpgid(int(d)) == pgid:
                    out.append(int(d))
            except OSError:
                continue
    return out


def _token_env() -> dict:
    """The head's token: one given (`RAY_AUTH_TOKEN`, or the file `RAY_AUTH_TOKEN_PATH` names, which must be
    private), else `~/.strata/ray-token`, made 0600 if there is none. Never a token file others can read, and
    never Ray's own `~/.ray/auth_token`, which an embedded Ray makes world-readable."""
    import stat

    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return {}
    given = os.environ.get("RAY_AUTH_TOKEN_PATH")
    path = os.path.expanduser(given or TOKEN_FILE)
    if os.path.isfile(path):
        mode = stat.S_IMODE(os.stat(path).st_mode)
        if mode & 0o077:
            raise StrataError(f"the token file {path} can be read by others (mode {mode:04o}): a head takes no token "
                              f"others can read. `chmod 600 {path}` if it is yours alone, or remove it (a new one is "
                              f"made at {TOKEN_FILE})")
        return {"RAY_AUTH_TOKEN_PATH": path}
    if given:
        raise StrataError(f"RAY_AUTH_TOKEN_PATH={given}: no such file")
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    _log.info(f"made a token only you hold: {path} (0600)")
    return {"RAY_AUTH_TOKEN_PATH": path}


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/api/version", timeout=2)  # noqa: S310 - loopback, ours
        return True
    except urllib.error.HTTPError:
        return True  # it answered (a refusal without the token is an answer)
    except OSError:
        return False


def _started(logfile: str) -> bool:
    """`ray start` says so once its node is up (the dashboard may answer before the node is registered)."""
    with open(logfile, errors="replace") as f:
        return "Ray runtime started" in f.read()


def _listeners(port: int) -> set[int]:
    """The pids of the processes listening on TCP `port` (any address): one with a pid psutil cannot see is
    reported as 0."""
    import psutil

    return {c.pid or 0 for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port}


def _free(port: int) -> bool:
    """Whether nothing listens on `port` and this process can bind it (on loopback and on every interface)."""
    import socket

    if _listeners(port):
        return False
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def _who(port: int) -> str:
    import psutil

    names = []
    for pid in sorted(_listeners(port)):
        try:
            names.append(f"pid {pid} ({' '.join(psutil.Process(pid).cmdline()[:3])[:80]})")
        except (psutil.Error, ValueError):
            names.append(f"pid {pid}")
    return ", ".join(names) or "another process"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(*, port: int, dashboard_port: int, agent_port: int | None, client_port: int = RAY_CLIENT_PORT,
          metrics_port: int | None = None, num_cpus: int | None = None) -> dict:
    if (rec := read_record()) and ours(rec):
        raise StrataError(f"a head started by strata is running (pid {rec['pid']}, GCS {rec['gcs']}, dashboard "
                          f"{rec['dashboard']}): stop it first with `strata head stop`")
    ports = {"--port (GCS)": port, "--dashboard-port": dashboard_port, "--agent-port (job agent)": agent_port or
             AGENT_PORT, "--client-port (Ray Client)": client_port, "--metrics-port": metrics_port or free_port()}
    for flag, p in ports.items():
        if not _free(p):
            raise StrataError(f"port {p} ({flag.split()[0]}) is taken by {_who(p)}: a head there would not be the "
                              f"one answering. Stop that, or start on another port ({flag.split()[0]} N)")
    from strata.data import signing

    signing.ensure_local_key()  # the key this machine's head signs and checks with, as a file the jobs find
    temp = tempfile.mkdtemp(prefix="strata-head-")
    env = {**os.environ, **_token_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           signing.KEY_FILE_ENV: signing.source()[1] or os.environ.get(signing.KEY_FILE_ENV, "")}
    if not env[signing.KEY_FILE_ENV]:
        env.pop(signing.KEY_FILE_ENV)
    env.pop(signing.KEY_ENV, None)  # the head's jobs read the key from its file, never from a variable
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray if os.path.exists(ray) else "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--port={port}", f"--dashboard-port={dashboard_port}",
           f"--labels={tiers.format_labels(tiers.local_node_labels())}", f"--temp-dir={temp}",
           f"--dashboard-agent-listen-port={ports['--agent-port (job agent)']}",
           f"--ray-client-server-port={client_port}", f"--metrics-export-port={ports['--metrics-port']}",
           f"--system-config={json.dumps(worker_pool_config(num_cpus))}",
           *([f"--num-cpus={num_cpus}"] if num_cpus is not None else [])]
    logfile = os.path.join(temp, "strata-head.log")
    import subprocess

    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    rec = {"pid": proc.pid, "pgid": proc.pid, "gcs": f"127.0.0.1:{port}",
           "dashboard": f"http://127.0.0.1:{dashboard_port}", "temp": temp, "log": logfile, "started_at": time.time(),
           "ports": {"gcs": port, "dashboard": dashboard_port, "agent": ports["--agent-port (job agent)"],
                     "client": client_port}}
    os.makedirs(os.path.dirname(_record_path()), mode=0o700, exist_ok=True)
    with open(_record_path(), "w") as f:
        json.dump(rec, f)
    try:
        _wait_up(proc, rec, logfile)
    except BaseException:
        stop(quiet=True)  # a head that did not come up as its own, or an interrupted wait, leaves nothing running
        raise
    os.chmod(temp, 0o700)  # Ray makes its temp dir 0777
    return rec


def _wait_up(proc, rec: dict, logfile: str) -> None:
    """Until the node is up, the dashboard answers and every port of the head's is held by its own processes;
    StrataError, naming why, if `ray start` exits, another process answers on one of its ports, or time runs out."""
    deadline = time.time() + START_WAIT_S
    while True:
        foreign = _foreign(rec)
        if not foreign and _started(logfile) and _answers(rec["dashboard"]) and _own_listening(rec):
            return
        if foreign:
            raise StrataError(f"the head did not come up: {foreign}")
        if proc.poll() is not None or time.time() > deadline:
            with open(logfile) as f:
                tail = f.read()[-2000:]
            raise StrataError(f"the head did not come up (`ray start` {'exited' if proc.poll() is not None else 'timed out'}"
                              f"); its output ends:\n{tail}")
        time.sleep(0.5)


def _foreign(rec: dict) -> str:
    """A port of the head's answered by a process outside the head's own process group, in words ('' if none)."""
    own = set(_group(rec["pgid"]))
    for what, p in rec["ports"].items():
        # Pid 0: a listener psutil could not yet tie to a process (its fds read mid-start, seen under load): the
        # next look names it. A port held before the start was refused then (`_free`).
        if others := _listeners(p) - own - {0}:
            return f"port {p} ({what}) is answered by {_who(p)}, not by this head's processes (pids {sorted(others)})"
    return ""


def _own_listening(rec: dict) -> bool:
    """Whether every port of the head's is listened on by one of its own processes."""
    own = set(_group(rec["pgid"]))
    return all(_listeners(p) & own for p in rec["ports"].values())


def stop(quiet: bool = False) -> str:
    """Stop the head strata started (its record says which); nothing else."""
    rec = read_record()
    if rec is None:
        return "no head started by strata here (no ~/.strata/head.json): nothing to stop"
    said = ""
    if ours(rec) and _leader(rec["pid"]):
        pgid = rec["pid"]  # the live head leads its own group (start_new_session): never a pgid the record names
        os.kill(rec["pid"], signal.SIGTERM)  # --block stops every process it started
        deadline = time.time() + STOP_WAIT_S
        while (cmdline(rec["pid"]) or _group(pgid)) and time.time() < deadline:
            time.sleep(0.2)
        left = _group(pgid)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        said = f"stopped the head (pid {rec['pid']}, GCS {rec['gcs']})" + (
            f"; {len(left)} process(es) of its own group killed after {STOP_WAIT_S} s" if left else "")
    else:
        said = f"the head strata started (pid {rec['pid']}) is already gone"
    import shutil

    temp = str(rec.get("temp") or "")
    if _own_temp(temp):  # the dir start made: nothing a crafted record names
        shutil.rmtree(temp, ignore_errors=True)
    os.remove(_record_path())
    return said


def main(argv: list[str]) -> int:
    return Command("python -m strata head", argv, tag="head").run(_main)


def _main(cmd: Command) -> int:
    import argparse

    p = Parser(prog="python -m strata head", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a Ray head on this machine (loopback, token auth, every tier)")
    s.add_argument("--port", type=int, default=6379, help="GCS port (default: 6379)")
    s.add_argument("--dashboard-port", type=int, default=8265, help="dashboard and job API port (default: 8265)")
    s.add_argument("--agent-port", type=int, help="the dashboard agent's port (default: Ray's, 52365)")
    s.add_argument("--client-port", type=int, default=RAY_CLIENT_PORT,
                   help=f"Ray Client's port (default: Ray's, {RAY_CLIENT_PORT})")
    s.add_argument("--metrics-port", type=int, help="the metrics export port (default: a free one)")
    s.add_argument("--num-cpus", type=int, help="CPUs the head offers (default: all)")
    sub.add_parser("status", help="say whether the head strata started is running")
    sub.add_parser("stop", help="stop the head strata started, and nothing else")
    a = p.parse_args(cmd.argv)
    if a.command == "start":
        rec = start(port=a.port, dashboard_port=a.dashboard_port, agent_port=a.agent_port, client_port=a.client_port,
                    metrics_port=a.metrics_port, num_cpus=a.num_cpus)
        _log.info(f"head up: GCS {rec['gcs']}, dashboard {rec['dashboard']} (pid {rec['pid']}, temp {rec['temp']})")
        print(f"export RAY_API_SERVER_ADDRESS={rec['dashboard']}")
        _log.info("stop it with: strata head stop")
    elif a.command == "status":
        rec = read_record()
        if rec and ours(rec):
            print(f"running: pid {rec['pid']}, GCS {rec['gcs']}, dashboard {rec['dashboard']}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec['started_at']))}")
        else:
            print("no head started by strata is running")
            return 1
    else:
        _log.info(stop())
    return 0
