"""Before tier 1's passes: what a run works on, fixed once (`Run`), and how its passes map over work units.

`start` connects to Ray, plans the work units, names the run by its work (a rerun of the same work after a
kill finds what its predecessor finished), makes its staging directories and writes its record; what it
returns is all any pass reads of the run. Each pass then takes the `Run` and the typed results of the
passes before it (pipelines/passes.py), and returns its own.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from pipelines import decontam
from pipelines.config import PreprocessConfig
from pipelines.stats import Output
from strata.accounting.openlineage import dataset as lineage_dataset
from strata.cluster import tiers
from strata.cluster.connect import embedded, warm_workers
from strata.commands.shell import Job
from strata.commands.shell import log as _logger
from strata.data.commit import abandoned_runs, check_extends, delete_run, failpoint
from strata.data.dataset import DatasetError, history
from strata.data.inputs import check_outside, list_inputs, plan_units
from strata.data.sources import InputUnreadable
from strata.data.storage import (
    Storage,
    basename,
    join,
    list_dir,
    make_dirs,
    read_json,
    write_json_atomic,
)

_say = _logger("preprocess").info

# What tier 1's workers import, loaded by an embedded Ray's idle workers while the driver starts
# (about 1 s sooner to the first unit on 2 cores), and by the workers a run starts on a cluster it joined.
WORKER_MODULES = ("ray.data", "pyarrow.parquet", "tokenizers", "tiktoken")
MAX_WARM_WORKERS = 64  # on a cluster it joined, the workers a run starts before its first pass (one per CPU)
UNIT_RETRIES = 2  # Ray runs a work unit whose file stayed unreadable again, this many times (with backoff)
REMOVED_DIR = "removed"  # parquet parts: every document dedup removed (doc_id, kind, kept doc key, earlier)


@dataclass(frozen=True)
class Run:
    """One run of tier 1, as every pass reads it: its config, where it writes, its work units and what a
    killed run of the same work finished. Nothing in it changes once the passes begin."""

    cfg: PreprocessConfig
    storage: Storage
    job: Job
    parent: object | None  # the version this one extends (strata.data.dataset.Version), or None
    tag: str  # g<lease generation>-<work>: its shards go to data/<tag>, its own files to _strata/<tag>
    staging: str
    shard_dir: str
    cpus: float
    units: list[list[dict]]
    total_bytes: int
    model: object | None = None  # --quality-model, resolved (infer.model)
    evaluation: dict | None = None  # the decontamination index, built on the driver
    contamination: dict | None = None  # and in the object store, for the workers
    forget: dict | None = None  # the dataset's forget list in the object store
    done: dict[str, Output] = field(default_factory=dict)  # what a killed run of the same work finished

    @property
    def work(self) -> str:
        return join(self.staging, "_work")

    @property
    def tables(self) -> tuple[str, ...]:
        """The dedup index's tables this run uses."""
        d = self.cfg.dedup
        return tuple(t for t, on in (("exact", d.exact_dedup), ("band", d.near_dedup)) if on)

    @property
    def fused(self) -> bool:
        """Without dedup, tokenizer training or quality scores nothing global sits between reading and packing:
        pass 2 reads the units itself."""
        return not self.tables and not self.cfg.pack.tokenizer.startswith("train:") and self.model is None

    def source_of(self) -> dict[str, str]:
        return {f["path"]: f.get("source", f["path"]) for unit in self.units for f in unit}


class Clock:
    """Wall time on the critical path, step by step; each step checks the lease (a lost one stops the run)."""

    def __init__(self, job: Job, started: float):
        self.job, self.walls, self.mark = job, {"start-up": round(time.time() - started, 2)}, time.time()

    def step(self, name: str, when: bool = True) -> None:
        """The time since the last step, as `name`'s (unless the step did not run: `when` false)."""
        if not when:
            return
        self.walls[name] = round(time.time() - self.mark, 2)
        self.mark = time.time()
        self.job.lease.check()


def inputs(cfg: PreprocessConfig, storage: Storage) -> list[dict]:
    """The input files, none of them inside the storage root (nor a link into it)."""
    check_outside(list(cfg.read.inputs), storage.root)
    skipped: list[str] = []
    files = list_inputs(list(cfg.read.inputs), cfg.read.allow_empty, cfg.read.follow_links, skipped)
    check_outside([], storage.root, files)
    if skipped:
        _say(f"{len(skipped)} symbolic link(s) lead out of their input folder and were not followed "
             f"(--follow-links reads them): {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}")
    return files


def quality_model(cfg: PreprocessConfig, storage: Storage):
    """The --quality-model, resolved (infer.model: its weights and tokenizer), or None."""
    if not cfg.quality.quality_model:
        return None
    from infer.model import resolve

    return resolve(cfg.quality.quality_model, storage, flag="--quality-model")


def check_tokenizer(cfg: PreprocessConfig, parent) -> None:
    """A version extends its parent: a named tokenizer must be the parent's (a trained one is reused)."""
    if parent and not cfg.pack.tokenizer.startswith("train:"):
        check_extends(parent, load_tokenizer(cfg, named_tokenizer(cfg)).info(), cfg.pack.seq_len)


def named_tokenizer(cfg: PreprocessConfig) -> str | None:
    """The definition of a tokenizer.json the config names (None: bytes)."""
    if cfg.pack.tokenizer == "bytes" or cfg.pack.tokenizer.startswith("train:"):
        return None
    from strata.data.tokenizer import HFTokenizer

    return HFTokenizer.from_file(cfg.pack.tokenizer, cfg.pack.eot_token, "hf").definition


def load_tokenizer(cfg: PreprocessConfig, definition: str | None):
    from strata.data.tokenizer import ByteTokenizer, HFTokenizer

    if not definition:
        return ByteTokenizer()
    trained = cfg.pack.tokenizer.startswith("train:")
    return HFTokenizer(definition, "" if trained else cfg.pack.eot_token, "hf")


def identity(f: dict) -> tuple:
    return f["path"], f["size"], f["mtime_ns"]


def consumed_segments(parent) -> list[dict]:
    """The parent's index of consumed inputs (paths made whole)."""
    return [{**seg, "files": [{**f, "path": parent.file(f["path"]), "named": parent.named(f["path"], legacy_ok=True)}
                              for f in seg["files"]]} for seg in (parent.manifest.consumed or [])] if parent else []


def legacy_consumed(storage: Storage, dataset: str, parent) -> frozenset[tuple]:
    """For a parent made before the index of consumed inputs, every earlier version's inputs (read once per run:
    this version's index segment then holds them); otherwise none."""
    if parent is None or parent.manifest.consumed is not None:
        return frozenset()
    return frozenset(identity(f) for v in history(storage, dataset) for f in v.manifest.inputs if "mtime_ns" in f)


def new_files(cfg: PreprocessConfig, parent, files: list[dict], legacy: frozenset[tuple]) -> list[dict]:
    """With --incremental, the files no earlier version consumed (same path, size and mtime): looked up
    in the dataset's index of consumed inputs, which reads only what may hold them."""
    if not cfg.read.incremental or parent is None:
        return files
    from pipelines.consumed import lookup

    candidates = [identity(f) for f in files]
    if parent.manifest.consumed is None:
        consumed = legacy & set(candidates)
    else:
        consumed = lookup([f for seg in consumed_segments(parent) for f in seg["files"]], candidates)
    new = [f for f in files if identity(f) not in consumed]
    if len(new) < len(files):
        _say(f"{len(files) - len(new)} of {len(files)} input files were consumed by earlier versions: skipped")
    return new


def start(cfg: PreprocessConfig, storage: Storage, job: Job, files: list[dict], *, run_id: str, head, parent,
          model, dashboard: bool) -> Run:
    """The evaluation index, Ray, the work units, the run's name and staging directory, and its record."""
    import ray
    from ray.data.context import ShuffleStrategy

    evaluation = _evaluation_index(cfg)  # read and checked before Ray starts
    # Ray's own worker logs stay in its log files (a worker's error reaches here as the run's error).
    job.connect(dashboard=dashboard, preload=WORKER_MODULES, quiet=True, log_to_driver=False)
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
    if not embedded():
        warm_workers(WORKER_MODULES, min(int(cpus), MAX_WARM_WORKERS), label_selector=tiers.selector(tiers.Tier.CPU))
    units = plan_units(files, cfg.read)
    total_bytes = sum(f["size"] for f in files)
    _say(f"{len(files)} input files, {total_bytes / 1e6:.1f} MB in {len(units)} work units")
    tag = run_tag(cfg, storage, job, files, parent, head)
    staging = storage.run_files(cfg.dataset, tag)
    work = join(staging, "_work")
    make_dirs(*(join(work, d) for d in ("docs", "packed", "tails", "done", "lineage", "places", "records")),
              *(join(staging, d) for d in ("dedup", REMOVED_DIR)))
    done = {name: Output.from_json(read_json(join(work, "done", name)))
            for name, is_dir in list_dir(join(work, "done")) if not is_dir}
    begin(cfg, storage, job, staging, tag, run_id)
    return Run(cfg=cfg, storage=storage, job=job, parent=parent, tag=tag, staging=staging,
               shard_dir=storage.run_shards(cfg.dataset, tag), cpus=cpus, units=units, total_bytes=total_bytes,
               model=model, evaluation=evaluation, contamination={"ref": ray.put(evaluation)} if evaluation else None,
               forget=forget_list(parent), done=done)


def begin(cfg: PreprocessConfig, storage: Storage, job: Job, staging: str, tag: str, run_id: str) -> None:
    """The run's record (run.json), and its OpenLineage START event (to _strata/openlineage/TAG-RUNID.jsonl in
    the dataset: a failed run's own directory goes, its events stay; a rerun of the same work has its own)."""
    write_json_atomic(join(staging, "run.json"), job.begin({**asdict(cfg), "run_id": run_id}))
    job.lineage([lineage_dataset(p) for p in cfg.read.inputs], [lineage_dataset(storage.dataset(cfg.dataset))],
                path=join(storage.dataset(cfg.dataset), "_strata", "openlineage", f"{tag}-{{run}}.jsonl"))


def forget_list(parent) -> dict | None:
    """The dataset's forget list (pipelines/forget.py) in the object store, for pass 1; None without one."""
    import ray

    from pipelines.forget import read_list

    listed = parent.manifest.forgotten.get("list") if parent else None
    if not listed:
        return None
    named = parent.named(listed, legacy_ok=True)
    keys, near = read_list(named), read_list(named, near=True)
    _say(f"forget list: {len(keys):,} keys of documents taken down"
         + (f" and {len(near):,} MinHash band keys of their text" if len(near) else "") + "; pass 1 drops them")
    return {"ref": ray.put({"keys": keys, "near": near, "params": parent.manifest.forgotten.get("near")})}


def run_tag(cfg: PreprocessConfig, storage: Storage, job: Job, files: list[dict], parent, head) -> str:
    """This run's name (`g<lease generation>-<work>`): named by the work (config, input files, parent), so a
    rerun of the same work after a kill finds the units its predecessor finished. Other runs' leftovers
    (crashed or killed before their commit, or another work) are deleted."""
    from pipelines.pack import digest

    work = digest({"config": asdict(cfg), "inputs": [identity(f) for f in files],
                   "parent": parent.manifest.version if parent else ""})
    leftovers = abandoned_runs(storage, cfg.dataset, job.lease.gen, head)
    mine = [t for t in leftovers if t.endswith(f"-{work}")][-1:]
    for leftover in leftovers:
        if leftover not in mine:
            _say(f"deleting run {leftover}'s files: it ended before its commit")
            delete_run(storage, cfg.dataset, leftover)
    if mine:
        _say(f"resuming the work of a run that ended before its commit ({mine[0]})")
        return mine[0]
    return f"g{job.lease.gen:08d}-{work}"


def map_units(run: Run, fn, items: list[dict], stage: str, names, **options) -> tuple[list[Output], int]:
    """`fn` over `items`, one Ray Data block each, on the cpu tier; each returns {"out": Output}. Returns the
    outputs and how many of them a killed run of the same work had finished.

    Each output is recorded as it arrives, as `_work/done/<stage>-<file>.json` (`names(item)` is the
    work file an item's output names): a rerun of the same work runs only the items not recorded. A
    unit with a deferred file is not recorded (a rerun tries the file again)."""
    import ray

    record = lambda name: f"{stage}-{name}.json"  # noqa: E731
    out = [run.done[record(names(i))] for i in items if record(names(i)) in run.done]
    reused = len(out)
    if not (todo := [i for i in items if record(names(i)) not in run.done]):
        return out, reused
    ds = ray.data.from_items(todo, override_num_blocks=len(todo))
    for row in ds.map_batches(fn, batch_size=1, label_selector=tiers.selector(tiers.Tier.CPU), **options).iter_rows():
        out.append(o := row["out"])
        if (name := o.packed_file or o.docs_file) and not o.tally.deferred:
            write_json_atomic(join(run.work, "done", record(name)), o.to_json())
            failpoint(f"{stage}:{len(out)}")
    return out, reused


def unit_item(unit: list[dict]) -> dict:
    return {"unit": json.dumps(unit)}


def _evaluation_index(cfg: PreprocessConfig) -> dict | None:
    """The decontamination index (pipelines/decontam.py), built once on the driver, or None."""
    if not cfg.clean.decontaminate:
        return None
    c = cfg.clean
    built = decontam.build(list(c.decontaminate), c.decontaminate_n, c.evaluation_fields(), c.decontaminate_min_words)
    _say(f"decontamination: {decontam.size(built):,} n-grams of {len(built['names'])} evaluation file(s): "
         + "; ".join(f"{basename(p)} {f['records']:,} records, {f['ngrams']:,} n-grams" for p, f in built["files"].items()))
    return built

