"""Submit a strata job to a Ray cluster: `python -m strata submit preprocess|train|tune [options] -- ARGS`.

What `ray job submit` leaves to you, filled in:

- the runtime env of `platform/runtime-env.yaml`, the working directory
  (default `.`) and its allow-list: only the packages' Python files and the
  files the commands read are uploaded, whatever runtime env file is given
  (`--runtime-env` can add files; it cannot add a dotfile, a key or a
  credential file);
- the driver's placement: 1 CPU on an on-demand cpu-tier node (never a GPU
  node, never a spot node that could take the driver with it);
- the token: the client sends it whenever one is found (`RAY_AUTH_TOKEN`,
  `RAY_AUTH_TOKEN_PATH`, `~/.strata/ray-token`, `~/.ray/auth_token`);
- for scheduled runs, `--slot hourly|daily|SECONDS`: the submission id is
  derived from the slot the current time falls in, so the same slot submitted
  twice runs once (the second call says so and exits 0). Preprocessing also
  gets the slot as its `--run-id`, so even a resubmitted slot commits no
  second version.

Cron (incremental preprocessing every hour, idempotent per slot), through an SSH tunnel to the head's
loopback dashboard (plain http:// to another machine is refused: the token would travel in the clear):

    0 * * * * cd /opt/strata && ssh -fN -o ExitOnForwardFailure=yes -L 8265:127.0.0.1:8265 ray@HEAD; \\
        .venv/bin/python -m strata submit preprocess --slot hourly --no-wait --address http://127.0.0.1:8265 \\
        -- --preset web --input s3://raw/web/ --dataset web --incremental
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import logging
import os
import re
import shlex
import sys
import time
from pathlib import Path

from strata.accounting.runinfo import code_version
from strata.cluster import tiers
from strata.commands.shell import Command, Parser, StrataError, UsageError, log
from strata.data import signing

TOKEN_FILES = ("~/.strata/ray-token", "~/.ray/auth_token")  # where Ray's token is looked for (never the signing key)

_log = log("submit")

MODULES = {"preprocess": "pipelines.preprocess", "train": "train", "tune": "tune", "infer": "infer"}
SLOTS = {"hourly": 3600, "daily": 86400}
RUNTIME_ENV = Path(__file__).resolve().parents[2] / "platform" / "runtime-env.yaml"
# Never uploaded with a working directory, whatever the runtime env says (after the allow-list of
# platform/runtime-env.yaml, which already leaves out all but the code: a second line of defence).
SECRET_EXCLUDES = [
    ".*", "*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "id_rsa*", "id_ecdsa*", "id_ed25519*",
    "*credentials*", "service-account*.json", "sa-key*.json", "*kubeconfig*", "terraform.tfstate*", "*.tfvars",
    "secrets.yaml", "secrets.yml", "*.token", "*-token", "auth_token",
]


def slot_start(slot: str, now: float | None = None) -> dt.datetime:
    """The UTC start of the slot `now` falls in: hourly, daily, or every N seconds."""
    period = SLOTS.get(slot) or (int(slot) if slot.isdigit() and int(slot) > 0 else None)
    if period is None:
        raise ValueError(f"--slot takes hourly, daily or a number of seconds, not {slot!r}")
    t = time.time() if now is None else now
    return dt.datetime.fromtimestamp(t - t % period, dt.UTC)


def submission_id(kind: str, args: list[str], slot: str, now: float | None = None) -> str:
    """strata-KIND-NAME-HASH-YYYYMMDDTHHMMSS: the same for every call within one slot, and distinct per
    dataset whatever characters its name holds (`web.en` and `web-en` sanitize alike; HASH, of the exact
    name, tells them apart). Without --dataset, the whole command line is what must be distinct."""
    dataset = _flag(args, "--dataset")
    key = dataset.partition("@")[0] if dataset else shlex.join(args)
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", key if dataset else "").strip("-")[:40] or "job"
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    return "-".join(["strata", kind, name, digest, slot_start(slot, now).strftime("%Y%m%dT%H%M%S")])


def _flag(args: list[str], flag: str) -> str:
    """The value of `flag` in args (`--flag V` or `--flag=V`), or ''."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return ""


def runtime_env(working_dir: str, env_file: str | None, storage: str | None = None) -> dict:
    """The job's runtime env: the file's (platform/runtime-env.yaml by default) with its allow-list, the
    storage root the submitter gives, and the code version."""
    import yaml

    path = Path(env_file) if env_file else RUNTIME_ENV
    env = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    if working_dir:
        env["working_dir"] = working_dir
        # The last match wins: the allow-list, what the file adds to or takes from it, and never a secret.
        allow = yaml.safe_load(RUNTIME_ENV.read_text())["excludes"]
        own = [e for e in env.get("excludes", []) if e not in allow]
        env["excludes"] = [*allow, *own, *SECRET_EXCLUDES, "!/."]
    env_vars = env.setdefault("env_vars", {})
    if storage:  # the submitter's storage wins over anything the file says
        env_vars["STRATA_STORAGE"] = storage
    env_vars.setdefault("STRATA_CODE_VERSION", code_version())  # the upload has no .git to ask
    # `ray job stop` sends SIGTERM and kills the job 3 s later by default: every strata command stops cleanly on
    # SIGTERM (a server drains and writes its record, about 7 s on 2 cores), so give it a minute.
    env_vars.setdefault("RAY_JOB_STOP_WAIT_TIME_S", "60")
    # Never the signing key: every token holder reads a job's runtime env (`GET /api/jobs/`), for as long as
    # the job history lasts. The cluster's nodes read theirs from a file provisioned with the cluster.
    if signing.KEY_ENV in env_vars:
        raise StrataError(f"the runtime env sets {signing.KEY_ENV}: the signing key never travels in a job's "
                          "environment, which every token holder can read; provision it on the cluster's nodes "
                          f"instead ({signing.PROVISIONING})")
    return env


UPLOADED = ("strata", "pipelines", "train", "tune", "infer", "bench", "pyproject.toml", "cluster.yaml", "prices.yaml")


def check_links(working_dir: str) -> None:
    """Refuse a symbolic link in what the upload takes (runtime-env.yaml's allow-list) that points outside
    the working directory: the upload would carry the file it points to, whatever that is."""
    root = os.path.realpath(working_dir)
    for top in UPLOADED:
        start = os.path.join(working_dir, top)
        paths = [start] if not os.path.isdir(start) or os.path.islink(start) else [
            os.path.join(d, n) for d, dirs, files in os.walk(start) for n in [*dirs, *files]
            if not n.startswith(".") and n != "__pycache__"]
        for path in paths:
            if os.path.islink(path) and not os.path.realpath(path).startswith(root + os.sep):
                raise ValueError(f"{path} is a link to {os.path.realpath(path)}, outside {root}: the upload would "
                                 "carry that file; replace the link with the file, or leave it out")


def job_storage(address: str, given: str | None) -> str:
    """Where the job writes: --storage, else the submitter's $STRATA_STORAGE; a head on this machine may
    also use the submitter's default root. A cluster's job never falls back to a root of its own."""
    from strata.data.storage import ENV_VAR, storage_root

    if given or os.environ.get(ENV_VAR):
        return storage_root(given)
    if _is_loopback(address):
        return storage_root()  # ~/strata-data: this machine's, which a head on this machine reaches too
    raise ValueError(f"no storage root for the job: set {ENV_VAR} (or --storage) to storage every node of the "
                     "cluster reaches, such as s3://BUCKET/strata; the job writes its outputs there")


def _is_loopback(address: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(address if "://" in address else f"http://{address}").hostname
    return host in ("127.0.0.1", "localhost", "::1")


def token() -> tuple[str | None, str | None]:
    """(the cluster token, where it came from): RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or a token file."""
    if value := os.environ.get("RAY_AUTH_TOKEN"):
        return value.strip(), "RAY_AUTH_TOKEN"
    for path in filter(None, [os.environ.get("RAY_AUTH_TOKEN_PATH"), *TOKEN_FILES]):
        full = os.path.expanduser(path)
        if os.path.isfile(full):
            with open(full) as f:
                return f.read().strip(), full
    return None, None


def auth_headers(value: str | None) -> dict:
    """The token as Ray's HTTP clients send it. Given explicitly, it goes whatever RAY_AUTH_MODE says:
    Ray's clients otherwise send one only when RAY_AUTH_MODE=token was set before `ray` was imported
    (the mode is read once, into a cached config)."""
    return {"Authorization": f"Bearer {value}"} if value else {}


# The tiers a job needs: its driver's (strata submit places it on the cpu tier), then its work's.
NEEDS = {"preprocess": (tiers.Tier.CPU,), "train": (tiers.Tier.CPU, tiers.Tier.GPU),
         "tune": (tiers.Tier.CPU, tiers.Tier.SPOT), "infer": (tiers.Tier.CPU,)}


def needs(kind: str, args: list[str]) -> tuple:
    """The tiers a job needs: infer's work goes to the gpu tier too with `--tier gpu`."""
    if kind == "infer" and _flag(args, "--tier") == "gpu":
        return (tiers.Tier.CPU, tiers.Tier.GPU)
    return NEEDS[kind]
ROLE = {tiers.Tier.CPU: "its driver", tiers.Tier.GPU: "its workers", tiers.Tier.SPOT: "its trials"}


def check_head(address: str, timeout: float = 5.0) -> None:
    """Refuse, in one line, an address where no Ray head answers (nothing listens, the host does not resolve,
    or it does not answer in `timeout` s): Ray's own message for that advises reinstalling Ray with its
    dashboard, which is not what is wrong."""
    import socket
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{address.rstrip('/')}/api/version", timeout=timeout):
            return
    except urllib.error.HTTPError:
        return  # something answers (a head with auth on refuses without the token; the job client says so)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, (ConnectionError, TimeoutError, socket.gaierror)) or isinstance(e, ValueError):
            raise StrataError(f"no Ray head answers at {address} ({reason}): start one on this machine with "
                             "`strata head start`, or give --address the dashboard of a running cluster") from None
        # Anything else (a certificate this check does not verify as the job client would): the client says.


def ray_command() -> str:
    """`ray` as a person can run it from any shell: the one beside this interpreter (the venv's), by its path."""
    beside = os.path.join(os.path.dirname(sys.executable), "ray")
    return beside if os.access(beside, os.X_OK) else "ray"


def check_tiers(kind: str, address: str, headers: dict, args: list[str] = ()) -> None:
    """Refuse a job no node of the cluster could run: every tier it needs is served by an alive node (its
    label) or announced by an alive node (the head of an autoscaling cluster) as one the autoscaler starts
    (`strata.cluster.tiers.autoscaled_tiers`). A job refused here would otherwise wait PENDING forever."""
    from ray.util.state import StateApiClient
    from ray.util.state.common import ListApiOptions, StateResource

    nodes = StateApiClient(address=address, headers=dict(headers)).list(
        StateResource.NODES, options=ListApiOptions(detail=False), raise_on_missing_output=False)
    served = set()
    for n in nodes:
        if n.state == "ALIVE":
            served |= tiers.tiers_of(n.labels or {}) | tiers.autoscaled_tiers(n.labels or {})
    missing = [t for t in needs(kind, list(args)) if t not in served]
    if missing:
        labels = tiers.format_labels(tiers.node_labels(*missing))
        raise ValueError(
            f"no node of the cluster at {address} serves the {missing[0]} tier, which {kind} needs for "
            f"{ROLE[missing[0]]} (node label {tiers.label_key(missing[0])}={tiers.LABEL_VALUE}), and no autoscaler "
            f"announces one: start a node with `ray start --labels={labels} ...`, or a laptop's head with every "
            "tier: `strata head start` (README: From a laptop to a cluster)")


def python_for(address: str, python: str | None) -> str:
    """The interpreter of the job's entrypoint: --python, else this one for a head on this machine (the
    head's own PATH may find another Python, without strata's packages), else `python` on the head's
    PATH (a cluster's image puts its environment first)."""
    if python:
        return python
    return sys.executable if _is_loopback(address) else "python"


def check_address(address: str, insecure_http: bool = False, token_set: bool = True) -> None:
    """Refuse plain HTTP, or Ray Client's `ray://` without TLS, to anything but loopback while a token is
    set: the token would cross the network in the clear."""
    from urllib.parse import urlparse

    url = urlparse(address if "://" in address else f"http://{address}")
    remote = url.hostname not in ("127.0.0.1", "localhost", "::1")
    if url.scheme == "http" and remote and not insecure_http:
        raise ValueError(f"{address} is plain HTTP to another machine: the cluster token would travel in the clear. "
                         "Reach the head through a port-forward or an SSH tunnel (http://127.0.0.1:8265), or "
                         "TLS (https://...); --insecure-http sends it anyway")
    tls = os.environ.get("RAY_USE_TLS", "").lower() in ("1", "true")
    if url.scheme == "ray" and remote and token_set and not tls and not insecure_http:
        raise ValueError(f"{address} is Ray Client (ray://) to another machine without TLS: the cluster token would "
                         "travel in the clear in its gRPC headers. Use the head's job API through a tunnel "
                         "(http://127.0.0.1:8265), or configure Ray's TLS (RAY_USE_TLS=1 with its certificates)")


def check_token_mode(path: str, fix: bool | None = None) -> bool:
    """Whether the token file is private (0600 or stricter); warns about one others can read and, asked or
    allowed (`fix`), makes it 0600. fix=None asks on a terminal."""
    import stat

    mode = stat.S_IMODE(os.stat(path).st_mode)
    if not mode & 0o077:
        return True
    _log.warning(f"WARNING: the token file {path} can be read by others (mode {mode:04o}); "
                 f"`chmod 600 {path}` fixes it")
    if fix is None:
        fix = sys.stdin.isatty() and input("[submit] make it 0600 now? [y/N] ").strip().lower() == "y"
    if fix:
        os.chmod(path, 0o600)
        _log.info(f"{path} is now 0600")
    return bool(fix)


AGENT_WAIT_S = 60  # how long a submission waits for the head's job agent (a head just started, or busy)


def submit(kind: str, args: list[str], *, address: str, slot: str | None = None, sub_id: str | None = None,
           working_dir: str = ".", env_file: str | None = None, wait: bool = True, at: float | None = None,
           insecure_http: bool = False, fix_token_mode: bool | None = False,
           storage: str | None = None, python: str | None = None, check_labels: bool = True) -> dict:
    """Submit; returns {"submission_id", "status", "duplicate"}. Waits and streams logs unless wait=False."""
    if kind not in MODULES:
        raise ValueError(f"unknown job kind {kind!r}: one of {', '.join(MODULES)}")
    check_address(address, insecure_http, token_set=token()[0] is not None)
    if working_dir:
        check_links(working_dir)
    root = job_storage(address, storage)
    check_head(address)  # after every check that needs no network
    if slot:
        sub_id = sub_id or submission_id(kind, args, slot, at)
        if kind == "preprocess" and "--run-id" not in args:
            args = [*args, "--run-id", sub_id]  # idempotent at the data level too
    entrypoint = shlex.join([python_for(address, python), "-m", MODULES[kind], *args])
    value, where = token()
    if where and os.path.isfile(where):
        check_token_mode(where, fix=fix_token_mode)
    headers = auth_headers(value)
    if check_labels:
        check_tiers(kind, address, headers, args)
    from ray.job_submission import JobStatus, JobSubmissionClient

    # Ray's packaging notes (which files its own defaults leave out) say nothing the allow-list does not.
    for name in ("ray._private.runtime_env", "ray.dashboard.modules.dashboard_sdk"):
        logging.getLogger(name).setLevel(logging.ERROR)

    _log.info(f"{entrypoint} -> {address}" + (f" as {sub_id}" if sub_id else "") + f", storage {root}"
              + ("" if where else " (no token found: the cluster will refuse this if it has auth on)"))
    client = JobSubmissionClient(address, headers=dict(headers))
    try:
        deadline = time.time() + AGENT_WAIT_S
        while True:
            try:
                job = client.submit_job(entrypoint=entrypoint, submission_id=sub_id,
                                        runtime_env=runtime_env(working_dir, env_file, root), entrypoint_num_cpus=1,
                                        entrypoint_label_selector=tiers.selector(tiers.Tier.CPU),
                                        metadata={"strata.kind": kind, **({"strata.slot": slot} if slot else {})})
                break
            except RuntimeError as e:  # a head just started, or loaded: its job agent is not reachable yet
                if "No available agent" not in str(e) or time.time() > deadline:
                    raise
                _log.info("the head's job agent is not available yet; trying again in 2 s")
                time.sleep(2)
    except RuntimeError as e:
        if sub_id and "already exists" in str(e):
            status = str(client.get_job_status(sub_id))
            _log.info(f"{sub_id} was already submitted for this slot ({status}); nothing to do")
            return {"submission_id": sub_id, "status": status, "duplicate": True}
        raise
    _log.info(f"submitted {job}")
    if not wait:
        ray = ray_command()
        _log.info(f"follow it with: {ray} job logs --follow --address {address} {job}  (status: {ray} job status "
                  f"--address {address} {job}; stop: {ray} job stop --address {address} {job})")
        return {"submission_id": job, "status": str(client.get_job_status(job)), "duplicate": False}
    shown, done = 0, {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
    while True:
        status = client.get_job_status(job)
        logs = client.get_job_logs(job)
        print(logs[shown:], end="", flush=True)
        shown = len(logs)
        if status in done:
            break
        time.sleep(2)
    _log.info(f"{job} {status}")
    return {"submission_id": job, "status": str(status), "duplicate": False}


def main(argv: list[str] | None = None) -> int:
    return Command("python -m strata submit", argv).run(_main)


def _main(cmd: Command) -> int:
    argv = cmd.argv
    head, rest = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = Parser(prog="python -m strata submit", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(MODULES), help="which stage to run")
    p.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS"),
                   help="the cluster's dashboard address, e.g. http://127.0.0.1:8265 (default: $RAY_API_SERVER_ADDRESS, "
                   "else $RAY_ADDRESS)")
    p.add_argument("--storage", help="the storage root the job writes to (default: $STRATA_STORAGE; a head on "
                   "this machine may use ~/strata-data; a remote cluster needs storage all its nodes reach)")
    p.add_argument("--slot", help="hourly, daily or SECONDS: one submission per slot (for cron)")
    p.add_argument("--slot-time", help="submit the slot of this UTC time (ISO 8601) instead of now: a backfill")
    p.add_argument("--submission-id", help="an explicit submission id (default: Ray's, or the slot's)")
    p.add_argument("--working-dir", default=".", help="directory to upload (default: .; '' uploads nothing)")
    p.add_argument("--runtime-env", help=f"runtime env YAML (default: {RUNTIME_ENV.relative_to(RUNTIME_ENV.parents[1])})")
    p.add_argument("--python", help="the interpreter the job runs (default: this one for a head on this machine, "
                   "else `python` on the head's PATH)")
    p.add_argument("--no-label-check", action="store_true", help="submit even when no node serves a tier the "
                   "job needs (it then waits PENDING until one joins)")
    p.add_argument("--no-wait", action="store_true", help="return once submitted instead of streaming logs")
    p.add_argument("--insecure-http", action="store_true", help="allow plain http:// to a head that is not "
                   "loopback (the token travels in the clear; use a tunnel or TLS instead)")
    p.add_argument("--fix-token-mode", action="store_true", help="make a token file others can read 0600 "
                   "without asking")
    a, extra = p.parse_known_args(head)
    if extra:
        raise UsageError(f"unrecognized arguments: {' '.join(extra)}; the job's own arguments go after `--`: "
                         f"strata submit {a.kind} [options] -- {shlex.join(extra)}")
    if not a.address:
        p.error("--address (or RAY_API_SERVER_ADDRESS) is required: the cluster's dashboard, e.g. "
                "http://127.0.0.1:8265 (`strata head start` starts one on this machine)")
    try:
        at = dt.datetime.fromisoformat(a.slot_time).replace(tzinfo=dt.UTC).timestamp() if a.slot_time else None
        if at is not None and not a.slot:
            raise ValueError("--slot-time needs --slot")
        r = submit(a.kind, rest, address=a.address, slot=a.slot, sub_id=a.submission_id,
                   working_dir=a.working_dir, env_file=a.runtime_env, wait=not a.no_wait, at=at,
                   insecure_http=a.insecure_http, fix_token_mode=True if a.fix_token_mode else None,
                   storage=a.storage, python=a.python, check_labels=not a.no_label_check)
    except ValueError as e:
        raise UsageError(str(e)) from e
    except StrataError:
        raise
    except Exception as e:  # the client's errors (refused token, unreachable head) are the user's to read
        raise StrataError(f"{type(e).__name__}: {e}") from e
    # A slot already submitted and still going, or a --no-wait submission, is not a failure.
    return 0 if r["status"] in ("SUCCEEDED", "PENDING", "RUNNING") else 1
