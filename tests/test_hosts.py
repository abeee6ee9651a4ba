"""strata across hosts with addresses of their own (tests/hosts.py), under network faults: a host cut off in
the middle of a stage: the partition cases of tier 1 and training, in `make test` (`make test-cluster`
runs this file alone).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time

import pytest
from conftest import WORDS, make_corpus
from hosts import HostCluster, missing

pytestmark = pytest.mark.slow
WHY = missing()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if WHY:
        pytest.skip(f"no cluster of hosts: {WHY}")
    from strata.connect import shutdown

    shutdown()  # the session's embedded Ray holds CPU this cluster needs; ensure_local_ray() brings it back
    c = HostCluster()
    try:
        corpus_dir = str(tmp_path_factory.mktemp("hosts-corpus"))
        corpus = make_corpus(corpus_dir, docs=60)
        rng = random.Random(1)
        big = [f"record {i} " + " ".join(rng.choice(WORDS) for _ in range(150)) for i in range(3000)]
        with open(os.path.join(corpus_dir, "big.jsonl"), "w") as f:  # about 3 MB: 48 work units of 64 KiB
            f.writelines(json.dumps({"text": t}) + "\n" for t in big)
        corpus["read"] = len(corpus["good"]) + len(big) + sum(
            sum(corpus[k].values()) for k in ("rejected", "filtered", "duplicate"))
        upload = ("import boto3, os, sys\ns3 = boto3.client('s3')\nfor n in os.listdir(sys.argv[1]):\n"
                  f"    s3.upload_file(os.path.join(sys.argv[1], n), '{c.bucket}', 'raw/' + n)\nprint('{{}}')")
        c.host("laptop").run([sys.executable, "-c", upload, corpus_dir], c.env("laptop"), timeout=120, check=True)
        c.corpus = corpus
        yield c
    finally:
        c.close()


class Stage:
    """A command on a host, its output followed line by line, with the wall clock of what it said."""

    def __init__(self, cluster: HostCluster, host: str, argv: list[str], **env):
        self.lines: list[tuple[float, str]] = []
        self.started = time.time()
        self.proc = subprocess.Popen(cluster.host(host).argv(argv), env=cluster.env(host, RAY_ADDRESS=cluster.gcs, **env),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cluster.workdir)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float = 300) -> float:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(re.search(pattern, line) for _, line in self.lines):
                return time.time()
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"never said /{pattern}/:\n{self.text()[-4000:]}")

    def finish(self, timeout: float = 900) -> int:
        rc = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        self.ended = time.time()
        return rc

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def summary(self) -> dict:
        return json.loads(next(line for _, line in reversed(self.lines) if line.startswith("{")))


def _preprocess(cluster, dataset: str) -> list[str]:
    return [sys.executable, "-m", "pipelines.preprocess", "--input", f"s3://{cluster.bucket}/raw",
            "--dataset", dataset, "--json", "--split-bytes", str(64 << 10)]


def record(cluster, ref: str) -> dict:
    """The newest run record named `ref`, read from the S3 host by the laptop."""
    return cluster.python("laptop", "import json, os\nfrom strata.records import find_record\n"
                          "from strata.storage import Storage\n"
                          f"print(json.dumps(find_record(Storage(os.environ['STRATA_STORAGE']), {ref!r})))")


def hosts_of(cluster, alive: dict, rec: dict) -> set:
    return {alive.get(n["node_id"], n["node_id"]) for n in rec["nodes"]}


def test_tier1_on_the_cpu_hosts_survives_one_cut_off_mid_pass(cluster):  # its version feeds training below
    """A cpu host's link goes down in pass 1 and stays down: the run commits once, with every document
    counted, from the host left; it names the host it lost."""
    alive = cluster.alive()
    stage = Stage(cluster, "head", _preprocess(cluster, "cut"))
    cut = stage.wait_for(r"pass 1/3") + 3
    time.sleep(max(0.0, cut - time.time()))
    cluster.host("cpu-b").cut()
    try:
        rc = stage.finish()
        assert rc == 0, stage.text()[-4000:]
        summary = stage.summary()
        docs = summary["snapshot"]["documents"]
        assert summary["snapshot"]["versions"] == 1
        assert docs["read"] == cluster.corpus["read"], docs
        assert sum(docs[k] for k in ("kept", "unpacked", "filtered", "duplicate", "rejected")) == docs["read"]
        rec = record(cluster, "preprocess/cut")
        lost = {n["address"] for n in rec["lost_nodes"]}
        print(f"FIGURE tier1 cut: {stage.ended - cut:.1f} s from the cut to the commit; lost {rec['lost_nodes']}; "
              f"work on {sorted(hosts_of(cluster, alive, rec))}")
        assert "cpu-a" in hosts_of(cluster, alive, rec)
        if lost:  # declared dead while the run still worked: it says which host
            assert lost == {cluster.host("cpu-b").ip}
            assert f"lost node {cluster.host('cpu-b').ip}" in stage.text()
    finally:
        cluster.replace("cpu-b")


def _train(run: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "train", "--dataset", "cut", "--preset", "debug", "--no-use-gpu",
            "--workers", "2", "--run", run, "--max-steps", str(steps), "--batch-size", "4",
            "--checkpoint-every", "25", "--json"]


def losses(cluster, run: str) -> dict[int, list[float]]:
    """Every step's loss a run logged (a log point holds each step's since the last), by step: a step run
    again after a resume appears twice."""
    rows = cluster.python("laptop", "import json, os\nfrom strata.runlog import read_log\nfrom strata.storage import join\n"
                          "from strata.storage import Storage\n"
                          f"print(json.dumps(read_log(join(Storage(os.environ['STRATA_STORAGE']).runs(), {run!r})).rows))")
    out: dict[int, list[float]] = {}
    for r in rows:
        for i, loss in enumerate(reversed(r.get("step_losses") or [])):
            out.setdefault(r["step"] - i, []).append(loss)
    return out


def test_training_on_two_hosts_resumes_after_one_is_cut_off_with_the_same_losses(cluster):
    """2 workers on the 2 gpu-labelled hosts (gloo across the bridge). A reference run, then the same run
    with gpu-b cut off after its first checkpoint; gpu-b comes back as a new node and the run resumes
    from the checkpoint: every loss equals the reference's, step for step."""
    steps = 150
    ref = Stage(cluster, "head", _train("ref", steps))
    assert ref.finish() == 0, ref.text()[-4000:]
    alive = cluster.alive()
    rec = record(cluster, "train/ref")
    assert hosts_of(cluster, alive, rec) >= {"gpu-a", "gpu-b"}, rec["nodes"]
    assert "CPU" in ref.text()  # a gpu-labelled host without a GPU trains on its CPU, and says so
    stage = Stage(cluster, "head", _train("cut", steps))
    cut = stage.wait_for(r"step ([3-9]\d|1\d\d)/")
    cluster.host("gpu-b").cut()
    try:
        stage.wait_for(r"lost node|restart|fail", timeout=180)
        noticed = time.time()
        cluster.replace("gpu-b")
        rc = stage.finish()
        assert rc == 0, stage.text()[-4000:]
        print(f"FIGURE train cut: noticed after {noticed - cut:.1f} s; {stage.ended - cut:.1f} s from the cut to "
              f"the end, against {ref.ended - ref.started:.1f} s for the whole reference run")
    finally:
        if "gpu-b" not in cluster.nodes or cluster.nodes["gpu-b"].poll() is not None:
            cluster.replace("gpu-b")
    want, got = losses(cluster, "ref"), losses(cluster, "cut")
    assert max(want) == max(got) == steps
    assert any(len(v) > 1 for v in got.values()), "no step ran twice: the cut did not land mid-run"
    for step, values in got.items():
        assert set(values) == set(want[step]), (step, values, want[step])
