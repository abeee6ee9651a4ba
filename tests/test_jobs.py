"""`ray job submit` against a real local cluster (`ray start --head` on loopback, token auth on)."""

import datetime as dt
import fnmatch
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import REPO, readme_command, wait_for

from strata.cluster import tiers
from strata.cluster.connect import remove_ray_dir
from strata.commands.submit import submission_id
from strata.data.dataset import list_versions
from strata.data.storage import Storage, check_name

BIN = os.path.dirname(sys.executable)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_head(command: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    """`ray start --head ... --block` on free ports of 127.0.0.1; returns (its process, the dashboard address)
    once the job server answers."""
    # Every port its own: an embedded Ray of an earlier test holds the default job agent port (52365), and a
    # head whose agent cannot bind it refuses every submission ("No available agent").
    port, dash, agent = _free_port(), _free_port(), _free_port()
    proc = subprocess.Popen(
        [*command, "--block", f"--port={port}", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", f"--dashboard-agent-listen-port={agent}", "--num-cpus=2",
         "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    while True:
        up = subprocess.run([os.path.join(BIN, "ray"), "job", "list", "--address", address], env=env,
                            capture_output=True, text=True)
        if up.returncode == 0:
            return proc, address
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"ray start --head did not come up: {proc.stderr.read() if proc.poll() is not None else ''}"
                        f"{up.stderr[-2000:]}")
        time.sleep(2)


def _stop_head(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # --block stops every process it started
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _head_env(temp: str) -> dict:
    """A head's environment: its own temp dir and token, no storage root (a job gets the one it is given)."""
    env = {k: v for k, v in os.environ.items() if k != "STRATA_STORAGE"}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_TMPDIR": temp, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
            "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}


@pytest.fixture(scope="module")
def head(storage_root):
    """The laptop head exactly as the README starts it (`strata head start`; the test adds free ports and a
    home of its own, where the head's record goes), stopped as the README stops it."""
    line = readme_command(".venv/bin/strata head start")
    temp = tempfile.mkdtemp(prefix="rayj-", dir="/tmp")
    env = {**_head_env(temp), "HOME": temp}
    out, address = _strata_head(line, env)
    gcs = re.search(r"GCS (\S+),", out.stderr + out.stdout).group(1)
    yield {"address": address, "env": env, "gcs": gcs}
    _strata(["head", "stop"], env)
    remove_ray_dir(temp)


def _strata(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([os.path.join(BIN, "strata"), *args], env=env, capture_output=True, text=True, timeout=300)


def _strata_head(line: str, env: dict) -> tuple[subprocess.CompletedProcess, str]:
    """`strata head start` (the README's line) on free ports; returns (its run, the dashboard address) once
    the job server answers."""
    out, address = _strata_head_started(line, env)
    _wait_for_jobs(address, env)
    return out, address


def _strata_head_started(line: str, env: dict) -> tuple[subprocess.CompletedProcess, str]:
    """`strata head start` (the README's line) on free ports, once it says "head up"."""
    port, dash, agent, client = _free_port(), _free_port(), _free_port(), _free_port()
    out = _strata([*shlex.split(line)[1:], f"--port={port}", f"--dashboard-port={dash}", f"--agent-port={agent}",
                   f"--client-port={client}", "--num-cpus=2"], env)
    assert out.returncode == 0, out.stderr[-3000:]
    address = f"http://127.0.0.1:{dash}"
    assert f"export RAY_API_SERVER_ADDRESS={address}" in out.stdout
    return out, address


def _wait_for_jobs(address: str, env: dict) -> None:
    deadline = time.time() + 120
    while subprocess.run([os.path.join(BIN, "ray"), "job", "list", "--address", address], env=env,
                         capture_output=True, text=True).returncode != 0:
        assert time.time() < deadline, "the head's job server never answered"
        time.sleep(2)


@pytest.mark.ray
@pytest.mark.slow("starts a head beside another Ray and stops it")
def test_stopping_the_head_stops_it_alone_and_another_ray_on_the_machine_runs_on(tmp_path):
    """The README's recipe once ended in Ray's own stop command, which stopped every Ray on the machine (another user's
    embedded Ray among them). `strata head stop` stops the head `strata head start` recorded, and nothing else;
    and every socket the head listens on is on 127.0.0.1."""
    import psutil

    beat = tmp_path / "beat"
    short = tempfile.mkdtemp(prefix="rayo-", dir="/tmp")  # Ray's socket paths must fit in 107 bytes
    other = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time, ray; os.environ['RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER'] = '0';"
        f"ray.init(address='local', num_cpus=1, include_dashboard=False, _temp_dir={short!r});"
        "f = ray.remote(lambda i: i + 1)\n"
        "for i in range(100000):\n"
        f"    open({str(beat)!r}, 'w').write(str(ray.get(f.remote(i)))); time.sleep(0.3)")],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, start_new_session=True)
    home = tmp_path / "home"
    env = {**{k: v for k, v in _head_env(short).items() if k != "RAY_AUTH_TOKEN"}, "HOME": str(home)}
    try:
        deadline = time.time() + 120
        while not beat.exists():
            assert other.poll() is None and time.time() < deadline, "the other Ray never ran a task"
            time.sleep(0.5)
        # Issue 57, 7: as after `make demo`, whose embedded Ray leaves a world-readable ~/.ray/auth_token, and with
        # no token given: the head makes ~/.strata/ray-token (0600), the one the README's export line names.
        (home / ".ray").mkdir(parents=True)
        (home / ".ray" / "auth_token").write_text("the demo's token\n")
        os.chmod(home / ".ray" / "auth_token", 0o644)
        _, address = _strata_head_started(readme_command(".venv/bin/strata head start"), env)
        token = home / ".strata" / "ray-token"
        assert token.stat().st_mode & 0o777 == 0o600 and token.read_text().strip() != "the demo's token"
        exported = shlex.split(readme_command("export RAY_API_SERVER_ADDRESS="))[1:]  # the README's line, as written
        env.update({k: v.replace("~", str(home), 1) for k, v in (a.split("=", 1) for a in exported)})
        env["RAY_API_SERVER_ADDRESS"] = address  # the test's head is on a free port, not 8265
        _wait_for_jobs(address, env)
        job = _submit({"env": env}, "preprocess", "--no-wait", "--", "--input", str(tmp_path), "--dataset", "x",
                      env={**env, "STRATA_STORAGE": str(tmp_path / "storage")})
        sub_id = re.search(r"submitted (raysubmit_\w+)", job.stderr)
        assert job.returncode == 0 and sub_id, job.stderr[-2000:]
        stop = subprocess.run([os.path.join(BIN, "ray"), "job", "stop", sub_id.group(1)], env=env, capture_output=True,
                              text=True, timeout=300)
        assert stop.returncode == 0 and "Traceback" not in stop.stderr, stop.stderr[-2000:]
        rec = json.loads((tmp_path / "home" / ".strata" / "head.json").read_text())
        group = [p for p in psutil.process_iter() if _pgid(p.pid) == rec["pgid"]]
        listening = {c.laddr.ip for p in group for c in _connections(p) if c.status == psutil.CONN_LISTEN}
        assert listening and listening <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
        assert _strata(["head", "status"], env).returncode == 0
        stopped = _strata(["head", "stop"], env)
        assert stopped.returncode == 0 and "stopped the head" in stopped.stderr, stopped.stderr
        assert not [p for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not os.path.exists(rec["temp"]) and _strata(["head", "status"], env).returncode == 1
        seen = beat.read_text()
        wait_for(lambda: beat.read_text() != seen or other.poll() is not None, "the other Ray's next task", 60)
        assert other.poll() is None and beat.read_text() != seen, "the other Ray stopped with the head"
    finally:
        if (home / ".strata" / "head.json").exists():  # a failed assertion above: the head goes too
            _strata(["head", "stop"], env)
        other.terminate()
        other.wait(timeout=60)
        shutil.rmtree(short, ignore_errors=True)


def test_head_start_refuses_a_port_someone_else_holds_and_stop_kills_only_the_live_head(tmp_path, monkeypatch):
    """Issue 57, 5 and 7: `strata head start` said "head up" while another Ray held the job agent's port (the
    first submit failed after 73 s), and a plain HTTP server on the dashboard port passed as the head; two heads
    shared Ray Client's port; `strata head stop` killed whatever process group head.json named; and a token
    file others can read was adopted. Each is refused now, before anything starts, in one line."""
    import http.server
    import threading

    home = tmp_path / "home"
    env = {**{k: v for k, v in _head_env(str(tmp_path)).items()
              if k != "RAY_AUTH_TOKEN"}, "HOME": str(home)}
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    taken = server.server_address[1]
    try:
        for flag in ("--dashboard-port", "--agent-port", "--client-port", "--metrics-port", "--port"):
            ports = {f: _free_port() for f in ("--port", "--dashboard-port", "--agent-port", "--client-port",
                                                "--metrics-port")}
            ports[flag] = taken
            out = _strata(["head", "start", *[f"{f}={p}" for f, p in ports.items()]], env)
            assert out.returncode == 1 and f"port {taken} ({flag}) is taken by pid {os.getpid()}" in out.stderr, \
                out.stderr[-2000:]
            assert "head up" not in out.stderr and not (home / ".strata" / "head.json").exists()
    finally:
        server.shutdown()
        server.server_close()
    # A token file others can read is never adopted.
    loose = tmp_path / "loose-token"
    loose.write_text("a token\n")
    os.chmod(loose, 0o644)
    out = _strata(["head", "start", *[f"{f}={_free_port()}" for f in ("--port", "--dashboard-port", "--agent-port",
                                                                       "--client-port", "--metrics-port")]],
                  {**env, "RAY_AUTH_TOKEN_PATH": str(loose)})
    assert out.returncode == 1 and f"the token file {loose} can be read by others" in out.stderr, out.stderr[-2000:]
    # A crafted record: a process that looks like the head, and another group's id. Only a live head that leads
    # its own group is stopped; the group the record names is never touched.
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    fake_temp = tempfile.mkdtemp(prefix="strata-head-")
    lookalike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "start", "--block",
                                  f"--temp-dir={fake_temp}"])  # not a group leader
    try:
        (home / ".strata").mkdir(parents=True, exist_ok=True)
        (home / ".strata" / "head.json").write_text(json.dumps({
            "pid": lookalike.pid, "pgid": victim.pid, "gcs": "127.0.0.1:1", "dashboard": "http://127.0.0.1:1",
            "temp": fake_temp, "started_at": time.time()}))
        out = _strata(["head", "stop"], env)
        assert out.returncode == 0 and "already gone" in out.stderr, out.stderr
        assert victim.poll() is None and lookalike.poll() is None
    finally:
        for p in (victim, lookalike):
            p.kill()
            p.wait()
        shutil.rmtree(fake_temp, ignore_errors=True)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _connections(p):
    try:
        return p.net_connections(kind="inet")
    except Exception:  # noqa: BLE001 - gone, or not ours to look at
        return []


def _job(head, command, *args, env=None):
    """`ray job COMMAND`; a submission the head refuses because its job agent is not (or, on a loaded
    machine, not at the moment) reachable is made again, as a person would, for up to a minute."""
    deadline = time.time() + 60
    while True:
        out = subprocess.run([os.path.join(BIN, "ray"), "job", command, "--address", head["address"], *args],
                             env=env or head["env"], capture_output=True, text=True, cwd=REPO, timeout=600)
        if "No available agent to submit job" not in out.stderr or time.time() > deadline:
            return out
        time.sleep(2)


@pytest.mark.ray
@pytest.mark.ray
def test_preprocess_with_ray_address_joins_the_running_head_and_starts_no_ray(head, corpus, tmp_path):
    """A scheduled job on a machine with a head up: RAY_ADDRESS is all it sets (the head's token is found as
    the head found it, and token auth is spoken without RAY_AUTH_MODE)."""
    env = {k: v for k, v in head["env"].items() if k != "RAY_AUTH_MODE"}
    env.update(RAY_ADDRESS=head["gcs"], STRATA_STORAGE=str(tmp_path / "root"))
    out = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", corpus["path"], "--dataset",
                          "joined", "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"joined Ray cluster at {head['gcs']}" in out.stderr and "started embedded" not in out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["version"] == "v0001"


def test_submitted_preprocessing_job_succeeds_and_commits_a_version(head, corpus, storage_root):
    runtime_env = {"env_vars": {"STRATA_STORAGE": storage_root}, "excludes": [".git/", "strata-data/"]}
    out = _job(head, "submit", "--working-dir", ".", "--submission-id", "strata-test-preprocess",
               "--runtime-env-json", json.dumps(runtime_env), "--",
               "python", "-m", "pipelines.preprocess", "--input", corpus["path"], "--dataset", "submitted", "--json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))
    d = summary["documents"]
    assert summary["dataset"] == "submitted" and d["kept"] + d["unpacked"] == len(corpus["good"])
    assert summary["version"] in list_versions(Storage(storage_root), "submitted")
    status = _job(head, "status", "strata-test-preprocess")
    assert "succeeded" in status.stdout.lower()


def test_the_cluster_refuses_a_client_without_the_token(head, tmp_path):
    env = {k: v for k, v in head["env"].items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    env["HOME"] = str(tmp_path)  # no ~/.ray/auth_token to fall back on
    out = _job(head, "list", env=env)
    assert out.returncode != 0
    assert "401" in out.stderr or "authentication" in out.stderr.lower()


@pytest.mark.slow("ray job submit of tier 1 then training")
def test_submitted_training_job_reads_the_submitted_dataset(head, dataset, storage_root, tmp_path):
    runtime_env = {"env_vars": {"STRATA_STORAGE": storage_root}}
    out = _job(head, "submit", "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
               "python", "-m", "train", "--dataset", dataset["ref"], "--no-use-gpu", "--max-steps", "2", "--batch-size", "4",
               "--run", "submitted", "--json")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith("{")))
    assert (summary["run"], summary["start_step"], summary["steps"]) == ("submitted", 0, 2)
    assert {"meta.json", "signed-0.json"} <= set(os.listdir(summary["checkpoint"]))
    # Issue 57, 3: another cluster verifies what this one trained when both read the one provisioned key file
    # (a Kubernetes Secret in every pod), and only then. Here: infer's embedded Ray in a home of its own.
    key = os.path.join(head["env"]["HOME"], ".strata", "signing-key")  # the file `strata head start` provisioned
    prompts = str(tmp_path / "p.jsonl")
    with open(prompts, "w") as f:
        f.write('{"prompt": "data "}\n')
    other = {**{k: v for k, v in os.environ.items() if not k.startswith("STRATA_SIGNING")},
             "STRATA_STORAGE": storage_root, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

    def generate(name: str, **env):
        home = tmp_path / f"home-{name}"  # pytest's, removed with it (mkdtemp's were left in /tmp)
        home.mkdir()
        return subprocess.run([sys.executable, "-m", "infer", "generate", "--model", "submitted", "--prompts",
                               prompts, "--max-tokens", "2", "--name", name], cwd=REPO, capture_output=True, text=True,
                              env={**other, "HOME": str(home), **env}, timeout=600)

    served = generate("cluster-b", STRATA_SIGNING_KEY_FILE=key)
    assert served.returncode == 0, served.stderr[-3000:]
    unkeyed = generate("cluster-c")  # a cluster given no key: its embedded Ray makes one of its own
    assert unkeyed.returncode != 0 and "signed with key" in unkeyed.stderr and "Traceback" not in unkeyed.stderr, \
        unkeyed.stderr[-3000:]


def _submit(head, *args, env=None):
    return subprocess.run([sys.executable, "-m", "strata", "submit", *args], env=env or head["env"], cwd=REPO,
                          capture_output=True, text=True, timeout=600)


def test_strata_submit_runs_a_scheduled_slot_once(head, corpus, storage_root, tmp_path):
    # The token without RAY_AUTH_MODE (strata submit sends it anyway), and a head whose PATH finds no Python
    # with strata's packages (one started from .venv/bin/ray unactivated): the job runs the submitter's.
    env = {k: v for k, v in head["env"].items() if k != "RAY_AUTH_MODE"}
    env["STRATA_STORAGE"] = storage_root
    bare = tmp_path / "bare-path.yaml"
    bare.write_text("env_vars: {PATH: /usr/bin:/bin}\n")
    args = ["preprocess", "--address", head["address"], "--slot", "hourly", "--slot-time", "2026-11-30T10:17:00",
            "--", "--input", corpus["path"], "--dataset", "slotted", "--json"]
    first = _submit(head, *args[:5], "--runtime-env", str(bare), *args[5:], env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    sub_id = submission_id("preprocess", args[7:], "hourly", dt.datetime(2026, 11, 30, 10, tzinfo=dt.UTC).timestamp())
    assert sub_id.startswith("strata-preprocess-slotted-") and sub_id.endswith("-20261130T100000")
    assert f"{sub_id} SUCCEEDED" in first.stderr
    summary = json.loads(next(line for line in reversed(first.stdout.splitlines()) if line.startswith("{")))
    assert summary["documents"]["kept"] + summary["documents"]["unpacked"] == len(corpus["good"])
    assert f"{sys.executable} -m pipelines.preprocess" in first.stderr
    again = _submit(head, *args[:5], "--slot-time", "2026-11-30T10:59:59", *args[7:], env=env)  # the same hour
    assert again.returncode == 0, again.stderr[-3000:]
    assert "already submitted for this slot (SUCCEEDED); nothing to do" in again.stderr
    assert len(list_versions(Storage(storage_root), "slotted")) == 1
    from strata.accounting.runinfo import code_version
    from strata.data.dataset import resolve

    # The upload has no .git: the submitter's code version travels with it.
    assert resolve(Storage(storage_root), "slotted").manifest.run["code_version"] == code_version()
    jobs = _job(head, "list").stdout
    assert jobs.count(f"submission_id='{sub_id}'") == 1
    # The token is in the submitter's and the head's environment, and nowhere it could be read back.
    token = head["env"]["RAY_AUTH_TOKEN"]
    seen = {"strata submit's output": first.stdout + first.stderr + again.stdout + again.stderr,
            "ray job list (with the runtime env)": jobs, "the job's logs": _job(head, "logs", sub_id).stdout}
    for dirpath, _, files in os.walk(storage_root):
        for name in files:
            if name.endswith((".json", ".csv", ".txt", ".log", ".md")):
                with open(os.path.join(dirpath, name), errors="replace") as f:
                    seen[os.path.join(dirpath, name)] = f.read()
    assert len(seen) > 5 and not [where for where, text in seen.items() if token in text]
    # Issue 57, 2: nor the signing key: the job API shows every token holder each job's runtime env.
    import urllib.request

    with open(os.path.join(head["env"]["HOME"], ".strata", "signing-key")) as f:
        key = f.read().strip()
    request = urllib.request.Request(f"{head['address']}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=60) as r:  # noqa: S310 - the test's own head on loopback
        listed = r.read().decode()
    assert sub_id in listed and key not in listed and not [where for where, text in seen.items() if key in text]


def test_slot_ids_are_distinct_per_dataset_and_stable_within_a_slot():
    at = dt.datetime(2026, 11, 30, 10, 17, tzinfo=dt.UTC).timestamp()
    names = ["web", "news", "web.en", "web-en"]
    ids = {n: submission_id("preprocess", ["--input", "s3://raw/", "--dataset", n], "hourly", at) for n in names}
    assert len(set(ids.values())) == 4, ids
    assert all(i.endswith("-20261130T100000") for i in ids.values())
    assert submission_id("preprocess", ["--dataset=web"], "hourly", at + 600) == ids["web"]  # same hour, same id
    assert submission_id("preprocess", ["--dataset", "web"], "hourly", at + 3600) != ids["web"]  # next hour
    for i in ids.values():
        check_name(i, "run id")  # it becomes preprocessing's --run-id


SECRET_LIKE = [  # every kind a working tree has been seen to hold, at the top and inside the packages
    "kubeconfig", "prod.kubeconfig", ".docker/config.json", ".npmrc", ".pgpass", "terraform.tfstate", "prod.tfvars",
    ".envrc", "secrets.yaml", "keystore.jks", "sa-key.json", ".git/config", ".env", ".env.local", "id_ecdsa",
    "id_rsa", ".aws/credentials", "client.p12", ".pypirc", ".git-credentials", ".ssh/config", "deploy.pem",
    "strata/.env", "train/kubeconfig", "pipelines/secrets.yaml", "tune/sa-key.json", "strata/tls.key",
    "notebooks/scratch.ipynb", "data/raw.jsonl", "tests/conftest.py",
]


def test_a_submitted_working_dir_uploads_the_code_and_nothing_else(head, tmp_path):
    from strata.commands.submit import runtime_env

    work = tmp_path / "project"
    code = [f for f in subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
            if f.split("/")[0] in ("strata", "pipelines", "train", "tune", "infer") and f.count("/") == 1
            and (f.endswith(".py") or fnmatch.fnmatch(f, "strata/*.yaml"))]  # and strata's package data
    code += ["pyproject.toml", "cluster.yaml", "prices.yaml"]
    for name in code:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(REPO, name), work / name)
    for name in SECRET_LIKE:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text("https://user:ghp_secretvalue@example.invalid/\n")
    listing = ("import os\nfor d, _, fs in os.walk('.'):\n    for f in fs:\n"
               "        print('FILE', os.path.relpath(os.path.join(d, f)))\n")
    custom = tmp_path / "custom-env.yaml"  # a runtime env of one's own, which once sent .git along
    custom.write_text("excludes: [strata-data/]\n")
    submissions = {  # the wrapper's runtime env (default and custom), and plain `ray job submit` with the file
        "strata submit": ["--runtime-env-json", json.dumps(runtime_env(str(work), None))],
        "strata submit --runtime-env": ["--runtime-env-json", json.dumps(runtime_env(str(work), str(custom)))],
        "ray job submit": ["--working-dir", str(work), "--runtime-env", os.path.join(REPO, "platform", "runtime-env.yaml")],
    }
    for how, flags in submissions.items():
        out = _job(head, "submit", *flags, "--", "python", "-c", listing)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        arrived = {line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("FILE ")}
        assert arrived == set(code), f"{how}: uploaded {sorted(arrived - set(code))}, missing {sorted(set(code) - arrived)}"


@pytest.mark.ray
def test_strata_submit_refuses_a_head_no_job_could_run_on(tmp_path, corpus):
    """A plain `ray start --head` has no tier label: a job would wait PENDING forever. strata submit refuses,
    naming the label and the command that adds it; without a storage root for a remote cluster, it refuses
    before any request."""
    temp = tempfile.mkdtemp(prefix="rayp-", dir="/tmp")
    os.makedirs(os.path.join(temp, "ray"))
    env = _head_env(temp)
    proc, address = _start_head([os.path.join(BIN, "ray"), "start", "--head"], env)
    try:
        for kind, tier in (("preprocess", "cpu"), ("train", "cpu")):
            out = _submit({"env": env}, kind, "--address", address, "--", "--input", corpus["path"], "--dataset", "x",
                          env={**env, "STRATA_STORAGE": str(tmp_path)})
            assert out.returncode == 2, out.stderr[-2000:]
            line = out.stderr.strip().splitlines()[-1]
            assert f"serves the {tier} tier" in line and f"--labels={tiers.label_key(tier)}=true" in line, line
            assert "README" in line and "Traceback" not in out.stderr
        listed = subprocess.run([os.path.join(BIN, "ray"), "job", "list", "--address", address], env=env,
                                capture_output=True, text=True)
        assert "submission_id='" not in listed.stdout, "nothing was submitted"
    finally:
        _stop_head(proc)
        remove_ray_dir(temp)
    remote = {k: v for k, v in env.items() if k != "STRATA_STORAGE"}
    out = _submit({"env": remote}, "train", "--address", "https://10.255.255.1:8265", "--", "--dataset", "x", env=remote)
    assert out.returncode == 2 and "set STRATA_STORAGE (or --storage) to storage every node" in out.stderr


def test_a_plain_ray_job_submit_without_a_storage_root_refuses_to_start(head, corpus):
    """The shipped runtime env names no bucket: a job submitted with it alone says what is missing."""
    env = {k: v for k, v in head["env"].items() if k != "STRATA_STORAGE"}
    out = _job(head, "submit", "--working-dir", ".", "--runtime-env", os.path.join(REPO, "platform", "runtime-env.yaml"),
               "--", "python", "-m", "pipelines.preprocess", "--input", corpus["path"], "--dataset", "nowhere", env=env)
    assert out.returncode != 0
    assert "STRATA_STORAGE is not set for this Ray job" in out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_strata_submit_runs_infer_and_no_wait_says_how_to_follow(head, exported_model, storage_root, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "def "}\n{"prompt": "import "}\n')
    env = {**head["env"], "STRATA_STORAGE": storage_root}
    out = _submit(head, "infer", "--address", head["address"], "--no-wait", "--", "generate", "--model",
                  exported_model, "--prompts", str(prompts), "--max-tokens", "4", "--name", "submitted-gen",
                  env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    follow = next(line for line in out.stderr.splitlines() if "follow it with: " in line)
    command = shlex.split(follow.split("follow it with: ", 1)[1].split("  (", 1)[0])
    assert command[:4] == [os.path.join(BIN, "ray"), "job", "logs", "--follow"]  # the venv's, runnable from any shell
    logs = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert logs.returncode == 0 and "2 prompts" in logs.stdout + logs.stderr, logs.stdout[-2000:] + logs.stderr[-2000:]
    assert "joined Ray cluster at 127.0.0.1:" in logs.stdout + logs.stderr  # the head's loopback, nothing else
    done = Storage(storage_root).generations("submitted-gen")
    assert os.path.exists(os.path.join(done, "completions.jsonl"))
