"""Tier 1's driver: what is new, the three passes in order, and the commit. `python -m pipelines.preprocess`
is its CLI.

Three Ray Data passes on cpu-tier nodes (see pipelines/pack.py): read, clean,
filter and sign every record; drop exact and near duplicates (across the
whole input and the versions in --dedup-window), tokenize and pack; shuffle rows into
shards. Every record is kept, filtered, duplicate or rejected with a reason
(pipelines/stats.py); the version is published only when complete.

`run` holds the dataset's lease (strata.commands.shell.Job) from deciding what is new
until its commit; `Preprocess` is one run, a method per step.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from dataclasses import asdict

from pipelines import decontam
from pipelines.config import PreprocessConfig
from pipelines.dedup import INDEX_FAN_IN, suggested_shards
from pipelines.stats import Output, Tally, accounting, outputs, summary_table, without_deferred
from strata.accounting.cost import ray_daemon_cpu
from strata.accounting.openlineage import dataset as lineage_dataset
from strata.cluster import tiers
from strata.commands.shell import Job, StrataError
from strata.commands.shell import log as _logger
from strata.data.commit import abandoned_runs, check_extends, commit, delete_run, failpoint
from strata.data.dataset import (
    DatasetError,
    Shard,
    head,
    history,
    latest,
    slot_version,
    token_dtype,
)
from strata.data.digests import file_digest
from strata.data.inputs import check_outside, list_inputs, plan_units
from strata.data.lineage import FILE as LINEAGE_FILE
from strata.data.sources import InputMissing, InputUnreadable
from strata.data.storage import (
    Storage,
    basename,
    delete_dir,
    exists,
    filesystem,
    join,
    list_dir,
    make_dirs,
    read_json,
    write_bytes_atomic,
    write_json_atomic,
)
from strata.data.tokenizer import TOKENIZER_FILE, TokenizerMismatch

_say = _logger("preprocess").info

# What tier 1's workers import, loaded by an embedded Ray's idle workers while the driver starts
# (about 1 s sooner to the first unit on 2 cores).
WORKER_MODULES = ("ray.data", "pyarrow.parquet", "tokenizers", "tiktoken")
UNIT_RETRIES = 2  # Ray runs a work unit whose file stayed unreadable again, this many times (with backoff)
AUDIT_FILE = "dedup-audit.json"
TAILS_FILE = "tails.parquet"  # what this version's rows could not hold: the next version packs it first
REMOVED_DIR = "removed"  # parquet parts: every document dedup removed (doc_id, kind, kept doc key, earlier)
LARGEST_CLUSTERS = 5
GUARD_MIN_DOCUMENTS = 20  # smaller sources are not judged: one copied file is not a wiped-out source


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
    files = _inputs(cfg, storage)  # a missing or empty input fails here, before anything is written
    model = _quality_model(cfg, storage)  # and a bad --quality-model
    against = _against(storage, cfg) if cfg.dedup.against else None  # and a bad --dedup-against
    with Job("preprocess", cfg.dataset, storage, holds=storage.dataset(cfg.dataset), what=f"dataset {cfg.dataset}",
             purpose=f"preprocess{f' run {run_id}' if run_id else ''}", wait=wait) as job:
        try:
            return Preprocess(cfg, storage, job, run_id, started, dashboard, model, against).run(files)
        except Exception as e:
            if (mapped := _as_user_error(e)) is None:
                raise
            raise mapped from e


def _inputs(cfg: PreprocessConfig, storage: Storage) -> list[dict]:
    """The input files, none of them inside the storage root (nor a link into it)."""
    check_outside(list(cfg.read.inputs), storage.root)
    skipped: list[str] = []
    files = list_inputs(list(cfg.read.inputs), cfg.read.allow_empty, cfg.read.follow_links, skipped)
    check_outside([], storage.root, files)
    if skipped:
        _say(f"{len(skipped)} symbolic link(s) lead out of their input folder and were not followed "
             f"(--follow-links reads them): {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}")
    return files


def _quality_model(cfg: PreprocessConfig, storage: Storage):
    """The --quality-model, resolved (infer.model: its weights and tokenizer), or None."""
    if not cfg.quality.quality_model:
        return None
    from infer.model import resolve

    return resolve(cfg.quality.quality_model, storage, flag="--quality-model")


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


class Preprocess:
    """One run under the dataset's lease: `run` reads top to bottom, one method per step. The passes
    leave what they made on the object (outputs, tokenizer, shards) and their figures in `tally`."""

    def __init__(self, cfg: PreprocessConfig, storage: Storage, job: Job, run_id: str, started: float,
                 dashboard: bool = True, model=None, against: tuple[dict, dict] | None = None):
        self.cfg, self.storage, self.job, self.run_id, self.started = cfg, storage, job, run_id, started
        self.dashboard, self.model, self.quality = dashboard, model, None
        self.head = head(storage, cfg.dataset)  # read once: no other writer commits while this run holds the lease
        self.parent = latest(storage, cfg.dataset, self.head)
        self.tables = tuple(t for t, on in (("exact", cfg.dedup.exact_dedup), ("band", cfg.dedup.near_dedup)) if on)
        # Without dedup, tokenizer training or quality scores nothing global sits between reading and packing:
        # fuse them.
        self.fused = not self.tables and not cfg.pack.tokenizer.startswith("train:") and model is None
        self.tally, self.deferred, self.walls = Tally(), {}, {}
        self.p1: list[Output] = []
        self.p2: list[Output] = []
        self.shards: list[Output] = []
        self.index, self.sizes, self.segments, self.index_rss = [], [], {}, 0.0
        self.window: list[str] | None = []  # the versions dedup compares with (None: every earlier one)
        self.compared = 0  # keys of earlier versions (and --dedup-against) the index read
        # With --dedup-against: the other dataset's version (what the manifest records) and its index.
        self.against, self.against_index = against or ({}, {})
        self.definition, self.tok, self.audit = None, None, {}
        self.evaluation, self.tag, self.staging, self.shard_dir, self.units = None, None, None, None, []
        self.forget: dict | None = None  # the forget list in the object store
        self.cpus, self.total_bytes, self.pass2_utilization = 0.0, 0, 0.0
        self.done: dict[str, Output] = {}  # what a killed run of the same work finished, by record name
        self.reused: dict[str, int] = {}
        self.lineage: dict = {}  # the version's lineage file's figures (documents, spans, bytes)

    def run(self, files: list[dict]) -> dict:
        if self.run_id and (done := slot_version(self.storage, self.cfg.dataset, self.run_id, self.head)):
            _say(f"run {self.run_id!r} already produced {done.ref}: nothing to do")
            return {**_summary(done), "already_existed": True}
        self.check_tokenizer()
        if not (files := self.new(files)):
            _say("nothing new: no version created")
            return self.empty("nothing new")
        self.start(files)
        try:
            with self.job.working():
                self.passes()
            files = self.consumed(files)
            if not self.shards:
                delete_run(self.storage, self.cfg.dataset, self.tag)
                _say("no document survived: no version created")
                return self.empty("no rows")
            version = self.commit(files)
            self.job.events.outputs = [lineage_dataset(self.storage.dataset(self.cfg.dataset), version.manifest.version)]
        except Exception:
            if self.tag:
                delete_run(self.storage, self.cfg.dataset, self.tag)  # a failed run leaves nothing behind
            raise  # (a killed or interrupted one leaves its work units, for a rerun of the same work to reuse)
        return self.finish(version)

    # ------------------------------------------------------------ before the passes

    def check_tokenizer(self) -> None:
        """A version extends its parent: a named tokenizer must be the parent's (a trained one is reused)."""
        if self.parent and not self.cfg.pack.tokenizer.startswith("train:"):
            check_extends(self.parent, self.load_tokenizer(self.named_tokenizer()).info(), self.cfg.pack.seq_len)

    def new(self, files: list[dict]) -> list[dict]:
        """With --incremental, the files no earlier version consumed (same path, size and mtime): looked up
        in the dataset's index of consumed inputs, which reads only what may hold them."""
        if not self.cfg.read.incremental or self.parent is None:
            return files
        from pipelines.consumed import lookup

        candidates = [_identity(f) for f in files]
        if self.parent.manifest.consumed is None:
            consumed = self.legacy_consumed() & set(candidates)
        else:
            consumed = lookup([f for seg in self.consumed_segments() for f in seg["files"]], candidates)
        new = [f for f in files if _identity(f) not in consumed]
        if len(new) < len(files):
            _say(f"{len(files) - len(new)} of {len(files)} input files were consumed by earlier versions: skipped")
        return new

    def consumed_segments(self) -> list[dict]:
        """The parent's index of consumed inputs (paths made whole)."""
        p = self.parent
        return [{**seg, "files": [{**f, "path": p.file(f["path"]), "named": p.named(f["path"], legacy_ok=True)}
                                  for f in seg["files"]]} for seg in (p.manifest.consumed or [])] if p else []

    @functools.cache  # noqa: B019 - one run, one walk
    def legacy_consumed(self) -> set[tuple]:
        """Every earlier version's inputs, for a parent made before the index of consumed inputs (once: this
        version's index segment then holds them)."""
        return {_identity(f) for v in history(self.storage, self.cfg.dataset) for f in v.manifest.inputs
                if "mtime_ns" in f}

    def start(self, files: list[dict]) -> None:
        """The evaluation index, Ray, the work units, the staging directory and the run info."""
        import ray
        from ray.data.context import ShuffleStrategy

        self.evaluation = _evaluation_index(self.cfg)  # read and checked before Ray starts
        # Ray's own worker logs stay in its log files (a worker's error reaches here as the run's error).
        self.job.connect(dashboard=self.dashboard, preload=WORKER_MODULES, quiet=True, log_to_driver=False)
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.label_selector = tiers.selector(tiers.Tier.CPU)  # every task and actor, shuffles too
        # A unit whose file stays unreadable runs again; then its error reaches run() as itself, not wrapped.
        ctx.retried_map_errors, ctx.max_map_retries = [f"{InputUnreadable.__name__}:"], UNIT_RETRIES
        ctx.raise_original_map_exception = True
        # Pass 3's sort as tasks (measured on 2 cores, 24-96 packed files: 1.5-1.8x sooner than Ray 2.60's
        # default shuffle, whose reducers are actors started per run).
        ctx.shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        if not (cpus := tiers.cpus_of(tiers.Tier.CPU, ray.nodes())):
            raise DatasetError(f"no alive node serves the cpu tier (label {tiers.label_key(tiers.Tier.CPU)}=true)")
        self.cpus, self.units = cpus, plan_units(files, self.cfg.read)
        self.total_bytes = sum(f["size"] for f in files)
        _say(f"{len(files)} input files, {self.total_bytes / 1e6:.1f} MB in {len(self.units)} work units")
        self.tag = self.run_tag(files)
        self.staging = self.storage.run_files(self.cfg.dataset, self.tag)
        self.shard_dir = self.storage.run_shards(self.cfg.dataset, self.tag)
        self.work = join(self.staging, "_work")
        make_dirs(*(join(self.work, d) for d in ("docs", "packed", "tails", "done", "lineage", "places", "records")),
                  *(join(self.staging, d) for d in ("dedup", REMOVED_DIR)))
        self.done = {name: Output.from_json(read_json(join(self.work, "done", name)))
                     for name, is_dir in list_dir(join(self.work, "done")) if not is_dir}
        self.begin()
        self.contamination = {"ref": ray.put(self.evaluation)} if self.evaluation else None  # one copy per node
        self.forget = self.forget_list()

    def begin(self) -> None:
        """The run's record (run.json), and its OpenLineage START event (to _strata/openlineage/TAG-RUNID.jsonl in
        the dataset: a failed run's own directory goes, its events stay; a rerun of the same work has its own)."""
        write_json_atomic(join(self.staging, "run.json"), self.job.begin({**asdict(self.cfg), "run_id": self.run_id}))
        self.job.lineage([lineage_dataset(p) for p in self.cfg.read.inputs],
                         [lineage_dataset(self.storage.dataset(self.cfg.dataset))],
                         path=join(self.storage.dataset(self.cfg.dataset), "_strata", "openlineage", f"{self.tag}-{{run}}.jsonl"))

    def forget_list(self) -> dict | None:
        """The dataset's forget list (pipelines/forget.py) in the object store, for pass 1; None without one."""
        import ray

        from pipelines.forget import read_list

        listed = self.parent.manifest.forgotten.get("list") if self.parent else None
        if not listed:
            return None
        named = self.parent.named(listed, legacy_ok=True)
        keys, near = read_list(named), read_list(named, near=True)
        _say(f"forget list: {len(keys):,} keys of documents taken down"
             + (f" and {len(near):,} MinHash band keys of their text" if len(near) else "") + "; pass 1 drops them")
        return {"ref": ray.put({"keys": keys, "near": near, "params": self.parent.manifest.forgotten.get("near")})}

    def run_tag(self, files: list[dict]) -> str:
        """This run's name (`g<lease generation>-<work>`; its shards go to `data/<tag>`, its own files to
        `_strata/<tag>`): named by the work (config, input files, parent), so a rerun of the same work
        after a kill finds the units its predecessor finished. Other runs' leftovers (crashed or killed
        before their commit, or another work) are deleted."""
        from pipelines.pack import digest

        work = digest({"config": asdict(self.cfg), "inputs": [_identity(f) for f in files],
                       "parent": self.parent.manifest.version if self.parent else ""})
        leftovers = abandoned_runs(self.storage, self.cfg.dataset, self.job.lease.gen, self.head)
        mine = [t for t in leftovers if t.endswith(f"-{work}")][-1:]
        for leftover in leftovers:
            if leftover not in mine:
                _say(f"deleting run {leftover}'s files: it ended before its commit")
                delete_run(self.storage, self.cfg.dataset, leftover)
        if mine:
            _say(f"resuming the work of a run that ended before its commit ({mine[0]})")
            return mine[0]
        return f"g{self.job.lease.gen:08d}-{work}"

    # ------------------------------------------------------------ the passes

    def passes(self) -> None:
        import ray

        self.walls["start-up"] = round(time.time() - self.started, 2)
        self.mark, driver_cpu, daemons = time.time(), time.process_time(), ray_daemon_cpu()
        if not self.fused:
            self.read_clean_sign()
        self.score_quality()
        self.start_index()
        try:
            self.train_tokenizer()
            self.dedup_tokenize_pack()
            self.save_index()
        finally:
            for i in self.index:
                ray.kill(i)
        self.write_shards()
        if self.tables and self.p2:
            self.audit = self.dedup_audit()
        self.step("dedup audit")
        self.tally += Tally(cpu_s={"ray-daemons": ray_daemon_cpu(since=daemons),
                                   "driver": time.process_time() - driver_cpu})

    def step(self, name: str) -> None:
        """Wall time on the critical path, step by step; a lost lease stops the run."""
        self.walls[name] = round(time.time() - self.mark, 2)
        self.mark = time.time()
        self.job.lease.check()

    def map_units(self, fn, items: list[dict], stage: str, names, **options) -> list[Output]:
        """`fn` over `items`, one Ray Data block each, on the cpu tier; each returns {"out": Output}.

        Each output is recorded as it arrives, as `_work/done/<stage>-<file>.json` (`names(item)` is the
        work file an item's output names): a rerun of the same work runs only the items not recorded. A
        unit with a deferred file is not recorded (a rerun tries the file again)."""
        import ray

        record = lambda name: f"{stage}-{name}.json"  # noqa: E731
        out = [self.done[record(names(i))] for i in items if record(names(i)) in self.done]
        self.reused[stage] = len(out)
        if not (todo := [i for i in items if record(names(i)) not in self.done]):
            return out
        ds = ray.data.from_items(todo, override_num_blocks=len(todo))
        for row in ds.map_batches(fn, batch_size=1, label_selector=tiers.selector(tiers.Tier.CPU), **options).iter_rows():
            out.append(o := row["out"])
            if (name := o.packed_file or o.docs_file) and not o.tally.deferred:
                write_json_atomic(join(self.work, "done", record(name)), o.to_json())
                failpoint(f"{stage}:{len(out)}")
        return out

    def read_clean_sign(self) -> None:
        """Pass 1: read, clean, filter, sign; one work file of documents and their dedup keys per unit."""
        from pipelines.pack import docs_name, read_clean_sign

        _say("pass 1/3: read, clean, filter, sign")
        c = self.cfg
        self.p1, self.deferred = without_deferred(self.map_units(
            read_clean_sign, [{"unit": json.dumps(u)} for u in self.units], "pass1", lambda i: docs_name(json.loads(i["unit"])),
            fn_kwargs=dict(read=c.read, clean=c.clean, dedup=c.dedup, work_dir=self.work,
                           contamination=self.contamination, forget=self.forget)))
        self.tally += Tally.total(o.tally for o in self.p1)
        self.step("pass 1: read, clean, sign")

    def score_quality(self) -> None:
        """With --quality-model: every kept document's score under the reference model, and which of them
        pass 2 drops (pipelines/quality.py)."""
        if self.model is None:
            return
        from pipelines.quality import score

        p = self.parent
        parent = {**p.manifest.quality, "scores": [p.file(f) for f in p.manifest.quality["scores"]]} \
            if p and p.manifest.quality else None
        self.quality = score(self.cfg.quality, self.model, [join(self.work, "docs", f) for f in self.docs_files()],
                             parent=parent, out_dir=join(self.staging, "quality"),
                             cpus=self.cpus, window=self.cfg.dedup.window_size())
        self.step("quality scores")

    def docs_files(self) -> list[str]:
        return sorted(o.docs_file for o in self.p1 if o.docs)

    def start_index(self) -> None:
        """The dedup index: actors that rebuild themselves from the work files if their node dies."""
        import ray

        from pipelines.dedup import DedupIndex, in_window

        docs = self.docs_files()
        n = (self.cfg.dedup.index_shards or suggested_shards(self.cpus, self.total_bytes)) if self.tables and docs else 0
        actor = ray.remote(DedupIndex).options(num_cpus=0, label_selector=tiers.selector(tiers.Tier.CPU),
                                               max_restarts=-1, max_task_retries=-1)
        earlier = functools.cache(functools.partial(history, self.storage, self.cfg.dataset))  # read once, if at all
        self.segments = _index_segments(self.parent, earlier, self.cfg)
        self.window = _window(self.parent, self.cfg.dedup.window_size(), earlier)
        if self.window is not None:
            self.segments = {t: in_window(segs, self.window) for t, segs in self.segments.items()}
        prior = self.segments if self.cfg.dedup.against_previous else {}
        if self.against_index:
            prior = {t: [*prior.get(t, []), *self.against_index.get(t, [])] for t in self.tables}
        self.compared = sum(f["rows"] for t in self.tables for seg in prior.get(t, []) for f in seg["files"]) if n else 0
        self.index = [actor.remote(s, n, [join(self.work, "docs", f) for f in docs], prior, self.tables)
                      for s in range(n)]
        self.sizes = ray.get([i.sizes.remote() for i in self.index])
        self.step("dedup index")

    def train_tokenizer(self) -> None:
        """The tokenizer: the parent's, one trained on this run's documents (train:VOCAB), or the named one."""
        import ray

        spec = self.cfg.pack.tokenizer
        if spec.startswith("train:") and self.parent is not None:
            _say(f"reusing the tokenizer of {self.parent.ref}: a version extends the previous one")
            self.definition = self.parent.tokenizer_definition()
        elif spec.startswith("train:"):
            _say(f"training a byte-level BPE tokenizer ({spec})")
            task = ray.remote(_train_tokenizer).options(label_selector=tiers.selector(tiers.Tier.CPU))
            self.definition = ray.get(task.remote([join(self.work, "docs", f) for f in self.docs_files()],
                                                  int(spec.partition(":")[2]), self.cfg.pack.tokenizer_sample_bytes))
        else:
            self.definition = self.named_tokenizer()
        self.tok = self.load_tokenizer(self.definition)
        if spec.startswith("train:"):
            self.step("tokenizer training")

    def named_tokenizer(self) -> str | None:
        """The definition of a tokenizer.json the config names (None: bytes)."""
        if self.cfg.pack.tokenizer == "bytes" or self.cfg.pack.tokenizer.startswith("train:"):
            return None
        from strata.data.tokenizer import HFTokenizer

        return HFTokenizer.from_file(self.cfg.pack.tokenizer, self.cfg.pack.eot_token, "hf").definition

    def load_tokenizer(self, definition: str | None):
        from strata.data.tokenizer import ByteTokenizer, HFTokenizer

        if not definition:
            return ByteTokenizer()
        trained = self.cfg.pack.tokenizer.startswith("train:")
        return HFTokenizer(definition, "" if trained else self.cfg.pack.eot_token, "hf")

    def dedup_tokenize_pack(self) -> None:
        """Pass 2: drop duplicates, tokenize, pack; one work file of rows per document file (or, fused, per
        unit). Then every unit's tails are packed together."""
        import ray

        from pipelines.pack import DedupTokenizePack, docs_name, packed_name

        _say("pass 2/3: read, clean, tokenize, pack (fused)" if self.fused else "pass 2/3: deduplicate, tokenize, pack")
        items = [{"unit": json.dumps(u)} for u in self.units] if self.fused else \
            [{"docs_file": f} for f in self.docs_files()]
        began = time.time()
        if items:
            # Two units in flight per actor: the next one waits at the actor, not 0.15-0.2 s in Ray Data's
            # dispatch after each (measured: 2 s of 14 per actor); at the end one unit may wait behind another.
            pool = ray.data.ActorPoolStrategy(size=max(1, min(int(self.cpus), len(items))),
                                              max_tasks_in_flight_per_actor=2)
            self.p2 = self.map_units(DedupTokenizePack, items, "pass2", lambda i: packed_name(
                i["docs_file"] if "docs_file" in i else docs_name(json.loads(i["unit"]))),
                compute=pool, fn_constructor_kwargs=self.packer())
        if self.fused:
            self.p2, self.deferred = without_deferred(self.p2)
        self.tally += Tally.total(o.tally for o in self.p2)
        self.tails = self.pack_tails() if self.p2 else Output(tally=Tally())
        self.tally += self.tails.tally
        wall = time.time() - began
        busy = self.tally.busy_s / max(wall * min(self.cpus, len(self.p2) or 1), 1e-9)
        self.pass2_utilization = round(busy, 3)
        self.step("pass 2: " + ("read, clean, " if self.fused else "dedup, ") + "tokenize, pack")

    def packer(self) -> dict:
        """DedupTokenizePack's constructor arguments."""
        c, fused = self.cfg, self.fused
        return dict(tokenizer=c.pack.tokenizer, eot_token=c.pack.eot_token, definition=self.definition,
                    tokenizer_engine=c.pack.tokenizer_engine, seq_len=c.pack.seq_len,
                    validation_fraction=c.pack.validation_fraction, seed=c.pack.seed, split_seed=c.pack.split_seed,
                    dedup=c.dedup, work_dir=self.work, index=self.index, removed_dir=join(self.staging, REMOVED_DIR),
                    read=c.read if fused else None, clean=c.clean if fused else None,
                    contamination=self.contamination, quality=self.quality_drop(),
                    forget=self.forget if fused else None)

    def quality_drop(self) -> dict | None:
        """The exact keys of the documents the quality scores drop, in the object store once, for pass 2."""
        import ray

        return {"ref": ray.put(self.quality.drop)} if self.quality else None

    def pack_tails(self) -> Output:
        """The parent version's leftover tails, then every unit's, packed together (pipelines/pack.py
        `pack_tails`), in one task on the cpu tier; what is left is padded (--final) or carried on."""
        import ray

        from pipelines.pack import pack_tails

        p = self.parent
        carried = p.named(p.manifest.tails, legacy_ok=True) if p and p.manifest.tails else None
        # No CPU asked for: it packs less than a row per unit, and waiting for pass 2's actors to give theirs
        # back cost 1.3 s on 2 cores (measured; the task itself took 0.03 s).
        task = ray.remote(pack_tails).options(label_selector=tiers.selector(tiers.Tier.CPU), num_cpus=0)
        return ray.get(task.remote(self.work, [o.packed_file for o in self.p2], seq_len=self.cfg.pack.seq_len,
                                   dtype=token_dtype(self.tok.vocab_size), seed=self.cfg.pack.seed,
                                   eot_id=self.tok.eot_id, carried=carried, final=self.cfg.pack.final,
                                   tails_out=join(self.staging, TAILS_FILE)))

    def save_index(self) -> None:
        """The keys this run adds, as a new segment of the dataset's dedup index (a file per actor, beside
        the version). Under a window, the segments of the next version's window are kept and the one that
        leaves is dropped (nothing is rewritten); under `all`, compaction: the newest INDEX_FAN_IN segments
        that cover as many versions each are merged into one, so the segments a run reads stay few."""
        import ray

        from pipelines.dedup import compaction, in_window
        from strata.data.commit import THIS_VERSION as THIS

        size = self.cfg.dedup.window_size()
        for t in self.tables if self.index else ():
            files = ray.get([i.save.remote(t, join(self.staging, f"dedup/{t}-{s:04d}.parquet"))
                             for s, i in enumerate(self.index)])
            segments = [*self.segments.get(t, []), {"versions": 1, "params": self.cfg.dedup.params(), "files": files,
                                                    "first": THIS, "last": THIS}]
            if size is not None:  # the next version's window: the oldest version leaves, its keys unread
                self.segments[t] = in_window(segments, [*self.window, THIS][-size:])
                continue
            while k := compaction(segments, INDEX_FAN_IN):
                merged = ray.get([i.merge.remote(t, segments[-k:], join(self.staging, f"dedup/{t}-m{len(segments)}-{s:04d}.parquet"))
                                  for s, i in enumerate(self.index)])
                segments = [*segments[:-k], {"versions": sum(x["versions"] for x in segments[-k:]),
                                             "params": self.cfg.dedup.params(), "files": merged,
                                             "first": segments[-k].get("first"), "last": segments[-1].get("last")}]
            self.segments[t] = segments
        self.tally += Tally(cpu_s={"dedup-index": sum(ray.get([i.cpu_s.remote() for i in self.index]))})
        self.index_rss = max(ray.get([i.peak_rss_mb.remote() for i in self.index]), default=0.0)

    def write_shards(self) -> None:
        """Pass 3: a global, seeded shuffle of rows into shards of about shard_bytes (pipelines/shard.py)."""
        from pipelines.shard import ShardPlan, shuffle, write_shards

        _say("pass 3/3: shuffle rows into shards")
        delete_dir(self.shard_dir)  # a killed run's shards (a rerun writes the same ones)
        delete_dir(join(self.work, "places"))  # and where their rows went
        make_dirs(join(self.work, "places"))
        row_bytes = (self.cfg.pack.seq_len + 1) * {"uint8": 1, "uint16": 2, "uint32": 4}[token_dtype(self.tok.vocab_size)]
        per_shard = max(1, self.cfg.pack.shard_bytes // row_bytes)
        rows = self.tally.rows
        plan = ShardPlan(tuple((split, max(1, math.ceil(rows[split] / per_shard)))
                               for split in ("train", "validation") if rows.get(split)))
        packed = [join(self.work, "packed", o.packed_file) for o in [*self.p2, self.tails] if o.packed_file]
        if plan.counts and packed:
            self.shards = outputs(shuffle(packed, plan).map_batches(
                write_shards, batch_format="pyarrow", batch_size=None,
                fn_kwargs={"directory": self.shard_dir, "plan": plan, "work_dir": self.work,
                           "dtype": token_dtype(self.tok.vocab_size)}).take_all())
            self.tally += Tally.total(o.tally for o in self.shards)
        written = {split: sum(o.shard[2] for o in self.shards if o.shard[1] == split) for split in rows}
        if written != {split: n for split, n in rows.items()}:
            raise RuntimeError(f"pass 3 wrote {written} rows by split, pass 2 packed {dict(rows)}: nothing committed")
        self.step("pass 3: shuffle, write shards")
        if self.shards:
            self.build_lineage()

    def build_lineage(self) -> None:
        """Which documents each row holds (pipelines/lineage.py), one file beside the version, in a cpu-tier
        task: pass 2's spans joined with pass 3's places."""
        import ray

        from pipelines import lineage

        task = ray.remote(lineage.build).options(label_selector=tiers.selector(tiers.Tier.CPU))
        self.lineage = ray.get(task.remote(self.work, f"data/{self.tag}", join(self.staging, lineage.FILE),
                                           self.cfg.pack.seq_len + 1))
        if self.lineage["unplaced"]:
            raise RuntimeError(f"lineage: {self.lineage['unplaced']} spans name a row pass 3 did not write: nothing "
                               "committed")
        self.step("lineage")

    def dedup_audit(self) -> dict:
        """What dedup removed, to check before trusting it: removal rates per source, a histogram of
        duplicate-cluster sizes (a kept document and those removed as its duplicates), the largest clusters,
        and sampled pairs with the Jaccard similarity their MinHash estimates and their true one."""
        import ray

        from pipelines.dedup import audit_pairs, size_histogram

        t = self.tally
        largest = sorted(t.clusters.items(), key=lambda kv: (-kv[1], kv[0]))[:LARGEST_CLUSTERS]
        docs = [join(self.work, "docs", f) for f in self.docs_files()]
        task = ray.remote(audit_pairs).options(label_selector=tiers.selector(tiers.Tier.CPU))
        found = ray.get(task.remote(docs, list(t.pairs), [w for w, _ in largest], self.cfg.dedup)) \
            if t.clusters else {"pairs": [], "winner_ids": {}}
        audit = {
            "by_source": self.by_source(), "cluster_sizes": size_histogram(n + 1 for n in t.clusters.values()),
            "largest_clusters": [{"size": n + 1, "kept": found["winner_ids"].get(str(w)) or "(an earlier version)"}
                                 for w, n in largest],
            "sampled_pairs": found["pairs"], "removed_by_earlier_version": t.removed_by_earlier_version,
            "threshold": self.cfg.dedup.threshold, "lsh": dict(zip(("bands", "rows"), self.cfg.dedup.lsh(), strict=True)),
        }
        if t.clusters:
            _say(f"dedup: {sum(t.clusters.values()):,} removed in {len(t.clusters):,} clusters; sizes "
                 + ", ".join(f"{k}: {v:,}" for k, v in audit["cluster_sizes"].items())
                 + f"; largest {audit['largest_clusters'][0]['size']:,}")
        return audit

    def by_source(self) -> dict[str, dict]:
        """Per input source: documents dedup looked at, how many it removed, and the share."""
        source_of = {f["path"]: f.get("source", f["path"]) for unit in self.units for f in unit}
        looked, removed = {}, {}
        for into, counts in ((looked, self.tally.looked_at), (removed, self.tally.removed)):
            for path, n in counts.items():
                into[source_of.get(path, path)] = into.get(source_of.get(path, path), 0) + n
        return {s: {"documents": n, "removed": removed.get(s, 0), "share": round(removed.get(s, 0) / n, 6)}
                for s, n in sorted(looked.items())}

    # ------------------------------------------------------------ after the passes

    def consumed(self, files: list[dict]) -> list[dict]:
        """The files this version consumes (not the deferred ones: the next run reads them), each with its
        digest (strata.data.digests.file_digest); the dedup guard."""
        for path, why in self.deferred.items():
            _say(f"WARNING: {path} left out of this version (--unreadable defer), to be read by a later run: {why}")
        _check_dedup_share(self.by_source(), self.cfg.dedup.max_duplicate_fraction)
        delete_dir(self.work)
        parts: dict[str, dict[int, str]] = {}
        for o in [*self.p1, *self.p2]:  # the parts of each file the units that read it digested
            for path, part, sha in o.digests:
                parts.setdefault(path, {})[part] = sha
        return [{**f, "digest": file_digest(f["size"], parts.get(f["path"], {}))} for f in files
                if f["path"] not in self.deferred]

    def table(self) -> dict:
        return summary_table(self.tally, time.time() - self.started, cpus=self.cpus, total_bytes=self.total_bytes,
                             shards=len(self.shards), walls=self.walls, by_source=self.by_source(),
                             evaluation=self.evaluation["files"] if self.evaluation else {}, deferred=self.deferred,
                             index_rss_mb=self.index_rss, utilization=self.pass2_utilization,
                             quality=self.quality.figures if self.quality else {})

    def commit(self, files: list[dict]):
        docs = accounting(self.tally)
        shards = sorted((Shard(path=p, split=split, rows=rows, tokens=tokens, bytes=size)
                         for p, split, rows, tokens, size in (o.shard for o in self.shards)), key=lambda s: s.path)
        if self.definition:
            write_bytes_atomic(join(self.staging, TOKENIZER_FILE), self.definition.encode())
        table = self.table()
        write_json_atomic(join(self.staging, "rejects.json"), {"counts": docs.reasons, "samples": self.samples()})
        audit = {}
        if self.audit:
            write_json_atomic(join(self.staging, AUDIT_FILE), self.audit)
            audit = {"audit": AUDIT_FILE, "removed": REMOVED_DIR}
        record = self.job.info  # the run's record (job.finish) says so too
        record.update(finished_at=time.time(), work_nodes=sorted(self.tally.nodes))
        tails = TAILS_FILE if exists(join(self.staging, TAILS_FILE)) else ""
        root = self.storage.dataset(self.cfg.dataset)
        index = {t: [{**seg, "files": [_relative(f, root) for f in seg["files"]]} for seg in segs]
                 for t, segs in self.segments.items()}
        dedup = {"params": self.cfg.dedup.params(), "index": index, "index_entries": self.sizes,
                 "window": self.window_record(), **({"against": self.against_record()} if self.against else {}), **audit}
        consumed = [{**seg, "files": [_relative(f, root) for f in seg["files"]]} for seg in self.save_consumed(files)]
        # A version made without --quality-model carries its parent's score cache on, for a later one with it.
        quality = {**self.quality.state, "scores": [f[len(root):].strip("/").replace(os.sep, "/")
                                                    for f in self.quality.state["scores"]]} if self.quality else \
            (self.parent.manifest.quality if self.parent else {})
        return commit(self.storage, self.cfg.dataset, self.tag, dict(
            tokenizer=self.tok.info(), seq_len=self.cfg.pack.seq_len, dtype=token_dtype(self.tok.vocab_size),
            shards=shards, documents=docs, tokens=table["tokens"], inputs=files, run=record, stats=table,
            rejects="rejects.json", run_id=self.run_id, tails=tails, dedup=dedup, consumed=consumed,
            quality=quality, forgotten=self.parent.manifest.forgotten if self.parent else {}, lineage={**{k: v for k, v in self.lineage.items() if k != "sha256"}, "file": LINEAGE_FILE}
            if self.lineage else {}, digests=self.reported_digests(root)),
            lease=self.job.lease, built_on=self.parent.manifest.version if self.parent else None, head=self.head)

    def reported_digests(self, root: str) -> dict[str, str]:
        """The SHA-256s its writers took as they wrote (the dedup index's files, the lineage file), by path in the
        dataset: the commit hashes the rest of what its manifest names."""
        reported = {_relative(f, root)["path"]: f["sha256"] for segs in self.segments.values() for seg in segs
                    for f in seg["files"] if f.get("sha256")}
        if self.lineage:
            reported[f"_strata/{self.tag}/{LINEAGE_FILE}"] = self.lineage["sha256"]
        return reported

    def window_record(self) -> dict:
        """What the manifest says of the window: its size and the versions this run compared with."""
        if self.window is None:
            return {"size": "all", "earlier_versions": self.parent.manifest.totals.get("versions", 1) if self.parent else 0,
                    "keys_compared": self.compared}
        return {"size": self.cfg.dedup.window_size(), "versions": list(self.window), "keys_compared": self.compared}

    def against_record(self) -> dict:
        return {"dataset": self.against["ref"], "segments": self.against["segments"],
                "removed": self.tally.removed_by_other_dataset}

    def save_consumed(self, files: list[dict]) -> list[dict]:
        """The index of consumed inputs with this version's as a new segment (and, after a parent made before
        the index, every earlier version's), then compaction, as the dedup index does."""
        from pipelines.consumed import MOST_VERSIONS, merge, write
        from pipelines.dedup import compaction

        p = self.parent
        earlier = self.legacy_consumed() if p and p.manifest.consumed is None else set()
        directory = join(self.staging, "consumed")
        make_dirs(directory)
        segments = [*self.consumed_segments(), {"versions": 1, "files": [
            write(join(directory, "c.parquet"), earlier | {_identity(f) for f in files})]}]
        while k := compaction(segments, INDEX_FAN_IN, MOST_VERSIONS):
            merged = merge([f for seg in segments[-k:] for f in seg["files"]], join(directory, f"m{len(segments)}.parquet"))
            segments = [*segments[:-k], {"versions": sum(seg["versions"] for seg in segments[-k:]), "files": [merged]}]
        return segments

    def samples(self) -> dict[str, list]:
        return {k: list(v) for k, v in sorted(self.tally.samples.items())}

    def finish(self, version) -> dict:
        """The run's record (cost, usage) and the summary the command prints."""
        m = version.manifest
        figures = {k: m.stats.get(k) for k in ("documents", "tokens", "bytes", "mb_per_s_per_cpu",
                                               "tokens_per_s_per_cpu", "peak_worker_rss_mb")}
        usage = self.job.usage
        figures.update(tokens_per_s=m.tokens / max(usage.ended - usage.started, 1e-9), version=m.version)
        cost = self.job.finish(beside=join(self.staging, "record.json"),
                               work_nodes=sorted(self.tally.nodes), figures=figures)
        return {**_summary(version), **cost, "units": self.unit_counts(),
                "dedup_index_entries": max((sum(n.values()) for n in self.sizes), default=0),
                "dedup_keys_compared": self.compared}

    def unit_counts(self) -> dict:
        """Work units, and how many a killed run of the same work had finished (its first pass reused;
        `by_pass`: each pass's units reused)."""
        return {"total": len(self.units), "reused": self.reused.get("pass2" if self.fused else "pass1", 0),
                "by_pass": dict(self.reused)}

    def empty(self, why: str) -> dict:
        """No version: nothing new, or nothing survived. The counts still say what was read."""
        table = self.table()
        return {"dataset": self.cfg.dataset, "version": None, "path": None, "documents": table["documents"],
                "reasons": accounting(self.tally).reasons, "tokens": 0, "sequences": 0, "shards": 0,
                "stats": table, "run_id": "", "already_existed": False, "note": why, "units": self.unit_counts()}


def _relative(f: dict, root: str) -> dict:
    """A segment file's entry as the manifest keeps it: its path in the dataset (its digest goes to the
    manifest's `digests`, not beside it)."""
    return {**{k: v for k, v in f.items() if k not in ("named", "sha256")},
            "path": f["path"][len(root):].strip("/").replace(os.sep, "/")}


def _identity(f: dict) -> tuple:
    return f["path"], f["size"], f["mtime_ns"]


def _evaluation_index(cfg: PreprocessConfig) -> dict | None:
    """The decontamination index (pipelines/decontam.py), built once on the driver, or None."""
    if not cfg.clean.decontaminate:
        return None
    c = cfg.clean
    built = decontam.build(list(c.decontaminate), c.decontaminate_n, c.evaluation_fields(), c.decontaminate_min_words)
    _say(f"decontamination: {decontam.size(built):,} n-grams of {len(built['names'])} evaluation file(s): "
         + "; ".join(f"{basename(p)} {f['records']:,} records, {f['ngrams']:,} n-grams" for p, f in built["files"].items()))
    return built


def _index_segments(parent, earlier, cfg: PreprocessConfig) -> dict[str, list[dict]]:
    """The dataset's dedup index as of `parent`, by table: its segments, each a file per slice of the key
    space (paths made whole). Band segments of other MinHash/LSH parameters are left out: their keys are
    not comparable. A dataset made before the index (each version's own dedup files, in `files`) gives
    a segment per earlier version whose files each span the whole key space (`earlier()` reads them)."""
    from pipelines.dedup import legacy_segment

    state = parent.manifest.dedup if parent else {}
    if "index" in state:
        segments = {t: [{**seg, "files": [{**f, "path": parent.file(f["path"]),
                                           "named": parent.named(f["path"], legacy_ok=True)} for f in seg["files"]]}
                        for seg in segs] for t, segs in state["index"].items()}
    else:
        versions = earlier() if parent else []
        segments = {t: [legacy_segment([v.file(p) for p in v.manifest.dedup["files"][t]], v.manifest.dedup.get("params"))
                        for v in versions if v.manifest.dedup.get("files", {}).get(t)] for t in ("exact", "band")}
    band = segments.get("band", [])
    if other := [seg for seg in band if seg["params"] != cfg.dedup.params()]:
        _say(f"near-dedup against {sum(seg['versions'] for seg in other)} earlier version(s) skipped: their "
             f"MinHash/LSH parameters {other[0]['params']} differ from this run's {cfg.dedup.params()} "
             "(pass --bands/--rows/--num-perm to match)")
        segments["band"] = [seg for seg in band if seg["params"] == cfg.dedup.params()]
    return segments


def _window(parent, size: int | None, earlier) -> list[str] | None:
    """The versions a run deduplicates against, oldest first (None: every earlier one): from the parent's
    window, or, once, from the history (`earlier()`) when the parent's does not say (made before windows,
    under `all`, or under a smaller window)."""
    from pipelines.dedup import window_versions

    if size is None:
        return None
    if parent is None:
        return []
    w = parent.manifest.dedup.get("window")
    listed = w.get("versions") if isinstance(w, dict) and w.get("size") != "all" else None
    if not (isinstance(listed, list) and all(isinstance(x, str) for x in listed)) or (
            len(listed) < size - 1 and parent.manifest.totals.get("versions", 1) > len(listed) + 1):
        listed = [v.manifest.version for v in earlier()][:-1]  # the parent's ancestors (earlier() ends with it)
    return window_versions(listed, parent.manifest.version, size)


def _against(storage: Storage, cfg: PreprocessConfig) -> tuple[dict, dict[str, list[dict]]]:
    """--dedup-against NAME[@VERSION]: that version's dedup index (its segments marked `against`, paths made
    whole), and what the manifest records of it. Band segments of other MinHash/LSH parameters are left out
    (their keys are not comparable), with a line saying so."""
    from strata.data.dataset import resolve

    ref = cfg.dedup.against
    name = ref.partition("@")[0]
    if not (cfg.dedup.exact_dedup or cfg.dedup.near_dedup):
        raise DatasetError(f"--dedup-against {ref} needs dedup on (--exact-dedup or --near-dedup)")
    if name == cfg.dataset:
        raise DatasetError(f"--dedup-against {ref}: that is the dataset being written; its own earlier versions are "
                           "what --dedup-window covers")
    other = resolve(storage, ref)
    state = other.manifest.dedup
    if not isinstance(state.get("index"), dict) or not any(state["index"].get(t) for t in ("exact", "band")):
        raise DatasetError(f"--dedup-against {other.ref}: it has no dedup index (it was made with dedup off, or "
                           "before the index): there is nothing to deduplicate against")
    # Another dataset's index: every file must match the digest its commit names (strata/data/integrity.py).
    segments = {t: [{**seg, "against": True, "files": [{**f, "path": other.file(f["path"]),
                                                        "named": other.named(f["path"])} for f in seg["files"]]}
                    for seg in state["index"].get(t, [])] for t in ("exact", "band")}
    if (band := segments["band"]) and (mismatch := [s for s in band if s.get("params") != cfg.dedup.params()]):
        _say(f"--dedup-against {other.ref}: its near-dedup keys were made with MinHash/LSH parameters "
             f"{mismatch[0].get('params')}, not this run's {cfg.dedup.params()}: only exact duplicates are dropped")
        segments["band"] = [s for s in band if s.get("params") == cfg.dedup.params()]
    keys = sum(f["rows"] for segs in segments.values() for seg in segs for f in seg["files"])
    count = sum(map(len, segments.values()))
    _say(f"deduplicating against {other.ref} too: {keys:,} keys in {count} segment(s)")
    return {"ref": other.ref, "segments": count}, segments


def _train_tokenizer(paths: list[str], vocab: int, sample_bytes: int) -> str:
    """A byte-level BPE from the first `sample_bytes` of kept text (a cpu-tier task)."""
    import pyarrow.parquet as pq

    from strata.data.tokenizer import train_bpe

    def texts():
        seen = 0
        for path in paths:
            fs, p = filesystem(path)
            for batch in pq.ParquetFile(fs.open_input_file(p)).iter_batches(columns=["text"], batch_size=256):
                for t in batch.column(0).to_pylist():
                    yield t
                    seen += len(t)
                    if seen >= sample_bytes:
                        return

    return train_bpe(texts(), vocab).definition


def _check_dedup_share(by_source: dict[str, dict], limit: float) -> None:
    """Refuse a run whose dedup removes more than `limit` of one source's documents: one colliding band
    or a bad key can wipe out a source, and nothing downstream would notice."""
    over = {s: v for s, v in by_source.items() if v["share"] > limit and v["documents"] >= GUARD_MIN_DOCUMENTS}
    if over:
        worst = max(over, key=lambda s: over[s]["share"])
        v = over[worst]
        raise DatasetError(
            f"dedup would remove {v['removed']:,} of {v['documents']:,} documents ({v['share']:.1%}) of source "
            f"{worst!r}{f' and {len(over) - 1} more' if len(over) > 1 else ''}, more than --max-duplicate-fraction "
            f"{limit}: nothing was committed. If the source is mostly copies, rerun with a higher "
            "--max-duplicate-fraction (1 turns the guard off)")


def _run_bytes(run_dir: str) -> int:
    """The bytes of the files a version's run wrote beside its shards: dedup index, tails, lineage, records."""
    import pyarrow.fs as pafs

    fs, p = filesystem(run_dir)
    return sum(i.size for i in fs.get_file_info(pafs.FileSelector(p, allow_not_found=True, recursive=True))
               if i.type == pafs.FileType.File)


def _summary(version) -> dict:
    m = version.manifest
    added = sum(s.bytes for s in version.added)
    lineage = {}
    if m.lineage.get("bytes"):  # the target is on all the version's bytes; its shards alone are the stricter share
        total = added + _run_bytes(version.file(m.lineage["file"].rsplit("/", 1)[0]))
        lineage = {**m.lineage, "share_of_version_bytes": round(m.lineage["bytes"] / total, 4),
                   "share_of_shard_bytes": round(m.lineage["bytes"] / added, 4) if added else None}
    return {"dataset": m.dataset, "version": m.version, "path": version.path, "parent": m.parent, "lineage": lineage,
            "documents": m.stats["documents"], "reasons": m.documents.reasons, "tokens": m.tokens,
            "sequences": sum(s.rows for s in version.added), "shards": len(version.added), "stats": m.stats,
            "snapshot": m.totals, "run_id": m.run_id, "already_existed": False}
