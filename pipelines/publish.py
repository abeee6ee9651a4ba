"""After tier 1's passes: what the version consumed, its commit, and the summary the command prints.

`Outcome` is what the passes made (pipelines/passes.py), gathered by the driver; `consumed` checks the dedup
guard and digests the inputs, `commit` writes the version's own files and commits it (strata.data.commit), and
`finish` or `empty` say what happened.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from pipelines.dedup import INDEX_FAN_IN
from pipelines.passes import TAILS_FILE, Index, Packed, Read, SavedIndex, Tokenizer, by_source
from pipelines.plan import REMOVED_DIR, Run, consumed_segments, identity
from pipelines.stats import Output, Tally, accounting, summary_table
from strata.commands.shell import log as _logger
from strata.data.commit import commit as commit_version
from strata.data.dataset import DatasetError, Shard, token_dtype
from strata.data.digests import file_digest
from strata.data.lineage import FILE as LINEAGE_FILE
from strata.data.storage import (
    delete_dir,
    exists,
    filesystem,
    join,
    make_dirs,
    write_bytes_atomic,
    write_json_atomic,
)
from strata.data.tokenizer import TOKENIZER_FILE

_say = _logger("preprocess").info
AUDIT_FILE = "dedup-audit.json"
GUARD_MIN_DOCUMENTS = 20  # smaller sources are not judged: one copied file is not a wiped-out source


@dataclass(frozen=True)
class Outcome:
    """What the passes made, as the commit and the summary read it."""

    tally: Tally  # every pass's figures, added up
    walls: dict[str, float]  # wall seconds on the critical path, by step
    read: Read
    packed: Packed
    index: Index
    saved: SavedIndex
    tok: Tokenizer
    shards: list[Output]
    lineage: dict  # the lineage file's figures
    audit: dict
    quality: object | None  # pipelines/quality.py's Decision, with --quality-model
    against: dict  # --dedup-against's version, as the manifest records it

    @property
    def deferred(self) -> dict[str, str]:
        return {**self.read.deferred, **self.packed.deferred}


def consumed(run: Run, files: list[dict], out: Outcome) -> list[dict]:
    """The files this version consumes (not the deferred ones: the next run reads them), each with its
    digest (strata.data.digests.file_digest); the dedup guard."""
    for path, why in out.deferred.items():
        _say(f"WARNING: {path} left out of this version (--unreadable defer), to be read by a later run: {why}")
    check_dedup_share(by_source(run, out.tally), run.cfg.dedup.max_duplicate_fraction)
    delete_dir(run.work)
    parts: dict[str, dict[int, str]] = {}
    for o in [*out.read.outputs, *out.packed.outputs]:  # the parts of each file the units that read it digested
        for path, part, sha in o.digests:
            parts.setdefault(path, {})[part] = sha
    return [{**f, "digest": file_digest(f["size"], parts.get(f["path"], {}))} for f in files
            if f["path"] not in out.deferred]


def check_dedup_share(sources: dict[str, dict], limit: float) -> None:
    """Refuse a run whose dedup removes more than `limit` of one source's documents: one colliding band
    or a bad key can wipe out a source, and nothing downstream would notice."""
    over = {s: v for s, v in sources.items() if v["share"] > limit and v["documents"] >= GUARD_MIN_DOCUMENTS}
    if over:
        worst = max(over, key=lambda s: over[s]["share"])
        v = over[worst]
        raise DatasetError(
            f"dedup would remove {v['removed']:,} of {v['documents']:,} documents ({v['share']:.1%}) of source "
            f"{worst!r}{f' and {len(over) - 1} more' if len(over) > 1 else ''}, more than --max-duplicate-fraction "
            f"{limit}: nothing was committed. If the source is mostly copies, rerun with a higher "
            "--max-duplicate-fraction (1 turns the guard off)")


def table(run: Run, started: float, tally: Tally, out: Outcome | None = None) -> dict:
    """The summary table's figures (pipelines/stats.py `summary_table`)."""
    return summary_table(tally, time.time() - started, cpus=run.cpus, total_bytes=run.total_bytes,
                         shards=len(out.shards) if out else 0, walls=out.walls if out else {},
                         by_source=by_source(run, tally), evaluation=run.evaluation["files"] if run.evaluation else {},
                         deferred=out.deferred if out else {}, index_rss_mb=out.saved.rss_mb if out else 0.0,
                         utilization=out.packed.utilization if out else 0.0,
                         quality=out.quality.figures if out and out.quality else {})


def commit(run: Run, files: list[dict], out: Outcome, *, run_id: str, started: float, head,
           legacy: frozenset[tuple]):
    """The version's own files (tokenizer, rejects, dedup audit), then its commit."""
    docs = accounting(out.tally)
    shards = sorted((Shard(path=p, split=split, rows=rows, tokens=tokens, bytes=size)
                     for p, split, rows, tokens, size in (o.shard for o in out.shards)), key=lambda s: s.path)
    if out.tok.definition:
        write_bytes_atomic(join(run.staging, TOKENIZER_FILE), out.tok.definition.encode())
    stats = table(run, started, out.tally, out)
    samples = {k: list(v) for k, v in sorted(out.tally.samples.items())}
    write_json_atomic(join(run.staging, "rejects.json"), {"counts": docs.reasons, "samples": samples})
    audit = {}
    if out.audit:
        write_json_atomic(join(run.staging, AUDIT_FILE), out.audit)
        audit = {"audit": AUDIT_FILE, "removed": REMOVED_DIR}
    record = run.job.info  # the run's record (job.finish) says so too
    record.update(finished_at=time.time(), work_nodes=sorted(out.tally.nodes))
    tails = TAILS_FILE if exists(join(run.staging, TAILS_FILE)) else ""
    root = run.storage.dataset(run.cfg.dataset)
    index = {t: [{**seg, "files": [relative(f, root) for f in seg["files"]]} for seg in segs]
             for t, segs in out.saved.segments.items()}
    dedup = {"params": run.cfg.dedup.params(), "index": index, "index_entries": out.index.sizes,
             "window": window_record(run, out.index), **audit,
             **({"against": {"dataset": out.against["ref"], "segments": out.against["segments"],
                             "removed": out.tally.removed_by_other_dataset}} if out.against else {})}
    inputs = [{**seg, "files": [relative(f, root) for f in seg["files"]]} for seg in save_consumed(run, files, legacy)]
    p = run.parent
    # A version made without --quality-model carries its parent's score cache on, for a later one with it.
    quality = {**out.quality.state, "scores": [f[len(root):].strip("/").replace(os.sep, "/")
                                               for f in out.quality.state["scores"]]} if out.quality else \
        (p.manifest.quality if p else {})
    lineage = {**{k: v for k, v in out.lineage.items() if k != "sha256"}, "file": LINEAGE_FILE} if out.lineage else {}
    return commit_version(run.storage, run.cfg.dataset, run.tag, dict(
        tokenizer=out.tok.tok.info(), seq_len=run.cfg.pack.seq_len, dtype=token_dtype(out.tok.tok.vocab_size),
        shards=shards, documents=docs, tokens=stats["tokens"], inputs=files, run=record, stats=stats,
        rejects="rejects.json", run_id=run_id, tails=tails, dedup=dedup, consumed=inputs, quality=quality,
        forgotten=p.manifest.forgotten if p else {}, lineage=lineage, digests=reported_digests(run, out, root)),
        lease=run.job.lease, built_on=p.manifest.version if p else None, head=head)


def reported_digests(run: Run, out: Outcome, root: str) -> dict[str, str]:
    """The SHA-256s its writers took as they wrote (the dedup index's files, the lineage file), by path in the
    dataset: the commit hashes the rest of what its manifest names."""
    reported = {relative(f, root)["path"]: f["sha256"] for segs in out.saved.segments.values() for seg in segs
                for f in seg["files"] if f.get("sha256")}
    if out.lineage:
        reported[f"_strata/{run.tag}/{LINEAGE_FILE}"] = out.lineage["sha256"]
    return reported


def window_record(run: Run, index: Index) -> dict:
    """What the manifest says of the window: its size and the versions this run compared with."""
    p = run.parent
    if index.window is None:
        return {"size": "all", "earlier_versions": p.manifest.totals.get("versions", 1) if p else 0,
                "keys_compared": index.compared}
    return {"size": run.cfg.dedup.window_size(), "versions": list(index.window), "keys_compared": index.compared}


def save_consumed(run: Run, files: list[dict], legacy: frozenset[tuple]) -> list[dict]:
    """The index of consumed inputs with this version's as a new segment (and, after a parent made before
    the index, every earlier version's), then compaction, as the dedup index does."""
    from pipelines.consumed import MOST_VERSIONS, merge, write
    from pipelines.dedup import compaction

    directory = join(run.staging, "consumed")
    make_dirs(directory)
    segments = [*consumed_segments(run.parent), {"versions": 1, "files": [
        write(join(directory, "c.parquet"), legacy | {identity(f) for f in files})]}]
    while k := compaction(segments, INDEX_FAN_IN, MOST_VERSIONS):
        merged = merge([f for seg in segments[-k:] for f in seg["files"]], join(directory, f"m{len(segments)}.parquet"))
        segments = [*segments[:-k], {"versions": sum(seg["versions"] for seg in segments[-k:]), "files": [merged]}]
    return segments


def finish(run: Run, version, out: Outcome) -> dict:
    """The run's record (cost, usage) and the summary the command prints."""
    m = version.manifest
    figures = {k: m.stats.get(k) for k in ("documents", "tokens", "bytes", "mb_per_s_per_cpu",
                                           "tokens_per_s_per_cpu", "peak_worker_rss_mb")}
    usage = run.job.usage
    figures.update(tokens_per_s=m.tokens / max(usage.ended - usage.started, 1e-9), version=m.version)
    cost = run.job.finish(beside=join(run.staging, "record.json"), work_nodes=sorted(out.tally.nodes), figures=figures)
    return {**summary(version), **cost, "units": unit_counts(run, out),
            "dedup_index_entries": max((sum(n.values()) for n in out.index.sizes), default=0),
            "dedup_keys_compared": out.index.compared}


def unit_counts(run: Run, out: Outcome | None) -> dict:
    """Work units, and how many a killed run of the same work had finished (its first pass reused;
    `by_pass`: each pass's units reused)."""
    reused = {} if out is None else {"pass1": out.read.reused, "pass2": out.packed.reused}
    by_pass = {k: n for k, n in reused.items() if n is not None}
    return {"total": len(run.units), "reused": by_pass.get("pass2" if run.fused else "pass1", 0), "by_pass": by_pass}


def empty(run: Run | None, why: str, *, dataset: str, started: float, tally: Tally | None = None,
          out: Outcome | None = None) -> dict:
    """No version: nothing new, or nothing survived. The counts still say what was read."""
    tally = tally or Tally()
    stats = table(run, started, tally, out) if run else summary_table(
        tally, time.time() - started, cpus=0, total_bytes=0, shards=0, walls={}, evaluation={}, by_source={},
        deferred={}, index_rss_mb=0.0, utilization=0.0)
    return {"dataset": dataset, "version": None, "path": None, "documents": stats["documents"],
            "reasons": accounting(tally).reasons, "tokens": 0, "sequences": 0, "shards": 0, "stats": stats,
            "run_id": "", "already_existed": False, "note": why,
            "units": unit_counts(run, out) if run else {"total": 0, "reused": 0, "by_pass": {}}}


def relative(f: dict, root: str) -> dict:
    """A segment file's entry as the manifest keeps it: its path in the dataset (its digest goes to the
    manifest's `digests`, not beside it)."""
    return {**{k: v for k, v in f.items() if k not in ("named", "sha256")},
            "path": f["path"][len(root):].strip("/").replace(os.sep, "/")}


def _run_bytes(run_dir: str) -> int:
    """The bytes of the files a version's run wrote beside its shards: dedup index, tails, lineage, records."""
    import pyarrow.fs as pafs

    fs, p = filesystem(run_dir)
    return sum(i.size for i in fs.get_file_info(pafs.FileSelector(p, allow_not_found=True, recursive=True))
               if i.type == pafs.FileType.File)


def summary(version) -> dict:
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
