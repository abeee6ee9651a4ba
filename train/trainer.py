"""Tier 2's driver: resolve the dataset, place the workers, hold the run's lease, run the
`TorchTrainer`, and summarise the run from its metrics. `python -m train` is its CLI."""


from __future__ import annotations

import threading
import time
from dataclasses import asdict, replace

from strata.accounting.runlog import read_launches, read_log, record_launch
from strata.cluster import tiers
from strata.cluster.connect import embedded
from strata.commands.shell import Job, StrataError
from strata.commands.shell import log as _logger
from strata.data.dataset import DatasetError
from strata.data.storage import Storage, basename, exists, join, read_json
from train.checkpoint import read_meta
from train.committed import fence, forget_missing, newest
from train.config import TrainConfig, accumulation
from train.loop import train_loop_per_worker
from train.model import GPTConfig, describe
from train.placement import place
from train.progress import Progress
from train.spec import RunSpec, continued_dataset

_log = _logger("train")
EVAL_WAIT_S = 300.0  # how long the driver waits, once training ends, for evaluations still running


def run(spec: RunSpec, *, run_name: str, storage: Storage, workers: int | None = None, use_gpu: bool | None = None,
        cpus_per_worker: float = 1, max_failures: int = 2, allow_change: bool = False, allow_mixed_gpus: bool = False,
        gpu_wait_s: float = 900.0, verbose: bool = False, reschedule: bool = False, from_sweep: str | None = None,
        allow_tainted: bool = False) -> dict:
    """Train (or continue) run `run_name` on `spec` (train.spec.resolve, with the same run_name), holding
    the run's lease: one writer per run. Continuing from a checkpoint a takedown tainted (train/taint.py) is
    refused unless `allow_tainted`."""
    run_dir = storage.run(run_name)
    if spec.train.eval_task:
        from train.tasks import load_task

        load_task(spec.train.eval_task)  # a bad task file is refused before the run starts
    if not read_launches(run_dir) and spec.train.max_repeat and spec.train.batch_size and workers:
        _check_repeats(spec, workers)  # refused before the run exists
    with Job("train", run_name, storage, holds=run_dir, what=f"training run {run_name}") as job:
        return _run_leased(spec, run_name=run_name, run_dir=run_dir, job=job, workers=workers, use_gpu=use_gpu,
                           cpus_per_worker=cpus_per_worker, max_failures=max_failures, allow_change=allow_change,
                           allow_mixed_gpus=allow_mixed_gpus, gpu_wait_s=gpu_wait_s, verbose=verbose,
                           reschedule=reschedule, from_sweep=from_sweep, allow_tainted=allow_tainted)


def _run_leased(spec: RunSpec, *, run_name, run_dir, job: Job, workers, use_gpu, cpus_per_worker, max_failures,
                allow_change, allow_mixed_gpus, gpu_wait_s, verbose, reschedule, from_sweep,
                allow_tainted=False) -> dict:
    import ray

    # The driver speaks for the run (train/progress.py): Ray's worker and controller logs stay in its log
    # files, and an embedded Ray starts without its dashboard (its nine module processes would share the
    # cores with Ray Train's start), unless --verbose.
    job.connect(dashboard=verbose, log_to_driver=verbose, quiet=not verbose)
    launches = read_launches(run_dir)
    placement = place(embedded=embedded(), workers=workers, use_gpu=use_gpu, allow_mixed=allow_mixed_gpus,
                      wait_s=gpu_wait_s)
    workers, use_gpu = placement.workers, placement.use_gpu
    if launches:
        spec = _continuation(spec, launches[-1]["config"], run_name, allow_change, reschedule)
    if spec.train.max_repeat and spec.train.batch_size:
        _check_repeats(spec, workers)
    size = describe(spec.model)
    fence(run_dir, job.lease.gen)  # before anything is read: an earlier holder's late checkpoints do not count
    resume_from = _newest_intact(run_dir)
    if resume_from:
        from train.taint import check

        check(run_dir, read_meta(resume_from)["step"], f"continuing run {run_name}", allow_tainted)
        what = f"continuing run {run_name} from step {read_meta(resume_from)['step']} ({resume_from})"
    else:
        what = f"{'restarting' if launches else 'starting'} run {run_name} (no checkpoint yet)"
    _log.info(f"{what}: {size['params'] / 1e6:.2f}M params, "
              f"{size['flops_per_token'] / 1e6:.1f} MFLOP/token, "
              f"{_strategy_words(spec.train.strategy)}, dataset {spec.dataset}; {placement.why}")
    if spec.init is not None and not resume_from:
        _log.info(f"run {run_name} starts from the weights of {spec.init_from}")
    record = job.begin({"model": asdict(spec.model), "train": asdict(spec.train), "dataset": spec.dataset,
                        "init_from": spec.init_from, "tokenizer": asdict(spec.tokenizer), "workers": workers,
                        "use_gpu": use_gpu, "cpus_per_worker": cpus_per_worker, "from_sweep": from_sweep, **size})
    record_launch(run_dir, len(launches), record)
    from strata.accounting.openlineage import dataset

    reads = [dataset(job.storage.dataset(s.name.partition("@")[0]), s.name.partition("@")[2]) for s in spec.sources]
    if spec.init_from:
        reads.append(dataset(spec.init_from.partition(" (")[0]))
    job.lineage(reads, [dataset(run_dir)])
    # Starting weights go to the object store once; every worker takes them from there.
    spec = replace(spec, init=ray.put(spec.init) if spec.init is not None and not resume_from else None)
    started = time.time()
    evals = _task_evals(spec, run_dir)
    with job.working():
        try:
            trainer = _trainer(spec, run_name, run_dir, job, workers, use_gpu, placement.accelerator,
                               cpus_per_worker, max_failures, verbose)
            result = fit(trainer, Progress(run_dir, spec.train.max_steps, since=started))
        except ray.train.TrainingFailedError as e:
            if evals:
                evals.close(wait_s=0)
            if refusal := _worker_refusal(e):
                raise refusal from e
            raise
        except BaseException:
            if evals:
                evals.close(wait_s=0)
            raise
        task_evals = evals.close(wait_s=EVAL_WAIT_S) if evals else []
    summary = _summary(spec, run_name, run_dir, started, result, workers, use_gpu, size)
    if evals:
        summary["task_evals"] = [{k: r.get(k) for k in ("step", "status", "acc", "acc_norm", "error") if k in r}
                                 for r in task_evals]
        _log.info(f"{evals.name}, evaluated on the cpu tier: " + ", ".join(
            f"step {r['step']} acc {r['acc']:.3f} (acc_norm {r['acc_norm']:.3f})" if r["status"] == "ok"
            else f"step {r['step']} failed ({r['error']})" for r in sorted(task_evals, key=lambda r: r["step"])))
    figures = {k: summary.get(k) for k in ("steps", "start_step", "tokens", "first_loss", "last_loss", "val_loss", "val_bpb",
                                           "val_loss_by_source", "tokens_by_source", "tokens_per_s",
                                           "tokens_per_s_per_worker", "mfu", "data_wait", "checkpoint_blocked",
                                           "report_blocked", "eval_share", "loop_s", "task_evals")}
    return {**summary, **job.finish(beside=join(run_dir, "record.json"), work_nodes=_worker_nodes(run_dir, workers),
                                    figures=figures)}


def _task_evals(spec: RunSpec, run_dir: str):
    """With --eval-task: the evaluations during training, started (train/tasks.py), or None."""
    if not spec.train.eval_task:
        return None
    from train.tasks import EVENT, TaskEvals

    done = {r["step"] for r in read_log(run_dir).events(EVENT) if r.get("status") == "ok"}
    evals = TaskEvals(run_dir, spec.train.eval_task, spec.train.eval_every, done).start()
    _log.info(f"evaluating {spec.train.eval_task} every {spec.train.eval_every} steps on the cpu tier, off the "
              "training workers")
    return evals


def _trainer(spec: RunSpec, run_name, run_dir, job, workers, use_gpu, accelerator, cpus_per_worker, max_failures,
             verbose):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"spec": spec, "run_dir": run_dir, "threads": max(1, int(cpus_per_worker)),
                           "lease": {"what": f"training run {run_name}", "gen": job.lease.gen}},
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=use_gpu, accelerator_type=accelerator,
                                     resources_per_worker={"CPU": cpus_per_worker},
                                     label_selector=tiers.selector(tiers.Tier.GPU)),
        run_config=RunConfig(name=run_name, storage_path=job.storage.runs(),
                             checkpoint_config=CheckpointConfig(num_to_keep=spec.train.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=max_failures),
                             logging_config=LoggingConfig(log_level="INFO" if verbose else "WARNING")),
    )


def _summary(spec: RunSpec, run_name, run_dir, started, result, workers, use_gpu, size) -> dict:
    """This launch's figures, from the run's log (strata/accounting/runlog.py)."""
    history = read_log(run_dir)
    mine = read_log(run_dir, since=started)
    steps = mine.steps
    # Ray's checkpoint path is inside its filesystem (no scheme): name it under the run's URI.
    checkpoint = join(run_dir, basename(result.checkpoint.path)) if result.checkpoint else None
    start_step = steps[0]["start_step"] if steps else (history.steps[-1]["step"] if history.steps else 0)
    last = steps[-1] if steps else {}
    start = next(iter(mine.events("start")), {})
    return {
        "run": run_name, "path": run_dir, "dataset": spec.dataset,
        "strategy": start.get("strategy", spec.train.strategy),
        "micro_batch": start.get("micro_batch", spec.train.batch_size),
        "grad_accum": start.get("grad_accum"), "tokens_per_step": start.get("tokens_per_step"),
        "workers": workers, "use_gpu": use_gpu, **size,
        "start_step": start_step, "steps": (last["step"] - start_step) if steps else 0,
        "first_loss": steps[0]["loss"] if steps else None, "last_loss": last.get("loss"),
        **{k: next((h[k] for h in reversed(steps) if k in h), None)
           for k in ("val_loss", "val_bpb", "val_loss_by_source", "val_bpb_by_source", "tokens_by_source",
                     "repeats_by_source")},
        **loop_totals(mine.events("end"), workers), "checkpoint": checkpoint,
        "seconds": round(time.time() - started, 1),
    }


def fit(trainer, progress: Progress):
    """`trainer.fit()` on a thread of its own while this thread shows the run's progress.

    Ray Train installs its own SIGINT handler when `fit()` runs on the main thread (it aborts the run and
    exits 0 or 1, with a line of its own; `DataParallelTrainer._initialize_and_run_controller`), and not
    on any other thread. So Ctrl-C stays the command's: a KeyboardInterrupt here, which `strata.commands.shell`
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


def _check_repeats(spec: RunSpec, workers: int) -> None:
    """Refuse a run that would pass over a dataset more than --max-repeat times."""
    train_cfg = spec.train
    accum = accumulation(train_cfg, train_cfg.batch_size, workers, spec.model.seq_len)
    rows = train_cfg.max_steps * accum * train_cfg.batch_size * workers
    over = {ref: r for ref, r in spec.repeats(rows, workers).items() if r > train_cfg.max_repeat}
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
                "loop_s": 0.0, "tokens": sum(e["tokens"] for e in ends)}
    tps = sum(e["tokens"] for e in ends) / seconds
    share = {k: sum(e[f"share_{k}"] * e["loop_s"] for e in ends) / seconds
             for k in ("data", "eval", "checkpoint", "report", "compute")}
    known = all(e.get("mfu") is not None for e in ends)
    return {"tokens_per_s": tps, "tokens_per_s_per_worker": tps / workers,
            "mfu": sum(e["mfu"] * e["loop_s"] for e in ends) / seconds if known else None,
            "data_wait": share["data"], "checkpoint_blocked": share["checkpoint"], "report_blocked": share["report"],
            "eval_share": share["eval"], "compute_share": share["compute"], "loop_s": round(seconds, 3),
            "tokens": sum(e["tokens"] for e in ends)}


# Settings that decide which rows each step trains on: a continued run keeps them, so it continues exactly.
DATA_ORDER = ("batch_size", "grad_accum", "seed")


def _continuation(spec: RunSpec, before: dict, run_name: str, allow_change: bool, reschedule: bool) -> RunSpec:
    """The spec a continued run goes on with (see _check_continuation), on the datasets it started on unless
    allowed to change (train.spec.resolve with the run's name picks those)."""
    continued_dataset(before.get("dataset", ""), spec.dataset, run_name, allow_change)
    return replace(spec, train=_check_continuation(before, run_name, spec.model, spec.train, spec.tokenizer.hash,
                                                   allow_change, reschedule))


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
    """The newest registered checkpoint whose files are all there and verify. Ones deleted by hand, or handed
    over by a fenced-off lease generation, are dropped from Ray Train's record (it would refuse the run
    otherwise); ones that fail their signatures are passed over. The run names each, with why."""
    gone = forget_missing(run_dir)
    found, _, refused = newest(run_dir)
    if refused:  # Ray Train would hand its newest registered checkpoint to the workers: not a refused one
        forget_missing(run_dir, dict(refused))
    missing = [name for name, why in gone.items() if why == "missing or incomplete"]
    for name, why in [*((n, w) for n, w in gone.items() if n not in missing), *refused]:
        _log.info(f"checkpoint {name} left out: {why}")
    if gone or refused:
        since = basename(found) if found else "step 0"
        _log.info(f"checkpoint(s) {', '.join(missing)} are registered but missing or incomplete: continuing from {since}"
                  if missing else f"continuing from {since}")
    return found
