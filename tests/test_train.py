"""Tier 2 on a local Ray: TorchTrainer reads the dataset, checkpoints, and a rerun continues."""

import json
import math
import os
import pathlib
import re
import shutil
import threading

import pytest
from conftest import edit_manifest, wait_for
from conftest import train_run as run

from strata.accounting.runlog import read_launches, read_metrics
from strata.data.dataset import DatasetError, resolve
from strata.data.lease import LeaseBusy, holder
from strata.data.storage import Storage, read_jsonl
from train.committed import committed_checkpoints
from train.config import TrainConfig
from train.model import preset


def _cfg(max_steps, **kw):
    return TrainConfig(**{**dict(max_steps=max_steps, batch_size=4, warmup_steps=2, log_every=2, eval_every=4,
                                 checkpoint_every=4, eval_batches=1), **kw})


def _metrics(path):
    return read_metrics(path)


@pytest.mark.slow("DDP on two workers, then reruns; FSDP2 beside it, then continued")
def test_ddp_run_checkpoints_and_a_rerun_continues_and_fsdp2_matches_it(local_ray, dataset, capfd):
    """Merged with the FSDP2 test, which trained a DDP run of its own to compare with: FSDP2 gives this
    DDP run's losses, step for step, and continues from its own checkpoint."""
    storage = Storage.from_env()
    ref = dataset["ref"]
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    first = run(model, _cfg(6), dataset=ref, run_name="ddp", storage=storage, workers=2, use_gpu=False)
    assert first["strategy"] == "ddp"
    sharded = run(model, _cfg(6, strategy="fsdp"), dataset=ref, run_name="agree-fsdp", storage=storage, workers=2,
                  use_gpu=False)
    assert sharded["strategy"] == "fsdp"
    losses = {out["strategy"]: [x for r in _metrics(out["path"]) for x in r["step_losses"]] for out in (first, sharded)}
    assert len(losses["ddp"]) == 6 and losses["fsdp"] == pytest.approx(losses["ddp"], rel=1e-4)
    more = run(model, _cfg(8, strategy="fsdp"), dataset=ref, run_name="agree-fsdp", storage=storage, workers=2,
               use_gpu=False)
    assert (more["start_step"], more["steps"]) == (6, 2) and math.isfinite(more["last_loss"])
    assert (first["start_step"], first["steps"]) == (0, 6)
    assert math.isfinite(first["first_loss"]) and math.isfinite(first["last_loss"])
    assert first["val_loss"] is not None
    # One directory per checkpoint: each rank's safetensors shard and RNG state, and the meta; no pickle.
    files = set(os.listdir(first["checkpoint"]))
    assert {"meta.json", "rng-0.safetensors", "rng-1.safetensors", "signed-0.json", "signed-1.json"} <= files
    assert {f for f in files if f.startswith("shard-")} <= {f"shard-0000{r}-model-00001-of-00001.safetensors"
                                                           for r in (1, 2)}
    assert not {f for f in files if f.endswith((".pt", ".distcp", ".metadata"))}
    assert os.path.basename(first["checkpoint"]) == "checkpoint-00000006"
    assert [os.path.basename(c) for c in committed_checkpoints(first["path"])] == \
        ["checkpoint-00000004", "checkpoint-00000006"]
    with open(os.path.join(first["checkpoint"], "meta.json")) as f:
        assert json.load(f)["step"] == 6
    ranks = sorted(os.listdir(os.path.join(first["path"], "workers")))
    assert ranks == ["rank-0.json", "rank-1.json"]
    rows = _metrics(first["path"])
    assert [r["step"] for r in rows] == [1, 2, 4, 6]
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_per_worker"] == pytest.approx(r["tokens_per_s"] / 2)
        assert 0 <= r["data_wait"] <= 1 and 0 <= r["checkpoint_blocked"] < 1 and r["lr"] > 0
        assert r["mfu"] is None  # a CPU has no entry in the peak table
    assert [r["step"] for r in rows if "val_loss" in r] == [4, 6]
    assert rows[-1]["checkpoint_blocked"] > 0
    events = [os.path.join(dp, f) for dp, _, fs in os.walk(os.path.join(first["path"], "tensorboard")) for f in fs]
    assert events and any(b"train/loss" in pathlib.Path(e).read_bytes() for e in events)

    # Token files that appear after training (Ray makes ~/.ray/auth_token, the README's laptop step
    # ~/.strata/ray-token) change no key: the run continues, samples and loads as infer and --quality-model do.
    home, made = pathlib.Path(os.environ["HOME"]), []
    for path in (home / ".ray" / "auth_token", home / ".strata" / "ray-token"):
        if not path.exists():
            path.parent.mkdir(exist_ok=True)
            path.write_text(f"a token that appeared later {path.name}\n")
            made.append(path)
    from infer.model import resolve as resolve_model
    from train.sample import sample

    assert resolve_model("ddp", storage).source == "ddp@6" and sample(first["checkpoint"], "a", 3, 1, 0.0, 0)
    capfd.readouterr()
    again = run(model, _cfg(10), dataset=ref, run_name="ddp", storage=storage, workers=2, use_gpu=False)
    assert "[train] continuing run ddp from step 6" in capfd.readouterr().err
    for path in made:
        path.unlink()
    assert (again["start_step"], again["steps"]) == (6, 4)
    with open(os.path.join(again["checkpoint"], "meta.json")) as f:
        assert json.load(f)["step"] == 10

    # The newest checkpoint deleted by hand: the run continues from the newest intact one, and says so.
    shutil.rmtree(again["checkpoint"])
    capfd.readouterr()
    third = run(model, _cfg(12), dataset=ref, run_name="ddp", storage=storage, workers=2, use_gpu=False)
    err = capfd.readouterr().err
    assert "checkpoint(s) checkpoint-00000010 are registered but missing" in err
    assert "continuing run ddp from step 8" in err and (third["start_step"], third["steps"]) == (8, 4)
    assert [launch["config"]["train"]["max_steps"] for launch in read_launches(first["path"])] == [6, 10, 12]
    # The report of the third launch plots the whole run: every launch's steps, and where each began.
    from strata.accounting.records import find_record
    from strata.commands.report import _train_metrics, html_page, plots

    record = find_record(storage, "train/ddp")
    rows, launches = _train_metrics(record, storage.root)
    assert launches == [0, 6, 8] and {1, 6, 10, 12} <= {r["step"] for r in rows}
    assert "Loss, all 3 launches" in html_page(record, plots(record, storage))

    # The red team's repro: a pickle that would run code, written over the start of a shard. Continuing the run
    # refuses the checkpoint, naming the file, and the pickle never runs.
    import pickle

    from strata.data.signing import Untrusted

    marker = os.path.join(third["path"], "pwned")
    payload = pickle.dumps(_Payload(marker))
    shard = os.path.join(third["checkpoint"], "shard-00001-model-00001-of-00001.safetensors")
    with open(shard, "r+b") as f:
        f.write(payload)
    with pytest.raises(Untrusted, match="shard-00001-model-00001-of-00001.safetensors does not match its signed SHA-256"):
        run(model, _cfg(14), dataset=ref, run_name="ddp", storage=storage, workers=2, use_gpu=False, max_failures=0)
    assert not os.path.exists(marker), "the planted pickle ran"


class _Payload:
    """Unpickled, it creates `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_reports_to_ray_never_throttle_the_loop(local_ray, dataset):
    """--log-every 1 keeps every step's metrics on the worker; Ray hears from the loop on a timer no
    shorter than its controller's poll interval (every report would otherwise block up to 2 s)."""
    from train.cadence import Cadence

    storage = Storage.from_env()
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    cfg = _cfg(60, log_every=1, checkpoint_every=0, eval_every=1000)
    out = run(model, cfg, dataset=dataset["ref"], run_name="chatty", storage=storage, use_gpu=False)
    rows = _metrics(out["path"])
    assert [r["step"] for r in rows] == list(range(1, 61))
    interval = Cadence(max_steps=1, log_every=1, report_every_s=cfg.report_every_s).report_every_s
    reported = [r["step"] for r in rows if r["reported"]]
    # The first step, the end (its checkpoint) and one per interval of loop time: far fewer than 60.
    assert 1 in reported and 60 in reported
    assert len(reported) <= 2 + out["loop_s"] / interval, (reported, out["loop_s"])
    # Throughput is over the loop's wall time, reports and checkpoints included; the shares add up.
    assert out["grad_accum"] == 1  # no --grad-accum and no recipe (tokens_per_step) for the debug preset
    tokens = 60 * cfg.batch_size * out["grad_accum"] * model.seq_len
    assert out["tokens_per_s"] == pytest.approx(tokens / out["loop_s"], rel=1e-3)
    for r in rows:
        shares = [r[f"share_{k}"] for k in ("data", "eval", "checkpoint", "report", "compute")]
        assert min(shares) >= 0 and sum(shares) == pytest.approx(1)
    assert out["compute_share"] >= 0 and out["report_blocked"] >= 0


def test_a_dataset_that_does_not_fit_the_model_is_refused(local_ray, dataset):
    with pytest.raises(DatasetError, match="seq_len is 128 but the model's is 64"):
        run(preset("debug", seq_len=64), _cfg(2), dataset=dataset["ref"], run_name="refused",
            storage=Storage.from_env())
    assert not os.path.exists(Storage.from_env().run("refused"))


def test_a_mixture_trains_in_proportion_reports_each_source_and_refuses_what_does_not_mix(local_ray, dataset,
                                                                                            second_dataset):
    storage = Storage.from_env()
    code = second_dataset["ref"]
    web = dataset["ref"]
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    out = run(model, _cfg(8, eval_every=8), dataset=f"{web}:0.7,{code}:0.3", run_name="mix", storage=storage,
              workers=1, use_gpu=False)
    assert out["dataset"] == f"{web}:0.7,{code}:0.3"
    tokens = out["tokens_by_source"]
    assert sum(tokens.values()) == 8 * 4 * 128  # steps x micro-batch x seq_len
    assert tokens[code] / sum(tokens.values()) == pytest.approx(0.3, abs=1 / 32)  # within a row of 32
    rows = [r for r in _metrics(out["path"]) if "val_loss" in r]
    assert set(rows[-1]["val_loss_by_source"]) == {web, code} and rows[-1]["tokens_by_source"] == tokens
    by = out["val_loss_by_source"]
    assert out["val_loss"] == pytest.approx(0.7 * by[web] + 0.3 * by[code])
    for ref in (web, code):  # bytes tokenizer: a byte a token, end-of-text left out
        assert out["val_bpb_by_source"][ref] == pytest.approx(by[ref] / math.log(2), rel=0.05)
    with open(os.path.join(out["path"], "run.json")) as f:
        assert json.load(f)["config"]["dataset"] == out["dataset"]

    train_rows = {ref: resolve(storage, ref).rows("train")
                  for ref in (web, code)}
    repeats = {web: 400 * 4 * 0.7 / train_rows[web], code: 400 * 4 * 0.3 / train_rows[code]}
    over, under = sorted(repeats, key=repeats.get, reverse=True)
    limit = (repeats[over] + repeats[under]) / 2
    with pytest.raises(DatasetError, match=f"400 steps would repeat {over} {repeats[over]:.2f} times, more than") as e:
        run(model, _cfg(400, max_repeat=limit), dataset=f"{web}:0.7,{code}:0.3", run_name="mix-long", storage=storage,
            workers=1, use_gpu=False)
    assert under not in str(e.value)
    # A copy of `code` whose manifest names another tokenizer does not mix with the others.
    shutil.copytree(storage.dataset("code"), storage.dataset("other"))
    edit_manifest(storage.dataset("other"), int(code.partition("@")[2][1:]),
                  lambda m: m.update(dataset="other", tokenizer={**m["tokenizer"], "hash": "f" * 16}))
    with pytest.raises(DatasetError, match=f"different tokenizers: {web} [0-9a-f]{{16}}, other@v0001 f{{16}}"):
        run(model, _cfg(2), dataset=f"{web}:0.5,other:0.5", run_name="mix-bad", storage=storage, use_gpu=False)
    assert not os.path.exists(storage.run("mix-bad")) and not os.path.exists(storage.run("mix-long"))


def test_a_run_continues_only_with_its_model_and_tokenizer(local_ray, dataset, tmp_path):
    from train.trainer import _check_continuation

    storage = Storage.from_env()
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    run_dir = storage.run("mismatch")
    os.makedirs(os.path.join(run_dir, "launches"))
    before = {"model": dict(vars(model)), "tokenizer": {"hash": "0123456789abcdef"}, "dataset": dataset["ref"]}
    with open(os.path.join(run_dir, "launches", "0000.json"), "w") as f:
        json.dump({"config": before}, f)
    with pytest.raises(DatasetError, match="trained with tokenizer 0123456789abcdef"):
        run(model, _cfg(2), dataset=dataset["ref"], run_name="mismatch", storage=storage)
    with pytest.raises(ValueError, match=r"another model \(n_embd differ\)"):
        _check_continuation(before, "mismatch", preset("debug", n_layer=1, n_embd=64, n_head=2), _cfg(2),
                            "0123456789abcdef", False)


@pytest.mark.slow("three training runs")
def test_a_continued_run_keeps_its_dataset_and_data_order_and_one_writer(local_ray, dataset):
    storage = Storage.from_env()
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    ref = dataset["ref"]
    run(model, _cfg(2), dataset=ref, run_name="keep", storage=storage, use_gpu=False)
    with pytest.raises(ValueError, match=f"trains on {ref}, not other-data"):
        run(model, _cfg(4), dataset="other-data", run_name="keep", storage=storage, use_gpu=False)
    with pytest.raises(ValueError, match="another data order \\(batch_size 4 -> 8, seed 0 -> 1\\)"):
        run(model, _cfg(4, batch_size=8, seed=1), dataset=ref, run_name="keep", storage=storage, use_gpu=False)
    out = run(model, _cfg(4, batch_size=8), dataset=ref, run_name="keep", storage=storage, use_gpu=False,
              allow_change=True)
    assert (out["start_step"], out["steps"]) == (2, 2)
    # No batch size given: the run keeps its own (it is part of the data order), not the device's default.
    out = run(model, _cfg(6, batch_size=0), dataset=ref, run_name="keep", storage=storage, use_gpu=False)
    assert (out["start_step"], out["steps"], out["micro_batch"]) == (4, 2, 8)
    assert [launch["config"]["train"]["batch_size"] for launch in read_launches(out["path"])] == [4, 8, 8]

    # While a run trains, a second `train --run` with its name is refused, naming the live one.
    long = threading.Thread(target=run, args=(model, _cfg(40, checkpoint_every=0, log_every=20, batch_size=0)),
                            daemon=True, kwargs=dict(dataset=ref, run_name="busy", storage=storage, use_gpu=False))
    long.start()
    wait_for(lambda: holder(storage.run("busy")) is not None, "the first run's lease")
    with pytest.raises(LeaseBusy, match=f"training run busy is in use by .*pid {os.getpid()}"):
        run(model, _cfg(400), dataset=ref, run_name="busy", storage=storage, use_gpu=False)
    long.join(timeout=600)
    assert holder(storage.run("busy")) is None
    from train.memory import CPU_MICRO_BATCH

    start = next(r for r in read_jsonl(os.path.join(storage.run("busy"), "metrics.jsonl")) if r.get("event") == "start")
    assert start["micro_batch"] == CPU_MICRO_BATCH  # no batch size given: a new run's is sized for its device


@pytest.mark.slow("several training commands")
def test_the_model_is_shaped_for_the_dataset_and_by_flags(local_ray, corpus):
    """A preset plus flags covers any shape; vocab_size and seq_len default to the dataset's."""
    import train.__main__ as cli
    from pipelines.config import debug
    from pipelines.driver import run as preprocess

    storage = Storage.from_env()
    short = preprocess(debug("short-rows", read={"inputs": (corpus["path"],)}, pack={"seq_len": 64}), storage)
    gcs = local_ray.get_runtime_context().gcs_address
    out = cli.main(["--dataset", "short-rows", "--preset", "gpt2-124m", "--n-layer", "1", "--n-head", "2",
                    "--n-embd", "32", "--max-steps", "2", "--batch-size", "2", "--no-use-gpu", "--run", "shaped"])
    # Run in-process on a Ray its caller connected, the command leaves that Ray up (as a notebook's).
    assert local_ray.is_initialized() and local_ray.get_runtime_context().gcs_address == gcs
    model = read_launches(out["path"])[-1]["config"]["model"]
    vocab = resolve(storage, f"short-rows@{short['version']}").manifest.tokenizer.vocab_size
    assert model["vocab_size"] == -(-vocab // 128) * 128 and model["vocab_size"] >= vocab
    assert (model["seq_len"], model["n_layer"], model["n_head"], model["n_embd"]) == (64, 1, 2, 32)
    assert out["steps"] == 2
    # MFU and FLOPs count the real shape: 6N + 12 L T C per token for the fitted model.
    from train.model import GPTConfig, describe

    assert out["flops_per_token"] == describe(GPTConfig(**model))["flops_per_token"]


def test_bf16_fsdp2_runs_on_cpu_accumulating_to_its_tokens_per_step(local_ray, dataset, capfd):
    """The path the >=700M presets take on GPU (FSDP2, bf16 mixed precision), exercised on CPU workers
    over gloo before any GPU sees it; with a tokens-per-step target the run accumulates micro-batches to
    reach it, says so at start, and keeps the count in its checkpoints."""
    model = preset("debug", n_layer=2, n_embd=32, n_head=2)
    target = 4 * model.seq_len * 2 * 2  # micro-batch 4, 2 workers: 2 micro-batches a step
    out = run(model, _cfg(3, strategy="fsdp", precision="bf16", log_every=1, tokens_per_step=target),
              dataset=dataset["ref"], run_name="bf16-fsdp", storage=Storage.from_env(), workers=2, use_gpu=False)
    assert out["strategy"] == "fsdp" and out["steps"] == 3 and math.isfinite(out["last_loss"])
    start = next(r for r in read_jsonl(os.path.join(out["path"], "metrics.jsonl")) if r.get("event") == "start")
    assert start["bf16"] is True and start["strategy"] == "fsdp"
    assert (out["grad_accum"], out["tokens_per_step"]) == (2, target)
    assert f"{target:,} tokens per step: micro-batch 4 x {model.seq_len} tokens x 2 accumulated x 2 workers" \
        in capfd.readouterr().err
    assert out["tokens_per_s"] == pytest.approx(3 * target / out["loop_s"], rel=1e-3)
    with open(os.path.join(out["checkpoint"], "meta.json")) as f:
        assert json.load(f)["grad_accum"] == 2


def test_a_continued_run_keeps_its_learning_rate_schedule_unless_rescheduled():
    """Continuing with a longer --max-steps once stretched the cosine under the run (the rate jumped from
    0.00287 to 0.00197 at step 76); now it keeps the schedule it started with, unless --reschedule."""
    from dataclasses import asdict

    from train.config import lr_at
    from train.trainer import _check_continuation

    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    first = _cfg(100, warmup_steps=10)
    before = {"train": asdict(first)}
    longer = _check_continuation(before, "r", model, _cfg(200, warmup_steps=10), "hash", False)
    assert longer.schedule_steps == 100 and longer.max_steps == 200
    assert [lr_at(s, longer) for s in range(100)] == [lr_at(s, first) for s in range(100)]
    assert lr_at(150, longer) == pytest.approx(first.lr * first.min_lr_ratio)
    again = _check_continuation({"train": asdict(longer)}, "r", model, _cfg(300, warmup_steps=10), "hash", False)
    assert again.schedule_steps == 100  # the third launch still keeps the first one's schedule
    stretched = _check_continuation(before, "r", model, _cfg(200, warmup_steps=10), "hash", False, reschedule=True)
    assert stretched.schedule_steps == 0 and lr_at(76, stretched) > lr_at(76, first)


def test_a_run_that_lost_its_lease_commits_no_more_checkpoints(local_ray, dataset, monkeypatch):
    """Another writer takes the run's lease while it trains (its holder stalled past the ttl): the workers see
    it before their next checkpoint commit, and the run fails saying so, with nothing more committed."""
    import time

    from strata.data.lease import LeaseLost, _generations, _path
    from strata.data.storage import create_exclusive
    from train.committed import fence

    monkeypatch.setenv("STRATA_LEASE_TTL_S", "4")
    storage = Storage.from_env()
    run_dir = storage.run("usurped")
    model = preset("debug", n_layer=1, n_embd=32, n_head=2)
    outcome = {}

    def train():
        try:
            outcome["summary"] = run(model, _cfg(400, checkpoint_every=2, log_every=1), dataset=dataset["ref"],
                                     run_name="usurped", storage=storage, use_gpu=False, max_failures=0)
        except BaseException as e:  # noqa: BLE001 - looked at below
            outcome["error"] = e

    thread = threading.Thread(target=train)
    thread.start()
    wait_for(lambda: committed_checkpoints(run_dir), "a first checkpoint", timeout=300)
    gen = _generations(run_dir)[-1]
    taker = {"owner": "another host pid 1", "host": "elsewhere", "pid": 1, "acquired_at": time.time(),
             "renewed_at": time.time(), "expires_at": time.time() + 600, "released": False}
    assert create_exclusive(_path(run_dir, gen + 1), json.dumps(taker).encode())
    fence(run_dir, gen + 1)  # what the new holder does first (train.trainer)
    taken_at = max(int(os.path.basename(c).split("-")[1]) for c in committed_checkpoints(run_dir))
    thread.join(timeout=300)
    assert isinstance(outcome.get("error"), LeaseLost), outcome
    # Ray Train's controller may still be rewriting its record of checkpoints as the failed run ends (CI once
    # read it in that moment and saw none): wait until it names some again, then check what it names.
    wait_for(lambda: committed_checkpoints(run_dir), "the run's record of checkpoints, after it failed", timeout=60)
    committed = [int(os.path.basename(c).split("-")[1]) for c in committed_checkpoints(run_dir)]
    assert max(committed) == taken_at, (committed, taken_at)  # fenced: nothing the old holder handed over later
    # What the workers had staged for that refused handover is gone too (it was left in the temp dir).
    import fnmatch
    import glob
    import tempfile

    from train.checkpoint import staging_prefix

    staged = os.path.join(tempfile.gettempdir(), "strata-usurped-checkpoint-*")
    assert fnmatch.fnmatch(os.path.join(tempfile.gettempdir(), staging_prefix("usurped", 8, 0)), staged)
    assert not glob.glob(staged)


def test_a_long_accumulating_step_says_how_far_it_is(tmp_path):
    """`--preset gpt2-124m` on a CPU printed nothing for 9.5 minutes (1,024 micro-batches a step): the first
    micro-batch's time says what a step will take, and a line follows every 30 s of the step."""
    import io
    from types import SimpleNamespace

    from strata.data.storage import append_jsonl
    from train import loop
    from train.progress import Progress

    clock = [100.0]
    events = []
    slow = loop.MicroProgress(SimpleNamespace(event=events.append), clock=lambda: clock[0])
    slow.begin(1)
    for i in range(1, 1025):
        clock[0] += 0.6
        slow(i, 1024)
    assert events[0] == {"event": "slow_step", "step": 1, "first_micro_s": pytest.approx(0.6), "micro_batches": 1024}
    micro = [e for e in events if e["event"] == "micro"]
    assert len(micro) == 20 and all(b["seconds"] - a["seconds"] >= 30 for a, b in zip(micro, micro[1:], strict=False))
    quick, said = loop.MicroProgress(SimpleNamespace(event=events.append), clock=lambda: clock[0]), len(events)
    quick.begin(1)
    for i in range(1, 9):
        clock[0] += 0.01
        quick(i, 8)
    assert len(events) == said  # a step of seconds says nothing

    run = tmp_path / "run"
    for e in events[:2]:
        append_jsonl(str(run / "metrics.jsonl"), {"time": 2e9, **e})
    out = io.StringIO()
    Progress(str(run), 5000, since=0, out=out).poll()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[train] one step is 1,024 micro-batches, about 10m") and "--tokens-per-step" in lines[0]
    assert re.fullmatch(r"\[train\] step 1/5000: micro-batch 5\d/1,024 after 3\ds; this step ends in about 9m\d+s",
                        lines[1]), lines[1]


def test_a_resumed_run_s_curve_holds_each_step_once(tmp_path):
    """metrics.jsonl held steps 61-80 twice after a resume from step 60 (append-only: the first launch logged
    them before it stopped): every reader takes the launch that went on."""
    from strata.accounting.runlog import read_log, read_metrics
    from strata.data.storage import append_jsonl

    log = str(tmp_path / "metrics.jsonl")
    append_jsonl(log, {"event": "start", "start_step": 0, "time": 1})
    for step in (20, 40, 60, 80):
        append_jsonl(log, {"step": step, "loss": 5 - step / 100, "time": 2})
    append_jsonl(log, {"event": "start", "start_step": 60, "time": 3})  # killed after 80; resumed from 60
    for step in (80, 100):
        append_jsonl(log, {"step": step, "loss": 1.0, "time": 4})
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [20, 40, 60, 80, 100] and rows[3]["time"] == 4
    assert read_log(str(tmp_path)).launch_steps() == [0, 60]
