"""Tier 1's passes, each a function of the run (pipelines/plan.py `Run`) and the typed results of the passes
before it, returning its own result: pass 1 reads, cleans, filters and signs; the dedup index; the tokenizer;
pass 2 deduplicates, tokenizes and packs; pass 3 shuffles rows into shards; then lineage and the dedup audit.
pipelines/driver.py calls them in that order. The work itself runs in pipelines/pack.py and pipelines/shard.py.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipelines.dedup import suggested_shards
from pipelines.plan import REMOVED_DIR, Run, load_tokenizer, map_units, named_tokenizer, unit_item
from pipelines.stats import Output, Tally, outputs, without_deferred
from strata.cluster import tiers
from strata.commands.shell import log as _logger
from strata.data.dataset import history, token_dtype
from strata.data.storage import delete_dir, filesystem, join, make_dirs

if TYPE_CHECKING:
    from pipelines.quality import Decision

_say = _logger("preprocess").info
TAILS_FILE = "tails.parquet"  # what this version's rows could not hold: the next version packs it first
LARGEST_CLUSTERS = 5


@dataclass(frozen=True)
class Read:
    """Pass 1's result: a work file of documents and their dedup keys per unit, and the files it deferred."""

    outputs: list[Output] = field(default_factory=list)
    deferred: dict[str, str] = field(default_factory=dict)
    reused: int | None = None  # units a killed run of the same work finished (None: the pass did not run)

    @property
    def tally(self) -> Tally:
        return Tally.total(o.tally for o in self.outputs)

    def docs_files(self) -> list[str]:
        return sorted(o.docs_file for o in self.outputs if o.docs)


def read_clean_sign(run: Run) -> Read:
    """Pass 1: read, clean, filter, sign; one work file of documents and their dedup keys per unit."""
    from pipelines.pack import docs_name
    from pipelines.pack import read_clean_sign as unit

    _say("pass 1/3: read, clean, filter, sign")
    c = run.cfg
    out, reused = map_units(run, unit, [unit_item(u) for u in run.units], "pass1",
                            lambda i: docs_name(json.loads(i["unit"])),
                            fn_kwargs=dict(read=c.read, clean=c.clean, dedup=c.dedup, work_dir=run.work,
                                           contamination=run.contamination, forget=run.forget))
    kept, deferred = without_deferred(out)
    return Read(kept, deferred, reused)


def score_quality(run: Run, read: Read) -> Decision | None:
    """With --quality-model: every kept document's score under the reference model, and which of them pass 2
    drops (pipelines/quality.py `Decision`); None without one."""
    if run.model is None:
        return None
    from pipelines.quality import score

    p = run.parent
    parent = {**p.manifest.quality, "scores": [p.file(f) for f in p.manifest.quality["scores"]]} \
        if p and p.manifest.quality else None
    return score(run.cfg.quality, run.model, [join(run.work, "docs", f) for f in read.docs_files()], parent=parent,
                 out_dir=join(run.staging, "quality"), cpus=run.cpus, window=run.cfg.dedup.window_size())


@dataclass
class Index:
    """The dedup index: actors (rebuilt from the work files if their node dies) over the segments of the
    earlier versions in the window (and --dedup-against's), and the figures the manifest records."""

    actors: list
    sizes: list
    segments: dict[str, list[dict]]
    window: list[str] | None  # the versions dedup compares with (None: every earlier one)
    compared: int  # keys of earlier versions (and --dedup-against) the index read

    def stop(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a)


def start_index(run: Run, read: Read, against: dict[str, list[dict]]) -> Index:
    """The dedup index's actors, each loaded with this run's keys of its slice and the prior ones it compares
    with (pipelines/index.py `index_segments`, `window`)."""
    import ray

    from pipelines.dedup import DedupIndex, in_window
    from pipelines.index import index_segments, window

    docs, tables, cfg = read.docs_files(), run.tables, run.cfg
    n = (cfg.dedup.index_shards or suggested_shards(run.cpus, run.total_bytes)) if tables and docs else 0
    actor = ray.remote(DedupIndex).options(num_cpus=0, label_selector=tiers.selector(tiers.Tier.CPU),
                                           max_restarts=-1, max_task_retries=-1)
    earlier = functools.cache(functools.partial(history, run.storage, cfg.dataset))  # read once, if at all
    segments = index_segments(run.parent, earlier, cfg)
    versions = window(run.parent, cfg.dedup.window_size(), earlier)
    if versions is not None:
        segments = {t: in_window(segs, versions) for t, segs in segments.items()}
    prior = segments if cfg.dedup.against_previous else {}
    if against:
        prior = {t: [*prior.get(t, []), *against.get(t, [])] for t in tables}
    compared = sum(f["rows"] for t in tables for seg in prior.get(t, []) for f in seg["files"]) if n else 0
    actors = [actor.remote(s, n, [join(run.work, "docs", f) for f in docs], prior, tables) for s in range(n)]
    return Index(actors, ray.get([i.sizes.remote() for i in actors]), segments, versions, compared)


@dataclass(frozen=True)
class Tokenizer:
    definition: str | None  # tokenizer.json's text (None: bytes)
    tok: object  # strata.data.tokenizer's ByteTokenizer or HFTokenizer
    trained: bool = False


def tokenizer(run: Run, read: Read) -> Tokenizer:
    """The tokenizer: the parent's, one trained on this run's documents (train:VOCAB), or the named one."""
    import ray

    spec, parent = run.cfg.pack.tokenizer, run.parent
    if spec.startswith("train:") and parent is not None:
        _say(f"reusing the tokenizer of {parent.ref}: a version extends the previous one")
        definition = parent.tokenizer_definition()
    elif spec.startswith("train:"):
        _say(f"training a byte-level BPE tokenizer ({spec})")
        task = ray.remote(_train_tokenizer).options(label_selector=tiers.selector(tiers.Tier.CPU))
        definition = ray.get(task.remote([join(run.work, "docs", f) for f in read.docs_files()],
                                         int(spec.partition(":")[2]), run.cfg.pack.tokenizer_sample_bytes))
    else:
        definition = named_tokenizer(run.cfg)
    return Tokenizer(definition, load_tokenizer(run.cfg, definition), spec.startswith("train:"))


@dataclass(frozen=True)
class Packed:
    """Pass 2's result: a work file of packed rows per item, the tails packed together, the files it deferred
    (fused: it read the units), and how busy its workers were."""

    outputs: list[Output]
    tails: Output
    deferred: dict[str, str]
    reused: int | None  # as Read's
    utilization: float

    @property
    def tally(self) -> Tally:
        return Tally.total(o.tally for o in self.outputs) + self.tails.tally


def dedup_tokenize_pack(run: Run, read: Read, index: Index, tok: Tokenizer, quality: Decision | None) -> Packed:
    """Pass 2: drop duplicates, tokenize, pack; one work file of rows per document file (or, fused, per unit).
    Then every unit's tails are packed together."""
    import ray

    from pipelines.pack import DedupTokenizePack, docs_name, packed_name

    _say("pass 2/3: read, clean, tokenize, pack (fused)" if run.fused else "pass 2/3: deduplicate, tokenize, pack")
    items = [unit_item(u) for u in run.units] if run.fused else [{"docs_file": f} for f in read.docs_files()]
    began, out, reused, deferred = time.time(), [], None, {}
    if items:
        # Two units in flight per actor: the next one waits at the actor, not 0.15-0.2 s in Ray Data's
        # dispatch after each (measured: 2 s of 14 per actor); at the end one unit may wait behind another.
        pool = ray.data.ActorPoolStrategy(size=max(1, min(int(run.cpus), len(items))), max_tasks_in_flight_per_actor=2)
        out, reused = map_units(run, DedupTokenizePack, items, "pass2", lambda i: packed_name(
            i["docs_file"] if "docs_file" in i else docs_name(json.loads(i["unit"]))),
            compute=pool, fn_constructor_kwargs=packer(run, index, tok, quality))
    if run.fused:
        out, deferred = without_deferred(out)
    tails = pack_tails(run, out, tok) if out else Output(tally=Tally())
    busy = Tally.total(o.tally for o in out).busy_s + tails.tally.busy_s
    utilization = busy / max((time.time() - began) * min(run.cpus, len(out) or 1), 1e-9)
    return Packed(out, tails, deferred, reused, round(utilization, 3))


def packer(run: Run, index: Index, tok: Tokenizer, quality: Decision | None) -> dict:
    """DedupTokenizePack's constructor arguments; the exact keys of the documents the quality scores drop go
    to the object store once."""
    import ray

    c, fused = run.cfg, run.fused
    return dict(tokenizer=c.pack.tokenizer, eot_token=c.pack.eot_token, definition=tok.definition,
                tokenizer_engine=c.pack.tokenizer_engine, seq_len=c.pack.seq_len,
                validation_fraction=c.pack.validation_fraction, seed=c.pack.seed, split_seed=c.pack.split_seed,
                dedup=c.dedup, work_dir=run.work, index=index.actors, removed_dir=join(run.staging, REMOVED_DIR),
                read=c.read if fused else None, clean=c.clean if fused else None,
                contamination=run.contamination, quality={"ref": ray.put(quality.drop)} if quality else None,
                forget=run.forget if fused else None)


def pack_tails(run: Run, packed: list[Output], tok: Tokenizer) -> Output:
    """The parent version's leftover tails, then every unit's, packed together (pipelines/pack.py `pack_tails`),
    in one task on the cpu tier; what is left is padded (--final) or carried on."""
    import ray

    from pipelines.pack import pack_tails as pack

    p = run.parent
    carried = p.named(p.manifest.tails, legacy_ok=True) if p and p.manifest.tails else None
    # No CPU asked for: it packs less than a row per unit, and waiting for pass 2's actors to give theirs
    # back cost 1.3 s on 2 cores (measured; the task itself took 0.03 s).
    task = ray.remote(pack).options(label_selector=tiers.selector(tiers.Tier.CPU), num_cpus=0)
    c = run.cfg.pack
    return ray.get(task.remote(run.work, [o.packed_file for o in packed], seq_len=c.seq_len,
                               dtype=token_dtype(tok.tok.vocab_size), seed=c.seed, eot_id=tok.tok.eot_id, carried=carried,
                               final=c.final, tails_out=join(run.staging, TAILS_FILE)))


@dataclass(frozen=True)
class SavedIndex:
    segments: dict[str, list[dict]]  # the dataset's dedup index as of this version
    tally: Tally  # the index's CPU seconds
    rss_mb: float  # its largest actor's peak


def save_index(run: Run, index: Index) -> SavedIndex:
    """The keys this run adds, as a new segment of the dataset's dedup index (a file per actor, beside the
    version). Under a window, the segments of the next version's window are kept and the one that leaves is
    dropped (nothing is rewritten); under `all`, compaction: the newest INDEX_FAN_IN segments that cover as
    many versions each are merged into one, so the segments a run reads stay few."""
    import ray

    from pipelines.dedup import INDEX_FAN_IN, compaction, in_window
    from strata.data.commit import THIS_VERSION as THIS

    size, params, saved = run.cfg.dedup.window_size(), run.cfg.dedup.params(), dict(index.segments)
    for t in run.tables if index.actors else ():
        files = ray.get([i.save.remote(t, join(run.staging, f"dedup/{t}-{s:04d}.parquet"))
                         for s, i in enumerate(index.actors)])
        segments = [*index.segments.get(t, []), {"versions": 1, "params": params, "files": files,
                                                 "first": THIS, "last": THIS}]
        if size is not None:  # the next version's window: the oldest version leaves, its keys unread
            saved[t] = in_window(segments, [*index.window, THIS][-size:])
            continue
        while k := compaction(segments, INDEX_FAN_IN):
            merged = ray.get([i.merge.remote(t, segments[-k:], join(run.staging, f"dedup/{t}-m{len(segments)}-{s:04d}.parquet"))
                              for s, i in enumerate(index.actors)])
            segments = [*segments[:-k], {"versions": sum(x["versions"] for x in segments[-k:]), "params": params,
                                         "files": merged, "first": segments[-k].get("first"),
                                         "last": segments[-1].get("last")}]
        saved[t] = segments
    return SavedIndex(saved, Tally(cpu_s={"dedup-index": sum(ray.get([i.cpu_s.remote() for i in index.actors]))}),
                      max(ray.get([i.peak_rss_mb.remote() for i in index.actors]), default=0.0))


def write_shards(run: Run, packed: Packed, tok: Tokenizer) -> list[Output]:
    """Pass 3: a global, seeded shuffle of rows into shards of about shard_bytes (pipelines/shard.py)."""
    from pipelines.shard import ShardPlan, shuffle
    from pipelines.shard import write_shards as writer

    _say("pass 3/3: shuffle rows into shards")
    delete_dir(run.shard_dir)  # a killed run's shards (a rerun writes the same ones)
    delete_dir(join(run.work, "places"))  # and where their rows went
    make_dirs(join(run.work, "places"))
    dtype = token_dtype(tok.tok.vocab_size)
    per_shard = max(1, run.cfg.pack.shard_bytes // ((run.cfg.pack.seq_len + 1) * {"uint8": 1, "uint16": 2, "uint32": 4}[dtype]))
    rows = packed.tally.rows
    plan = ShardPlan(tuple((split, max(1, math.ceil(rows[split] / per_shard)))
                           for split in ("train", "validation") if rows.get(split)))
    files = [join(run.work, "packed", o.packed_file) for o in [*packed.outputs, packed.tails] if o.packed_file]
    shards = []
    if plan.counts and files:
        shards = outputs(shuffle(files, plan).map_batches(
            writer, batch_format="pyarrow", batch_size=None,
            fn_kwargs={"directory": run.shard_dir, "plan": plan, "work_dir": run.work, "dtype": dtype}).take_all())
    written = {split: sum(o.shard[2] for o in shards if o.shard[1] == split) for split in rows}
    if written != dict(rows):
        raise RuntimeError(f"pass 3 wrote {written} rows by split, pass 2 packed {dict(rows)}: nothing committed")
    return shards


def build_lineage(run: Run) -> dict:
    """Which documents each row holds (pipelines/lineage.py), one file beside the version, in a cpu-tier task:
    pass 2's spans joined with pass 3's places. Its figures (documents, spans, bytes, digest)."""
    import ray

    from pipelines import lineage

    task = ray.remote(lineage.build).options(label_selector=tiers.selector(tiers.Tier.CPU))
    figures = ray.get(task.remote(run.work, f"data/{run.tag}", join(run.staging, lineage.FILE),
                                  run.cfg.pack.seq_len + 1))
    if figures["unplaced"]:
        raise RuntimeError(f"lineage: {figures['unplaced']} spans name a row pass 3 did not write: nothing committed")
    return figures


def dedup_audit(run: Run, read: Read, tally: Tally) -> dict:
    """What dedup removed, to check before trusting it: removal rates per source, a histogram of
    duplicate-cluster sizes (a kept document and those removed as its duplicates), the largest clusters,
    and sampled pairs with the Jaccard similarity their MinHash estimates and their true one."""
    import ray

    from pipelines.dedup import audit_pairs, size_histogram

    t = tally
    largest = sorted(t.clusters.items(), key=lambda kv: (-kv[1], kv[0]))[:LARGEST_CLUSTERS]
    docs = [join(run.work, "docs", f) for f in read.docs_files()]
    task = ray.remote(audit_pairs).options(label_selector=tiers.selector(tiers.Tier.CPU))
    found = ray.get(task.remote(docs, list(t.pairs), [w for w, _ in largest], run.cfg.dedup)) \
        if t.clusters else {"pairs": [], "winner_ids": {}}
    audit = {
        "by_source": by_source(run, t), "cluster_sizes": size_histogram(n + 1 for n in t.clusters.values()),
        "largest_clusters": [{"size": n + 1, "kept": found["winner_ids"].get(str(w)) or "(an earlier version)"}
                             for w, n in largest],
        "sampled_pairs": found["pairs"], "removed_by_earlier_version": t.removed_by_earlier_version,
        "threshold": run.cfg.dedup.threshold, "lsh": dict(zip(("bands", "rows"), run.cfg.dedup.lsh(), strict=True)),
    }
    if t.clusters:
        _say(f"dedup: {sum(t.clusters.values()):,} removed in {len(t.clusters):,} clusters; sizes "
             + ", ".join(f"{k}: {v:,}" for k, v in audit["cluster_sizes"].items())
             + f"; largest {audit['largest_clusters'][0]['size']:,}")
    return audit


def by_source(run: Run, tally: Tally) -> dict[str, dict]:
    """Per input source: documents dedup looked at, how many it removed, and the share."""
    source_of = run.source_of()
    looked, removed = {}, {}
    for into, counts in ((looked, tally.looked_at), (removed, tally.removed)):
        for path, n in counts.items():
            into[source_of.get(path, path)] = into.get(source_of.get(path, path), 0) + n
    return {s: {"documents": n, "removed": removed.get(s, 0), "share": round(removed.get(s, 0) / n, 6)}
            for s, n in sorted(looked.items())}


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
