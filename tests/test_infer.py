"""Batch scoring (python -m infer score): every token predicted once, the same losses as Hugging Face
transformers on the same weights, and the commands end to end on the session's Ray (an embedded one is
test_ledger's and test_cli's subject)."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import REPO, make_corpus

from infer.model import resolve
from infer.score import score_ids, windows
from strata.data.storage import Storage


@pytest.mark.parametrize(("n", "context", "stride"), [(1, 8, 4), (8, 8, 4), (9, 8, 4), (50, 8, 3), (50, 8, 8),
                                                      (17, 16, 1)])
def test_windows_predict_every_token_once_within_the_context(n, context, stride):
    predicted = []
    for begin, end, first in windows(n, context, stride):
        assert 0 < end - begin <= context and begin + 1 <= first <= end
        predicted += range(first, end + 1)  # targets are ids[begin + 1:end + 1]
        if begin:  # a later window keeps at least context - stride tokens before what it predicts
            assert first - begin >= min(context - stride, first)
    assert predicted == list(range(1, n + 1))


@pytest.fixture(scope="module")
def exported(exported_model):
    return exported_model


def _hf_nll(hf, seq: list[int], context: int, stride: int) -> float:
    """The summed NLL of seq[1:] given what comes before, windowed as Hugging Face's perplexity guide does."""
    total = 0.0
    for begin, end, first in windows(len(seq) - 1, context, stride):
        with torch.no_grad():
            logits = hf(torch.tensor([seq[begin:end]])).logits[0].double()
        logp = torch.log_softmax(logits, dim=-1)
        for pos in range(first, end + 1):  # the target at `pos` is predicted from position pos - 1
            total -= logp[pos - 1 - begin, seq[pos]].item()
    return total


def test_document_losses_match_transformers_on_the_same_weights(exported):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    model, tok = resolve(exported, Storage("/nonexistent")).build()
    texts = ["a short one", "x" * 5, "a document longer than the context, so it is scored in windows " * 3, "é€😀 ok"]
    docs = [tok.encode(t) for t in texts]
    for stride in (16, 7):
        ours = score_ids(model, docs, tok.eot_id, stride=stride, batch_tokens=64)
        for ids, s in zip(docs, ours, strict=True):
            theirs = _hf_nll(hf, [tok.eot_id, *ids.tolist()], model.cfg.seq_len, stride)
            assert s.tokens == len(ids)
            assert abs(s.nll / s.tokens - theirs / len(ids)) < 1e-4, (s, theirs)



def test_packed_linear_layers_give_the_logits_of_the_model_as_trained(exported):
    from infer.model import PackedLinear

    plain, _ = resolve(exported, Storage("/nonexistent")).build(packed=False)
    packed, _ = resolve(exported, Storage("/nonexistent")).build()
    if not isinstance(packed.blocks[0].attn.qkv, PackedLinear):
        pytest.skip("this torch has no oneDNN linear kernel: the model stays as it was")
    idx = torch.randint(0, 257, (3, plain.cfg.seq_len))
    with torch.inference_mode():
        torch.testing.assert_close(packed(idx), plain(idx), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(packed(idx[:1, :5], start=2), plain(idx[:1, :5])[:, 2:], rtol=1e-4, atol=1e-4)

def test_a_model_directory_without_its_tokenizer_is_refused(tmp_path, exported):
    import shutil

    shutil.copytree(exported, tmp_path / "m")
    os.remove(tmp_path / "m" / "strata.json")
    with pytest.raises(ValueError, match="no strata.json"):
        resolve(str(tmp_path / "m"), Storage(str(tmp_path)))
    with pytest.raises(ValueError, match="neither an exported model directory nor a run"):
        resolve("no-such-run", Storage(str(tmp_path)))


def test_check_names_what_resolve_loads_and_reads_no_weights(tmp_path, exported, monkeypatch):
    """`infer serve` checks each --model on the driver with `check`: the same source and errors as `resolve`,
    with the loaders of weights out of reach."""
    from serving import commit_checkpoint

    from infer.model import check

    storage = Storage(str(tmp_path))
    run_dir = storage.run("live")
    for step in (1, 2):
        commit_checkpoint(run_dir, step, seed=step)
    want = {spec: resolve(spec, storage).source for spec in (exported, "live", "live@1")}
    assert want["live"] == "live@2" and want["live@1"] == "live@1"

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight loader was called")
    monkeypatch.setattr("train.pretrained.load", no_weights)
    monkeypatch.setattr("train.sample.load", no_weights)
    assert {spec: check(spec, storage) for spec in want} == want
    for spec, message in (("live@7", "no committed checkpoint at step 7"), ("live@x", "must be a number"),
                          ("no-such-run", "neither an exported model directory nor a run")):
        with pytest.raises(ValueError, match=message):
            check(spec, storage)


@pytest.mark.ray
def test_score_command_writes_a_table_keyed_by_document(tmp_path, exported, joined):
    corpus = {"path": str(tmp_path / "corpus"), **make_corpus(str(tmp_path / "corpus"), docs=24, seed=3)}
    env = {**os.environ, "STRATA_STORAGE": str(tmp_path / "storage"), **joined}
    proc = subprocess.run([sys.executable, "-m", "infer", "score", "--model", exported, "--input", corpus["path"],
                           "--name", "s1", "--actors", "1", "--docs-per-batch", "8", "--json"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    table = pq.read_table(out["output"]).to_pylist()
    assert {"doc_id", "source", "tokens", "loss", "bpb", "bytes", "unscored"} <= set(table[0])
    assert len(table) == out["documents"] + out["unscored"] and out["documents"] > 0
    assert len({r["doc_id"] for r in table}) == len(table)  # keyed by document: each once
    # Each row names its file (`source`) and the --input that found it; the summary names the best scored.
    assert all(os.path.isfile(r["source"]) and r["doc_id"].startswith(r["source"]) and r["input"] == corpus["path"]
               for r in table)
    best = sorted((r for r in table if not r["unscored"]), key=lambda r: r["bpb"])[0]
    shown = next(line for line in proc.stderr.splitlines() if line.startswith("    bpb "))
    assert shown.startswith(f"    bpb {best['bpb']:.3f} {os.path.basename(best['doc_id']).removesuffix(':0')}")
    scored = [r for r in table if not r["unscored"]]
    assert all(r["tokens"] > 0 and math.isfinite(r["loss"]) and r["bpb"] > 0 for r in scored)
    assert all(r["loss"] is None or math.isnan(r["loss"]) for r in table if r["unscored"])
    assert {r["unscored"].split(":")[0] for r in table if r["unscored"]} <= {"rejected"}  # bad input, with why
    tokens = sum(r["tokens"] for r in scored)
    assert out["tokens"] == tokens and out["loss"] == pytest.approx(sum(r["loss"] * r["tokens"] for r in scored) / tokens)
    # The same documents scored here in-process give the same losses (the actor pool changes nothing).
    model, tok = resolve(exported, Storage("/nonexistent")).build()
    text = {r["doc_id"]: r for r in scored}
    some = sorted(text)[:3]
    from strata.data.inputs import list_inputs
    from strata.data.sources import ReadConfig, read_file

    docs = {d["doc_id"]: d["text"] for f in list_inputs([corpus["path"]])
            for d in read_file({**f, "start": 0, "end": f["size"]}, ReadConfig()) if d["doc_id"] in some}
    again = score_ids(model, [tok.encode(docs[d]) for d in some], tok.eot_id, stride=16, batch_tokens=8192)
    assert [s.loss() for s in again] == pytest.approx([text[d]["loss"] for d in some], abs=1e-5)
    assert out["dollars_per_million_tokens"] is not None and out["cost"] >= 0
    assert os.path.exists(os.path.join(str(tmp_path / "storage"), "scores", "s1", "record.json"))
    assert np.isfinite(out["bpb"])


TASK = os.path.join(REPO, "infer", "tasks", "arithmetic.jsonl")


def test_multiple_choice_accuracy_equals_the_one_from_transformers_logits(exported):
    transformers = pytest.importorskip("transformers")
    from infer.evaluate import evaluate, load_task

    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    model, tok = resolve(exported, Storage("/nonexistent")).build()
    items = load_task(TASK)
    ours = evaluate(model, tok, items, batch_tokens=64)
    acc, acc_norm = [], []
    for item, lls in zip(items, ours["logliks"], strict=True):
        theirs = []
        for choice in item["choices"]:
            ctx, cont = tok.encode(item["context"]).tolist(), tok.encode(choice).tolist()
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([ctx + cont])).logits[0].double(), dim=-1)
            theirs.append(sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont)))
        assert lls == pytest.approx(theirs, abs=1e-4)
        acc.append(float(np.argmax(theirs) == item["gold"]))
        acc_norm.append(float(np.argmax(np.array(theirs) / [len(c.encode()) for c in item["choices"]]) == item["gold"]))
    assert ours["acc"] == np.mean(acc) and ours["acc_norm"] == np.mean(acc_norm)
    assert ours["acc_stderr"] == pytest.approx(np.std(acc, ddof=1) / math.sqrt(len(acc)))


@pytest.mark.ray
def test_eval_command_reports_accuracy_and_heldout_bits_per_byte_and_refuses_a_bad_task(tmp_path, exported, joined):
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "a.txt").write_text("held-out text that the model never saw. " * 20)
    env = {**os.environ, "STRATA_STORAGE": str(tmp_path / "storage"), **joined}
    cmd = [sys.executable, "-m", "infer", "eval", "--model", exported, "--json"]
    proc = subprocess.run(cmd + ["--task", TASK, "--input", str(tmp_path / "held")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["items"] == 40 and 0 <= out["acc"] <= 1 and out["acc_stderr"] > 0
    assert out["heldout_documents"] == 1 and out["bpb"] > 0 and math.isfinite(out["loss"])
    # It ran as a task on the cpu tier, with a record beside its summary, like every other run.
    assert out["cost"] is not None and out["node_hours"] > 0
    with open(out["output"]) as f:
        assert json.load(f)["acc"] == out["acc"]
    assert os.path.exists(os.path.join(os.path.dirname(out["output"]), "record.json"))
    from test_openlineage import check_event

    with open(os.path.join(os.path.dirname(out["output"]), "openlineage.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"] and events[0]["job"]["name"].startswith("eval.")
    assert {d["name"] for d in events[0]["inputs"]} == {exported, TASK, str(tmp_path / "held")}
    for e in events:
        check_event(e)
    # Every item as it was judged (lm-evaluation-harness's --log_samples): the mean of its acc is the summary's.
    with open(out["samples"]) as f:
        judged = [json.loads(line) for line in f]
    assert len(judged) == 40 and sum(r["acc"] for r in judged) / 40 == pytest.approx(out["acc"])
    assert all(r["acc"] == float(r["pred"] == r["gold"]) and len(r["logliks"]) == len(r["choices"]) for r in judged)
    (tmp_path / "bad.jsonl").write_text('{"context": "x", "choices": [" a", " b"], "gold": 0}\n{"context": "y", "choices": [" a"], "gold": 0}\n')
    bad = subprocess.run(cmd + ["--task", str(tmp_path / "bad.jsonl")], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and "bad.jsonl:2: an item needs" in bad.stderr


def test_greedy_generation_gives_the_tokens_transformers_gives(exported):
    transformers = pytest.importorskip("transformers")
    from infer.generate import decode

    hf = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    model, tok = resolve(exported, Storage("/nonexistent")).build()
    prompts = [tok.encode(p).tolist() for p in ("def f(x):", "ab", "cd", "the quick brown fox")]
    ours = decode(model, prompts, max_tokens=12, temperature=0, eot_id=tok.eot_id, vocab_limit=tok.vocab_size)
    for p, made in zip(prompts, ours, strict=True):
        x = torch.tensor([p])
        for _ in range(len(made)):  # transformers' own forward, one token at a time, without its cache
            with torch.no_grad():
                logits = hf(x).logits[0, -1]
            logits[tok.vocab_size:] = -float("inf")
            x = torch.cat([x, logits.argmax().view(1, 1)], dim=1)
        assert made == x[0, len(p):].tolist()
        assert len(made) == 12 or made[-1] == tok.eot_id


def test_sampling_depends_on_the_seed_only(exported):
    from infer.generate import decode

    model, tok = resolve(exported, Storage("/nonexistent")).build()
    a, b = tok.encode("same prompt").tolist(), tok.encode("other").tolist()

    def run(prompts, seed):
        return decode(model, prompts, max_tokens=10, temperature=1.0, top_k=20, seed=seed, eot_id=tok.eot_id,
                      vocab_limit=tok.vocab_size)

    alone = run([a], 1)[0]
    assert run([a, b], 1)[0] == alone  # another prompt in the batch changes nothing
    assert any(run([a], s)[0] != alone for s in (2, 3, 4))
    assert all(t < tok.vocab_size for t in alone)


@pytest.mark.ray
def test_generate_command_writes_a_completion_per_prompt(tmp_path, exported, joined):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello"}\n{"prompt": ""}\n')
    env = {**os.environ, "STRATA_STORAGE": str(tmp_path / "storage"), **joined}
    cmd = [sys.executable, "-m", "infer", "generate", "--model", exported, "--prompts", str(tmp_path / "p.jsonl"),
           "--max-tokens", "8", "--temperature", "0", "--json"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(out["output"]) as f:
        lines = [json.loads(line) for line in f]
    assert [x["prompt"] for x in lines] == ["hello", ""] and all(isinstance(x["completion"], str) for x in lines)
    assert out["prompts"] == 2 and 0 < out["tokens"] <= 16 and out["tokens_per_s"] > 0
    assert out["dollars_per_million_tokens"] is not None and out["node_hours"] > 0
    assert os.path.exists(os.path.join(os.path.dirname(out["output"]), "record.json"))
    from test_openlineage import check_event

    with open(os.path.join(os.path.dirname(out["output"]), "openlineage.jsonl")) as f:
        events = [json.loads(line) for line in f]
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"] and events[0]["job"]["name"].startswith("generate.")
    assert {d["name"] for d in events[0]["inputs"]} == {exported, str(tmp_path / "p.jsonl")}
    for e in events:
        check_event(e)
    again = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    with open(json.loads(again.stdout.strip().splitlines()[-1])["output"]) as f:
        assert [json.loads(line) for line in f] == lines  # greedy: the same text
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt"}\n')
    bad = subprocess.run(cmd[:7] + [str(tmp_path / "bad.jsonl")] + cmd[8:], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 1 and "bad.jsonl:1: a line needs a prompt" in bad.stderr


def test_score_dataset_scores_each_packed_row_and_refuses_another_tokenizer(tmp_path, local_ray, dataset, exported):
    import shutil

    from infer.driver import ScoreConfig, score
    from strata.data.dataset import pad_value
    from strata.data.dataset import resolve as resolve_dataset
    from strata.data.rows import read_rows

    storage = Storage.from_env()
    out = score(exported, [], ScoreConfig(actors=1, docs_per_batch=16), storage, "rows", dataset=dataset["ref"])
    version = resolve_dataset(storage, dataset["ref"])
    table = {r["doc_id"]: r for r in pq.read_table(out["output"]).to_pylist()}
    assert len(table) == sum(s.rows for s in version.shards) == out["documents"]
    assert {r["source"] for r in table.values()} == {s.split for s in version.shards}
    model, tok = resolve(exported, storage).build()
    shard = version.shards[0]
    rows = read_rows(version.file(shard.path))
    for i in (0, len(rows) - 1):  # each row scored as a document of its own ids (padding left out)
        ids = rows[i][rows[i] != pad_value(rows.dtype)].astype(np.int64)
        want = score_ids(model, [ids], tok.eot_id, stride=16, batch_tokens=8192)[0]
        got = table[f"{shard.path}:{i}"]
        assert got["tokens"] == len(ids) and got["loss"] == pytest.approx(want.loss(), abs=1e-5)
        assert got["bytes"] == int(tok.token_bytes()[ids].sum())
    # A model of another tokenizer cannot read the rows.
    other = tmp_path / "other"
    shutil.copytree(exported, other)
    meta = json.loads((other / "strata.json").read_text())
    meta["tokenizer"]["hash"] = "0" * 64
    (other / "strata.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="was tokenized with"):
        score(str(other), [], ScoreConfig(actors=1), storage, "rows-other", dataset=dataset["ref"])
