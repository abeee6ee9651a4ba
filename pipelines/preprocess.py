"""Tier 1 entry point: raw text to a committed, versioned parquet dataset.

    python -m pipelines.preprocess --input PATH_GLOB_OR_URI [--input ...] --dataset NAME [--json]

Three Ray Data passes on cpu-tier nodes (see pipelines/pack.py): read, clean,
filter and sign every record; drop exact and near duplicates (across the
whole input and earlier versions), tokenize and pack; shuffle rows into
shards. Every record is kept, filtered, duplicate or rejected with a reason;
the version is published only when complete.
"""

from __future__ import annotations

import json
import math
import sys
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field

from pipelines import decontam
from pipelines.clean import WEB, CleanConfig
from pipelines.dedup import DedupConfig, suggested_shards
from pipelines.pack import CONTAMINATED_BY, LANGUAGE, TALLIES
from pipelines.sources import (
    InputMissing,
    InputUnreadable,
    ReadConfig,
    check_outside,
    list_inputs,
    plan_units,
    without_deferred,
)
from strata import tiers
from strata.cli import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    add_config_arguments,
    check_fields,
    finish,
    overrides,
)
from strata.cli import parser as cli_parser
from strata.connect import connect
from strata.cost import UsageMonitor, ray_daemon_cpu
from strata.dataset import (
    DOCUMENT_STATUSES,
    DatasetError,
    DocumentCounts,
    Shard,
    abandoned_run_files,
    check_extends,
    commit,
    list_versions,
    resolve,
    token_dtype,
)
from strata.lease import Lease, LeaseBusy
from strata.records import write_record
from strata.runinfo import run_info
from strata.shell import Command
from strata.shell import log as _logger
from strata.storage import (
    Storage,
    basename,
    check_name,
    delete_dir,
    exists,
    filesystem,
    join,
    make_dirs,
    write_bytes_atomic,
    write_json_atomic,
)
from strata.tokenizer import ENGINES, TOKENIZER_FILE, TokenizerMismatch, check_spec

_say = _logger("preprocess").info

# What tier 1's workers import, loaded by an embedded Ray's idle workers while the driver starts
# (about 1 s sooner to the first unit on 2 cores).
WORKER_MODULES = ("ray.data", "pyarrow.parquet", "tokenizers", "tiktoken")


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    tokenizer: str = "bytes"
    """`bytes`, a path to a Hugging Face tokenizer.json, or train:VOCAB (byte-level BPE trained on the corpus)."""
    eot_token: str = ""
    """End-of-text token of a tokenizer.json (default: the first of <|endoftext|>, </s>, ...)."""
    tokenizer_engine: str = "auto"
    """How a tokenizer.json encodes: auto (tiktoken's BPE core where the file allows it, checked against
    Hugging Face's on a sample of documents; the same ids) or hf (Hugging Face tokenizers always)."""
    tokenizer_sample_bytes: int = 32 << 20
    """Text sampled from the corpus to train a train:VOCAB tokenizer."""
    seq_len: int = 128
    """Tokens a model sees per row; rows hold seq_len + 1 ids (inputs and shifted targets)."""
    validation_fraction: float = 0.05
    """Fraction of documents held out for validation, chosen by a stable hash of the document id."""
    shard_bytes: int = 128 << 20
    """Target size of a shard's token data; shards are this size on average."""
    seed: int = 0
    """Seed of the row shuffle: the same seed, the same order."""
    split_seed: int = 0
    """Seed of the train/validation split of documents."""
    final: bool = False
    """Pad what is left of each split into a last row (the padding is left out of training's loss) instead
    of carrying it into the next version: every kept document is in this version. For a one-off dataset,
    or the last version of one."""

    def __post_init__(self):
        check_spec(self.tokenizer)
        if self.tokenizer_engine not in ENGINES:
            raise ValueError(f"tokenizer_engine {self.tokenizer_engine!r}: use one of {', '.join(ENGINES)}")
        check_fields(self, {**dict.fromkeys(("seq_len", "shard_bytes", "tokenizer_sample_bytes"), AT_LEAST_ONE),
                            **dict.fromkeys(("seed", "split_seed"), NON_NEGATIVE)})
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError("validation_fraction must be in [0, 1)")


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    dataset: str
    read: ReadConfig
    clean: CleanConfig = field(default_factory=CleanConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    pack: PackConfig = field(default_factory=PackConfig)

    def __post_init__(self):
        check_name(self.dataset, "dataset name")
        if not self.read.inputs:
            raise ValueError("give at least one --input")


STAGES = {"read": ReadConfig, "clean": CleanConfig, "dedup": DedupConfig, "pack": PackConfig}


def debug(dataset: str, **stages: dict) -> PreprocessConfig:
    """Short rows and length-only filters: a laptop CPU in seconds, fine for source code."""
    return _build(dataset, stages, pack={"seq_len": 128, "shard_bytes": 16 << 20})


def web(dataset: str, **stages: dict) -> PreprocessConfig:
    """Web text: Gopher/C4 quality rules, GPT-2 length rows."""
    return _build(dataset, stages, clean=WEB, pack={"seq_len": 1024})


PRESETS = {"debug": debug, "web": web}


def _build(dataset: str, stages: dict, **preset: dict) -> PreprocessConfig:
    made = {name: cls(**{**preset.get(name, {}), **stages.get(name, {})}) for name, cls in STAGES.items()}
    return PreprocessConfig(dataset=dataset, **made)


def _evaluation_index(cfg: PreprocessConfig) -> dict | None:
    """The decontamination index (pipelines/decontam.py), built once on the driver, or None."""
    if not cfg.clean.decontaminate:
        return None
    c = cfg.clean
    built = decontam.build(list(c.decontaminate), c.decontaminate_n, c.evaluation_fields(), c.decontaminate_min_words)
    _say(f"decontamination: {decontam.size(built):,} n-grams of {len(built['names'])} evaluation file(s): "
         + "; ".join(f"{basename(p)} {f['records']:,} records, {f['ngrams']:,} n-grams" for p, f in built["files"].items()))
    return built


def _tier_cpus() -> float:
    import ray

    return sum(n["Resources"].get("CPU", 0) for n in ray.nodes()
               if n["Alive"] and tiers.Tier.CPU in tiers.tiers_of(n.get("Labels", {})))


def _earlier(storage: Storage, cfg: PreprocessConfig) -> list:
    return [resolve(storage, f"{cfg.dataset}@{v}") for v in list_versions(storage, cfg.dataset)]


def _prior_state(earlier: list, cfg: PreprocessConfig) -> dict[str, list[str]]:
    """Dedup state files of earlier versions with comparable parameters."""
    files = {"exact": [], "band": []}
    if not cfg.dedup.against_previous:
        return files
    for v in earlier:
        state = v.manifest.dedup
        for table in files:
            if table == "band" and state.get("params") != cfg.dedup.params():
                _say(f"near-dedup against {v.ref} skipped: its MinHash/LSH parameters {state.get('params')} "
                     f"differ from this run's {cfg.dedup.params()} (pass --bands/--rows/--num-perm to match)")
                continue  # different shingles/bands: signatures are not comparable
            files[table] += [v.file(p) for p in state.get("files", {}).get(table, [])]
    return files


def _identity(f: dict) -> tuple:
    return f["path"], f["size"], f["mtime_ns"]


UNIT_RETRIES = 2  # Ray runs a work unit whose file stayed unreadable again, this many times (with backoff)
EXIT_BUSY = 75  # EX_TEMPFAIL: another run holds the dataset (with --no-wait)


def run(cfg: PreprocessConfig, storage: Storage, run_id: str = "", *, wait: bool = True,
        dashboard: bool = True) -> dict:
    """Run the three passes over what is new and commit a version; returns the summary.

    The run holds the dataset's lease from deciding what is new until its commit,
    so concurrent runs (overlapping schedule slots, a person beside cron) publish
    each input once: a second run waits, then processes only what is still new
    (`wait=False` raises LeaseBusy instead). Input files an earlier version
    consumed (same path, size and mtime) are skipped; with nothing new, no version
    is made. A `run_id` (a scheduled slot) that an earlier version already carries
    returns that version.
    """
    started = time.time()
    check_outside(list(cfg.read.inputs), storage.root)
    # A missing or empty input fails here, before anything is written; so does a link into the storage root.
    skipped: list[str] = []
    files = list_inputs(list(cfg.read.inputs), cfg.read.allow_empty, cfg.read.follow_links, skipped)
    check_outside([], storage.root, files)
    if skipped:
        _say(f"{len(skipped)} symbolic link(s) lead out of their input folder and were not followed "
             f"(--follow-links reads them): {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''}")
    lease = Lease(storage.dataset(cfg.dataset), f"dataset {cfg.dataset}",
                  purpose=f"preprocess{f' run {run_id}' if run_id else ''}")
    lease.acquire(wait=wait, log=_say)
    try:
        for leftover in abandoned_run_files(storage, cfg.dataset, lease.gen):
            _say(f"deleting {leftover}: files of a run that ended before its commit")
            delete_dir(leftover)
        return _run_leased(cfg, storage, run_id, lease, files, started, dashboard)
    except Exception as e:
        if (cause := _worker_error(e, (InputUnreadable, TokenizerMismatch))) is None:
            raise
        first = str(cause).split("\n")[0]  # without the traceback and Ray's retry advice
        if isinstance(cause, (InputMissing, TokenizerMismatch)):
            raise DatasetError(f"{first}. Nothing was committed") from e
        raise DatasetError(
            f"{first}, in each of {1 + UNIT_RETRIES} runs of its work unit. Nothing was committed and the file is "
            "not recorded as consumed: rerun to retry it, or pass --unreadable defer to publish without it") from e
    finally:
        lease.release()


def _run_leased(cfg: PreprocessConfig, storage: Storage, run_id: str, lease: Lease, files: list[dict],
                started: float, dashboard: bool = True) -> dict:
    import ray

    earlier = _earlier(storage, cfg)
    if run_id and (done := next((v for v in earlier if v.manifest.run_id == run_id), None)):
        _say(f"run {run_id!r} already produced {done.ref}: nothing to do")
        return {**_summary(done), "already_existed": True}
    parent = earlier[-1] if earlier else None
    if parent and not cfg.pack.tokenizer.startswith("train:"):
        check_extends(parent, _tokenizer(cfg, _tokenizer_definition(cfg, None, None, [], None)).info(),
                      cfg.pack.seq_len)
    if cfg.read.incremental:
        consumed = {_identity(f) for v in earlier for f in v.manifest.inputs if "mtime_ns" in f}
        new = [f for f in files if _identity(f) not in consumed]
        if len(new) < len(files):
            _say(f"{len(files) - len(new)} of {len(files)} input files were consumed by earlier versions: skipped")
        files = new
    if not files:
        _say("nothing new: no version created")
        return _empty_summary(cfg, started, "nothing new")
    evaluation = _evaluation_index(cfg)  # read and checked before Ray starts: a file that checks nothing fails here
    # Ray's own worker logs stay in its log files (a worker's error reaches here as the run's error).
    _say(connect(dashboard=dashboard, preload=WORKER_MODULES, quiet=True, log_to_driver=False))
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.label_selector = tiers.selector(tiers.Tier.CPU)  # every task and actor, shuffles too
    # A unit whose file stays unreadable runs again; then its error reaches run() as itself, not wrapped.
    ctx.retried_map_errors, ctx.max_map_retries = [f"{InputUnreadable.__name__}:"], UNIT_RETRIES
    ctx.raise_original_map_exception = True
    cpus = _tier_cpus()
    if not cpus:
        raise DatasetError(f"no alive node serves the cpu tier (label {tiers.label_key(tiers.Tier.CPU)}=true)")
    units = plan_units(files, cfg.read)
    total_bytes = sum(f["size"] for f in files)
    _say(f"{len(files)} input files, {total_bytes / 1e6:.1f} MB in {len(units)} work units")

    staging = storage.run_files(cfg.dataset, f"g{lease.gen:08d}-{uuid.uuid4().hex[:8]}")
    work = join(staging, "_work")
    make_dirs(join(work, "docs"), join(work, "packed"), join(work, "tails"), join(staging, "dedup"),
              join(staging, REMOVED_DIR))
    record = run_info("preprocess", {**asdict(cfg), "run_id": run_id})
    write_json_atomic(join(staging, "run.json"), record)
    try:
        with UsageMonitor() as usage:
            passes = _run_passes(cfg, ray, units, work, staging, cpus, _prior_state(earlier, cfg), parent, started,
                                 lease, evaluation)
        delete_dir(work)
        for path, why in passes.deferred.items():
            _say(f"WARNING: {path} left out of this version (--unreadable defer), to be read by a later run: {why}")
        files = [f for f in files if f["path"] not in passes.deferred]  # not consumed: the next run reads it
        _check_dedup_share(passes.dedup_by_source, cfg.dedup.max_duplicate_fraction)
        if not passes.shards:
            delete_dir(staging)
            _say("no document survived: no version created")
            return _empty_summary(cfg, started, "no rows", passes)
        version = _commit(cfg, storage, staging, files, record, passes, started, cpus, total_bytes, run_id, lease,
                          parent)
    except BaseException:
        delete_dir(staging)  # a failed run leaves nothing behind (a killed one: the next writer cleans up)
        raise
    figures = {k: version.manifest.stats.get(k) for k in ("documents", "tokens", "bytes", "mb_per_s_per_cpu",
                                                          "tokens_per_s_per_cpu", "peak_worker_rss_mb")}
    figures["tokens_per_s"] = version.manifest.tokens / max(usage.ended - usage.started, 1e-9)
    figures["version"] = version.manifest.version
    rec = write_record(storage, record, name=cfg.dataset, usage=usage, work_nodes=passes.nodes, figures=figures,
                       beside=join(storage.dataset(cfg.dataset), f"{version.manifest.version}.record.json"))
    return {**_summary(version), "cost": rec["cost"], "node_hours": rec["node_hours"],
            "cpu_busy": rec["utilization"]["cpu_busy"]}


@dataclass
class PassResults:
    """What the three passes hand the commit: the accounting (computed once), the shards and the rest."""

    docs: DocumentCounts
    packed: Counter
    """Pass 2's and the tails' figures: tokens:SPLIT, rows:SPLIT, unpacked_tokens:SPLIT, duplicate:KIND."""
    samples: dict
    shards: list[dict]
    tokenizer: object
    definition: str | None
    dedup_files: dict
    index: list
    nodes: list[str]
    peak_rss_mb: float
    """The largest worker process's peak memory, the dedup index actors' included."""
    index_rss_mb: float
    """The largest dedup index actor's peak memory (it holds its share of every key, old versions' too)."""
    pass2_utilization: float
    dedup_by_source: dict[str, dict]
    languages: dict[str, int]
    """With --languages: documents the language rule scored, by detected language, most first."""
    contaminated_by: dict[str, int]
    """With --decontaminate: documents filtered as contaminated, by the evaluation file that caught them."""
    evaluation_files: dict[str, dict]
    """With --decontaminate: each evaluation file's records, n-grams and whole short items."""
    """Per input source: documents dedup looked at, how many it removed, and the share."""
    dedup_audit: dict
    """Written beside the version (`AUDIT_FILE`): see `_dedup_audit`."""
    deferred: dict[str, str]
    """Input files left out of the version (`--unreadable defer`), with why: not recorded as consumed."""
    cpu_s: dict[str, float]
    """CPU seconds by stage: read, clean, sign, dedup, dedup-index, tokenize, pack, write, shuffle-write
    (the work, summed over workers) and ray-daemons (Ray's own processes on this node)."""
    wall_s: dict[str, float]
    """Wall seconds of each step on the critical path, in order."""


def _run_passes(cfg, ray, units, work, staging, cpus, prior, parent, started: float, lease,
                evaluation: dict | None) -> PassResults:
    from pipelines.dedup import DedupIndex
    from pipelines.pack import DedupTokenizePack, read_clean_sign, write_shard

    on_cpu = tiers.selector(tiers.Tier.CPU)
    tables = tuple(t for t, on in (("exact", cfg.dedup.exact_dedup), ("band", cfg.dedup.near_dedup)) if on)
    # Without dedup or tokenizer training nothing global sits between reading and packing: fuse them.
    fused = not tables and not cfg.pack.tokenizer.startswith("train:")
    counts, samples, p1, docs_files, deferred = Counter(), {}, [], [], {}
    walls, mark, driver_cpu = {"start-up": round(time.time() - started, 2)}, time.time(), time.process_time()

    def step(name: str) -> None:  # wall time on the critical path, step by step; a lost lease stops the run
        nonlocal mark
        walls[name] = round(time.time() - mark, 2)
        mark = time.time()
        lease.check()

    cpu, daemons = Counter(), ray_daemon_cpu()
    contamination = {"ref": ray.put(evaluation)} if evaluation else None  # every worker reads the node's copy
    if not fused:
        # Pass 1: read, clean, filter, sign; one work file of documents and their dedup keys per unit.
        _say("pass 1/3: read, clean, filter, sign")
        p1 = ray.data.from_items([{"unit": json.dumps(u)} for u in units], override_num_blocks=len(units)) \
            .map_batches(read_clean_sign, batch_size=1, label_selector=on_cpu,
                         fn_kwargs=dict(read=cfg.read, clean=cfg.clean, dedup=cfg.dedup,
                                        work_dir=work, contamination=contamination)).take_all()
        p1, deferred = without_deferred(p1)
        step("pass 1: read, clean, sign")
        for row in p1:
            counts.update(json.loads(row["counts"]))
            _add_samples(samples, row)
        docs_files = sorted(r["docs_file"] for r in p1 if r["docs"])

    # The dedup index: actors that rebuild themselves from the work files if their node dies.
    n_index = (cfg.dedup.index_shards or suggested_shards(cpus)) if tables and docs_files else 0
    index = [ray.remote(DedupIndex).options(num_cpus=0, label_selector=on_cpu, max_restarts=-1,
                                            max_task_retries=-1).remote(
        s, n_index, [join(work, "docs", f) for f in docs_files], prior, tables) for s in range(n_index)]
    try:
        sizes = ray.get([i.sizes.remote() for i in index])
        step("dedup index")
        definition = _tokenizer_definition(cfg, ray, work, docs_files, on_cpu, parent)
        if cfg.pack.tokenizer.startswith("train:"):
            step("tokenizer training")

        # Pass 2: drop duplicates, tokenize, pack; one work file of rows per document file.
        _say("pass 2/3: read, clean, tokenize, pack (fused)" if fused else "pass 2/3: deduplicate, tokenize, pack")
        inputs = [{"unit": json.dumps(u)} for u in units] if fused else [{"docs_file": f} for f in docs_files]
        pass2_started = time.time()
        p2 = []
        if inputs:
            p2 = ray.data.from_items(inputs, override_num_blocks=len(inputs)).map_batches(
                DedupTokenizePack, batch_size=1, label_selector=on_cpu,
                # Two units in flight per actor: the next one waits at the actor, not 0.15-0.2 s in Ray Data's
                # dispatch after each (measured: 2 s of 14 per actor); at the end one unit may wait behind another.
                compute=ray.data.ActorPoolStrategy(size=max(1, min(int(cpus), len(inputs))),
                                                   max_tasks_in_flight_per_actor=2),
                fn_constructor_kwargs=dict(
                    tokenizer=cfg.pack.tokenizer, eot_token=cfg.pack.eot_token, definition=definition,
                    tokenizer_engine=cfg.pack.tokenizer_engine,
                    seq_len=cfg.pack.seq_len, validation_fraction=cfg.pack.validation_fraction,
                    seed=cfg.pack.seed, split_seed=cfg.pack.split_seed, dedup=cfg.dedup, work_dir=work,
                    index=index, removed_dir=join(staging, REMOVED_DIR), read=cfg.read if fused else None,
                    clean=cfg.clean if fused else None, contamination=contamination)).take_all()
        if fused:
            p2, deferred = without_deferred(p2)
        packed = Counter()
        for row in p2:
            packed.update(json.loads(row["stats"]))
            counts.update(json.loads(row["counts"]))
            _add_samples(samples, row)
        tok = _tokenizer(cfg, definition)
        tails = _pack_tails(cfg, ray, work, [r["packed_file"] for r in p2], tok, on_cpu, parent,
                            join(staging, TAILS_FILE)) if p2 else {}
        packed.update({k: v for k, v in tails.items() if k not in ("packed_file", "tails_file", "cpu_s")})
        cpu["pack"] += tails.get("cpu_s", 0.0)
        pass2_wall = time.time() - pass2_started
        step("pass 2: " + ("read, clean, " if fused else "dedup, ") + "tokenize, pack")
        dedup_files = {t: [] for t in ("exact", "band")}
        for s, i in enumerate(index):
            for t in tables:
                name = f"dedup/{t}-{s:04d}.parquet"
                ray.get(i.save.remote(t, join(staging, name)))
                dedup_files[t].append(name)
        cpu["dedup-index"] += sum(ray.get([i.cpu_s.remote() for i in index]))
        index_rss = max(ray.get([i.peak_rss_mb.remote() for i in index]), default=0.0)
    finally:
        for i in index:
            ray.kill(i)

    # Pass 3: a global, seeded shuffle of rows into shards of about shard_bytes.
    _say("pass 3/3: shuffle rows into shards")
    row_bytes = (cfg.pack.seq_len + 1) * {"uint8": 1, "uint16": 2, "uint32": 4}[token_dtype(tok.vocab_size)]
    per_shard = max(1, cfg.pack.shard_bytes // row_bytes)
    shards_per_split = {sid: max(1, math.ceil(packed.get(f"rows:{split}", 0) / per_shard))
                        for split, sid in (("train", 0), ("validation", 1))}
    specs = [{"split": split, "shard": i, "shards": n} for split, sid in (("train", 0), ("validation", 1))
             if packed.get(f"rows:{split}", 0) for n in [shards_per_split[sid]] for i in range(n)]
    shards = []
    if specs:
        packed_files = [join(work, "packed", f) for f in [r["packed_file"] for r in p2] + [tails["packed_file"]] if f]
        shards = ray.data.from_items(specs, override_num_blocks=len(specs)).map_batches(
            write_shard, batch_size=1, label_selector=on_cpu,
            fn_kwargs={"staging": staging, "packed_files": packed_files}).take_all()
    step("pass 3: shuffle, write shards")
    rows_all = p1 + p2 + shards
    for row in rows_all:
        cpu.update(json.loads(row["cpu_s"]))
    source_of = {f["path"]: f.get("source", f["path"]) for unit in units for f in unit}
    looked, removed = Counter(), Counter()
    for rows, column, into in ((p1, "kept_by_path", looked), (p2, "removed_by_path", removed)):
        for row in rows:
            for path, n in json.loads(row[column]).items():
                into[source_of.get(path, path)] += n
    by_source = {s: {"documents": n, "removed": removed[s], "share": round(removed[s] / n, 6)}
                 for s, n in sorted(looked.items())}
    audit = _dedup_audit(cfg, ray, [join(work, "docs", f) for f in docs_files], p2, by_source, on_cpu) \
        if tables and p2 else {}
    step("dedup audit")
    cpu["ray-daemons"] = ray_daemon_cpu(since=daemons)
    cpu["driver"] = time.process_time() - driver_cpu
    return PassResults(
        docs=_accounting(counts, packed), packed=packed, samples=samples, shards=shards, tokenizer=tok,
        definition=definition, dedup_files=dedup_files, index=sizes, nodes=sorted({r["node"] for r in rows_all}),
        peak_rss_mb=round(max([index_rss, *(r.get("peak_rss_mb", 0) for r in rows_all)]), 1),
        index_rss_mb=round(index_rss, 1),
        pass2_utilization=round(sum(r["busy_s"] for r in p2) / max(pass2_wall * min(cpus, len(p2) or 1), 1e-9), 3),
        dedup_by_source=by_source, dedup_audit=audit, deferred=deferred,
        languages=_tally(counts, LANGUAGE), contaminated_by=_tally(counts, CONTAMINATED_BY),
        evaluation_files=evaluation["files"] if evaluation else {},
        cpu_s={k: round(v, 1) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}, wall_s=walls)


AUDIT_FILE = "dedup-audit.json"
TAILS_FILE = "tails.parquet"  # what this version's rows could not hold: the next version packs it first
REMOVED_DIR = "removed"  # parquet parts: every document dedup removed (doc_id, kind, kept doc key, earlier)
LARGEST_CLUSTERS = 5


def _dedup_audit(cfg, ray, docs_paths: list[str], p2: list[dict], by_source: dict, on_cpu) -> dict:
    """What dedup removed, to check before trusting it: removal rates per source, a histogram of
    duplicate-cluster sizes (a kept document and those removed as its duplicates), the largest clusters,
    and sampled pairs with the Jaccard similarity their MinHash estimates and their true one."""
    from pipelines.dedup import audit_pairs, size_histogram
    from pipelines.pack import audit_sample

    clusters, pairs = Counter(), []
    for row in p2:
        clusters.update({int(k): v for k, v in json.loads(row["clusters"]).items()})
        pairs = audit_sample(pairs + json.loads(row["pairs"]))
    largest = clusters.most_common(LARGEST_CLUSTERS)
    found = ray.get(ray.remote(audit_pairs).options(label_selector=on_cpu).remote(
        docs_paths, pairs, [w for w, _ in largest], cfg.dedup)) if clusters else {"pairs": [], "winner_ids": {}}
    audit = {
        "by_source": by_source,
        "cluster_sizes": size_histogram(n + 1 for n in clusters.values()),
        "largest_clusters": [{"size": n + 1, "kept": found["winner_ids"].get(str(w)) or "(an earlier version)"}
                             for w, n in largest],
        "sampled_pairs": found["pairs"],
        "removed_by_earlier_version": sum(json.loads(r["stats"]).get("removed_by_earlier_version", 0) for r in p2),
        "threshold": cfg.dedup.threshold, "lsh": dict(zip(("bands", "rows"), cfg.dedup.lsh(), strict=True)),
    }
    if clusters:
        _say(f"dedup: {sum(clusters.values()):,} removed in {len(clusters):,} clusters; sizes "
             + ", ".join(f"{k}: {v:,}" for k, v in audit["cluster_sizes"].items())
             + f"; largest {audit['largest_clusters'][0]['size']:,}")
    return audit


def _pack_tails(cfg, ray, work, names, tok, on_cpu, parent, tails_out: str) -> dict:
    """The parent version's leftover tails, then every unit's, packed together (pipelines/pack.py
    `pack_tails`), in one task on the cpu tier; what is left is padded (--final) or carried on."""
    from pipelines.pack import pack_tails

    carried = parent.file(parent.manifest.tails) if parent and parent.manifest.tails else None
    task = ray.remote(pack_tails).options(label_selector=on_cpu, num_cpus=1)
    return ray.get(task.remote(work, names, seq_len=cfg.pack.seq_len, dtype=token_dtype(tok.vocab_size),
                               seed=cfg.pack.seed, eot_id=tok.eot_id, carried=carried, final=cfg.pack.final,
                               tails_out=tails_out))


def _add_samples(samples: dict, row: dict) -> None:
    for k, v in json.loads(row["samples"]).items():
        samples.setdefault(k, []).extend(v[: 3 - len(samples.get(k, []))])


def _tokenizer_definition(cfg, ray, work, docs_files, on_cpu, parent=None) -> str | None:
    if cfg.pack.tokenizer.startswith("train:") and parent is not None:
        _say(f"reusing the tokenizer of {parent.ref}: a version extends the previous one")
        return parent.tokenizer_definition()
    if cfg.pack.tokenizer.startswith("train:"):
        _say(f"training a byte-level BPE tokenizer ({cfg.pack.tokenizer})")
        return ray.get(ray.remote(_train_tokenizer).options(label_selector=on_cpu).remote(
            [join(work, "docs", f) for f in docs_files], int(cfg.pack.tokenizer.partition(":")[2]),
            cfg.pack.tokenizer_sample_bytes))
    if cfg.pack.tokenizer != "bytes":
        from strata.tokenizer import HFTokenizer

        return HFTokenizer.from_file(cfg.pack.tokenizer, cfg.pack.eot_token, "hf").definition
    return None


def _tokenizer(cfg, definition):
    from strata.tokenizer import ByteTokenizer, HFTokenizer

    if not definition:
        return ByteTokenizer()
    return HFTokenizer(definition, "" if cfg.pack.tokenizer.startswith("train:") else cfg.pack.eot_token, "hf")


def _train_tokenizer(paths: list[str], vocab: int, sample_bytes: int) -> str:
    """A byte-level BPE from the first `sample_bytes` of kept text (a cpu-tier task)."""
    import pyarrow.parquet as pq

    from strata.tokenizer import train_bpe

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


GUARD_MIN_DOCUMENTS = 20  # smaller sources are not judged: one copied file is not a wiped-out source


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


def _tally(counts: Counter, prefix: str) -> dict[str, int]:
    return dict(sorted(((k[len(prefix):], v) for k, v in counts.items() if k.startswith(prefix)), key=lambda kv: -kv[1]))


def _accounting(counts: Counter, packed: Counter) -> DocumentCounts:
    """Every document read, by status and reason, from pass 1's counts and pass 2's figures."""
    unpacked = packed.get("unpacked_documents", 0)
    counts = Counter({k: v for k, v in counts.items() if not k.startswith(tuple(TALLIES.values()))})  # tallies beside the statuses
    docs = DocumentCounts(
        read=sum(counts.values()), kept=packed.get("kept", 0) - unpacked, unpacked=unpacked,
        filtered=sum(v for k, v in counts.items() if k.startswith("filtered:")),
        duplicate=packed.get("duplicate:exact", 0) + packed.get("duplicate:near", 0),
        rejected=sum(v for k, v in counts.items() if k.startswith("rejected:")),
        reasons=dict(sorted({**{k: v for k, v in counts.items() if k != "kept"},
                             **{k: v for k, v in packed.items() if k.startswith("duplicate:") and v},
                             **({"unpacked:carried": unpacked} if unpacked else {})}.items())))
    if not docs.balanced() or counts.get("kept", 0) != docs.kept + docs.unpacked + docs.duplicate:
        raise RuntimeError(f"document accounting does not balance: {docs}")  # a bug, never bad input
    return docs


def _table(passes: PassResults | None, started: float, cpus: float, total_bytes: int) -> dict:
    """The summary table, stored in the manifest and printed."""
    docs = passes.docs if passes else DocumentCounts()
    packed = passes.packed if passes else Counter()
    seconds = time.time() - started
    tokens = packed.get("tokens:train", 0) + packed.get("tokens:validation", 0)
    return {
        "documents": {k: getattr(docs, k) for k in DOCUMENT_STATUSES},
        "filtered_by_rule": {k.split(":", 1)[1]: v for k, v in docs.reasons.items() if k.startswith("filtered:")},
        "duplicate": {"exact": packed.get("duplicate:exact", 0), "near": packed.get("duplicate:near", 0)},
        "rejected_by_reason": {k.split(":", 1)[1]: v for k, v in docs.reasons.items() if k.startswith("rejected:")},
        "bytes": total_bytes, "tokens": tokens,
        # Tokens of kept documents in no row: what is left of each split after every tail is packed, carried
        # into the next version (which packs it first); none with --final, which pads the last row instead.
        "tokens_unpacked": {s: packed.get(f"unpacked_tokens:{s}", 0) for s in ("train", "validation")},
        "tokens_padding": {s: packed.get(f"padding_tokens:{s}", 0) for s in ("train", "validation")},
        "carried_in": {"documents": packed.get("carried_in_documents", 0),
                       "tokens": {s: packed.get(f"carried_in_tokens:{s}", 0) for s in ("train", "validation")}},
        "carried_on": {"documents": packed.get("carried_on_documents", 0),
                       "tokens": {s: packed.get(f"unpacked_tokens:{s}", 0) for s in ("train", "validation")}},
        "rows": {s: packed.get(f"rows:{s}", 0) for s in ("train", "validation")}, "shards": len(passes.shards) if passes else 0,
        # Which engine encoded how many documents, and how many of them both engines encoded (strata.tokenizer).
        # With --languages: the documents the language rule scored, by detected language (kept or not).
        "documents_by_language": passes.languages if passes else {},
        "contaminated_by_file": passes.contaminated_by if passes else {},
        # Per evaluation file: its records, n-grams (whole short items among them) and the documents it caught.
        "decontamination": {path: {**f, "documents": passes.contaminated_by.get(path, 0)}
                            for path, f in passes.evaluation_files.items()} if passes else {},
        "documents_by_tokenizer_engine": {k.split(":", 1)[1]: v for k, v in packed.items() if k.startswith("encoded_by:")},
        "tokenizer_checked": packed.get("tokenizer_checked", 0),
        "seconds": round(seconds, 2), "cpus": cpus,
        "mb_per_s_per_cpu": round(total_bytes / 1e6 / seconds / max(cpus, 1), 3),
        "tokens_per_s_per_cpu": round(tokens / seconds / max(cpus, 1)),
        "peak_worker_rss_mb": passes.peak_rss_mb if passes else 0,
        "peak_index_rss_mb": passes.index_rss_mb if passes else 0,
        "pack_worker_utilization": passes.pass2_utilization if passes else 0.0,
        "dedup_by_source": passes.dedup_by_source if passes else {},
        "deferred_inputs": passes.deferred if passes else {},
        "cpu_s_by_stage": passes.cpu_s if passes else {},
        # [step, seconds] in order (the manifest's JSON sorts keys)
        "wall_s_by_step": [*passes.wall_s.items(), ("commit and the rest", round(max(0.0, seconds - sum(passes.wall_s.values())), 2))]
        if passes else [],
    }


def _commit(cfg, storage, staging, files, record, passes: PassResults, started, cpus, total_bytes, run_id, lease,
            parent):
    docs = passes.docs
    shards = sorted((Shard(path=s["path"], split=s["split"], rows=s["rows"], tokens=s["tokens"])
                     for s in passes.shards), key=lambda s: s.path)
    tok = passes.tokenizer
    if passes.definition:
        write_bytes_atomic(join(staging, TOKENIZER_FILE), passes.definition.encode())
    table = _table(passes, started, cpus, total_bytes)
    write_json_atomic(join(staging, "rejects.json"), {"counts": docs.reasons, "samples": passes.samples})
    audit = {}
    if passes.dedup_audit:
        write_json_atomic(join(staging, AUDIT_FILE), passes.dedup_audit)
        audit = {"audit": AUDIT_FILE, "removed": REMOVED_DIR}
    record.update(finished_at=time.time(), work_nodes=passes.nodes)
    tails = TAILS_FILE if exists(join(staging, TAILS_FILE)) else ""
    return commit(storage, cfg.dataset, staging, dict(
        tokenizer=tok.info(), seq_len=cfg.pack.seq_len, dtype=token_dtype(tok.vocab_size), shards=shards,
        documents=docs, tokens=table["tokens"], inputs=files, run=record, stats=table, rejects="rejects.json",
        run_id=run_id, tails=tails,
        dedup={"params": cfg.dedup.params(), "files": passes.dedup_files, "index_entries": passes.index, **audit}),
        lease=lease, built_on=parent.manifest.version if parent else None)


def _summary(version) -> dict:
    m = version.manifest
    return {"dataset": m.dataset, "version": m.version, "path": version.path, "parent": m.parent,
            "documents": m.stats["documents"], "reasons": m.documents.reasons, "tokens": m.tokens,
            "sequences": sum(s.rows for s in m.added()), "shards": len(m.added()), "stats": m.stats,
            "snapshot": m.totals, "run_id": m.run_id, "already_existed": False}


def _empty_summary(cfg, started: float, why: str, passes: PassResults | None = None) -> dict:
    """No version: nothing new, or nothing survived. The counts still say what was read."""
    table = _table(passes, started, 0, 0)
    docs = passes.docs if passes else DocumentCounts()
    return {"dataset": cfg.dataset, "version": None, "path": None, "documents": table["documents"],
            "reasons": docs.reasons, "tokens": 0, "sequences": 0, "shards": 0, "stats": table,
            "run_id": "", "already_existed": False, "note": why}


def format_table(stats: dict) -> str:
    """The summary table, for people."""
    d = stats["documents"]
    lines = [f"{'documents read':<28}{d['read']:>14,}", f"{'  kept':<28}{d['kept']:>14,}",
             f"{'  filtered':<28}{d['filtered']:>14,}"]
    lines += [f"{'    ' + k:<28}{v:>14,}" for k, v in sorted(stats["filtered_by_rule"].items())]
    lines += [f"{'  duplicate':<28}{d['duplicate']:>14,}"]
    lines += [f"{'    ' + k:<28}{v:>14,}" for k, v in stats["duplicate"].items()]
    lines += [f"{'  rejected':<28}{d['rejected']:>14,}"]
    lines += [f"{'    ' + k:<28}{v:>14,}" for k, v in sorted(stats["rejected_by_reason"].items())]
    lines += [f"{'  unpacked (carried on)':<28}{d.get('unpacked', 0):>14,}"]
    if stats.get("documents_by_language"):
        lines += ["documents by language"] + [f"{'  ' + k:<28}{v:>14,}" for k, v in stats["documents_by_language"].items()]
    if stats.get("decontamination"):
        lines += ["evaluation files: records, n-grams, documents caught"] + [
            f"{'  ' + basename(k):<28}{f['records']:>10,} {f['ngrams']:>10,} {f['documents']:>8,}"
            for k, f in stats["decontamination"].items()]
    lines += [f"{'input MB':<28}{stats['bytes'] / 1e6:>14,.1f}", f"{'tokens':<28}{stats['tokens']:>14,}",
              f"{'rows (train / validation)':<28}{stats['rows']['train']:>7,} / {stats['rows']['validation']:,}",
              f"{'shards':<28}{stats['shards']:>14,}", f"{'seconds':<28}{stats['seconds']:>14,.1f}",
              f"{'peak worker RSS MB':<28}{stats.get('peak_worker_rss_mb', 0):>14,.0f}",
              f"{'peak dedup index RSS MB':<28}{stats.get('peak_index_rss_mb', 0):>14,.0f}",
              f"{'MB/s per CPU':<28}{stats['mb_per_s_per_cpu']:>14,.3f}",
              f"{'tokens/s per CPU':<28}{stats['tokens_per_s_per_cpu']:>14,}"]
    if stats.get("cpu_s_by_stage"):
        lines += ["CPU seconds by stage"] + [f"{'  ' + k:<28}{v:>14,.1f}" for k, v in stats["cpu_s_by_stage"].items()]
        lines += ["wall seconds, critical path"] + [f"{'  ' + k:<36}{v:>6,.1f}"
                                                     for k, v in stats["wall_s_by_step"]]
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> dict:
    return Command("python -m pipelines.preprocess", argv).run(_main)


def _main(cmd: Command) -> dict:
    argv = cmd.argv
    parser = cli_parser("python -m pipelines.preprocess", __doc__)
    parser.add_argument("--dataset", required=True, help="dataset name under $STRATA_STORAGE/datasets")
    parser.add_argument("--preset", default="debug", choices=sorted(PRESETS), help="config preset (default: debug)")
    parser.add_argument("--run-id", default="", help="idempotency key (e.g. the scheduled slot): a run id "
                        "that already produced a version returns it instead of running again")
    parser.add_argument("--no-wait", action="store_true", help="when another run is writing the dataset, exit "
                        f"at once with code {EXIT_BUSY} instead of waiting for it")
    for cls in STAGES.values():
        add_config_arguments(parser, cls)
    args = parser.parse_args(argv)
    try:
        cfg = PRESETS[args.preset](args.dataset, **{n: overrides(args, c) for n, c in STAGES.items()})
    except ValueError as e:
        parser.error(str(e))
    storage = Storage.from_env(args.storage)
    before = _newest(storage, cfg.dataset)
    cmd.interrupted = lambda: _interrupted(storage, cfg.dataset, before, cmd.continue_with(*argv))
    try:
        if args.run_id:
            check_name(args.run_id, "run id")
        # The command ends with its run: an embedded Ray needs no dashboard (a joined cluster keeps its own).
        summary = run(cfg, storage, run_id=args.run_id, wait=not args.no_wait, dashboard=False)
    except LeaseBusy as e:
        print(f"error: {e}; not waiting (--no-wait): its inputs are left for a later run", file=sys.stderr)
        sys.exit(EXIT_BUSY)
    except (FileNotFoundError, DatasetError, ValueError) as e:
        sys.exit(f"error: {e}")
    if summary["already_existed"]:
        _say(f"run {args.run_id!r} already exists as {summary['dataset']}@{summary['version']}")
    elif summary["version"] is None:
        _say(f"no version created ({summary['note']}): {summary['documents']['kept']} documents kept")
    else:
        _say(f"committed {summary['dataset']}@{summary['version']} at {summary['path']}")
    _say("\n" + format_table(summary["stats"]))
    return finish(summary, args.json)


def _newest(storage: Storage, dataset: str) -> str | None:
    versions = list_versions(storage, dataset)
    return versions[-1] if versions else None


def _interrupted(storage: Storage, dataset: str, before: str | None, again: str) -> str:
    """What Ctrl-C left: a version committed before it, or nothing (the run's files go with the next run)."""
    now = _newest(storage, dataset)
    kept = (f"version {dataset}@{now}, committed before the interrupt" if now != before else
            "no new version: nothing was committed, and its inputs stay new for the next run")
    return f"preprocessing into dataset {dataset}; kept {kept}; continue with: {again}"


if __name__ == "__main__":
    main()
