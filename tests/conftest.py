"""Shared fixtures: hermetic storage, a generated corpus, one local Ray per session.

Every Ray here binds to 127.0.0.1 (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, set
before Ray is imported) and gets its own short temp dir.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import socket
import tempfile
import time
import uuid

import guard
import pytest
from guard import marks_are_true  # noqa: F401 - an autouse fixture: every test's marks are checked

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray Train's controller polls its workers every 2 s, so a tiny run's end was seen up to 2 s late (its start too):
# 0.25 s took a 4-step run from 15-18 s to 11-14 s, the same CPU. A poll that misses is no failure (10 min is).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Tests never write to the real home (~/.ray, ~/.strata): every process they start gets a temporary one.
TEST_HOME = os.environ["HOME"] = tempfile.mkdtemp(prefix="strata-test-home-")
# Removed at exit by whichever process made it: xdist's controller and a script importing conftest run no
# session fixture (the session's own removal, below, comes first where one runs).
atexit.register(shutil.rmtree, TEST_HOME, True)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "STRATA_SIGNING_KEY", "STRATA_SIGNING_KEY_FILE",
            "STRATA_SIGNING_KEYRING"):
    os.environ.pop(var, None)


def _session_key() -> None:
    """This machine's signing key in the session's home, as a laptop's first embedded run makes it: tests sign
    checkpoints without a Ray too."""
    from strata.data import signing

    signing.ensure_local_key()


_session_key()


def train_run(model, tcfg, *, dataset: str, run_name: str, storage, allow_change: bool = False, **launch) -> dict:
    """train.trainer.run of `model` exactly as given (its shape too) with `tcfg` on `dataset`, resolved as
    `python -m train` resolves a launch (train.spec.resolve)."""
    from dataclasses import asdict

    from train.spec import resolve
    from train.trainer import run

    spec = resolve(storage, dataset, model, tcfg, model_flags=asdict(model), run_name=run_name,
                   allow_change=allow_change)
    return run(spec, run_name=run_name, storage=storage, allow_change=allow_change, **launch)


def doc_pages() -> list[str]:
    """The README and every page of docs/: what a person reads, and what the README tests hold true."""
    import glob

    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def doc_text() -> str:
    out = []
    for path in doc_pages():
        with open(path) as f:
            out.append(f.read())
    return "\n".join(out)


def readme_blocks(lang: str = "bash") -> list[str]:
    """The fenced code blocks in `lang` of the README and the docs pages, continuation lines joined."""
    import re

    return [block.replace("\\\n", " ") for block in re.findall(rf"```{lang}\n(.*?)```", doc_text(), re.S)]


def readme_command(prefix: str) -> str:
    """The one README command line that starts with `prefix` (a test runs exactly what the README shows)."""
    found = [line.strip() for block in readme_blocks() for line in block.splitlines()
             if line.strip().startswith(prefix)]
    assert len(found) == 1, f"the README should show one `{prefix} ...` line, not {len(found)}"
    return " ".join(found[0].split())


def write_checkpoint(dest, model, step: int, meta: dict, optimizer=None) -> str:
    """A checkpoint as training writes it (train.checkpoint.AsyncCheckpointer, in one process), at `dest`:
    signed for the run whose folder holds it (`.../runs/RUN/checkpoint-<step>`), if one does."""
    import torch

    from train.checkpoint import AsyncCheckpointer, bound_to

    run = bound_to(str(dest))[0] or ""
    checkpointer = AsyncCheckpointer(model, optimizer or torch.optim.AdamW(model.parameters()), 0, run=run)
    checkpointer.start(step, meta)
    _, local = checkpointer.take()
    shutil.move(local, str(dest))
    return str(dest)


def edit_manifest(dataset_dir: str, number: int, edit) -> None:
    """Rewrite version `number`'s manifest in its Delta log entry with `edit(manifest_dict)` (a tampered
    or foreign dataset, for tests of what readers refuse)."""
    entry = os.path.join(dataset_dir, "_delta_log", f"{number:020d}.json")
    with open(entry) as f:
        actions = [json.loads(line) for line in f if line.strip()]
    for a in actions:
        if "commitInfo" in a:
            st = json.loads(a["commitInfo"]["strata"])
            edit(st["manifest"])
            a["commitInfo"]["strata"] = json.dumps(st)
    with open(entry, "w") as f:
        f.write("".join(json.dumps(a) + "\n" for a in actions))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The S3 API server (moto, as Ray's own tests use) for s3:// storage. Set before any Ray starts, so
# every Ray worker, and every subprocess, reaches it through the standard variables.
# A subprocess that imports this module keeps its parent's endpoint.
# Each pytest-xdist worker runs its own server (the variable names the worker).
_S3_VAR = "STRATA_TEST_S3_ENDPOINT" + (f"_{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "")
S3_ENDPOINT = os.environ.setdefault(_S3_VAR, f"http://127.0.0.1:{_free_port()}")
os.environ.update({"AWS_ENDPOINT_URL": S3_ENDPOINT, "AWS_ACCESS_KEY_ID": "testing",
                   "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_EC2_METADATA_DISABLED": "true"})

WORDS = ["data", "model", "token", "train", "layer", "batch", "node", "cluster", "spot", "shard", "parquet", "ray", "tune", "loss", "step", "the", "a", "of", "and", "to", "in", "is", "for", "on", "with"]


def make_corpus(root: str, docs: int = 40, seed: int = 0) -> dict:
    """Good text files, a JSONL file, and one of each kind of bad input.

    Returns what was made, so tests derive expectations from construction.
    """
    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    good = []
    for i in range(docs):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 200))) + f" doc{i}."
        with open(os.path.join(root, f"doc{i:03d}.txt"), "w") as f:
            f.write(text)
        good.append(text)
    json_good = ["first json document with plenty of words in it", "second json document, also long enough"]
    with open(os.path.join(root, "lines.jsonl"), "w") as f:
        f.write("\n".join([f'{{"text": "{json_good[0]}"}}', "{not json", '{"id": 3}',
                           f'{{"text": "{json_good[1]}"}}']) + "\n")
    # Duplicates keep the byte length, so the token count does not depend on which copy wins.
    variants = ["  " + good[0].upper() + "  \n", good[1].rsplit(" ", 1)[0] + " dox1."]
    with open(os.path.join(root, "exact-dup.txt"), "w") as f:  # doc000 up to case and spacing
        f.write(variants[0])
    with open(os.path.join(root, "near-dup.txt"), "w") as f:  # doc001 with its last word changed
        f.write(variants[1])
    with open(os.path.join(root, "bad-utf8.txt"), "wb") as f:
        f.write(b"caf\xe9 is not utf-8 but this line is long")
    with open(os.path.join(root, "binary.txt"), "wb") as f:
        f.write(b"\x00\x01\x02" * 100)
    with open(os.path.join(root, "short.txt"), "w") as f:
        f.write("tiny")
    return {"files": len(os.listdir(root)), "good": good + json_good, "variants": [v.strip() for v in variants],
            "rejected": {"malformed-json": 1, "missing-text-field": 1, "invalid-utf8": 1, "binary": 1},
            "filtered": {"too-short": 1}, "duplicate": {"exact": 1, "near": 1}}


@pytest.fixture
def priced(tmp_path):
    """Runs priced at 3.6 per hour on the local node (STRATA_PRICES), so their cost is their node-seconds
    / 1000 and every run has one of its own."""
    import yaml

    path = tmp_path / "prices.yaml"
    path.write_text(yaml.safe_dump({"currency": "EUR", "as_of": "test",
                                    "node_types": {"local": {"instance": "test box", "on_demand": 3.6}}}))
    os.environ["STRATA_PRICES"] = str(path)
    yield str(path)
    os.environ.pop("STRATA_PRICES", None)


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("storage"))
    os.environ["STRATA_STORAGE"] = root
    return root


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server on 127.0.0.1, once per pytest run."""
    from moto.server import ThreadedMotoServer

    port = int(S3_ENDPOINT.rsplit(":", 1)[1])
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield S3_ENDPOINT
    server.stop()


@pytest.fixture
def s3_root(s3_server):
    """A fresh bucket for this test; returns the storage root URI inside it."""
    import boto3

    guard.uses("s3")  # the test's mark is checked against it
    bucket = f"strata-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/strata"


@pytest.fixture(params=["local", "s3"])
def any_root(request, tmp_path):
    """The same test on local disk and on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "storage")
    return request.getfixturevalue("s3_root")


# Sweeps in tests search the learning rate at micro-batch 4: the default space's batch sizes of 8-32 made each
# trial 2-8x the compute on the debug model (most of a sweep test's CPU), for nothing those tests check.
SWEEP_SPACE = {"lr": {"loguniform": [3e-4, 3e-2]}, "batch_size": {"choice": [4]}}


@pytest.fixture(scope="session")
def sweep_space(tmp_path_factory) -> str:
    """SWEEP_SPACE as a space file (--space, SweepConfig.space)."""
    import yaml

    path = tmp_path_factory.mktemp("space") / "lr-at-batch-4.yaml"
    path.write_text(yaml.safe_dump(SWEEP_SPACE))
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("corpus"))
    return {"path": root, **make_corpus(root)}


_ray_dirs: list[str] = []


def ensure_local_ray():
    """The embedded local Ray, started once and shared; restarted only if a
    multi-node test module replaced it with a cluster of its own."""
    import ray

    from strata.cluster import tiers
    from strata.cluster.connect import connect, shutdown

    nodes = ray.nodes() if ray.is_initialized() else []
    if len(nodes) == 1 and tiers.tiers_of(nodes[0].get("Labels", {})) == set(tiers.Tier):
        return ray
    shutdown()
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    _ray_dirs.append(temp)
    connect(num_cpus=2, temp_dir=temp)
    return ray


@pytest.fixture
def local_ray(storage_root):
    return ensure_local_ray()


@pytest.fixture
def joined(local_ray) -> dict:
    """The variables that run a command on the session's Ray, as a submitted job runs, instead of on an
    embedded one of its own (7-10 CPU s to start and stop on 2 cores): for a command whose start and exit
    are not what the test checks."""
    return {"RAY_ADDRESS": local_ray.get_runtime_context().gcs_address}


def wait_for(predicate, what: str, timeout: float = 300) -> None:
    """Poll `predicate` until true; a TimeoutError naming `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise TimeoutError(f"timed out waiting for {what}")



def kill_node(cluster, node) -> None:
    """`cluster.remove_node(node, allow_graceful=False)`, as a lost machine goes, and every worker of that node
    with it. Ray kills the node's daemons; a worker that misses its raylet's death lives on (a fresh clone's
    run, 2026-12-06: a `ray::MapWorker` of test_crash's killed node outlived the suite)."""
    from ray._private import ray_constants

    from strata.cluster.connect import _reap
    from strata.cluster.procs import processes, tree

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    workers = tree(raylet, processes()) - {raylet}
    cluster.remove_node(node, allow_graceful=False)
    _reap(workers)


@contextlib.contextmanager
def simulated_cluster(nodes: list[tuple[tuple, int]]):
    """A multi-node Ray cluster on 127.0.0.1: a head with no CPUs and no tier, plus
    one node per (tiers, cpus). Yields (cluster, [node, ...]); this process is its driver."""
    import ray
    from ray.cluster_utils import Cluster

    from strata.cluster import tiers
    from strata.cluster.connect import remove_ray_dir, shutdown, state_api_at, stop_monitor
    from strata.cluster.procs import kill_naming

    shutdown()  # replaces the session's local Ray; ensure_local_ray() brings it back
    temp = tempfile.mkdtemp(prefix="rayc-", dir="/tmp")
    os.makedirs(os.path.join(temp, "ray"))
    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp  # every node, and the cluster's address file, under our own dir
    port = _free_port()  # not 8265: another pytest process (an xdist worker) may be starting a Ray on it
    try:
        with state_api_at(port):  # as strata.cluster.connect does for an embedded Ray
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "object_store_memory": 100 << 20, "include_dashboard": True,
                "dashboard_host": "127.0.0.1", "dashboard_port": port})
    except BaseException:  # a head half started: its processes go with its dir
        kill_naming(temp)
        shutil.rmtree(temp, ignore_errors=True)
        raise
    try:
        with state_api_at(port):
            added = [cluster.add_node(num_cpus=cpus, labels=tiers.node_labels(*node_tiers),
                                      object_store_memory=100 << 20) for node_tiers, cpus in nodes]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield cluster, added
    finally:
        ray.shutdown()
        stop_monitor(cluster.head_node)
        cluster.shutdown()
        if old_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmpdir
        remove_ray_dir(temp)  # a worker of the cluster still dying writes its log there for a moment


def pytest_configure(config):
    guard.configure(config)
    if not guard.WATCHER.is_alive():
        guard.WATCHER.start()


def pytest_collection_modifyitems(config, items):
    guard.modify_items(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    guard.setup_begins(item)


@pytest.fixture(scope="session", autouse=True)
def _stop_ray_at_end():
    """The shared Ray stopped and its temp dir gone; then nothing the session started may be left
    (tests/guard.py): a process still alive or a Ray temp dir still there fails the run."""
    yield
    from strata.cluster.connect import remove_ray_dir, shutdown

    shutdown()
    for d in _ray_dirs:
        remove_ray_dir(d)
    shutil.rmtree(TEST_HOME, ignore_errors=True)
    if left := guard.end_of_session():
        pytest.fail("the tests left behind:\n" + "\n".join(left), pytrace=False)


@pytest.fixture(scope="session")
def exported_model(tmp_path_factory):
    """A small model with non-trivial weights (byte tokenizer, context 32), as training checkpoints it and
    train.export writes it: its directory."""
    from dataclasses import asdict

    import torch

    from strata.data.tokenizer import ByteTokenizer
    from train.export import export
    from train.model import GPT, preset

    root = tmp_path_factory.mktemp("model")
    cfg = preset("debug", n_layer=2, n_embd=64, n_head=4, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    ckpt = write_checkpoint(root / "checkpoint-00000005", model, 5,
                            {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())})
    export(ckpt, str(root / "hf"))
    return str(root / "hf")


@pytest.fixture(scope="session")
def dataset(storage_root, corpus):
    """The corpus preprocessed once into a committed version (debug preset: seq_len 128)."""
    from pipelines.config import debug
    from pipelines.driver import run
    from strata.data.storage import Storage

    ensure_local_ray()
    # Document ids carry the (random) temp path and pick the split by hash: 30% keeps a validation
    # split all but certain (0.7^42) whatever the path, so tests that need one never flake.
    out = run(debug("corpus", read={"inputs": (corpus["path"],)}, pack={"validation_fraction": 0.3}),
              Storage.from_env())
    return {**out, "ref": f"{out['dataset']}@{out['version']}"}  # later tests add versions: pin this one


@pytest.fixture(scope="session")
def second_dataset(storage_root, dataset, tmp_path_factory):
    """Another corpus (`code`) with the same tokenizer and seq_len as `dataset`: a mixture's second source."""
    from pipelines.config import debug
    from pipelines.driver import run
    from strata.data.storage import Storage

    root = str(tmp_path_factory.mktemp("code"))
    make_corpus(root, docs=30, seed=1)
    out = run(debug("code", read={"inputs": (root,)}, pack={"validation_fraction": 0.3}), Storage.from_env())
    return {**out, "ref": f"{out['dataset']}@{out['version']}"}
