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
def cluster():
    if WHY:
        pytest.skip(f"no cluster of hosts: {WHY}")
    from strata.connect import shutdown

    shutdown()  # the session's embedded Ray holds CPU this cluster needs; ensure_local_ray() brings it back
    c = HostCluster()
    try:
        corpus_dir = os.path.join(c.workdir, "corpus")
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


@pytest.mark.cluster
def test_a_sweep_runs_on_the_spot_host_and_reruns_what_a_cut_lost(cluster):
    """Trials run on the spot host only. Cut off mid-sweep and back as a new node, the sweep ends with
    every config accounted for: the trials that ran there are rerun, none lost."""
    argv = [sys.executable, "-m", "tune", "--dataset", "cut", "--preset", "debug", "--num-samples", "6",
            "--max-concurrent", "2", "--json"]
    stage = Stage(cluster, "head", [*argv, "--sweep", "spot"])
    assert stage.finish() == 0, stage.text()[-4000:]
    alive = cluster.alive()
    assert hosts_of(cluster, alive, record(cluster, "sweep/spot")) <= {"spot", "head"}
    whole = stage.ended - stage.started
    stage = Stage(cluster, "head", [*argv, "--sweep", "spot-cut"])
    cut = stage.wait_for(r"trial|Trial", timeout=300) + 5
    time.sleep(max(0.0, cut - time.time()))
    cluster.host("spot").cut()
    try:
        stage.wait_for(r"lost node", timeout=180)
        noticed = time.time()
    finally:
        cluster.replace("spot")
    assert stage.finish() == 0, stage.text()[-4000:]
    out = stage.summary()
    print(f"FIGURE sweep cut: noticed after {noticed - cut:.1f} s; {stage.ended - cut:.1f} s from the cut to the "
          f"end, against {whole:.1f} s for a whole sweep; {out['trials']} trials, {out['errors']} errors")
    assert out["trials"] == 6 and out["ended"] == 6 and out["errors"] == 0, out


@pytest.mark.cluster
def test_strata_submit_from_the_laptop_reaches_only_the_job_api_with_the_token(cluster):
    """The laptop reaches the head's job API (8265) and nothing else of the cluster; `strata submit` from it
    runs tier 1 there with the token, and is refused without it."""
    laptop = cluster.host("laptop")
    probe = ("import socket, sys\nfor port in (6379, 8265):\n    s = socket.socket(); s.settimeout(3)\n"
             "    print(port, s.connect_ex((sys.argv[1], port)))")
    out = laptop.run([sys.executable, "-c", probe, cluster.host("head").ip], cluster.env("laptop"), timeout=30)
    assert out.stdout.split() == ["6379", str(13), "8265", "0"], out  # 13: EACCES, the prohibit rule
    submit = [sys.executable, "-m", "strata", "submit", "preprocess", "--address", cluster.dashboard,
              "--insecure-http", "--",  # plain HTTP on the test bridge: strata refuses it to another host unless told
              "--input", f"s3://{cluster.bucket}/raw", "--dataset", "submitted", "--json", "--split-bytes", str(64 << 10)]
    refused = laptop.run(submit, {**cluster.env("laptop"), "RAY_AUTH_TOKEN": "0" * 64}, timeout=300)
    assert refused.returncode != 0 and ("401" in refused.stderr or "token" in refused.stderr.lower()), refused.stderr[-2000:]
    done = laptop.run(submit, cluster.env("laptop"), timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith("{")))
    assert summary["dataset"] == "submitted" and summary["snapshot"]["documents"]["read"] == cluster.corpus["read"]


@pytest.mark.cluster
def test_scoring_on_the_cpu_hosts_accounts_for_every_document_when_one_is_cut_off(cluster):
    """`infer score` of the trained run over the raw input from S3, its actors on the cpu hosts; with cpu-b
    cut off mid-scoring, the same documents are scored or accounted for as in a run left alone, each once."""
    argv = [sys.executable, "-m", "infer", "score", "--model", "ref", "--input", f"s3://{cluster.bucket}/raw",
            "--actors", "1", "--docs-per-batch", "64", "--json"]
    whole = Stage(cluster, "head", [*argv, "--name", "hosts-whole"])
    assert whole.finish() == 0, whole.text()[-4000:]
    alive = cluster.alive()
    assert hosts_of(cluster, alive, record(cluster, "score/hosts-whole")) <= {"cpu-a", "cpu-b", "head"}
    stage = Stage(cluster, "head", [*argv, "--name", "hosts-cut"])
    cut = stage.started + (whole.ended - whole.started) / 2
    time.sleep(max(0.0, cut - time.time()))
    cluster.host("cpu-b").cut()
    try:
        rc = stage.finish()
    finally:
        cluster.replace("cpu-b")
    assert rc == 0, stage.text()[-4000:]
    out = stage.summary()
    print(f"FIGURE score cut: {stage.ended - cut:.1f} s from the cut to the end, against "
          f"{whole.ended - whole.started:.1f} s for a whole run; {out['documents']} scored, {out['unscored']} unscored")

    def ids(summary) -> list[str]:
        return cluster.python("laptop", "import json, pyarrow.parquet as pq\nfrom strata.storage import filesystem\n"
                              f"f, p = filesystem({summary['output']!r})\n"
                              "print(json.dumps(pq.read_table(p, filesystem=f, columns=['doc_id']).column(0).to_pylist()))")

    got, want = ids(out), ids(whole.summary())
    assert len(got) == len(set(got)) == out["documents"] + out["unscored"]
    assert sorted(got) == sorted(want)


def _versions(cluster, dataset: str) -> list:
    return cluster.python("laptop", "import json, os\nfrom strata.dataset import list_versions\n"
                          "from strata.storage import Storage\n"
                          f"print(json.dumps(list_versions(Storage(os.environ['STRATA_STORAGE']), {dataset!r})))")


@pytest.mark.cluster
def test_storage_cut_off_at_tier1s_commit_commits_once_or_not_at_all(cluster):
    """The S3 host's link goes down as tier 1 writes its shards and commits, for 20 s: the run commits
    once with every document, or fails naming storage and commits nothing; a rerun then commits once."""
    stage = Stage(cluster, "head", _preprocess(cluster, "s3cut"))
    cut = stage.wait_for(r"pass 3/3")
    cluster.host("s3").cut()
    time.sleep(20)
    cluster.host("s3").heal()
    rc = stage.finish()
    print(f"FIGURE storage cut at commit: rc {rc}, {stage.ended - cut:.1f} s from the cut to the end")
    if rc == 0:
        assert stage.summary()["snapshot"]["documents"]["read"] == cluster.corpus["read"]
        assert len(_versions(cluster, "s3cut")) == 1
    else:
        assert _versions(cluster, "s3cut") == [], stage.text()[-3000:]
        again = Stage(cluster, "head", _preprocess(cluster, "s3cut"))
        assert again.finish() == 0, again.text()[-4000:]
        assert len(_versions(cluster, "s3cut")) == 1


@pytest.mark.cluster
def test_tier1_through_a_flapping_link_commits_once_with_every_document(cluster):
    """cpu-b's link goes down and up every 3 s through tier 1's passes."""
    stage = Stage(cluster, "head", _preprocess(cluster, "flap"))
    stage.wait_for(r"pass 1/3")
    flaps = 0
    while stage.proc.poll() is None and flaps < 20:
        cluster.host("cpu-b").cut()
        time.sleep(3)
        cluster.host("cpu-b").heal()
        time.sleep(3)
        flaps += 1
    rc = stage.finish()
    if cluster.nodes["cpu-b"].poll() is not None or "cpu-b" not in cluster.alive().values():
        cluster.replace("cpu-b")
    assert rc == 0, stage.text()[-4000:]
    print(f"FIGURE flapping: {flaps} flaps, {stage.ended - stage.started:.1f} s for the run")
    assert stage.summary()["snapshot"]["documents"]["read"] == cluster.corpus["read"]
    assert len(_versions(cluster, "flap")) == 1
