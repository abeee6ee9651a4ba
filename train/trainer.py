"""Tier 2's driver: resolve the dataset, place the workers, hold the run's lease, run the
`TorchTrainer`, and summarise the run from its metrics. `python -m train` is its CLI."""


from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, replace

from strata import tiers
from strata.connect import connect, embedded
from strata.cost import UsageMonitor
from strata.dataset import DatasetError, check_compatible
from strata.lease import Lease
from strata.records import write_record
from strata.runinfo import run_info
from strata.shell import StrataError
from strata.shell import log as _logger
from strata.storage import (
    Storage,
    basename,
    create_exclusive,
    exists,
    join,
    list_dir,
    read_json,
    read_jsonl,
    write_json_atomic,
)
from strata.tokenizer import from_info
from train import mixture
from train.checkpoint import check_checkpoint, committed_checkpoints, forget_missing, read_meta
from train.config import TrainConfig, accumulation
from train.data import Source
from train.loop import train_loop_per_worker
from train.mixture import resolve_all
from train.model import GPTConfig, describe
from train.placement import place
from train.progress import Progress

_log = _logger("train")


def read_metrics(run_dir: str) -> list[dict]:
    return [m for m in read_jsonl(join(run_dir, "metrics.jsonl")) if "loss" in m]  # step reports, not events


def run(model_cfg: GPTConfig, train_cfg: TrainConfig, *, dataset: str, run_name: str, storage: Storage,
        workers: int | None = None, use_gpu: bool | None = None, cpus_per_worker: float = 1,
        max_failures: int = 2, allow_change: bool = False, allow_mixed_gpus: bool = False,
        gpu_wait_s: float = 900.0, init: tuple[str, dict] | None = None, verbose: bool = False,
        reschedule: bool = False, sources: list | None = None) -> dict:
    """Train (or continue) run `run_name`, holding the run's lease: one writer per run. `init` is
    (source, weights) to start from (train.pretrained) when the run has no checkpoint yet. `sources`:
    `dataset` resolved already (train.mixture.resolve_all), so a launch reads each manifest once."""
    run_dir = storage.run(run_name)
    if not read_launches(run_dir):  # a new run on a dataset it cannot train on is refused before it exists
        sources = sources or resolve_all(storage, dataset)
        for v, _ in sources:
            check_compatible(v, vocab_size=model_cfg.vocab_size, seq_len=model_cfg.seq_len)
        if train_cfg.max_repeat and train_cfg.batch_size and workers:
            _check_repeats(sources, train_cfg, workers, model_cfg.seq_len)
    with Lease(run_dir, f"training run {run_name}", purpose="train").acquire(wait=False) as lease:
        return _run_leased(model_cfg, train_cfg, dataset=dataset, run_name=run_name, run_dir=run_dir, lease=lease,
                           storage=storage, workers=workers, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker,
                           max_failures=max_failures, allow_change=allow_change,
                           allow_mixed_gpus=allow_mixed_gpus, gpu_wait_s=gpu_wait_s, init=init, verbose=verbose,
                           reschedule=reschedule, sources=sources)


def _run_leased(model_cfg, train_cfg, *, dataset, run_name, run_dir, lease, storage, workers, use_gpu,
                cpus_per_worker, max_failures, allow_change, allow_mixed_gpus, gpu_wait_s, init, verbose,
                reschedule, sources) -> dict:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The driver speaks for the run (train/progress.py); Ray's worker and controller logs stay in its log
    # files unless --verbose.
    _log.info(connect(log_to_driver=verbose, quiet=not verbose))
    launches = read_launches(run_dir)
    if launches and (continued := _continued_dataset(launches[-1]["config"], dataset, run_name,
                                                     allow_change)) != dataset:
        dataset, sources = continued, None
    sources = sources or resolve_all(storage, dataset)
    for v, _ in sources:
        check_compatible(v, vocab_size=model_cfg.vocab_size, seq_len=model_cfg.seq_len)
    version, dataset = sources[0][0], mixture.spec([(v.ref, w) for v, w in sources])  # all share its tokenizer
    placement = place(embedded=embedded(), workers=workers, use_gpu=use_gpu, allow_mixed=allow_mixed_gpus,
                      wait_s=gpu_wait_s)
    workers, use_gpu = placement.workers, placement.use_gpu
    m = version.manifest
    if launches:
        train_cfg = _check_continuation(launches[-1]["config"], run_name, model_cfg, train_cfg, m.tokenizer.hash,
                                        allow_change, reschedule)
    if train_cfg.max_repeat and train_cfg.batch_size:
        _check_repeats(sources, train_cfg, workers, model_cfg.seq_len)
    size = describe(model_cfg)
    resume_from = _newest_intact(run_dir)
    if resume_from:
        check_checkpoint(resume_from)
        what = f"continuing run {run_name} from step {read_meta(resume_from)['step']} ({resume_from})"
    else:
        what = f"{'restarting' if launches else 'starting'} run {run_name} (no checkpoint yet)"
    _log.info(f"{what}: {size['params'] / 1e6:.2f}M params, "
              f"{size['flops_per_token'] / 1e6:.1f} MFLOP/token, "
              f"{_strategy_words(train_cfg.strategy)}, dataset {dataset}; {placement.why}")
    if init and not resume_from:
        _log.info(f"run {run_name} starts from the weights of {init[0]}")
    record = run_info("train", {"model": asdict(model_cfg), "train": asdict(train_cfg), "dataset": dataset,
                                "init_from": init[0] if init else None,
                                "tokenizer": asdict(m.tokenizer), "workers": workers, "use_gpu": use_gpu,
                                "cpus_per_worker": cpus_per_worker, **size})
    _record_launch(run_dir, len(launches), record)

    definition = version.tokenizer_definition()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"model": model_cfg, "train": train_cfg, "run_dir": run_dir,
                           "lease": {"what": f"training run {run_name}", "gen": lease.gen},
                           "sources": [Source.of(v, w) for v, w in sources],
                           "tokenizer": asdict(m.tokenizer), "tokenizer_definition": definition,
                           "token_bytes": from_info(m.tokenizer, definition).token_bytes().tolist(),
                           "threads": max(1, int(cpus_per_worker)),
                           # Read once by the driver; every worker takes them from the object store.
                           "init_weights": ray.put(init[1]) if init and not resume_from else None},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, accelerator_type=placement.accelerator,
                                     resources_per_worker={"CPU": cpus_per_worker},
                                     label_selector=tiers.selector(tiers.Tier.GPU)),
        run_config=RunConfig(name=run_name, storage_path=storage.runs(),
                             checkpoint_config=CheckpointConfig(num_to_keep=train_cfg.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=max_failures),
                             logging_config=LoggingConfig(log_level="INFO" if verbose else "WARNING")),
    )
    started = time.time()
    with UsageMonitor() as usage:
        try:
            result = fit(trainer, Progress(run_dir, train_cfg.max_steps, since=started))
        except ray.train.TrainingFailedError as e:
            if refusal := _worker_refusal(e):
                raise refusal from e
            raise
    rows = read_jsonl(join(run_dir, "metrics.jsonl"))
    history = [r for r in rows if "loss" in r]
    mine = [h for h in history if h["time"] >= started]
    # Ray's checkpoint path is inside its filesystem (no scheme): name it under the run's URI.
    checkpoint = join(run_dir, basename(result.checkpoint.path)) if result.checkpoint else None
    start_step = mine[0]["start_step"] if mine else (history[-1]["step"] if history else 0)
    last = mine[-1] if mine else {}
    wall = loop_totals([r for r in rows if r.get("event") == "end" and r["time"] >= started], workers)
    start = next((r for r in rows if r.get("event") == "start" and r["time"] >= started), {})
    summary = {
        "run": run_name, "path": run_dir, "dataset": dataset,
        "strategy": start.get("strategy", train_cfg.strategy),
        "micro_batch": start.get("micro_batch", train_cfg.batch_size),
        "grad_accum": start.get("grad_accum"), "tokens_per_step": start.get("tokens_per_step"),
        "workers": workers, "use_gpu": use_gpu, **size,
        "start_step": start_step, "steps": (last["step"] - start_step) if mine else 0,
        "first_loss": mine[0]["loss"] if mine else None, "last_loss": last.get("loss"),
        **{k: next((h[k] for h in reversed(mine) if k in h), None)
           for k in ("val_loss", "val_bpb", "val_loss_by_source", "val_bpb_by_source", "tokens_by_source",
                     "repeats_by_source")},
        **wall, "checkpoint": checkpoint, "seconds": round(time.time() - started, 1),
    }
    figures = {k: summary.get(k) for k in ("steps", "first_loss", "last_loss", "val_loss", "val_bpb",
                                           "val_loss_by_source", "tokens_by_source", "tokens_per_s",
                                           "tokens_per_s_per_worker", "mfu", "data_wait", "checkpoint_blocked",
                                           "report_blocked", "eval_share", "loop_s")}
    rec = write_record(storage, record, name=run_name, beside=join(run_dir, "record.json"), usage=usage,
                       work_nodes=_worker_nodes(run_dir, workers), figures=figures)
    return {**summary, "cost": rec["cost"], "node_hours": rec["node_hours"], "cpu_busy": rec["utilization"]["cpu_busy"]}


def fit(trainer, progress: Progress):
    """`trainer.fit()` on a thread of its own while this thread shows the run's progress.

    Ray Train installs its own SIGINT handler when `fit()` runs on the main thread (it aborts the run and
    exits 0 or 1, with a line of its own; `DataParallelTrainer._initialize_and_run_controller`), and not
    on any other thread. So Ctrl-C stays the command's: a KeyboardInterrupt here, which `strata.shell`
    turns into one line saying what was kept (tests/test_cli.py sends it)."""
    box: dict = {}

    def target():
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # noqa: BLE001 - raised again on this thread
            box["error"] = e

    thread = threading.Thread(target=target, name="strata-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=1.0)
        progress.poll()
    progress.close()
    if "error" in box:
        raise box["error"]
    return box["result"]


def _worker_refusal(e) -> Exception | None:
    """What a worker refused, for a reason meant for the user (a checkpoint that fails its signatures, a
    lease lost), as the one line it is."""
    for failure in (getattr(e, "worker_failures", None) or {}).values():
        cause = failure
        while cause is not None and not isinstance(cause, StrataError):
            cause = getattr(cause, "cause", None) or cause.__cause__
        if cause is not None:
            return type(cause)(str(cause).splitlines()[0])
    return None


def _check_repeats(sources, train_cfg: TrainConfig, workers: int, seq_len: int) -> None:
    """Refuse a run that would pass over a dataset more than --max-repeat times."""
    accum = accumulation(train_cfg, train_cfg.batch_size, workers, seq_len)
    rows = train_cfg.max_steps * accum * train_cfg.batch_size * workers
    over = {ref: r for ref, r in mixture.expected_repeats(sources, rows, workers).items() if r > train_cfg.max_repeat}
    if over:
        raise DatasetError(f"{train_cfg.max_steps} steps would repeat " + ", ".join(
            f"{ref} {r:.2f} times" for ref, r in over.items()) + f", more than --max-repeat {train_cfg.max_repeat:g}: "
            "train fewer steps, give it more weight elsewhere, or raise --max-repeat")


def _worker_nodes(run_dir: str, workers: int) -> list[str]:
    """The nodes of this run's ranks (as each rank recorded at start)."""
    out = []
    for rank in range(workers):
        path = join(run_dir, "workers", f"rank-{rank}.json")
        if exists(path):
            out.append(read_json(path)["node_id"])
    return out


def best_of_sweep(storage: Storage, sweep: str) -> dict:
    path = join(storage.sweep(sweep), "best.json")
    if not exists(path):
        raise FileNotFoundError(f"sweep {sweep!r} has no best.json under {storage.sweeps()}")
    return read_json(path)


def _strategy_words(strategy: str) -> str:
    return "DDP or FSDP2 by device memory" if strategy == "auto" else strategy.upper()


def loop_totals(ends: list[dict], workers: int) -> dict:
    """Throughput over the training loop's wall time (every attempt's, each ending in an `end` event):
    tokens/s = tokens trained / loop seconds, and the shares of that time (they add up to 1)."""
    seconds = sum(e["loop_s"] for e in ends)
    if not seconds:
        return {"tokens_per_s": None, "tokens_per_s_per_worker": None, "mfu": None, "data_wait": None,
                "checkpoint_blocked": None, "report_blocked": None, "eval_share": None, "compute_share": None,
                "loop_s": 0.0}
    tps = sum(e["tokens"] for e in ends) / seconds
    share = {k: sum(e[f"share_{k}"] * e["loop_s"] for e in ends) / seconds
             for k in ("data", "eval", "checkpoint", "report", "compute")}
    known = all(e.get("mfu") is not None for e in ends)
    return {"tokens_per_s": tps, "tokens_per_s_per_worker": tps / workers,
            "mfu": sum(e["mfu"] * e["loop_s"] for e in ends) / seconds if known else None,
            "data_wait": share["data"], "checkpoint_blocked": share["checkpoint"], "report_blocked": share["report"],
            "eval_share": share["eval"], "compute_share": share["compute"], "loop_s": round(seconds, 3)}


# Settings that decide which rows each step trains on: a continued run keeps them, so it continues exactly.
DATA_ORDER = ("batch_size", "grad_accum", "seed")


def read_launches(run_dir: str) -> list[dict]:
    """Every launch of the run (its resolved config, code and library versions), oldest first."""
    return [read_json(join(run_dir, "launches", name)) for name, d in list_dir(join(run_dir, "launches"))
            if not d and name.endswith(".json")]


def _record_launch(run_dir: str, n: int, record: dict) -> None:
    """Each launch's config is kept (launches/NNNN.json); run.json is the first launch's."""
    if not create_exclusive(join(run_dir, "launches", f"{n:04d}.json"), (json.dumps(record, indent=2) + "\n").encode()):
        raise RuntimeError(f"launch {n} of {run_dir} was recorded by another process: is the run's lease broken?")
    if n == 0:
        write_json_atomic(join(run_dir, "run.json"), record)


def _continued_dataset(before: dict, dataset: str, run_name: str, allow_change: bool) -> str:
    """The datasets a continued run reads: the snapshots it started on, unless asked to change them."""
    old = before.get("dataset", "")
    if dataset == old or allow_change:
        return dataset
    if mixture.spec(mixture.split(dataset)) == mixture.unpinned(old):
        _log.info(f"run {run_name} continues on {old}, the snapshot it started on "
                  f"(--dataset {dataset}@vN --allow-change to move it to a newer one)")
        return old
    raise ValueError(f"run {run_name} trains on {old}, not {dataset}: continue it with --dataset {old}, "
                     "start a new --run, or pass --allow-change")


def _check_continuation(before: dict, run_name: str, model_cfg: GPTConfig, train_cfg: TrainConfig,
                        tokenizer_hash: str, allow_change: bool, reschedule: bool = False) -> TrainConfig:
    """A run continues only with the model and tokenizer it started with, and, unless asked,
    with the same data order and learning-rate schedule; returns `train_cfg`, with the run's batch size
    and accumulation when none is given and its schedule when --max-steps changed."""
    if before.get("model") and before["model"] != asdict(model_cfg):
        changed = sorted(k for k, v in asdict(model_cfg).items() if before["model"].get(k) != v)
        raise ValueError(f"run {run_name} was started with another model ({', '.join(changed)} differ): "
                         "use a new --run")
    old = (before.get("tokenizer") or {}).get("hash")
    if old and old != tokenizer_hash:
        raise DatasetError(f"run {run_name} was trained with tokenizer {old}; this dataset's is {tokenizer_hash}: "
                           "the token ids would mean different things")
    for key in ("batch_size", "grad_accum"):  # none given: the run's (sized by its workers when that was none too)
        if not getattr(train_cfg, key):
            train_cfg = replace(train_cfg, **{key: before.get("train", {}).get(key, 0)})
    changed = [f"{k} {before['train'][k]} -> {getattr(train_cfg, k)}" for k in DATA_ORDER
               if k in before.get("train", {}) and before["train"][k] != getattr(train_cfg, k)]
    if changed and not allow_change:
        raise ValueError(f"run {run_name} would continue with another data order ({', '.join(changed)}): "
                         "pass --allow-change to continue anyway, or start a new --run")
    return _schedule(before.get("train", {}), run_name, train_cfg, reschedule)


def _schedule(before: dict, run_name: str, train_cfg: TrainConfig, reschedule: bool) -> TrainConfig:
    """The learning-rate schedule a continued run goes on with: the one it started with (the decay ends
    where it ended, then the rate stays at its floor), so a longer --max-steps never moves the rate under
    the run; --reschedule stretches the decay to the new --max-steps instead."""
    if train_cfg.schedule_steps or "max_steps" not in before:
        return train_cfg
    started = before.get("schedule_steps") or before["max_steps"]
    if reschedule or started == train_cfg.max_steps:
        if reschedule and started != train_cfg.max_steps:
            _log.info(f"run {run_name}: the learning rate now decays over {train_cfg.max_steps} steps, not "
                      f"{started} (--reschedule)")
        return train_cfg
    _log.info(f"run {run_name} keeps its learning-rate schedule: decay over its first {started} steps, then "
              f"lr x min_lr_ratio to step {train_cfg.max_steps} (--reschedule decays over {train_cfg.max_steps})")
    return replace(train_cfg, schedule_steps=started)


def _newest_intact(run_dir: str) -> str | None:
    """The newest registered checkpoint whose files are all there. Ones deleted by hand are dropped
    from Ray Train's record (it would refuse the run otherwise), and the run says so."""
    gone = forget_missing(run_dir)
    intact = committed_checkpoints(run_dir)
    if gone:
        _log.info(f"checkpoint(s) {', '.join(gone)} are registered but missing or incomplete: continuing "
                  f"from {basename(intact[-1]) if intact else 'step 0'}")
    return intact[-1] if intact else None
