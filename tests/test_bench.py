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


def test_the_gpu_check_runs_on_cpu_as_a_smoke_test(tmp_path):
    # As on a lent GPU machine: a bare HOME and no strata signing key (its checkpoint needs one of its own).
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_SIGNING_KEY")}
    out = subprocess.run(["bash", "bench/train/gpu.sh", "--smoke", "--json"], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env={**env, "PYTHON": sys.executable, "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-2])
    from train.memory import CPU_MICRO_BATCH

    # The loop's default micro-batch on this device, and twice it.
    assert [r["batch_size"] for r in result["runs"]] == [CPU_MICRO_BATCH, 2 * CPU_MICRO_BATCH]
    assert all(r["preset"] == "debug" and r["steps"] >= 3 and r["tokens_per_s"] > 0 for r in result["runs"])
    fsdp = result["fsdp"]
    assert fsdp["restored_step"] == 1 and fsdp["weights_match"]  # the sharded checkpoint loads back
    loss = result["loss"]  # the loss's share of a step, timed against the step and a plain cross_entropy
    assert 0 < loss["share"] < 1 and loss["vs_plain"] > 0 and loss["batch_size"] == CPU_MICRO_BATCH
    shares = result["profile"]["shares"]
    assert set(shares) == {"matmul", "attention", "loss", "optimizer", "other", "idle"}
    assert sum(shares.values()) == pytest.approx(1)
    assert all(shares[k] > 0 for k in ("matmul", "attention", "loss", "optimizer"))  # each found where it runs
    assert result["environment"]["torch"] and lines[0].startswith("environment: ")
    infer = result["inference"]  # infer's scorer and key/value-cached decoding on the same device
    assert infer["score_tokens_per_s"] > 0 and infer["generate_tokens_per_s"] > 0 and infer["device"] == "cpu"
    assert lines[-1].startswith("ratio lowest MFU/target")


@pytest.mark.gpu
def test_gpu_benchmark_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    lines = _run("bench.train.gpu", "--presets", "debug", "--fsdp-preset", "debug", "--seconds", "2", "--json")
    result = json.loads(lines[-2])
    assert all(r["bf16"] and r["tokens_per_s"] > 0 for r in result["runs"])
    assert result["fsdp"]["weights_match"] and result["fsdp"]["fused_adamw"]  # training's optimizer
    assert result["inference"]["device"].startswith("cuda") and result["inference"]["score_tokens_per_s"] > 0


@pytest.mark.ray
def test_ingest_benchmark_prints_its_ratio_last(tmp_path):
    lines = _run("bench.train.ingest", "--seconds", "0.5", "--steps", "3", "--workdir", str(tmp_path))
    assert lines[-1].startswith("ratio delivered/consumed: ")
    assert float(lines[-1].rsplit(" ", 1)[1]) > 0


@pytest.mark.bench  # about 3 minutes: make test-bench runs it, keeping make test within CI's time
def test_tune_benchmark_lists_its_targets_and_extrapolates_to_50000_configs_last():
    lines = _run("bench.tune", "--trials", "200", "--baseline-trials", "10", "--asha-trials", "0", "--rounds", "1",
                 "--max-concurrent", "4", "--real-configs", "4",
                 "--fleet=--nodes 2 --per-node 2 --configs 40 --config-s 0.2 --preempt-configs 24 "
                 "--preempt-per-node 2 --kill 1", "--json")
    result = json.loads(lines[-3])
    fleet = result["fleet"]
    assert fleet["concurrency"]["peak"] == 4 and fleet["preemption"]["each_once"]
    assert fleet["preemption"]["rerun"] <= fleet["preemption"]["held_on_killed"] == 2  # at most what the node held
    assert result["real"]["4"]["ratio"] > 0 and lines[-2].startswith("targets: overhead ")
    assert result["queued"]["trials"] == 200 and result["queued"]["queued"] and result["half"]["trials"] == 100
    assert result["baseline"]["tune_trials"] == 10 and result["queued"]["tune_trials"] == 4
    assert lines[-1].startswith("extrapolated to 50,000 configs (queued): ")


@pytest.mark.bench  # about 2 minutes
def test_scale_benchmark_counts_requests_per_version_and_prints_its_targets_last(tmp_path):
    lines = _run("bench.scale", "--mb", "0.5", "--versions", "3", "--window", "1", "--all-versions", "3",
                 "--sizes", "1", "--storage", "s3", "--takedown-versions", "2", "--out", str(tmp_path), "--json")
    result = json.loads(lines[-2])
    s3, every = result["history"]["s3"], result["history"]["s3 all"]
    assert [r["version"] for r in s3] == ["v0001", "v0002", "v0003"] and all(r["total_requests"] > 0 for r in s3)
    # Version 3 compares with version 2's keys alone under a window of 1, with both versions' under all.
    assert s3[0]["keys_compared"] == 0 < s3[2]["keys_compared"] < every[2]["keys_compared"]
    assert result["law"]["versions"] == 3 and "s3 worst of v3-v3 / v2 total_requests" in result["ratios"]
    assert lines[-1].startswith("ratio targets met ") and (tmp_path / "scale.md").exists()
    # The takedown: the claimed file's two copies by digest, its text in other bytes by exact key, three forgets.
    t = result["takedown"]
    assert (t["copies"], t["same_text"], t["datasets_forgotten"]) == (2, 1, 3)
    assert all(t[k]["requests"] > 0 and t[k]["wall_s"] > 0 for k in ("open", "plan", "apply"))


def test_the_results_table_has_a_row_per_benchmark_run():
    sys.path.insert(0, REPO)
    from bench.__main__ import BENCHMARKS, markdown

    ok = {"ok": True, "seconds": 12.0, "last_line": "ratio delivered/consumed: 4571.0", "stderr_tail": ""}
    bad = {"ok": False, "seconds": 3.0, "last_line": "", "stderr_tail": "Traceback ... boom"}
    text = markdown({"date": "2026-11-30", "machine": "2 cores", "seconds": 15.0,
                     "benchmarks": {"train.ingest": ok, "tune": bad}})
    rows = [line for line in text.splitlines() if line.startswith("| train.") or line.startswith("| tune")]
    assert len(rows) == 2
    assert BENCHMARKS["train.ingest"][2] in rows[0] and "ratio delivered/consumed: 4571.0" in rows[0]
    assert "FAILED" in rows[1] and "boom" in rows[1]


@pytest.mark.bench
def test_end_to_end_benchmark_times_the_real_command(tmp_path):
    lines = _run("bench.train.e2e", "--steps", "12", "--short-steps", "4", "--log-every", "1", "--workdir",
                 str(tmp_path), "--json")  # make bench runs --log-every 10 too
    result = json.loads(lines[-2])
    assert set(result["seconds"]) == {"plain", "log1"} and all(len(v) == 2 for v in result["seconds"].values())
    fixed, per_step = result["fits"]["plain"]["fixed_s"], result["fits"]["plain"]["step_s"]
    assert fixed + 12 * per_step == pytest.approx(result["seconds"]["plain"][1])  # the line meets both runs
    assert lines[-1].startswith("ratio plain/train wall per step, --log-every 1: ")
    # Each python -m train run is a whole run with its final checkpoint, under the workdir's storage.
    runs = [r for r in os.listdir(tmp_path / "storage" / "runs") if r.startswith("bench-e2e-")]
    assert len(runs) == 2, runs


def test_dedup_benchmark_prints_recall_and_precision_beside_the_s_curve():
    lines = _run("bench.dedup", "--pairs", "300", "--json")
    result = json.loads(lines[-2])
    assert sum(row["pairs"] for row in result["table"]) == 300
    assert all(0 <= row["collided"] <= 1 and 0 <= row["s_curve"] <= 1 for row in result["table"])
    assert result["table"][-1]["collided"] > result["table"][0]["collided"]  # similar pairs collide more
    assert lines[-1].startswith("ratio measured/S-curve: recall ")


@pytest.mark.bench  # about a minute
def test_real_config_sweep_benchmark_times_the_command_and_the_plain_loop_and_prints_its_ratio_last():
    lines = _run("bench.tune.real", "--configs", "4", "--steps", "2", "--json")
    result = json.loads(lines[-2])["4"]
    assert result["sweep_s"] > result["before_first_report_s"] > 0 and result["plain_s"] > 0
    assert result["ratio"] == pytest.approx(result["sweep_s"] / result["plain_s"])
    # The reference sweep's figures by the law: what grows with configs scaled from 4 to 50,000.
    assert result["mb_at_reference"] == pytest.approx(result["mb"] * 50_000 / 4)
    assert result["files_at_reference"] >= result["files"] and any(line.startswith("  extrapolated to 50,000 configs: ")
                                                                   for line in lines)
    assert lines[-1].startswith("overhead, sweep / plain loop: ") and lines[-1].endswith("(target <= 1.1)")


@pytest.mark.bench  # about 40 s
def test_infer_benchmark_checks_the_losses_and_prints_its_ratio_last():
    pytest.importorskip("transformers")
    lines = _run("bench.infer", "--docs", "6", "--chars", "600", "--rounds", "1", "--json")
    result = json.loads(lines[-3])
    assert result["max_loss_difference"] < 1e-4 and result["tokens"] > 0
    assert lines[-1].startswith("ratio tokens/s per core, strata / transformers: ")


@pytest.mark.bench
@pytest.mark.slow("three servers started, each loaded by guidellm: about 2 minutes")
@pytest.mark.ray
@pytest.mark.serve
def test_serve_benchmark_loads_each_server_with_guidellm_and_prints_its_targets_last():
    import importlib.util

    if importlib.util.find_spec("guidellm") is None:  # not imported here: it starts multiprocessing's tracker
        pytest.skip("guidellm is not installed")
    lines = _run("bench.serve", "--seconds", "1", "--concurrency", "1,4", "--presets", "debug", "--json", timeout=900)
    result = json.loads(lines[-2])
    servers = result["results"]["embeddings debug"]
    assert set(servers) == {"plain", "strata", "strata-proxy"}
    assert all(p["ok"] > 0 and p["errored"] == 0 and p["p50_ms"] > 0 for points in servers.values() for p in points)
    # Every request guidellm counted as answered, the server counted too (its record: 200s and the 499s of
    # requests open when a window closed).
    for kind in ("strata", "strata-proxy"):
        answered = sum(p["ok"] for p in servers[kind])
        assert result["summaries"][kind]["by_status"]["200"] >= answered
        assert set(result["summaries"][kind]["by_status"]) <= {"200", "499"}
    assert set(result["targets"]["strata"]) >= {"embeddings_c1_p50_over_plain_ms", "embeddings_c32_rps_ratio"}
    assert lines[-1].startswith("strata serve / plain FastAPI: embeddings c=1 p50")
