"""What tier 1's work units tell the driver: one typed record per unit, merged with `+`.

A work unit's task returns one `Output` (its files, as Ray Data rows hold it) whose `tally` counts
what the unit did. The driver adds the tallies of every unit of every pass (`Tally.total`) and
builds the version's accounting and summary table from the total's fields. Each field says how it
merges (`_add` unless its metadata says otherwise), so a new figure is one line here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields

from strata.data.dataset import DOCUMENT_STATUSES, DocumentCounts
from strata.data.storage import basename

SAMPLES_PER_REASON = 3  # example records kept per reason, for rejects.json
AUDIT_PAIRS = 8  # sampled duplicate pairs per kind in a version's dedup audit


def _add(a, b):
    """Numbers add; mappings add key by key (a Counter of the two)."""
    if isinstance(a, Mapping):
        out = Counter(a)
        out.update(b)
        return dict(out)
    return a + b


def _samples(a: Mapping[str, tuple], b: Mapping[str, tuple]) -> dict[str, tuple]:
    return {k: (tuple(a.get(k, ())) + tuple(b.get(k, ())))[:SAMPLES_PER_REASON] for k in {*a, *b}}


def audit_sample(pairs: Iterable[dict]) -> tuple[dict, ...]:
    """Up to AUDIT_PAIRS pairs per kind, the same ones whatever order units finish in (lowest removed key)."""
    out = []
    for kind in ("exact", "near"):
        out += sorted((p for p in pairs if p["kind"] == kind), key=lambda p: p["removed"])[:AUDIT_PAIRS]
    return tuple(out)


def _merge(how):
    return field(default_factory=dict, metadata={"merge": how})


@dataclass(frozen=True, kw_only=True)
class Tally:
    """One unit's figures (or, added up, a run's). Splits are `train` and `validation`."""

    # Reading and cleaning (pass 1, or pass 2 fused): every record read is kept, filtered or rejected.
    kept: int = 0
    """Documents that passed cleaning and the quality filters."""
    filtered: Mapping[str, int] = field(default_factory=dict)
    """Documents filtered, by rule."""
    rejected: Mapping[str, int] = field(default_factory=dict)
    """Records that were not documents (undecodable, no text field, ...), by reason."""
    samples: Mapping[str, tuple] = _merge(_samples)
    """Up to SAMPLES_PER_REASON examples per `status:reason` ({"doc_id", "sample"})."""
    languages: Mapping[str, int] = field(default_factory=dict)
    """With --languages: documents the language rule scored, by detected language."""
    contaminated_by: Mapping[str, int] = field(default_factory=dict)
    """With --decontaminate: documents filtered as contaminated, by the evaluation file that caught them."""
    pii: Mapping[str, int] = field(default_factory=dict)
    """With --pii: replacements in the text kept, by kind (email, ip)."""
    deferred: Mapping[str, str] = _merge(lambda a, b: {**a, **b})
    """Input files left out (--unreadable defer), with why."""

    # Dedup (pass 2).
    looked_at: Mapping[str, int] = field(default_factory=dict)
    """Kept documents that dedup looked at, by input file."""
    removed: Mapping[str, int] = field(default_factory=dict)
    """Documents dedup removed, by input file."""
    duplicate: Mapping[str, int] = field(default_factory=dict)
    """Documents removed as duplicates, by kind (exact, near)."""
    removed_by_earlier_version: int = 0
    removed_by_other_dataset: int = 0
    """Documents removed because the --dedup-against dataset holds them."""
    clusters: Mapping[int, int] = field(default_factory=dict)
    """Duplicates removed per kept document key (the cluster's winner)."""
    pairs: tuple = field(default=(), metadata={"merge": lambda a, b: audit_sample(a + b)})
    """Sampled (removed, kept, kind) pairs for the audit."""

    # Tokenizing and packing (pass 2 and the tails).
    packed: int = 0
    """Documents that survived dedup and were tokenized."""
    tokens: Mapping[str, int] = field(default_factory=dict)
    rows: Mapping[str, int] = field(default_factory=dict)
    encoded_by: Mapping[str, int] = field(default_factory=dict)
    """Documents by the engine that encoded them (strata.data.tokenizer)."""
    tokenizer_checked: int = 0
    """Documents both engines encoded, to check they agree."""
    unpacked_tokens: Mapping[str, int] = field(default_factory=dict)
    """Tokens of kept documents in no row, carried into the next version."""
    padding_tokens: Mapping[str, int] = field(default_factory=dict)
    carried_in_tokens: Mapping[str, int] = field(default_factory=dict)
    unpacked_documents: int = 0
    carried_in_documents: int = 0
    carried_on_documents: int = 0

    # Cost.
    cpu_s: Mapping[str, float] = field(default_factory=dict)
    """CPU seconds by stage (read, clean, sign, dedup, tokenize, pack, write, shuffle-write, ...)."""
    busy_s: float = 0.0
    """Wall seconds the unit's worker spent on it (pass 2's utilization)."""
    peak_rss_mb: float = field(default=0.0, metadata={"merge": max})
    nodes: frozenset = field(default=frozenset(), metadata={"merge": frozenset.union})

    def __add__(self, other: Tally) -> Tally:
        return Tally(**{f.name: f.metadata.get("merge", _add)(getattr(self, f.name), getattr(other, f.name))
                        for f in fields(self)})

    @staticmethod
    def total(tallies: Iterable[Tally]) -> Tally:
        out = Tally()
        for t in tallies:
            out = out + t
        return out

    def read(self) -> int:
        return self.kept + sum(self.filtered.values()) + sum(self.rejected.values())

    def to_json(self) -> dict:
        """As JSON values: a finished unit's record (`_work/done/`), read back by a resumed run."""
        return {**asdict(self), "nodes": sorted(self.nodes), "clusters": {str(k): v for k, v in self.clusters.items()}}

    @classmethod
    def from_json(cls, d: dict) -> Tally:
        return cls(**{**d, "samples": {k: tuple(v) for k, v in d["samples"].items()}, "pairs": tuple(d["pairs"]),
                      "clusters": {int(k): v for k, v in d["clusters"].items()}, "nodes": frozenset(d["nodes"])})


@dataclass(frozen=True, kw_only=True)
class Output:
    """What one unit's task returns: the files it wrote and its tally (one Ray Data row: {"out": Output})."""

    tally: Tally
    unit_files: tuple[str, ...] = ()
    """The input files of the work unit (pass 1 and fused pass 2)."""
    docs_file: str = ""
    """Pass 1: the work file of kept documents and their dedup keys."""
    docs: int = 0
    """Pass 1: documents in docs_file."""
    packed_file: str = ""
    """Pass 2: the work file of packed rows."""
    shard: tuple = ()
    """Pass 3: (path, split, rows, tokens) of the shard written."""
    digests: tuple = ()
    """Pass 1 (or fused pass 2): (path, part, sha256) of the input files' parts the unit owns."""

    def to_json(self) -> dict:
        return {**asdict(self), "tally": self.tally.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> Output:
        return cls(**{**d, "tally": Tally.from_json(d["tally"]), "unit_files": tuple(d["unit_files"]),
                      "shard": tuple(d["shard"]), "digests": tuple(tuple(x) for x in d.get("digests", ()))})


def outputs(rows: list[dict]) -> list[Output]:
    return [r["out"] for r in rows]


def without_deferred(outs: list[Output]) -> tuple[list[Output], dict[str, str]]:
    """The outputs of work units that hold no byte range of a deferred file, and the deferred files."""
    deferred = {p: why for o in outs for p, why in o.tally.deferred.items()}
    return [o for o in outs if not set(o.unit_files) <= set(deferred)], deferred


def accounting(t: Tally) -> DocumentCounts:
    """Every document read, by status and reason: kept (packed, or carried on unpacked), filtered,
    duplicate or rejected. A total that does not balance is a bug, never bad input."""
    reasons = {**{f"filtered:{k}": v for k, v in t.filtered.items()}, **{f"rejected:{k}": v for k, v in t.rejected.items()},
               **{f"duplicate:{k}": v for k, v in t.duplicate.items() if v},
               **({"unpacked:carried": t.unpacked_documents} if t.unpacked_documents else {})}
    docs = DocumentCounts(read=t.read(), kept=t.packed - t.unpacked_documents, unpacked=t.unpacked_documents,
                          filtered=sum(t.filtered.values()), duplicate=sum(t.duplicate.values()),
                          rejected=sum(t.rejected.values()), reasons=dict(sorted(reasons.items())))
    if not docs.balanced() or t.kept != docs.kept + docs.unpacked + docs.duplicate:
        raise RuntimeError(f"document accounting does not balance: {docs}")
    return docs


SPLITS = ("train", "validation")


def summary_table(t: Tally, seconds: float, *, cpus: float, total_bytes: int, shards: int, walls: dict,
                  evaluation: dict, by_source: dict, deferred: dict, index_rss_mb: float, utilization: float,
                  quality: dict | None = None) -> dict:
    """The run's summary table, stored in the manifest and printed (`format_table`)."""
    docs = accounting(t)
    tokens = sum(t.tokens.values())
    per_split = lambda counts: {s: counts.get(s, 0) for s in SPLITS}  # noqa: E731
    return {
        "documents": {k: getattr(docs, k) for k in DOCUMENT_STATUSES},
        "filtered_by_rule": dict(t.filtered), "duplicate": {k: t.duplicate.get(k, 0) for k in ("exact", "near")},
        # Of those: the ones an earlier version (within the window) or the --dedup-against dataset holds.
        "duplicate_of": {"earlier versions": t.removed_by_earlier_version,
                         "other dataset": t.removed_by_other_dataset},
        "rejected_by_reason": dict(t.rejected), "bytes": total_bytes, "tokens": tokens,
        # Tokens of kept documents in no row: what is left of each split after every tail is packed, carried
        # into the next version (which packs it first); none with --final, which pads the last row instead.
        "tokens_unpacked": per_split(t.unpacked_tokens), "tokens_padding": per_split(t.padding_tokens),
        "carried_in": {"documents": t.carried_in_documents, "tokens": per_split(t.carried_in_tokens)},
        "carried_on": {"documents": t.carried_on_documents, "tokens": per_split(t.unpacked_tokens)},
        "rows": per_split(t.rows), "shards": shards,
        # With --languages: the documents the language rule scored, by detected language (kept or not).
        "documents_by_language": _most_first(t.languages),
        "contaminated_by_file": _most_first(t.contaminated_by),
        # With --pii: what was replaced in the text kept, by kind.
        "pii_replaced": dict(t.pii),
        # With --quality-model: the rule, its threshold, the documents it filtered, scores computed and reused.
        "quality": quality or {},
        # Per evaluation file: its records, n-grams (whole short items among them) and the documents it caught.
        "decontamination": {path: {**f, "documents": t.contaminated_by.get(path, 0)} for path, f in evaluation.items()},
        # Which engine encoded how many documents, and how many of them both engines encoded (strata.data.tokenizer).
        "documents_by_tokenizer_engine": dict(t.encoded_by), "tokenizer_checked": t.tokenizer_checked,
        "seconds": round(seconds, 2), "cpus": cpus,
        "mb_per_s_per_cpu": round(total_bytes / 1e6 / seconds / max(cpus, 1), 3),
        "tokens_per_s_per_cpu": round(tokens / seconds / max(cpus, 1)),
        "peak_worker_rss_mb": round(max(t.peak_rss_mb, index_rss_mb), 1), "peak_index_rss_mb": round(index_rss_mb, 1),
        "pack_worker_utilization": utilization, "dedup_by_source": by_source, "deferred_inputs": deferred,
        "cpu_s_by_stage": {k: round(v, 1) for k, v in sorted(t.cpu_s.items(), key=lambda kv: -kv[1])},
        # [step, seconds] in order (the manifest's JSON sorts keys)
        "wall_s_by_step": [*walls.items(), ("commit and the rest", round(max(0.0, seconds - sum(walls.values())), 2))]
        if walls else [],
    }


def _most_first(counts: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def format_table(stats: dict) -> str:
    """The summary table, for people."""
    d = stats["documents"]
    lines = [f"{'documents read':<28}{d['read']:>14,}", f"{'  kept':<28}{d['kept']:>14,}",
             f"{'  filtered':<28}{d['filtered']:>14,}"]
    lines += [f"{'    ' + k:<28}{v:>14,}" for k, v in sorted(stats["filtered_by_rule"].items())]
    lines += [f"{'  duplicate':<28}{d['duplicate']:>14,}"]
    lines += [f"{'    ' + k:<28}{v:>14,}" for k, v in stats["duplicate"].items()]
    lines += [f"{'      of ' + k:<28}{v:>14,}" for k, v in stats.get("duplicate_of", {}).items() if v]
    lines += [f"{'  rejected':<28}{d['rejected']:>14,}"]
    lines += [f"{'    ' + k:<28}{v:>14,}" for k, v in sorted(stats["rejected_by_reason"].items())]
    lines += [f"{'  unpacked (carried on)':<28}{d.get('unpacked', 0):>14,}"]
    if stats.get("pii_replaced"):
        lines += ["personal data replaced (--pii)"] + [f"{'  ' + k:<28}{v:>14,}" for k, v in stats["pii_replaced"].items()]
    if stats.get("documents_by_language"):
        lines += ["documents by language"] + [f"{'  ' + k:<28}{v:>14,}" for k, v in stats["documents_by_language"].items()]
    if q := stats.get("quality"):
        threshold = "none" if q["threshold"] is None else f"{q['threshold']:.4f}"
        lines += [f"quality: {q['rule']} under {q['model']}, threshold {threshold}",
                  f"{'  documents filtered':<28}{q['filtered']:>14,}",
                  f"{'  scores computed / reused':<28}{q['scored']:>7,} / {q['reused']:,}"]
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
