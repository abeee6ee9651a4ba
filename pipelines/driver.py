"""Tier 1's driver: what is new, the passes in order, and the commit. `python -m pipelines.preprocess` is its CLI.

Three Ray Data passes on cpu-tier nodes (pipelines/passes.py): read, clean, filter and sign every record; drop
exact and near duplicates (across the whole input and the versions in --dedup-window), tokenize and pack;
shuffle rows into shards. Every record is kept, filtered, duplicate or rejected with a reason
(pipelines/stats.py); the version is published only when complete (pipelines/publish.py).

`run` holds the dataset's lease (strata.commands.shell.Job) from deciding what is new until its commit;
`preprocess` is the run, top to bottom: each pass takes the run (pipelines/plan.py `Run`) and the typed
results of the passes before it, and returns its own.
"""

from __future__ import annotations

import time

from pipelines import passes, plan, publish
from pipelines.config import PreprocessConfig
from pipelines.plan import UNIT_RETRIES, WORKER_MODULES  # noqa: F401 - what callers name of the driver
from pipelines.stats import Tally
from strata.accounting.cost import ray_daemon_cpu
from strata.accounting.openlineage import dataset as lineage_dataset
from strata.commands.shell import Job, StrataError
from strata.commands.shell import log as _logger
from strata.data.commit import delete_run
from strata.data.dataset import DatasetError, head, latest, slot_version
from strata.data.sources import InputMissing, InputUnreadable
from strata.data.storage import Storage
from strata.data.tokenizer import TokenizerMismatch

_say = _logger("preprocess").info


def run(cfg: PreprocessConfig, storage: Storage, run_id: str = "", *, wait: bool = True,
        dashboard: bool = True) -> dict:
    """Run the three passes over what is new and commit a version; returns the summary.

    Concurrent runs (overlapping schedule slots, a person beside cron) publish each input once: a
    second run waits for the lease, then processes only what is still new (`wait=False` raises
    LeaseBusy instead). Input files an earlier version consumed (same path, size and mtime) are
    skipped; with nothing new, no version is made. A `run_id` (a scheduled slot) that an earlier
    version already carries returns that version.
    """
    started = time.time()
    files = plan.inputs(cfg, storage)  # a missing or empty input fails here, before anything is written
    model = plan.quality_model(cfg, storage)  # and a bad --quality-model
    against = plan_against(storage, cfg)  # and a bad --dedup-against
    with Job("preprocess", cfg.dataset, storage, holds=storage.dataset(cfg.dataset), what=f"dataset {cfg.dataset}",
             purpose=f"preprocess{f' run {run_id}' if run_id else ''}", wait=wait) as job:
        try:
            return preprocess(cfg, storage, job, files, run_id=run_id, started=started, dashboard=dashboard,
                              model=model, against=against)
        except Exception as e:
            if (mapped := _as_user_error(e)) is None:
                raise
            raise mapped from e


def preprocess(cfg: PreprocessConfig, storage: Storage, job: Job, files: list[dict], *, run_id: str, started: float,
               dashboard: bool, model, against: tuple[dict, dict]) -> dict:
    """One run under the dataset's lease, top to bottom."""
    at = head(storage, cfg.dataset)  # read once: no other writer commits while this run holds the lease
    parent = latest(storage, cfg.dataset, at)
    if run_id and (done := slot_version(storage, cfg.dataset, run_id, at)):
        _say(f"run {run_id!r} already produced {done.ref}: nothing to do")
        return {**publish.summary(done), "already_existed": True}
    plan.check_tokenizer(cfg, parent)
    legacy = plan.legacy_consumed(storage, cfg.dataset, parent)
    if not (files := plan.new_files(cfg, parent, files, legacy)):
        _say("nothing new: no version created")
        return publish.empty(None, "nothing new", dataset=cfg.dataset, started=started)
    run = plan.start(cfg, storage, job, files, run_id=run_id, head=at, parent=parent, model=model, dashboard=dashboard)
    try:
        with job.working():
            clock, cpu, daemons = plan.Clock(job, started), time.process_time(), ray_daemon_cpu()
            read = passes.Read() if run.fused else passes.read_clean_sign(run)
            clock.step("pass 1: read, clean, sign", when=not run.fused)
            quality = passes.score_quality(run, read)
            clock.step("quality scores", when=model is not None)
            index = passes.start_index(run, read, against[1])
            clock.step("dedup index")
            try:
                tok = passes.tokenizer(run, read)
                clock.step("tokenizer training", when=tok.trained)
                packed = passes.dedup_tokenize_pack(run, read, index, tok, quality)
                clock.step("pass 2: " + ("read, clean, " if run.fused else "dedup, ") + "tokenize, pack")
                saved = passes.save_index(run, index)
            finally:
                index.stop()
            shards = passes.write_shards(run, packed, tok)
            clock.step("pass 3: shuffle, write shards")
            lineage = passes.build_lineage(run) if shards else {}
            clock.step("lineage", when=bool(shards))
            tally = read.tally + packed.tally + saved.tally + Tally.total(o.tally for o in shards)
            audit = passes.dedup_audit(run, read, tally) if run.tables and packed.outputs else {}
            clock.step("dedup audit")
            tally += Tally(cpu_s={"ray-daemons": ray_daemon_cpu(since=daemons), "driver": time.process_time() - cpu})
        out = publish.Outcome(tally, clock.walls, read, packed, index, saved, tok, shards, lineage, audit, quality,
                              against[0])
        files = publish.consumed(run, files, out)
        if not shards:
            delete_run(storage, cfg.dataset, run.tag)
            _say("no document survived: no version created")
            return publish.empty(run, "no rows", dataset=cfg.dataset, started=started, tally=tally, out=out)
        version = publish.commit(run, files, out, run_id=run_id, started=started, head=at, legacy=legacy)
        job.events.outputs = [lineage_dataset(storage.dataset(cfg.dataset), version.manifest.version)]
    except Exception:
        delete_run(storage, cfg.dataset, run.tag)  # a failed run leaves nothing behind
        raise  # (a killed or interrupted one leaves its work units, for a rerun of the same work to reuse)
    return publish.finish(run, version, out)


def plan_against(storage: Storage, cfg: PreprocessConfig) -> tuple[dict, dict]:
    """--dedup-against's version (what the manifest records) and its dedup index (pipelines/index.py), or none."""
    from pipelines.index import against

    return against(storage, cfg) if cfg.dedup.against else ({}, {})


def _as_user_error(e: BaseException) -> StrataError | None:
    """An unreadable input or a tokenizer mismatch a worker raised, as the one line the user acts on."""
    from strata.data.integrity import IntegrityError

    if (cause := _worker_error(e, (InputUnreadable, TokenizerMismatch, IntegrityError))) is None:
        return None
    first = str(cause).split("\n")[0]  # without the traceback and Ray's retry advice
    if isinstance(cause, IntegrityError):
        return IntegrityError(f"{first}. Nothing was committed")
    if isinstance(cause, (InputMissing, TokenizerMismatch)):
        return DatasetError(f"{first}. Nothing was committed")
    return DatasetError(
        f"{first}, in each of {1 + UNIT_RETRIES} runs of its work unit. Nothing was committed and the file is "
        "not recorded as consumed: rerun to retry it, or pass --unreadable defer to publish without it")


def _worker_error(e: BaseException, kinds):
    """The error of one of `kinds` a worker raised, from the Ray errors around it (or None)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(getattr(e, "cause", None), kinds):  # a RayTaskError: the worker's own error
            return e.cause
        if isinstance(e, kinds):
            return e
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None
