"""A Ray head on this machine for `strata submit`, started and stopped by strata's own record of it:

    python -m strata head start [--port 6379] [--dashboard-port 8265] [--num-cpus N]
    python -m strata head status
    python -m strata head stop

`start` runs `ray start --head --block` in a session of its own: loopback only (every Ray process binds
and talks on 127.0.0.1), token auth on (the token is `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, or
`~/.strata/ray-token`, made 0600 if there is none), every tier's label, a private temp dir. It records
the process (`~/.strata/head.json`) and waits until the dashboard answers.

`stop` stops that process, and only it: SIGTERM to the recorded `ray start --block` (which stops every
process it started), then, after a grace period, SIGKILL to what is left of its own process group. It
never stops another Ray on the machine, as Ray's own stop command does (it stops every Ray process of the
machine, other users' embedded ones included).
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

from strata import tiers
from strata.shell import Command, Parser, StrataError, log

_log = log("head")
RECORD = "~/.strata/head.json"
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


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def ours(rec: dict) -> bool:
    """Whether the recorded process is alive and still the `ray start --block` strata started (a pid can be
    reused by anything once its process is gone)."""
    cmd = _cmdline(rec["pid"])
    return "start" in cmd and "--block" in cmd and f"--temp-dir={rec.get('temp')}" in cmd


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
    """The head's token: the one `strata submit` would send (strata.submit.token), else ~/.strata/ray-token,
    made 0600."""
    from strata.submit import token

    value, where = token()
    if value:  # from the environment, or a file the head must read too
        return {"RAY_AUTH_TOKEN_PATH": where} if os.path.isfile(where) else {}
    path = os.path.expanduser("~/.strata/ray-token")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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


def start(*, port: int, dashboard_port: int, agent_port: int | None, num_cpus: int | None) -> dict:
    if (rec := read_record()) and ours(rec):
        raise StrataError(f"a head started by strata is running (pid {rec['pid']}, GCS {rec['gcs']}, dashboard "
                          f"{rec['dashboard']}): stop it first with `strata head stop`")
    temp = tempfile.mkdtemp(prefix="strata-head-")
    env = {**os.environ, **_token_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray if os.path.exists(ray) else "ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1",
           "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--port={port}", f"--dashboard-port={dashboard_port}",
           f"--labels={tiers.format_labels(tiers.local_node_labels())}", f"--temp-dir={temp}",
           *([f"--dashboard-agent-listen-port={agent_port}"] if agent_port else []),
           *([f"--num-cpus={num_cpus}"] if num_cpus is not None else [])]
    logfile = os.path.join(temp, "strata-head.log")
    import subprocess

    with open(logfile, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    rec = {"pid": proc.pid, "pgid": proc.pid, "gcs": f"127.0.0.1:{port}",
           "dashboard": f"http://127.0.0.1:{dashboard_port}", "temp": temp, "log": logfile, "started_at": time.time()}
    os.makedirs(os.path.dirname(_record_path()), mode=0o700, exist_ok=True)
    with open(_record_path(), "w") as f:
        json.dump(rec, f)
    deadline = time.time() + START_WAIT_S
    while not (_started(logfile) and _answers(rec["dashboard"])):
        if proc.poll() is not None or time.time() > deadline:
            with open(logfile) as f:
                tail = f.read()[-2000:]
            stop(quiet=True)
            raise StrataError(f"the head did not come up (`ray start` {'exited' if proc.poll() is not None else 'timed out'}"
                              f"); its output ends:\n{tail}")
        time.sleep(0.5)
    os.chmod(temp, 0o700)  # Ray makes its temp dir 0777
    return rec


def stop(quiet: bool = False) -> str:
    """Stop the head strata started (its record says which); nothing else."""
    rec = read_record()
    if rec is None:
        return "no head started by strata here (no ~/.strata/head.json): nothing to stop"
    said = ""
    if ours(rec):
        os.kill(rec["pid"], signal.SIGTERM)  # --block stops every process it started
        deadline = time.time() + STOP_WAIT_S
        while (_cmdline(rec["pid"]) or _group(rec["pgid"])) and time.time() < deadline:
            time.sleep(0.2)
        left = _group(rec["pgid"])
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        said = f"stopped the head (pid {rec['pid']}, GCS {rec['gcs']})" + (
            f"; {len(left)} process(es) of its own group killed after {STOP_WAIT_S} s" if left else "")
    else:
        said = f"the head strata started (pid {rec['pid']}) is already gone"
    import shutil

    temp = str(rec.get("temp") or "")
    if os.path.basename(temp).startswith("strata-head-"):  # the dir start made: nothing a crafted record names
        shutil.rmtree(temp, ignore_errors=True)
    os.remove(_record_path())
    return said


def main(argv: list[str]) -> int:
    return Command("python -m strata head", argv, tag="head").run(_main)


def _main(cmd: Command) -> int:
    p = Parser(prog="python -m strata head", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("start", help="start a Ray head on this machine (loopback, token auth, every tier)")
    s.add_argument("--port", type=int, default=6379, help="GCS port (default: 6379)")
    s.add_argument("--dashboard-port", type=int, default=8265, help="dashboard and job API port (default: 8265)")
    s.add_argument("--agent-port", type=int, help="the dashboard agent's port (default: Ray's, 52365)")
    s.add_argument("--num-cpus", type=int, help="CPUs the head offers (default: all)")
    sub.add_parser("status", help="say whether the head strata started is running")
    sub.add_parser("stop", help="stop the head strata started, and nothing else")
    a = p.parse_args(cmd.argv)
    if a.command == "start":
        rec = start(port=a.port, dashboard_port=a.dashboard_port, agent_port=a.agent_port, num_cpus=a.num_cpus)
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
