"""The sweep driver: the Tuner over train's loop on spot-tier nodes, resume, results (table, CSV,
plots, best config) and the run record. `python -m tune` is its CLI."""


from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
import threading
import time
from dataclasses import asdict, replace

import numpy as np
from ray.tune import Callback
from ray.tune.stopper import Stopper

from strata.cluster import tiers
from strata.cluster.procs import rss_mb
from strata.commands.shell import Job, StrataError
from strata.commands.shell import log as _logger
from strata.data.storage import (
    Storage,
    exists,
    join,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
)
from train import mixture
from train.config import TRAIN_PRESETS
from train.model import preset
from train.spec import resolve
from train.tasks import load_task
from tune.config import REFERENCE_CONCURRENT
from tune.plots import write_plots
from tune.queued import FLUSH_S, GRACE, REDUCTION, ConfigQueue, read_results, rungs, sample
from tune.sweep import (
    MIX,
    STATE_FILE,
    SweepConfig,
    TrialSpec,
    load_rows,
    load_space,
    to_tune,
    trial,
    work,
)
from tune.trials import status_counts, trials_csv, trials_table
from tune.trust import SignTuneState, check_tune_state, sign_tuner

_log = _logger("tune")
# Ray Tune drives one experiment per process: two sweeps started from two threads of one process both hung
# (neither wrote a result in 600 s; two processes at once are fine). So a second one is refused.
_ONE_SWEEP = threading.Lock()


def _alone(run):
    """`run`, refused with a StrataError while another sweep runs in this process."""
    @functools.wraps(run)
    def alone(cfg, **kwargs):
        if not _ONE_SWEEP.acquire(blocking=False):
            raise StrataError(f"sweep {kwargs['sweep_name']}: another sweep is running in this process, and Ray "
                              "Tune runs one at a time per process (two at once hang). Start it after that one "
                              "ends, or from another process: `python -m tune ...` or `ray job submit -- python -m "
                              "tune ...`")
        try:
            return run(cfg, **kwargs)
        finally:
            _ONE_SWEEP.release()

    return alone



@_alone
def run(cfg: SweepConfig, *, dataset: str, model_preset: str, sweep_name: str, storage: Storage,
        progress: bool = True, dashboard: bool = True, verbose: bool = False) -> dict:
    """Run (or, when the sweep directory holds an unfinished one, resume) a sweep; write its results.

    `dashboard=False` starts an embedded Ray without its dashboard (a joined cluster keeps its own);
    `verbose` shows the trial workers' own output (a failed config's traceback; its error is recorded
    either way). One
    sweep at a time per process: a second one started while the first runs (another thread, a notebook's
    background cell) is refused with a StrataError."""
    # Per-trial JSON/TensorBoard loggers cost driver memory and time; keep CSV only.
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    # A config's own trial (--pack 1) keeps its last 2 checkpoints (model state), so Tune snapshots the
    # experiment every 2 checkpoints of a trial: expected. Queued workers checkpoint nothing.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")

    import ray

    space = load_space(cfg.space)  # read and checked once, on the driver, before anything starts
    sweep_dir = storage.sweep(sweep_name)
    if exists(join(sweep_dir, "sweep.json")):  # a resume reads the snapshots it began on
        began = read_json(join(sweep_dir, "sweep.json"))["config"]["dataset"]
        dataset = began if mixture.unpinned(began) == mixture.unpinned(dataset) else dataset
    trial_spec = spec_for(cfg, space, dataset, model_preset, storage, sweep_dir)
    # One driver per sweep: a resume while the first driver is alive would run every trial twice.
    with Job("sweep", sweep_name, storage, holds=sweep_dir, what=f"sweep {sweep_name}", purpose="tune",
             tag="tune") as job:
        # Everything above is read and checked before Ray starts: a mistake costs no start-up.
        job.connect(quiet=True, dashboard=dashboard, log_to_driver=verbose)  # workers' logs: --verbose
        check_driver_node()
        # The starting weights go to the object store once; each trial process fetches them once.
        base = trial_spec.run
        trial_spec = replace(trial_spec, run=replace(base, init=ray.put(base.init) if base.init is not None else None))
        return _run_leased(job, cfg, space, base.dataset, trial_spec, sweep_name, sweep_dir, model_preset, progress)


def spec_for(cfg: SweepConfig, space: dict, dataset: str, model_preset: str, storage: Storage,
             out: str = "") -> TrialSpec:
    """What every trial of the sweep trains from, read and checked before Ray starts (`out`: the sweep's
    directory, where trials write their losses; bench.tune's plain loop builds its configs from this too)."""
    if cfg.init_from and (shaped := sorted(set(space) & {"n_layer", "n_head", "n_embd"})):
        raise ValueError(f"--init-from takes the model's shape from the weights: the space cannot tune {shaped[0]}")
    # The preset shaped for the dataset, as `python -m train --preset` shapes it (so --from-sweep matches).
    base = resolve(storage, dataset, preset(model_preset), TRAIN_PRESETS[model_preset], init_from=cfg.init_from,
                   weighted=False)
    names = [s.name.partition("@")[0] for s in base.sources]
    if unknown := sorted({k[len(MIX):] for k in space if k.startswith(MIX)} - set(names)):
        raise ValueError(f"the space weighs {', '.join(unknown)}, which {'is' if len(unknown) == 1 else 'are'} "
                         f"not among the sweep's datasets ({', '.join(names)})")
    # No validation split: score on the last training rows (which trials also see).
    val_rows = [held if (held := load_rows(s, "validation", cfg.eval_rows)) is not None
                else load_rows(s, "train", cfg.eval_rows, last=True) for s in base.sources]
    task = tuple(load_task(cfg.eval_task)) if cfg.eval_task else ()  # a bad task file fails before Ray starts
    return TrialSpec(run=base, sweep=cfg, val_rows=np.concatenate(val_rows), out=out, task=task)


def _run_leased(job: Job, cfg, space, dataset, trial_spec, sweep_name, sweep_dir, model_preset, progress) -> dict:
    from ray import tune

    what = {"sweep": asdict(cfg), "dataset": dataset, "preset": model_preset}
    resuming = tune.Tuner.can_restore(sweep_dir)
    if resuming:
        info = job.begin(what, read_json(join(sweep_dir, "sweep.json")))
        if info["config"] != json.loads(json.dumps(what)):
            raise ValueError(f"sweep {sweep_name} already exists with other settings ({info['config']}); "
                             "rerun it with the same ones to resume it, or pick another --sweep name")
    else:
        info = job.begin(what)
        write_json_atomic(join(sweep_dir, "sweep.json"), info)
    workers = worker_count(cfg) if cfg.queued else 0
    _log.info(f"{'resuming' if resuming else 'starting'} sweep {sweep_name}: {cfg.num_samples} trials"
              f"{f' taken from its queue by {workers} workers' if workers else ''} on "
              f"{sum(src.rows for s in trial_spec.run.sources for src in s.shards):,} rows of {dataset}")

    started = time.time()
    queue = {}
    with job.working():
        if cfg.queued:
            # Data goes into the object store once; every trial reads the same copy.
            grid, trials, queue = fit_queued(work, cfg, space, sweep_dir, workers=workers, progress=progress,
                                             resume=resuming, spec=trial_spec)
        else:
            tuner = make_tuner(tune.with_parameters(trial, spec=trial_spec, space=space), cfg, space, sweep_dir,
                               progress=progress, resume=resuming)
            grid = fit(tuner)
            trials = collect(grid, cfg, space)
    done = [t for t in trials if t["best"] is not None]
    if not done:
        raise RuntimeError(f"sweep {sweep_name}: no trial reported a metric; first error: "
                           f"{next((t['error'] for t in trials if t['error']), None)}")
    best = min(done, key=lambda t: cfg.sign * t["best"])
    write_json_atomic(join(sweep_dir, "best.json"), {"config": best["config"], cfg.metric: best["best"],
                                                     "metric": cfg.metric, "init_from": cfg.init_from,
                                                     "trial": best["trial"], "preset": model_preset,
                                                     "dataset": dataset, "space": cfg.space,
                                                     "search": cfg.search, "seed": cfg.seed})
    write_json_atomic(join(sweep_dir, "trials.json"), {"trials": trials})
    write_bytes_atomic(join(sweep_dir, "trials.csv"), trials_csv(trials, cfg.metric, cfg.sign).encode())
    plots = write_plots(trials, space, cfg, sweep_dir)
    print(trials_table(trials, cfg.metric, sign=cfg.sign), file=sys.stderr)
    counts = status_counts(trials)
    hours = (job.usage.ended - job.usage.started) / 3600
    figures = {"trials": len(trials), **{k.replace(" ", "_"): v for k, v in counts.items()},
               "iterations": sum(t["iterations"] for t in trials), "best": best["best"], "metric": cfg.metric,
               "trials_per_hour": len(trials) / hours if hours else None, "pack": cfg.pack,
               "curves": [t["curve"] for t in sorted(done, key=lambda t: cfg.sign * t["best"])[:5]]}
    return {
        **job.finish(beside=join(sweep_dir, "record.json"), work_nodes=[t["node_id"] for t in trials if t["node_id"]],
                     figures=figures),
        "sweep": sweep_name, "path": sweep_dir, "dataset": dataset, "resumed": resuming,
        "trials": len(trials), "completed": counts["completed"], "stopped_early": counts["stopped early"],
        "errors": counts["error"], "ended": counts["completed"] + counts["stopped early"], "tune_trials": len(grid),
        "pack": cfg.pack, "workers": workers, "restores": sum(t["restores"] for t in trials),
        "requeued": queue.get("requeued", 0),
        "best": {"config": best["config"], "metric": best["best"], "metric_name": cfg.metric},
        "iterations": sum(t["iterations"] for t in trials), "seconds": round(time.time() - started, 1),
        "plots": plots,
    }


class _Interrupted:
    """The SIGINT handler while Tune runs. Tune installs its own over it (on the main thread) and, on the
    first Ctrl-C, checkpoints the experiment, stops, and puts back the handler it found: this one. So this
    handler being in place after `fit()` means the sweep was interrupted (`ray/tune/tune.py`,
    `_setup_signal_catching`; tests/test_cli.py sends the Ctrl-C)."""

    def __call__(self, signum, frame):
        raise KeyboardInterrupt


class _QuietInterrupt(logging.Filter):
    """Tune's own lines about an interrupt point at `Tuner.restore`: strata's one line says how to go on."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not msg.startswith(("Stop signal received", "Experiment has been interrupted"))


def fit(tuner):
    """`tuner.fit()`; a KeyboardInterrupt once Tune has saved what an interrupted sweep keeps."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():  # no signals here: Tune installs none
        return tuner.fit()
    marker, quiet, log = _Interrupted(), _QuietInterrupt(), logging.getLogger("ray.tune.tune")
    previous = signal.signal(signal.SIGINT, marker)
    log.addFilter(quiet)
    try:
        grid = tuner.fit()
        interrupted = signal.getsignal(signal.SIGINT) is marker
    finally:
        signal.signal(signal.SIGINT, previous)
        log.removeFilter(quiet)
    if interrupted:
        raise KeyboardInterrupt
    return grid


def make_tuner(trainable, cfg: SweepConfig, space: dict, sweep_dir: str, *, progress: bool = True,
               resume: bool = False, queue: str = "", workers: int = 0):
    """The sweep's Tuner: trials on spot nodes, retried on node loss. With `queue` (the queue actor's name):
    `workers` worker trials that take configs from it; else a trial per config, checkpointed at every
    report, with Tune's scheduler and search."""
    from ray import tune
    from ray.tune.logger import CSVLoggerCallback
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    trainable = tune.with_resources(trainable, tune.PlacementGroupFactory(
        [{"CPU": cfg.cpus_per_trial}], bundle_label_selector=[tiers.selector(tiers.Tier.SPOT)]))
    if resume:
        check_tune_state(sweep_dir)  # Tune unpickles what it restores from: only what strata signed
        return tune.Tuner.restore(sweep_dir, trainable, resume_unfinished=True, resume_errored=True)
    max_t = cfg.reports
    # Queued configs meet ASHA's rule in the queue; Tune's scheduler only sees a config's own trial.
    scheduler = (ASHAScheduler(max_t=max_t, grace_period=min(GRACE, max_t), reduction_factor=REDUCTION)
                 if cfg.scheduler == "asha" and not queue else FIFOScheduler())
    storage_path, name = sweep_dir.rstrip("/").rsplit("/", 1)
    poll = QueuePoll(queue) if queue else None
    if queue:
        space_or_workers = {"worker": tune.grid_search(list(range(workers)))}
        concurrency = {}
        callbacks = [RequeueLost(queue)]
    else:
        space_or_workers, concurrency, callbacks = to_tune(space), _concurrency(cfg, _searcher(cfg)), [DropFinishedState()]
    tuner = tune.Tuner(
        trainable,
        param_space=space_or_workers,
        # A worker reports once, at its end (`configs`, its count): no metric for Tune to rank by.
        tune_config=tune.TuneConfig(metric=None if queue else cfg.metric, mode=None if queue else cfg.mode,
                                    num_samples=1 if queue else cfg.num_samples, scheduler=scheduler,
                                    reuse_actors=True, **concurrency),
        run_config=tune.RunConfig(
            name=name, storage_path=storage_path, verbose=0,  # SweepProgress and the final table instead
            callbacks=[CSVLoggerCallback(), SignTuneState(name), *callbacks,
                       *([SweepProgress(cfg, sweep_dir, poll=poll)] if progress else [])],
            stop=QueueOver(poll) if queue else None,
            checkpoint_config=tune.CheckpointConfig(num_to_keep=2),  # a config's own trial: the last report's
            failure_config=tune.FailureConfig(max_failures=cfg.max_failures)),
    )
    sign_tuner(sweep_dir)
    return tuner


def worker_count(cfg: SweepConfig) -> int:
    """Workers of a queued sweep: --max-concurrent; else one per spot slot of the cluster now, or, where an
    autoscaler announces that it starts spot nodes on demand, enough for the reference (200) so that it
    does, as far as the sweep has configs."""
    import ray

    if cfg.max_concurrent:
        return min(cfg.num_samples, cfg.max_concurrent)
    nodes = ray.nodes()
    slots = tiers.cpus_of(tiers.Tier.SPOT, nodes, per=cfg.cpus_per_trial)
    autoscaled = any(n.get("Alive") and tiers.Tier.SPOT in tiers.autoscaled_tiers(n.get("Labels") or {}) for n in nodes)
    return max(1, min(cfg.num_samples, max(slots, REFERENCE_CONCURRENT if autoscaled else 1)))


def queue_name(sweep_dir: str) -> str:
    """The name of a sweep's queue actor: callbacks and workers find it by name (Tune pickles callbacks
    with the experiment, and a resumed sweep has a new queue)."""
    import hashlib

    return "strata-sweep-queue-" + hashlib.sha256(sweep_dir.encode()).hexdigest()[:16]


def fit_queued(worker, cfg: SweepConfig, space: dict, sweep_dir: str, *, workers: int, progress: bool = True,
                resume: bool = False, **params) -> tuple:
    """Run a queued sweep: its queue actor on this (the driver's) node, and `workers` worker trials of
    `worker(config, space=, queue=, **params)` (Tune's function trainable; `queue` is the queue's name).
    Returns Tune's ResultGrid, a record per config (`collect_queued`) and the queue's final counts."""
    import ray
    from ray import tune
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    name = queue_name(sweep_dir)
    for _ in read_results(sweep_dir, cfg.num_samples):  # a rerun's parts, checked here: one line if one is junk
        pass
    queue = ray.remote(ConfigQueue).options(
        name=name, num_cpus=0, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False),
    ).remote(sweep_dir, cfg.num_samples, rungs=rungs(cfg.reports) if cfg.scheduler == "asha" else [], sign=cfg.sign,
             max_attempts=cfg.max_failures + 1 if cfg.max_failures >= 0 else 1 << 30,
             flush_s=float(os.environ.get("STRATA_SWEEP_FLUSH_S", FLUSH_S)))
    state = {}
    try:
        before = ray.get(queue.progress.remote())  # up, and done reading what a killed driver's queue wrote
        if before["resumed"]:
            _log.info(f"{before['resumed']} of {cfg.num_samples} configs are on record from before; "
                      f"{before['queued']} to run")
        tuner = make_tuner(tune.with_parameters(worker, space=space, queue=name, **params), cfg, space, sweep_dir,
                           progress=progress, resume=resume, queue=name, workers=workers)
        grid = fit(tuner)
    finally:  # Ctrl-C too: what finished is written, and the rerun does not run it again
        try:
            state = ray.get(queue.close.remote(), timeout=120)
        except ray.exceptions.RayError as e:
            _log.warning(f"the sweep's queue did not write its last results ({e})")
        ray.kill(queue)
    return grid, collect_queued(sweep_dir, cfg, space, grid), state


def check_driver_node() -> None:
    """Refuse to drive a sweep from a spot node of a multi-node cluster: losing it would lose the sweep."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    me = ray.get_runtime_context().get_node_id()
    labels = next((n.get("Labels", {}) for n in nodes if n["NodeID"] == me), {})
    if len(nodes) > 1 and tiers.Tier.SPOT in tiers.tiers_of(labels):
        raise ValueError("this sweep's driver is on a spot node, which can be reclaimed with the sweep on it; "
                         "submit it to the head (`ray job submit` without entrypoint resources) or a cpu node")


def collect(grid, cfg: SweepConfig, space: dict) -> list[dict]:
    """Every config of a sweep with a Tune trial per config, from each trial's last checkpoint."""
    out = []
    for r in grid:
        tid = r.metrics.get("trial_id") or os.path.basename(r.path or "")
        book = _book(r.checkpoint, r.metrics.get("trial_id"))
        error = f"{type(r.error).__name__}: {r.error}"[:500] if r.error else None
        rec = book["current"] or {"config": r.config, "curve": []}
        status = ("error" if r.error else "completed" if len(rec["curve"]) == cfg.reports else "stopped early")
        out.append(_record(tid, rec, status, error, len(book["restores"]), book.get("report_share"), cfg))
    return out


def collect_queued(sweep_dir: str, cfg: SweepConfig, space: dict, grid) -> list[dict]:
    """Every config of a queued sweep, from its results: none goes unaccounted for. A config with no
    result (every worker failed before it ran) is an error with the first worker's error."""
    failed = next((f"{type(r.error).__name__}: {r.error}"[:500] for r in grid if r.error), None)
    have = {rec["index"]: rec for rec in read_results(sweep_dir, cfg.num_samples)}
    out = []
    for i in range(cfg.num_samples):
        rec = have.pop(i, None) or {"config": None, "curve": [], "status": "error", "worker": "none", "attempts": 0,
                                    "error": failed or "never run: the sweep ended before a worker took it"}
        if rec["config"] is None:  # lost too often to have run to a result: recomputed from its index
            rec["config"] = sample(space, cfg.seed, i)
        out.append(_record(f"{rec['worker']}:{i}", rec, rec["status"], rec["error"], max(rec["attempts"] - 1, 0),
                           rec.get("report_share"), cfg))
    return out


def _book(checkpoint, trial_id: str | None) -> dict:
    """A trial's book of results from its last checkpoint, checked against the checkpoint's signed list."""
    from tune.trust import trial_files

    empty = {"current": None, "restores": []}
    if checkpoint is None:
        return empty

    def read(name: str) -> bytes:
        with checkpoint.filesystem.open_input_stream(join(checkpoint.path, name)) as f:
            return f.read()

    try:
        read("pack.json")
    except FileNotFoundError:
        return empty
    return json.loads(trial_files(read, checkpoint.path, trial_id)["pack.json"])


def _record(trial_id: str, rec: dict, status: str, error: str | None, restores: int,
            report_share: float | None, cfg: SweepConfig) -> dict:
    curve = [float(v) for v in rec["curve"]]
    return {"trial": trial_id, "config": rec["config"], "status": status, "iterations": len(curve),
            "best": cfg.best(curve) if curve else None, "curve": curve, "node_id": rec.get("node"),
            "restores": restores, "error": error, "report_share": report_share}


class RequeueLost(Callback):
    """Tells a queued sweep's queue at once when Tune sees a worker fail (its node lost, its process
    killed), so that the configs it held go to a waiting worker rather than wait for this one's restart."""

    def __init__(self, queue: str):
        self.queue = queue

    def _lost(self, trial) -> None:
        import ray

        with contextlib.suppress(ValueError):  # the queue is gone: the sweep is ending
            ray.get_actor(self.queue).requeue.remote(trial.trial_id)

    def on_trial_recover(self, iteration, trials, trial, **info):
        self._lost(trial)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._lost(trial)


class QueuePoll:
    """A queued sweep's progress as its queue tells it, asked at most every `every_s`: the progress bar and
    the stopper share one, so the driver makes one request where it made two. None: the queue is gone
    (the sweep is ending)."""

    def __init__(self, queue: str, every_s: float = 1.0):
        self.queue, self.every_s, self.at, self.last = queue, every_s, -math.inf, None

    def __getstate__(self):
        return {**self.__dict__, "at": -math.inf, "last": None}

    def get(self, fresh: bool = False) -> dict | None:
        import ray

        now = time.monotonic()
        if fresh or now - self.at >= self.every_s:
            self.at, self.last = now, None
            with contextlib.suppress(ValueError, ray.exceptions.RayError):
                self.last = ray.get(ray.get_actor(self.queue).progress.remote(), timeout=30)
        return self.last


class QueueOver(Stopper):
    """Ends a queued sweep once its queue has handed out every config and has every result: worker trials
    Tune has not started yet (more workers than the cluster holds now) then never start.

    It stops the experiment `grace_s` after the queue said so: running workers end by themselves as soon as
    they hear it, and one that Tune stopped in the middle of its last report printed a traceback."""

    def __init__(self, poll: QueuePoll, grace_s: float = 3.0):
        self.poll, self.grace_s, self.over = poll, grace_s, None

    def __getstate__(self):
        return {**self.__dict__, "over": None}

    def __call__(self, trial_id, result) -> bool:
        return False

    def stop_all(self) -> bool:
        now = time.monotonic()
        if self.over is None and (p := self.poll.get()) and p["over"]:
            self.over = now
        return self.over is not None and now - self.over >= self.grace_s


class DropFinishedState(Callback):
    """A config's own trial checkpoints its model and optimizer at every report, for Tune's scheduler to pause
    and resume it; once the trial has ended (completed, or stopped by ASHA) no resume needs them. Its
    checkpoints keep only the book of results (pack.json, which `collect` reads): without this, 1,024
    configs of the debug preset kept 21 GB. A trial that errored keeps its state, for --resume."""

    def on_trial_complete(self, iteration, trials, trial, **info):
        from pyarrow import fs as pafs

        try:
            store = trial.storage.storage_filesystem
            for f in store.get_file_info(pafs.FileSelector(trial.path, recursive=True, allow_not_found=True)):
                if f.type == pafs.FileType.File and f.base_name == STATE_FILE:
                    store.delete_file(f.path)
        except OSError as e:  # the results stand; only the space is not given back
            _log.warning(f"trial {trial.trial_id}: its checkpoints' model state was not deleted ({e})")


class SweepProgress(Callback):
    """Counts configs done, stopped early and failed (from the queue, or from a Tune trial per config): a
    bar on stderr, and `progress.json` in the sweep directory for notebooks and other watchers."""

    def __init__(self, cfg: SweepConfig, sweep_dir: str, every_s: float = 2.0, poll: QueuePoll | None = None):
        self.cfg, self.sweep_dir, self.every_s, self.poll = cfg, sweep_dir, every_s, poll
        self.last, self.bar, self.said = 0.0, None, None
        self.peak = 0  # the most trials running at once (--max-concurrent caps it)

    def __getstate__(self):  # Tune pickles its callbacks with the experiment; the bar is rebuilt
        return {**self.__dict__, "bar": None, "last": 0.0, "said": None}

    def counts(self, trials, fresh: bool = False) -> dict | None:
        if self.poll:  # what the queue knows: configs, and workers holding some (`running`)
            return self.poll.get(fresh)
        done = errors = 0
        best = None
        for t in trials:
            # Ended with a result: a trial Ctrl-C ended before it reported ends TERMINATED too.
            done += int(t.status == "TERMINATED" and self.cfg.metric in (t.last_result or {}))
            errors += int(t.status == "ERROR")
            m = t.metric_analysis.get(self.cfg.metric, {}).get(self.cfg.mode)
            if m is not None and (best is None or self.cfg.sign * m < self.cfg.sign * best):
                best = m
        return {"trials": self.cfg.num_samples, "done": done, "errors": errors, "best": best,
                "running": sum(t.status == "RUNNING" for t in trials), "peak_running": self.peak}

    def on_step_begin(self, iteration, trials, **info):
        self._update(trials)

    def on_trial_start(self, iteration, trials, trial, **info):  # called before Tune marks `trial` RUNNING
        self.peak = max(self.peak, 1 + sum(t.status == "RUNNING" for t in trials if t is not trial))

    def on_experiment_end(self, trials, **info):
        self._update(trials, force=True)
        if self.bar is not None:
            self.bar.close()

    def _update(self, trials, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < self.every_s:
            return
        self.last = now
        if (c := self.counts(trials, fresh=force)) is None:
            return
        # The driver's memory too: it should stay flat as configs complete (results stream to storage).
        write_json_atomic(join(self.sweep_dir, "progress.json"), {**c, "updated": time.time(),
                                                                  "driver_rss_mb": round(rss_mb(), 1)})
        if not sys.stderr.isatty():  # a log (a submitted job's, a file): a line when something changed
            line = (f"[tune] trials: {c['done']}/{c['trials']} done, {c['running']} running, {c['errors']} failed, "
                    f"best {c['best']:.4f}" if c["best"] is not None else f"[tune] trials: {c['done']}/{c['trials']} "
                    f"done, {c['running']} running, {c['errors']} failed")
            if line != self.said or force:
                print(line, file=sys.stderr, flush=True)
                self.said = line
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.cfg.num_samples, desc="[tune] trials", unit="trial", file=sys.stderr,
                            dynamic_ncols=True)
        self.bar.n = c["done"] + c["errors"]
        self.bar.set_postfix(best=f"{c['best']:.4f}" if c["best"] is not None else "-", running=c["running"],
                             errors=c["errors"], refresh=False)
        self.bar.refresh()


def _concurrency(cfg: SweepConfig, searcher) -> dict:
    """TuneConfig's search_alg and max_concurrent_trials with --max-concurrent applied. Tune applies
    max_concurrent_trials by wrapping a Searcher (OptunaSearch), or building the random search itself when
    none is given, but ignores it for a BasicVariantGenerator passed in (ray/tune/tune.py): that one takes
    the limit itself."""
    from ray import tune

    if isinstance(searcher, tune.search.BasicVariantGenerator):  # built with the limit (_searcher)
        return {"search_alg": searcher}
    return {"search_alg": searcher, "max_concurrent_trials": cfg.max_concurrent or None}


def _searcher(cfg: SweepConfig):
    from ray import tune

    if cfg.search == "optuna":
        try:
            from ray.tune.search.optuna import OptunaSearch

            return OptunaSearch(seed=cfg.seed)  # TPE
        except (ImportError, AssertionError):  # Ray asserts optuna is importable
            raise ValueError("--search optuna needs the optuna package: pip install optuna") from None
    return tune.search.BasicVariantGenerator(random_state=cfg.seed, max_concurrent=cfg.max_concurrent)
