"""Filtering by a reference model's score (`--quality-model`): tier 1 reaches the model through `infer`.

A run with `--quality-model RUN[@STEP]|DIR` scores every document pass 1 kept under that model, with
infer's scoring actors on the cpu tier (`infer.score`: the document tokenized with the model's
tokenizer and scored whole, in windows of its context). Then `--keep 'bpb<=X'` keeps the documents
whose score passes the threshold, or `--keep-fraction F` the best-scored share F of this run's
documents (lowest bits per byte); pass 2 counts the others `filtered:quality`. The threshold, and what
it kept, go in the version's summary (`quality`).

Scores are cached with the dataset, keyed by the document's exact key (its text up to case and
whitespace, pipelines/dedup.py) under the model's weights (a digest of them): the next version scored
with the same model reuses the score of every document it meets again, and a killed run's rerun reuses
what it scored. The cache is a sorted parquet file per version (`_strata/<tag>/quality/`): the newest
`--dedup-window` of them, so what a run reads stays flat as history grows (with `--dedup-window all`,
merged into one when they pass QUALITY_SEGMENTS).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from strata.commands.cli import NON_NEGATIVE, check_fields
from strata.commands.shell import log as _logger
from strata.data.storage import exists, filesystem, join, make_dirs

_say = _logger("preprocess").info
_warn = _logger("preprocess").warning

QUALITY_SEGMENTS = 8  # cache files carried from version to version before they are merged into one
_KEEP = re.compile(r"^\s*(bpb|loss)\s*(<=|<|>=|>)\s*([-+0-9.eE]+)\s*$")
_OPS = {"<=": np.less_equal, "<": np.less, ">=": np.greater_equal, ">": np.greater}
SCHEMA = pa.schema([("key", pa.int64()), ("tokens", pa.int64()), ("loss", pa.float64()), ("bpb", pa.float64())])


@dataclass(frozen=True, kw_only=True)
class QualityConfig:
    quality_model: str = ""
    """A reference model (RUN[@STEP], or an exported model directory) whose scores filter documents, with
    --keep or --keep-fraction."""
    keep: str = ""
    """With --quality-model: the documents to keep, `bpb<=X` or `loss<=X` (also <, >=, >); lower scores are
    text more like the reference model's data."""
    keep_fraction: float = 0.0
    """With --quality-model: keep this share of the run's documents, the best scored (lowest bits per byte)."""
    quality_actors: int = 0
    """Scoring actors (0: one per cpu-tier CPU but one)."""

    def __post_init__(self):
        check_fields(self, {"quality_actors": NON_NEGATIVE})
        if self.quality_model and bool(self.keep) == bool(self.keep_fraction):
            raise ValueError("--quality-model needs one of --keep 'bpb<=X' and --keep-fraction F")
        if not self.quality_model and (self.keep or self.keep_fraction):
            raise ValueError("--keep and --keep-fraction need --quality-model RUN")
        if self.keep:
            parse_keep(self.keep)
        if not 0.0 <= self.keep_fraction <= 1.0:
            raise ValueError("--keep-fraction must be in (0, 1]")

    def rule(self) -> str:
        return self.keep.replace(" ", "") if self.keep else f"best {self.keep_fraction:g} by bpb"


def parse_keep(keep: str) -> tuple[str, str, float]:
    """`bpb<=1.5` as (metric, operator, value)."""
    if not (m := _KEEP.match(keep)):
        raise ValueError(f"--keep {keep!r}: write METRIC OP VALUE, e.g. 'bpb<=1.5' (metric bpb or loss; "
                         "op <=, <, >= or >)")
    try:
        value = float(m.group(3))
    except ValueError:
        raise ValueError(f"--keep {keep!r}: {m.group(3)!r} is not a number") from None
    return m.group(1), m.group(2), value


@dataclass
class Decision:
    """What the scores decided: the keys of the documents to drop (sorted, int64) and the figures."""

    drop: np.ndarray
    figures: dict
    state: dict
    """The manifest's `quality`: the model and the cache files (paths whole; the commit makes them relative)."""


def model_id(weights: dict[str, np.ndarray]) -> str:
    """A digest of a model's weights: the cache's key for the model."""
    import hashlib

    h = hashlib.blake2b(digest_size=12)
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    return h.hexdigest()


def read_scores(paths: list[str], checked: dict[str, bytes] | None = None) -> pa.Table:
    """The cache files as one table sorted by key (`checked`: the bytes of those already read and checked
    against their digests, parsed as they are: nothing is read twice)."""
    tables = []
    for path in paths:
        if checked and path in checked:
            tables.append(pq.read_table(pa.BufferReader(checked[path]), schema=SCHEMA))
            continue
        fs, p = filesystem(path)
        tables.append(pq.read_table(p, filesystem=fs, schema=SCHEMA))
    return pa.concat_tables(tables).sort_by("key") if tables else SCHEMA.empty_table()


def digest(path: str) -> str:
    """SHA-256 of a cache file: the manifest keeps it, and a file that does not match is not used."""
    import hashlib

    from strata.data.storage import read_bytes

    return hashlib.sha256(read_bytes(path)).hexdigest()


def _checked_cache(parent: dict) -> dict[str, bytes]:
    """The parent's cache files that match the digests its manifest keeps, with their checked bytes. A cache is
    only a cache: a file that was changed, cannot be read, or has no digest (a version made before digests) is
    left out with a warning, and its documents are scored again."""
    import hashlib

    from strata.data.storage import read_bytes

    scores, digests = list(parent.get("scores") or []), parent.get("digests")
    if not isinstance(digests, list) or len(digests) != len(scores):
        if scores:
            _warn(f"quality: the score cache of {len(scores)} file(s) has no digests in its manifest (made before "
                  "2026-12-04); its documents are scored again")
        return {}
    kept = {}
    for path, want in zip(scores, digests, strict=True):
        try:
            data = read_bytes(path)
        except OSError as e:
            _warn(f"quality: score cache file {path} cannot be read ({e}); its documents are scored again")
            continue
        if hashlib.sha256(data).hexdigest() == want:
            kept[path] = data
        else:
            _warn(f"quality: score cache file {path} does not match the digest in its manifest (changed since it "
                  "was written); its documents are scored again")
    return kept


def _read_or_none(path: str) -> pa.Table:
    """A killed run's own score file, or an empty table (with a warning) when it does not read."""
    try:
        return read_scores([path])
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a damaged file vary; it is only a cache
        _warn(f"quality: score cache file {path} does not read ({type(e).__name__}); its documents are scored again")
        return SCHEMA.empty_table()


def write_scores(path: str, table: pa.Table) -> str:
    fs, p = filesystem(path)
    pq.write_table(table.cast(SCHEMA).sort_by("key"), p, filesystem=fs)
    return path


def _documents(batch: dict, *, cached: dict) -> pa.Table:
    """One docs work file's documents, one row per distinct exact key (pass 1's) with its `count`; `skip` when
    the cache holds its score (then without its text)."""
    import ray

    fs, path = filesystem(str(batch["docs_file"][0]))
    table = pq.read_table(fs.open_input_file(path), columns=["exact", "text"])
    texts = table.column("text").to_pylist()
    keys = table.column("exact").to_numpy().view(np.int64)
    unique, first, count = np.unique(keys, return_index=True, return_counts=True)
    skip = np.isin(unique, ray.get(cached["ref"]))
    return pa.table({"key": unique, "count": count, "skip": skip,
                     "text": pa.array(["" if s else texts[i] for i, s in zip(first, skip, strict=True)],
                                      pa.large_string())})


def score(cfg: QualityConfig, model, docs_files: list[str], *, parent: dict | None,
          out_dir: str, cpus: float, window: int | None = None) -> Decision:
    """Score the documents of `docs_files` (pass 1's work files) under `model` (infer.model.Model), reusing
    the cache that `parent` (the parent version's `quality`, paths whole) holds for the same model and
    what a killed run of the same work scored (`out_dir`), and decide which to drop.

    The cache is a file per version that scored something: the scores it added. With a `window` (the
    dedup window, in versions) it keeps the newest `window` files, so what a run reads of it is bounded;
    without one, files are merged once there are more than QUALITY_SEGMENTS."""
    import ray

    from infer.score import scoring
    from strata.cluster import tiers

    started = time.time()
    mid = model_id(model.weights)
    checked = _checked_cache(parent) if parent and parent.get("model_id") == mid else {}
    carried = list(checked)
    known = dict(zip(parent.get("scores") or [], parent.get("digests") or [], strict=False)) if parent else {}
    mine = join(out_dir, "scores.parquet")
    had = exists(mine)
    before = _read_or_none(mine) if had else SCHEMA.empty_table()  # what a killed run of this work scored
    had = had and before.num_rows > 0
    cache = pa.concat_tables([read_scores(carried, checked), before])
    cache_keys = cache.column("key").to_numpy()
    actors = cfg.quality_actors or max(1, int(cpus) - 1)
    stride = max(1, model.cfg.seq_len // 2)
    _say(f"quality: scoring documents under {model.source} ({actors} actor(s); {len(cache_keys):,} scores cached)")
    ds = ray.data.from_items([{"docs_file": f} for f in docs_files], override_num_blocks=max(1, len(docs_files)))
    ds = ds.map_batches(_documents, batch_size=1, batch_format="numpy", label_selector=tiers.selector(tiers.Tier.CPU),
                        fn_kwargs={"cached": {"ref": ray.put(cache_keys)}})
    ds = scoring(ds, model, tier=tiers.Tier.CPU, actors=actors, stride=stride, batch_tokens=0, docs_per_batch=64)
    parts = [b for b in ds.select_columns(["key", "count", "skip", "tokens", "loss", "bpb", "unscored"])
             .iter_batches(batch_format="pyarrow", batch_size=None)]
    rows = pa.concat_tables(parts) if parts else pa.table({})
    new_scores = _distinct(rows.filter(pc.equal(rows.column("unscored"), ""))) if rows.num_rows else SCHEMA.empty_table()
    if new_scores.num_rows:
        make_dirs(out_dir)
        # Before the decision: a rerun of this work reuses it.
        write_scores(mine, pa.concat_tables([before, new_scores]))
    decision = _decide(cfg, rows, pa.concat_tables([cache, new_scores]).sort_by("key"))
    files = carried + ([mine] if new_scores.num_rows or had else [])
    if window is not None:
        files = files[-window:]
    elif len(files) > QUALITY_SEGMENTS:
        make_dirs(out_dir)
        files = [write_scores(join(out_dir, "scores-merged.parquet"), read_scores(files, checked))]
    seconds = time.time() - started
    tokens = int(np.sum(new_scores.column("tokens").to_numpy())) if new_scores.num_rows else 0
    decision.figures.update(model=model.source, model_id=mid, scored=new_scores.num_rows,
                            reused=int(np.sum(rows.column("skip").to_numpy())) if rows.num_rows else 0,
                            tokens_scored=tokens, seconds=round(seconds, 2),
                            tokens_per_s=round(tokens / max(seconds, 1e-9), 1))
    decision.state = {"model": model.source, "model_id": mid, "scores": files, "digests": [known.get(f) or digest(f) for f in files]}
    _say(f"quality: {decision.figures['documents']:,} documents, {decision.figures['scored']:,} scored and "
         f"{decision.figures['reused']:,} reused; {decision.figures['filtered']:,} fail {cfg.rule()} "
         f"(threshold {_number(decision.figures['threshold'])})")
    return decision


def _number(v: float | None) -> str:
    return "none" if v is None else f"{v:.4g}"


def _distinct(scored: pa.Table) -> pa.Table:
    """Newly scored rows, one per key (a document met in two work files was scored in each)."""
    _, first = np.unique(scored.column("key").to_numpy(), return_index=True)
    return scored.take(pa.array(first)).select(SCHEMA.names).cast(SCHEMA)


def _decide(cfg: QualityConfig, rows: pa.Table, scores: pa.Table) -> Decision:
    """Which of the run's documents (`rows`: a key and its count per file) to drop under the rule."""
    if not rows.num_rows:
        return Decision(np.zeros(0, np.int64), {"rule": cfg.rule(), "documents": 0, "filtered": 0, "unscored": 0,
                                                "threshold": None}, {})
    keys, counts = rows.column("key").to_numpy(), rows.column("count").to_numpy()
    metric, op, value = parse_keep(cfg.keep) if cfg.keep else ("bpb", "<=", math.nan)
    known = scores.column("key").to_numpy()
    at = np.clip(np.searchsorted(known, keys), 0, max(0, len(known) - 1))
    found = (known[at] == keys) if len(known) else np.zeros(len(keys), bool)
    values = np.where(found, scores.column(metric).to_numpy()[at] if len(known) else np.nan, np.nan)
    scored = ~np.isnan(values)  # a document the model could not score (no text) is kept
    if cfg.keep_fraction:
        order = np.argsort(values[scored], kind="stable")
        weights = np.cumsum(counts[scored][order])
        want = math.ceil(cfg.keep_fraction * weights[-1]) if len(weights) else 0
        value = float(values[scored][order][np.searchsorted(weights, max(want, 1))]) if len(weights) else math.nan
    fails = scored & ~_OPS[op](values, value)
    drop = np.unique(keys[fails])
    filtered = int(counts[fails].sum())
    return Decision(drop, {"rule": cfg.rule(), "metric": metric, "threshold": None if math.isnan(value) else value,
                           "documents": int(counts.sum()), "filtered": filtered,
                           "kept_share": round(1 - filtered / max(1, int(counts[scored].sum())), 6),
                           "unscored": int(counts[~scored].sum())}, {})
