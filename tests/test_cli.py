"""The entry points as users run them: `--help`, clear errors for bad input, progress, Ctrl-C."""

import json
import os
import shlex
import subprocess
import sys
import tempfile

import pytest
from conftest import REPO

from strata.cluster.connect import remove_ray_dir

ENTRY_POINTS = {
    "pipelines.preprocess": ["--input", "--dataset", "--tokenizer", "--seq-len", "--json"],
    "train": ["--dataset", "--preset", "--max-steps", "--run", "--json"],
    "tune": ["--dataset", "--preset", "--num-samples", "--json"],
    "train.sample": ["--run", "--prompt"],
}


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_help_lists_the_documented_flags(module):
    out = cli(module, "--help")
    assert out.returncode == 0, out.stderr
    for flag in ENTRY_POINTS[module]:
        assert flag in out.stdout, f"{module} --help lacks {flag}"


def test_strata_command_lists_demo():
    out = cli("strata", "--help")
    assert out.returncode == 0 and "demo" in out.stdout


def test_the_demo_shows_each_stage_as_a_shell_takes_it():
    from strata.commands.demo import shown

    line = shown("train.sample", ["--run", "demo", "--prompt", "def ", "--tokens", "160"])
    assert line == "python -m train.sample --run demo --prompt 'def ' --tokens 160"


def test_missing_input_is_a_clear_error(tmp_path):
    out = cli("pipelines.preprocess", "--input", str(tmp_path / "nope"), "--dataset", "x", "--json",
              env={"STRATA_STORAGE": str(tmp_path / "store")})
    assert out.returncode != 0
    assert "does not exist" in out.stderr and "Traceback" not in out.stderr
    assert not os.path.exists(tmp_path / "store" / "datasets" / "x")


def test_bad_config_values_are_usage_errors(tmp_path):
    out = cli("pipelines.preprocess", "--input", str(tmp_path), "--dataset", "bad/name")
    assert out.returncode == 2 and "invalid dataset name" in out.stderr
    out = cli("pipelines.preprocess", "--input", str(tmp_path), "--dataset", "x", "--seq-len", "many")
    assert out.returncode == 2 and "invalid int value" in out.stderr


def test_training_on_a_missing_dataset_is_a_clear_error(tmp_path):
    out = cli("train", "--dataset", "ghost", "--max-steps", "1", env={"STRATA_STORAGE": str(tmp_path)})
    assert out.returncode != 0 and "dataset 'ghost' has no committed version" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_mistyped_flag_is_one_line_with_a_hint():
    for module, required in (("train", []), ("pipelines.preprocess", ["--input", "x", "--dataset", "x"]),
                             ("tune", ["--dataset", "x"])):
        out = cli(module, *required, "--max-stepz", "3")
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            f"python -m {module}: error: unrecognized arguments: --max-stepz 3") and lines[0].endswith(
            f"(see python -m {module} --help)"), out.stderr


def test_bad_values_are_refused_in_one_line_before_ray_starts(tmp_path):
    env = {"STRATA_STORAGE": str(tmp_path)}
    for module, args, message in (("train", ["--lr", "-1"], "--lr -1.0: must be > 0"),
                                  ("train", ["--dropout", "1.5"], "--dropout 1.5: must be in [0, 1)"),
                                  ("train", ["--warmup-steps", "-5"], "--warmup-steps -5: must be >= 0"),
                                  ("tune", ["--num-samples", "0"], "--num-samples 0: must be >= 1"),
                                  ("tune", ["--cpus-per-trial", "nan"], "--cpus-per-trial nan: must be > 0")):
        out = cli(module, "--dataset", "anything", *args, env=env)
        assert out.returncode == 2, (module, args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, out.stderr)
    assert not os.path.exists(tmp_path / "runs") and not os.path.exists(tmp_path / "sweeps")


def test_a_missing_dataset_lists_the_datasets_there_and_starts_nothing(dataset, storage_root):
    for module in ("train", "tune"):
        out = cli(module, "--dataset", "ghost", "--max-steps" if module == "train" else "--steps", "1",
                  env={"STRATA_STORAGE": storage_root})
        assert out.returncode == 1, out.stderr
        assert "dataset 'ghost' has no committed version" in out.stderr and dataset["dataset"] in out.stderr
        assert "started embedded local Ray" not in out.stderr and "Traceback" not in out.stderr


def test_an_empty_input_folder_is_an_error_unless_allowed(tmp_path):
    (tmp_path / "empty").mkdir()
    env = {"STRATA_STORAGE": str(tmp_path / "store")}
    out = cli("pipelines.preprocess", "--input", str(tmp_path / "empty"), "--dataset", "x", "--json", env=env)
    assert out.returncode == 1, out.stderr
    assert f"no input files found under {tmp_path / 'empty'}" in out.stderr and "--allow-empty" in out.stderr
    out = cli("pipelines.preprocess", "--input", str(tmp_path / "empty"), "--dataset", "x", "--allow-empty", "--json",
              env=env)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["version"] is None and summary["documents"]["read"] == 0


def test_sample_documents_its_flags():
    text = cli("train.sample", "--help").stdout
    for flag in ("--temperature", "--seed", "--tokens", "--samples"):
        help_line = text[text.index(flag):].split("\n  -")[0]
        assert len(help_line.split()) > 3, f"{flag} has no help: {help_line!r}"


def test_the_strata_command_runs_from_any_shell(tmp_path):
    """`.venv/bin/strata` (a console script) runs with the environment's Python whatever PATH finds first."""
    script = os.path.join(os.path.dirname(sys.executable), "strata")
    out = subprocess.run([script, "runs"], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "STRATA_STORAGE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "no runs recorded under" in out.stdout


def _follow(cmd: list[str], env: dict, until: str) -> tuple[subprocess.Popen, list[str]]:
    """Start a command in its own process group and read its output until a line contains `until`. Its SIGINT is
    a terminal's (the default), even when the suite itself runs as a background job, which ignores SIGINT and
    passes that on to every child."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", *cmd], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, **env},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if until in line:
            return proc, lines
    proc.wait()
    raise AssertionError(f"{until!r} never came:\n{''.join(lines)[-3000:]}")


@pytest.mark.slow("trains twice, Ctrl-C between, each its own Ray")
def test_training_prints_its_progress_and_no_ray_noise_and_ctrl_c_says_how_to_continue(local_ray, dataset,
                                                                                         storage_root):
    """What a person sees: one line per log point, no Ray internals, no error-level line; the run's record counts
    the whole command; Ctrl-C (SIGINT to the process group, as a terminal sends it) ends with one line. The first
    command starts its own Ray, as on a laptop; the second joins the session's, as a submitted job does."""
    import signal
    import time

    from strata.accounting.records import find_record
    from strata.data.storage import Storage

    env = {"STRATA_STORAGE": storage_root}
    started = time.time()
    out = cli("train", "--dataset", dataset["ref"], "--max-steps", "40", "--log-every", "5", "--eval-every", "40",
              "--run", "watched", "--json", env=env)
    wall = time.time() - started
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [line for line in out.stderr.splitlines() if line.startswith("[train] step ")]
    assert steps and steps[-1].startswith("[train] step 40/40 · loss ") and " tok/s" in steps[-1], out.stderr
    assert any("ETA " in line for line in steps[:-1]) and "val " in steps[-1]
    for noise in ("TrainingReport(", "PreemptionWatcher", "Traceback", "ERROR", " E ", "(TrainController",
                  "(RayTrainWorker"):
        assert noise not in out.stderr, f"{noise!r} in:\n{out.stderr[-3000:]}"
    record = find_record(Storage(storage_root), "train/watched")
    # The command, not the fit alone. Its start is the process's (strata.commands.shell.process_started), which psutil
    # derives from the kernel's boot time in whole seconds: up to a second early (CI saw 28.7 s for 28.57).
    assert 0.8 * wall <= record["seconds"] <= wall + 1.0, (record["seconds"], wall)

    joined = {**env, "RAY_ADDRESS": local_ray.get_runtime_context().gcs_address}
    proc, lines = _follow(["train", "--dataset", dataset["ref"], "--max-steps", "5000", "--checkpoint-every", "10",
                           "--log-every", "5", "--run", "stopped", "--no-use-gpu"], joined, until="[train] step 2")
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("[train] interrupted: training run stopped; kept "), last
    assert last.endswith(f"continue with: python -m train --dataset {dataset['ref']} --max-steps 5000 "
                         "--checkpoint-every 10 --log-every 5 --run stopped --no-use-gpu"), last
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest


@pytest.mark.ray
def test_ctrl_c_in_preprocessing_keeps_nothing_and_the_printed_command_continues(corpus, tmp_path, joined):
    import signal

    env = {"STRATA_STORAGE": str(tmp_path / "store")}
    proc, lines = _follow(["pipelines.preprocess", "--input", corpus["path"], "--dataset", "halted"], env,
                          until="pass 1/3")
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("[preprocess] interrupted: preprocessing into dataset halted; kept no new version"), last
    assert "Traceback" not in rest
    again = shlex.split(last.split("continue with: ", 1)[1])
    assert again[:3] == ["python", "-m", "pipelines.preprocess"]
    out = cli(*again[2:], "--json", env={**env, **joined})  # on the session's Ray: its start is not the subject
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1])["version"] == "v0001"
    # The summary table follows the tagged lines as it is: no line that holds only the tag before it.
    lines = out.stderr.splitlines()
    assert not [ln for ln in lines if ln.strip() == "[preprocess]"], out.stderr[-2000:]
    assert any(ln.startswith("documents read") for ln in lines), out.stderr[-2000:]


@pytest.mark.ray
def test_sigterm_stops_a_command_as_ctrl_c_does_and_its_ray_temp_dir_goes(corpus, tmp_path):
    """m9: SIGTERM (a job manager, Kubernetes, kill) gave Ray's C++ abort, exit 134; m11: the embedded Ray's
    temp dir was left behind, mode 0777."""
    import re
    import signal

    env = {"STRATA_STORAGE": str(tmp_path / "store")}
    proc, lines = _follow(["pipelines.preprocess", "--input", corpus["path"], "--dataset", "termed"],
                          env, until="pass 1/3")
    temp = next(m.group(1) for line in lines if (m := re.search(r"temp (/\S+strata-ray-\w+)\)", line)))
    assert os.stat(temp).st_mode & 0o777 == 0o700
    os.kill(proc.pid, signal.SIGTERM)  # the process alone, as a job manager sends it
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 143, "".join(lines) + rest
    last = rest.strip().splitlines()[-1]
    assert last.startswith("[preprocess] terminated (SIGTERM), interrupted: preprocessing into dataset termed; "
                           "kept no new version"), last
    assert "Traceback" not in rest and "abort" not in rest.lower()
    assert not os.path.exists(temp)


_ENDING = """
import atexit, sys, threading, time
from strata.commands.shell import Command

def body(cmd):
    atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))
    if sys.argv[2] == "thread":  # work left in a thread that is not a daemon: the process waits for it
        threading.Thread(target=lambda: (time.sleep(0.5), open(sys.argv[1] + ".thread", "w").write("done"))).start()
    if sys.argv[2] == "interrupt":
        raise KeyboardInterrupt
    print("last line, unflushed", end="")
    return {}

Command("python -m ending").run(body)
print(" -- after the command: never printed")
"""


@pytest.mark.parametrize("how", ["done", "thread", "interrupt"])
def test_a_command_that_is_the_process_ends_it_with_its_exit_handlers_run_and_output_flushed(tmp_path, how):
    out = subprocess.run([sys.executable, "-c", _ENDING, str(tmp_path / "m"), how], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == (130 if how == "interrupt" else 0), out.stderr
    assert (tmp_path / "m.atexit").read_text() == "ran"
    if how == "interrupt":
        assert "interrupted" in out.stderr and not out.stdout
    else:
        assert out.stdout == "last line, unflushed", out.stdout
    if how == "thread":
        assert (tmp_path / "m.thread").read_text() == "done"


@pytest.mark.parametrize("command", [["pipelines.datasets", "show", "ds", "--json"], ["pipelines.datasets", "list"],
                                     ["strata", "runs"]])
def test_a_reader_that_goes_away_ends_a_command_quietly(tmp_path, command):
    """`datasets show X --json | head` ended in a BrokenPipeError reported as a bug in strata (exit 70)."""
    from test_dataset_contract import _stage

    from strata.data.commit import commit
    from strata.data.storage import Storage, write_json_atomic

    storage = Storage(str(tmp_path))
    commit(storage, "ds", *_stage(storage, "ds"))
    from test_trust import _record

    for i in range(50):
        write_json_atomic(os.path.join(storage.records(), f"r{i}.json"), _record(name=f"r{i}", started_at=float(i)))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes a line
    out = subprocess.run([sys.executable, "-m", *command], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "STRATA_STORAGE": str(tmp_path)}, timeout=120)
    os.close(write)
    assert "Traceback" not in out.stderr and "a bug in strata" not in out.stderr, out.stderr
    assert out.returncode == 141, out.stderr


@pytest.mark.ray
def test_every_console_line_of_tier_1_and_a_sweep_is_strata_s(corpus, tmp_path):
    """Ray Data's executor lines (about 40 a pass), the driver's `E core_worker.cc` line and Ray Tune's
    experiment box reached the console: every line a command prints is now its own (tagged, or its summary
    table), unless --verbose."""
    import re

    env = {"STRATA_STORAGE": str(tmp_path / "store")}
    pre = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", corpus["path"], "--dataset", "quiet"],
                         cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert pre.returncode == 0, pre.stderr[-3000:]
    sweep = subprocess.run([sys.executable, "-m", "tune", "--dataset", "quiet", "--num-samples", "2", "--steps", "2"],
                           cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    # Ray's own formats: its Python loggers (a timestamp first), its C++ log ([time E pid pid]), a worker's
    # prefix ((name pid=N)), Tune's boxes, Python warnings and tracebacks.
    ray = re.compile(r"^(\d{4}-\d\d-\d\d[ T]|\[\d{4}-\d\d-\d\d |\(\w+ pid=\d+|[╭│╰├]|.*Warning: |Traceback)")
    for out in (pre, sweep):
        foreign = [line for line in (out.stderr + out.stdout).splitlines() if ray.match(line)]
        assert not foreign, "\n".join(foreign[:20])
        others = [line for line in out.stderr.splitlines()
                  if line.startswith("[") and not line.startswith(("[preprocess] ", "[tune] ", "[train] ", "[lease] "))]
        assert not others, "\n".join(others[:20])
    assert "Configuration for experiment" not in sweep.stderr + sweep.stdout


@pytest.mark.ray
def test_a_dataset_without_validation_rows_says_so(tmp_path, joined):
    """A 7-document dataset got 0 validation rows with no warning. (Each document's split is a hash of its
    record id, which holds the test's temp path: at 0.01, 1 run in 15 drew a validation document and no
    warning was due; at 0.0001, about 1 in 1,400.)"""
    src = tmp_path / "seven"
    src.mkdir()
    for i in range(7):
        (src / f"f{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + 1  # a small function with words\n" * 3)
    out = cli("pipelines.preprocess", "--input", str(src), "--dataset", "seven", "--validation-fraction", "0.0001",
              env={"STRATA_STORAGE": str(tmp_path / "store"), **joined})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "[preprocess] warning: seven@v0001 has no validation rows" in out.stderr


def test_a_sweep_of_a_missing_dataset_says_so_before_ray_starts(tmp_path):
    """`tune` took 21.7 s to say a dataset does not exist: it started Ray first."""
    out = cli("tune", "--dataset", "nope", "--num-samples", "2", env={"STRATA_STORAGE": str(tmp_path)})
    assert out.returncode == 1 and "dataset 'nope' has no committed version" in out.stderr, out.stderr
    assert "started embedded local Ray" not in out.stderr and "Traceback" not in out.stderr


def test_a_mistyped_flag_gets_a_did_you_mean():
    out = cli("train", "--dataset", "x", "--max-step", "5")
    assert out.returncode == 2 and "--max-step: did you mean --max-steps" in out.stderr, out.stderr
    out = cli("pipelines.datasets", "show", "x", "--jsn")
    assert out.returncode == 2 and "--jsn: did you mean --json?" in out.stderr, out.stderr


_LOST = """
import os
import sys
import tempfile
import ray
from strata.cluster.connect import connect
from strata.commands.shell import Command

def body(cmd):
    connect(num_cpus=1, temp_dir=sys.argv[1], dashboard=False, quiet=True)

    @ray.remote(max_restarts=0)
    class Peer:
        def ping(self):
            return 1

        def crash(self):
            os._exit(1)  # as a node lost under it would: the peer is gone mid-call

    peer = Peer.remote()
    ray.get(peer.ping.remote())
    return ray.get(peer.crash.remote())  # not ray.kill: a call right after it could still be answered

Command("python -m lost").run(body)
"""


@pytest.mark.ray
def test_the_cluster_failing_under_a_command_is_one_line_not_a_bug(tmp_path):
    """A peer the run worked with died (its node cut off, say): Ray's ActorDiedError ended the command as a
    bug in strata (exit 70, a traceback). It is one line naming what Ray lost, exit 1."""
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "HOME": str(tmp_path)}
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit
    try:
        out = subprocess.run([sys.executable, "-c", _LOST, temp], cwd=REPO, capture_output=True, text=True,
                             timeout=180, env=env)
    finally:
        remove_ray_dir(temp)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error: the Ray cluster failed under this run: ActorDiedError" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "a bug in strata" not in out.stderr


def test_the_help_a_newcomer_reads_first():
    """`strata --help` names every kind submit takes; `strata head --help` keeps its usage lines as written."""
    from strata.commands.submit import MODULES

    line = next(ln for ln in cli("strata", "--help").stdout.splitlines() if ln.strip().startswith("submit"))
    assert all(kind in line for kind in MODULES), line
    head = cli("strata", "head", "--help").stdout
    assert "\n    python -m strata head status\n" in head and "\n    python -m strata head stop\n" in head, head


def test_submit_with_no_head_there_says_to_start_one(tmp_path):
    """No head at the address: one line saying so and how to start one, not Ray's advice to reinstall it."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"HOME": str(tmp_path), "RAY_AUTH_TOKEN": "t" * 32}
    out = cli("strata", "submit", "preprocess", "--address", f"http://127.0.0.1:{port}", "--working-dir", "",
              "--", "--input", "x", "--dataset", "x", env=env)
    assert out.returncode == 1, out.stderr
    assert f"no Ray head answers at http://127.0.0.1:{port}" in out.stderr and "strata head start" in out.stderr
    assert "pip install" not in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_job_arguments_without_the_separator_get_a_hint(tmp_path):
    out = cli("strata", "submit", "preprocess", "--address", "http://127.0.0.1:8265", "--input", "corpus", "--dataset",
              "web", env={"HOME": str(tmp_path)})
    assert out.returncode == 2, out.stderr
    assert "go after `--`: strata submit preprocess [options] -- --input corpus --dataset web" in out.stderr, out.stderr
