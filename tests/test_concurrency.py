"""Two strata commands at the same moment on one machine, as overlapping cron slots or a notebook
beside a CLI start them: each starts its own embedded Ray (no port clash), and the dataset's lease
makes them publish every input once."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, make_corpus

from strata.commands.shell import EXIT_BUSY
from strata.data.dataset import list_versions, resolve
from strata.data.storage import Storage


def _start(root: str, raw: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", raw, "--dataset", "web", "--incremental",
           "--json", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    return subprocess.Popen(cmd, cwd=REPO, env={**env, "STRATA_STORAGE": root}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _both(*procs):
    outs = [p.communicate(timeout=600) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


@pytest.mark.ray
@pytest.mark.slow("two tier-1 commands at once, each its own Ray")
def test_overlapping_runs_publish_each_input_once(tmp_path):
    root, raw = str(tmp_path / "storage"), str(tmp_path / "raw")
    made = make_corpus(raw, docs=30, seed=5)
    storage = Storage(root)

    # Two slots with the same run id at the same moment: both run (two embedded Rays), one version.
    results = _both(_start(root, raw, "--run-id", "slot-1"), _start(root, raw, "--run-id", "slot-1"))
    for code, _, err in results:
        assert code == 0, err[-3000:]
        assert "Failed to find a valid port" not in err
    assert list_versions(storage, "web") == ["v0001"]
    waited = [err for _, _, err in results if "waiting for" in err]
    assert len(waited) == 1 and "which holds dataset web" in waited[0]
    assert "already produced web@v0001" in waited[0]
    docs = resolve(storage, "web").manifest.documents
    assert docs.kept + docs.unpacked == len(made["good"])

    # New input, two runs without a run id: the second waits, then finds nothing new.
    (tmp_path / "raw" / "late.txt").write_text(" ".join(f"late words {i % 13} here" for i in range(80)))
    results = _both(_start(root, raw), _start(root, raw))
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    assert list_versions(storage, "web") == ["v0001", "v0002"]
    summaries = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    assert sorted(str(s["version"]) for s in summaries) == ["None", "v0002"]
    docs = resolve(storage, "web").manifest.documents
    assert docs.kept + docs.unpacked == 1  # the one new file, published once

    # With --no-wait (a Kubernetes CronJob), the loser exits at once with its own code and names the holder.
    (tmp_path / "raw" / "later.txt").write_text(" ".join(f"later words {i % 11} here" for i in range(80)))
    results = _both(_start(root, raw, "--no-wait"), _start(root, raw, "--no-wait"))
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, EXIT_BUSY], [err[-2000:] for _, _, err in results]
    busy = next(err for code, _, err in results if code == EXIT_BUSY)
    assert "dataset web is in use by" in busy and "pid" in busy and "left for a later run" in busy
    assert list_versions(storage, "web") == ["v0001", "v0002", "v0003"]
    totals = resolve(storage, "web").manifest.totals["documents"]
    assert totals["kept"] + totals["unpacked"] == len(made["good"]) + 2
