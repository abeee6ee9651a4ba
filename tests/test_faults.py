"""Tier 1 under object-store faults: resets are retried, a file that cannot be read is never consumed.

The input and the storage root are on the test S3 server, reached by a preprocess process (its own
embedded Ray, as cron or `ray job submit` starts it) through a proxy that resets every fourth
connection mid-response and every request for one object. What it publishes must equal an undisturbed
run's, less that one object, which a later run then reads.
"""

import json
import os
import random
import subprocess
import sys

import boto3
import pytest
from conftest import REPO, ensure_local_ray, make_corpus

from bench.s3proxy import ResettingProxy
from pipelines.config import debug
from pipelines.driver import UNIT_RETRIES
from pipelines.driver import run as preprocess
from strata.data.dataset import resolve
from strata.data.storage import Storage


def _upload(bucket: str, local: str, prefix: str) -> list[str]:
    s3 = boto3.client("s3")
    uris = []
    for name in sorted(os.listdir(local)):
        s3.upload_file(os.path.join(local, name), bucket, f"{prefix}/{name}")
        uris.append(f"s3://{bucket}/{prefix}/{name}")
    return uris


@pytest.mark.ray
@pytest.mark.slow("two tier-1 runs through a resetting proxy")
def test_resets_are_retried_and_an_unreadable_file_is_left_for_a_later_run(s3_root, tmp_path):
    bucket = s3_root.split("/")[2]
    raw = tmp_path / "raw"
    made = make_corpus(str(raw), docs=30, seed=5)
    rng = random.Random(5)
    with open(raw / "big.jsonl", "w") as f:  # cut into several byte ranges (work units) at 64 KiB
        for i in range(900):
            f.write(json.dumps({"text": f"line {i} " + " ".join(f"w{rng.randrange(5000)}" for _ in range(30))}) + "\n")
    good = _upload(bucket, str(raw), "raw")
    late_dir = tmp_path / "late"
    late_dir.mkdir()
    (late_dir / "late.jsonl").write_text("".join(json.dumps({"text": f"late document {i} " + "word " * 40}) + "\n"
                                                 for i in range(12)))
    _upload(bucket, str(late_dir), "late")
    read = {"split_bytes": 64 << 10}

    # The undisturbed run: the same objects (the same record ids), straight to the server.
    ensure_local_ray()
    ref = preprocess(debug("ref", read={**read, "inputs": (f"s3://{bucket}/raw",)}), Storage(f"{s3_root}/ref"))

    upstream = os.environ["AWS_ENDPOINT_URL"].rsplit("/", 1)[1].split(":")
    proxy = ResettingProxy((upstream[0], int(upstream[1])), every=4, cut=300, poison=b"late/late.jsonl")
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "STRATA_STORAGE": f"{s3_root}/faulty",
           "STRATA_S3_ATTEMPTS": "5"}  # a request reset 5 times gives up in ~1 s, not ~25 s
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--split-bytes", str(64 << 10), "--read-retries", "1",
           "--json"]
    try:
        # The default, --unreadable fail: the unit is run again (UNIT_RETRIES), then the run fails.
        failed = subprocess.run(cmd + ["--input", f"s3://{bucket}/late", "--dataset", "d"], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=600)
        failing_reads, proxy.poisoned = proxy.poisoned, 0
        proc = subprocess.run(cmd + ["--input", f"s3://{bucket}/raw", "--input", f"s3://{bucket}/late",
                                     "--dataset", "d", "--unreadable", "defer"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        proxy.close()
    assert failed.returncode == 1 and "late/late.jsonl" in failed.stderr
    assert failed.stderr.strip().splitlines()[-1].startswith(f"error: reading s3://{bucket}/late/late.jsonl failed")
    assert "Nothing was committed and the file is not recorded as consumed" in failed.stderr
    assert failing_reads == (1 + UNIT_RETRIES) * proxy.poisoned > 0  # the unit was run 3 times
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proxy.resets - failing_reads - proxy.poisoned > 20  # resets mid-response, on most kinds of request
    late = f"s3://{bucket}/late/late.jsonl"
    assert list(out["stats"]["deferred_inputs"]) == [late] and "WARNING" in proc.stderr
    # What was published equals the undisturbed run. (Which few documents end in the last partial rows
    # depends on how files were grouped into work units, and the extra input regroups them.)
    for summary in (out, ref):
        d = summary["documents"]
        d["kept"] += d.pop("unpacked")
        summary["reasons"].pop("unpacked:carried", None)
    for key in ("documents", "reasons", "tokens", "sequences"):
        assert out[key] == ref[key], key
    assert out["documents"]["read"] >= len(made["good"]) + 900
    storage = Storage(f"{s3_root}/faulty")
    v1 = resolve(storage, "d")
    assert sorted(f["path"] for f in v1.manifest.inputs) == good  # the deferred file is not consumed

    # A later run, the faults gone, reads just that file.
    again = preprocess(debug("d", read={**read, "inputs": (f"s3://{bucket}/raw", f"s3://{bucket}/late")}),
                       storage)
    assert v1.manifest.version == "v0001"  # the failed run committed nothing
    assert again["parent"] == v1.manifest.version and again["documents"]["read"] == 12
    assert again["documents"]["kept"] + again["documents"]["unpacked"] == 12
    assert resolve(storage, "d").manifest.totals["inputs"] == len(good) + 1
