"""Growth laws, counted on the S3 API server: what a run costs in requests and bytes grows with the work,
not with a product of file counts.

A preprocess process (its own embedded Ray, as cron or `ray job submit` starts it) reaches the server
through a proxy that logs every request (bench/s3proxy.py). Small work units and shards make the file
counts of a large input from a small one.
"""

import json
import os
import random
import subprocess
import sys

import boto3
import pytest
from conftest import REPO

from bench.s3proxy import ResettingProxy, tally


def _preprocess(proxy, s3_root: str, inputs: str, *flags: str) -> dict:
    env = {**os.environ, "AWS_ENDPOINT_URL": proxy.endpoint, "STRATA_STORAGE": s3_root}
    proc = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", inputs, "--json", *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.ray
def test_the_final_pass_reads_each_packed_file_once(s3_root):
    bucket = s3_root.split("/")[2]
    rng = random.Random(7)
    lines = "".join(json.dumps({"text": f"doc {i} " + " ".join(f"w{rng.randrange(3000)}" for _ in range(60))}) + "\n"
                    for i in range(2000))
    boto3.client("s3").put_object(Bucket=bucket, Key="raw/a.jsonl", Body=lines.encode())
    upstream = os.environ["AWS_ENDPOINT_URL"].rsplit("/", 1)[1].split(":")
    proxy = ResettingProxy((upstream[0], int(upstream[1])), every=0)
    try:
        out = _preprocess(proxy, s3_root, f"s3://{bucket}/raw", "--dataset", "g", "--split-bytes", str(64 << 10),
                          "--shard-bytes", str(16 << 10))
    finally:
        proxy.close()
    packed = {r.path for r in proxy.log if "/_work/packed/" in r.path and r.method == "PUT"}
    shards = out["shards"]
    assert len(packed) >= 8 and shards >= 16  # shards x files would be >= 128 files opened, >= 640 requests
    reads = tally(proxy.log, "/_work/packed/")
    opened = sum(n for m, n in reads["requests"].items() if m in ("GET", "HEAD"))
    assert opened <= 2 * len(packed), reads  # each packed file is read once (a HEAD and a GET), not once per shard
    written = sum(r.sent for r in proxy.log if "/_work/packed/" in r.path and r.method in ("PUT", "POST"))
    assert reads["read_bytes"] <= 1.1 * written, (reads, written)  # each row is read once


def test_a_small_file_is_one_request_on_s3(s3_root, monkeypatch):
    """Small files (records, manifests, each work unit's record) are most of a run's writes by count."""
    from strata.data.storage import read_json, write_json_atomic

    upstream = os.environ["AWS_ENDPOINT_URL"].rsplit("/", 1)[1].split(":")
    proxy = ResettingProxy((upstream[0], int(upstream[1])), every=0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        write_json_atomic(f"{s3_root}/small.json", {"units": list(range(100))})
        writes = [r for r in proxy.log if r.method in ("PUT", "POST")]
        assert [r.method for r in writes] == ["PUT"] and writes[0].path.endswith("/small.json")
        assert read_json(f"{s3_root}/small.json") == {"units": list(range(100))}
    finally:
        proxy.close()


def test_the_index_of_consumed_inputs_reads_only_what_may_hold_the_candidates(tmp_path, monkeypatch):
    """A run looks its inputs up in the index of consumed ones: a new prefix reads no segment, and a
    candidate inside a segment's range reads its row group only, however many inputs came before."""
    from pipelines import consumed

    old = [(f"s3://b/raw/2026-12-01/{i:05d}.jsonl", 100 + i, i) for i in range(5 * consumed.ROW_GROUP)]
    segment = consumed.write(str(tmp_path / "a.parquet"), old)
    groups = []

    class Counting(consumed.pq.ParquetFile):
        def read_row_group(self, i, *args, **kwargs):
            groups.append(i)
            return super().read_row_group(i, *args, **kwargs)

    monkeypatch.setattr(consumed.pq, "ParquetFile", Counting)
    new = [(f"s3://b/raw/2026-12-02/{i:05d}.jsonl", 7, i) for i in range(50)]
    assert consumed.lookup([segment], new) == set() and groups == []  # a new prefix: nothing read
    changed = (old[3 * consumed.ROW_GROUP][0], 1, 1)  # the same path, another size: new again
    assert consumed.lookup([segment], [old[3 * consumed.ROW_GROUP + 5], changed, *new]) == {old[3 * consumed.ROW_GROUP + 5]}
    assert groups == [3]
    merged = consumed.merge([segment, consumed.write(str(tmp_path / "b.parquet"), new)], str(tmp_path / "m.parquet"))
    assert merged["rows"] == len(old) + len(new) and consumed.lookup([merged], new) == set(new)
