"""The entry points as users run them: `--help`, and clear errors for bad input."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

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
