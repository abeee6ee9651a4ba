"""lm-evaluation-harness runs a local multiple-choice task on a strata model (infer/harness.py) and gets
the accuracy `infer eval` computes; no download."""

import json
import math
import os

import pytest
from conftest import REPO

pytest.importorskip("lm_eval")
TASK = os.path.join(REPO, "infer", "tasks", "arithmetic.jsonl")


def _local_task(tmp_path):
    """The harness's own task format over the task file infer eval reads (the choice follows the context
    directly, no delimiter, as infer eval scores it): its folder."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "strata_arith.yaml").write_text("\n".join([
        "task: strata_arith", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {TASK}",
        "test_split: test", "output_type: multiple_choice", 'doc_to_text: "{{context}}"',
        'doc_to_choice: "{{choices}}"', 'doc_to_target: "{{gold}}"', 'target_delimiter: ""', "metric_list:",
        "  - metric: acc", "  - metric: acc_norm", ""]))
    return tasks


def test_the_harness_scores_a_local_task_as_infer_eval_does(tmp_path, exported_model, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from infer.harness import StrataLM
    from infer.model import resolve
    from strata.data.storage import Storage
    from train.tasks import evaluate, load_task

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    tasks = _local_task(tmp_path)
    lm = StrataLM(exported_model)
    out = lm_eval.simple_evaluate(model=lm, tasks=["strata_arith"], task_manager=TaskManager(include_path=str(tasks)))
    got = out["results"]["strata_arith"]
    model, tok = resolve(exported_model, Storage(str(tmp_path))).build()
    ours = evaluate(model, tok, load_task(TASK))
    assert got["acc,none"] == pytest.approx(ours["acc"])
    assert got["acc_norm,none"] == pytest.approx(ours["acc_norm"])  # ASCII choices: characters are bytes
    assert out["results"]["strata_arith"]["acc_stderr,none"] == pytest.approx(ours["acc_stderr"])


def test_the_harness_interface_agrees_with_the_model_itself(exported_model):
    import torch

    from infer.harness import StrataLM

    lm = StrataLM(exported_model)

    class Req:
        def __init__(self, *args):
            self.args = args

    ll, greedy = lm.loglikelihood([Req("the cat ", "sat")])[0]
    ids = lm.tok.encode("the cat sat").tolist()
    with torch.no_grad():
        logp = torch.log_softmax(lm.net(torch.tensor([ids[:-1]])).double(), -1)[0]
    n = len(lm.tok.encode("sat"))
    want = sum(logp[i - 1, ids[i]].item() for i in range(len(ids) - n, len(ids)))
    assert ll == pytest.approx(want, abs=1e-6)
    assert greedy == all(logp[i - 1].argmax().item() == ids[i] for i in range(len(ids) - n, len(ids)))
    rolling = lm.loglikelihood_rolling([Req("a document to score whole")])[0]
    assert rolling < 0 and math.isfinite(rolling)
    text = lm.generate_until([Req("x = ", {"until": ["\n"], "max_gen_toks": 8})])[0]
    assert isinstance(text, str) and "\n" not in text and len(json.dumps(text)) > 0


def test_the_harness_command_line_runs_the_strata_model(tmp_path, exported_model):
    """`lm_eval --model strata` was not registered: the harness's own CLI finds no outside models, so
    `python -m infer.harness` (the `strata-lm-eval` script) is that CLI with the model registered."""
    import subprocess
    import sys

    tasks = _local_task(tmp_path)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "STRATA_STORAGE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "infer.harness", "run", "--model", "strata", "--model_args",
                          f"model={exported_model}", "--tasks", "strata_arith", "--include_path", str(tasks),
                          "--output_path", str(tmp_path / "out")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "strata_arith" in out.stdout and "acc" in out.stdout
