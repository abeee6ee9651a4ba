"""The benchmarks still run (smoke tests: tiny sizes, no figures asserted), and the GPU one on a GPU."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, timeout=600):
    out = subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()


def test_gpu_benchmark_runs_on_cpu_as_a_smoke_test():
    lines = _run("bench.train.gpu", "--device", "cpu", "--presets", "debug", "--seconds", "0.5", "--warmup", "1",
                 "--no-compile", "--json")
    [result] = json.loads(lines[-2])
    assert result["preset"] == "debug" and result["steps"] >= 3 and result["tokens_per_s"] > 0
    assert lines[-1].startswith("ratio lowest MFU/target")


@pytest.mark.gpu
def test_gpu_benchmark_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    lines = _run("bench.train.gpu", "--presets", "debug", "--seconds", "2", "--json")
    [result] = json.loads(lines[-2])
    assert result["bf16"] and result["tokens_per_s"] > 0


@pytest.mark.slow
def test_ingest_benchmark_prints_its_ratio_last(tmp_path):
    lines = _run("bench.train.ingest", "--seconds", "0.5", "--steps", "3", "--workdir", str(tmp_path))
    assert lines[-1].startswith("ratio delivered/consumed: ")
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0
