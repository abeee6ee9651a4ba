"""Tier 1 entry point: raw text to a committed, versioned parquet dataset.

    python -m pipelines.preprocess --input PATH_GLOB_OR_URI [--input ...] --dataset NAME [--json]

Three Ray Data passes on cpu-tier nodes (see pipelines/pack.py): read, clean,
filter and sign every record; drop exact and near duplicates (across the
whole input and earlier versions), tokenize and pack; shuffle rows into
shards. Every record is kept, filtered, duplicate or rejected with a reason;
the version is published only when complete.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from pipelines.clean import WEB, CleanConfig
from pipelines.dedup import DedupConfig, suggested_shards
from pipelines.sources import ReadConfig, list_inputs, plan_units
from strata import tiers
from strata.cli import add_config_arguments, finish, overrides
from strata.connect import connect
from strata.dataset import (
    DatasetError,
    DocumentCounts,
    Shard,
    commit,
    list_versions,
    resolve,
    token_dtype,
)
from strata.runinfo import run_info
from strata.storage import Storage, check_name, filesystem, join, write_json_atomic
from strata.tokenizer import TOKENIZER_FILE, check_spec


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    tokenizer: str = "bytes"
    """`bytes`, a path to a Hugging Face tokenizer.json, or train:VOCAB (byte-level BPE trained on the corpus)."""
    eot_token: str = ""
    """End-of-text token of a tokenizer.json (default: the first of <|endoftext|>, </s>, ...)."""
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

    def __post_init__(self):
        check_spec(self.tokenizer)
        if self.seq_len < 1 or self.shard_bytes < 1:
            raise ValueError("seq_len and shard_bytes must be >= 1")
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


def _tier_cpus() -> float:
    import ray

    return sum(n["Resources"].get("CPU", 0) for n in ray.nodes()
               if n["Alive"] and tiers.Tier.CPU in tiers.tiers_of(n.get("Labels", {})))


def _prior_state(storage: Storage, cfg: PreprocessConfig) -> dict[str, list[str]]:
    """Dedup state files of earlier versions with comparable parameters."""
    files = {"exact": [], "band": []}
    if not cfg.dedup.against_previous:
        return files
    for version in list_versions(storage, cfg.dataset):
        v = resolve(storage, f"{cfg.dataset}@{version}")
        state = v.manifest.dedup
        for table in files:
            if table == "band" and state.get("params") != cfg.dedup.params():
                continue  # different shingles/bands: signatures are not comparable
            files[table] += [join(v.path, p) for p in state.get("files", {}).get(table, [])]
    return files


def run(cfg: PreprocessConfig, storage: Storage) -> dict:
    """Run the three passes and commit a version; returns the summary."""
    import ray

    from pipelines.dedup import DedupIndex
    from pipelines.pack import DedupTokenizePack, assign_shard, read_clean_sign, write_shard

    started = time.time()
    files = list_inputs(list(cfg.read.inputs))
    units = plan_units(files, cfg.read)
    total_bytes = sum(f["size"] for f in files)
    _log(f"{len(files)} input files, {total_bytes / 1e6:.1f} MB in {len(units)} work units")
    _log(connect())
    on_cpu = tiers.selector(tiers.Tier.CPU)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.label_selector = on_cpu  # every task and actor, shuffles included
    cpus = _tier_cpus()
    if not cpus:
        raise DatasetError(f"no alive node serves the cpu tier (label {tiers.label_key(tiers.Tier.CPU)}=true)")

    staging = storage.staging(cfg.dataset)
    work = join(staging, "_work")
    fs, staging_path = filesystem(staging)
    for sub in ("docs", "packed", "dedup"):
        fs.create_dir(filesystem(join(work if sub != "dedup" else staging, sub))[1])
    record = run_info("preprocess", cfg)
    write_json_atomic(join(staging, "run.json"), record)
    n_index = cfg.dedup.index_shards or suggested_shards(cpus)
    index = [ray.remote(DedupIndex).options(num_cpus=0, label_selector=on_cpu, max_restarts=0).remote()
             for _ in range(n_index)]
    try:
        prior = _prior_state(storage, cfg)
        ray.get([i.load.remote(t, prior[t], s, n_index) for s, i in enumerate(index) for t in prior if prior[t]])
        stats = _run_passes(cfg, ray, units, work, staging, index, cpus, read_clean_sign, DedupTokenizePack,
                            assign_shard, write_shard)
        dedup_files = {t: [] for t in ("exact", "band")}
        for t, on in (("exact", cfg.dedup.exact_dedup), ("band", cfg.dedup.near_dedup)):
            if on:
                for s, i in enumerate(index):
                    name = f"dedup/{t}-{s:04d}.parquet"
                    ray.get(i.save.remote(t, join(staging, name)))
                    dedup_files[t].append(name)
        fs.delete_dir(filesystem(work)[1])
        version = _commit(cfg, storage, staging, files, record, stats, dedup_files, started, cpus, total_bytes)
    except BaseException:
        fs.delete_dir(staging_path)  # a failed run leaves no staging behind
        raise
    finally:
        for i in index:
            ray.kill(i)
    return _summary(version, stats)


def _run_passes(cfg, ray, units, work, staging, index, cpus, read_clean_sign, DedupTokenizePack,
                assign_shard, write_shard) -> dict:
    on_cpu = tiers.selector(tiers.Tier.CPU)
    # Pass 1: read, clean, filter, register dedup keys; one work file of documents per unit.
    _log("pass 1/3: read, clean, filter, sign")
    units_ds = ray.data.from_items([{"unit": json.dumps(u)} for u in units], override_num_blocks=len(units))
    p1 = units_ds.map_batches(
        read_clean_sign, batch_size=1, label_selector=on_cpu,
        fn_kwargs=dict(read=asdict(cfg.read), clean=asdict(cfg.clean), dedup=asdict(cfg.dedup),
                       work_dir=work, index=index)).take_all()
    counts, samples = Counter(), {}
    for row in p1:
        counts.update(json.loads(row["counts"]))
        for k, v in json.loads(row["samples"]).items():
            samples.setdefault(k, []).extend(v[: 3 - len(samples.get(k, []))])
    sizes = ray.get([i.finalize.remote() for i in index])
    docs_files = sorted(r["docs_file"] for r in p1 if r["docs"])

    definition = None
    if cfg.pack.tokenizer.startswith("train:"):
        _log(f"training a byte-level BPE tokenizer ({cfg.pack.tokenizer})")
        definition = ray.get(ray.remote(_train_tokenizer).options(label_selector=on_cpu).remote(
            [join(work, "docs", f) for f in docs_files], int(cfg.pack.tokenizer.partition(":")[2]),
            cfg.pack.tokenizer_sample_bytes))
    elif cfg.pack.tokenizer != "bytes":
        from strata.tokenizer import HFTokenizer

        definition = HFTokenizer.from_file(cfg.pack.tokenizer, cfg.pack.eot_token).definition

    # Pass 2: drop duplicates, tokenize, pack; one work file of rows per document file.
    _log("pass 2/3: deduplicate, tokenize, pack")
    p2 = []
    if docs_files:
        p2 = ray.data.from_items([{"docs_file": f} for f in docs_files], override_num_blocks=len(docs_files)) \
            .map_batches(DedupTokenizePack, batch_size=1, label_selector=on_cpu,
                         compute=ray.data.ActorPoolStrategy(min_size=1, max_size=max(1, int(cpus) - 1)),
                         fn_constructor_kwargs=dict(
                             tokenizer=cfg.pack.tokenizer, eot_token=cfg.pack.eot_token, definition=definition,
                             seq_len=cfg.pack.seq_len, validation_fraction=cfg.pack.validation_fraction,
                             seed=cfg.pack.seed, split_seed=cfg.pack.split_seed, dedup=asdict(cfg.dedup), work_dir=work, index=index)).take_all()
    packed = Counter()
    for row in p2:
        packed.update(json.loads(row["stats"]))
        for k, v in json.loads(row["samples"]).items():
            samples.setdefault(k, []).extend(v[: 3 - len(samples.get(k, []))])

    # Pass 3: a global, seeded shuffle of rows into shards of about shard_bytes.
    _log("pass 3/3: shuffle rows into shards")
    from strata.tokenizer import ByteTokenizer, HFTokenizer

    tok = HFTokenizer(definition, cfg.pack.eot_token if not cfg.pack.tokenizer.startswith("train:") else "") \
        if definition else ByteTokenizer()
    row_bytes = (cfg.pack.seq_len + 1) * {"uint8": 1, "uint16": 2, "uint32": 4}[token_dtype(tok.vocab_size)]
    per_shard = max(1, cfg.pack.shard_bytes // row_bytes)
    shards_per_split = {sid: max(1, math.ceil(packed.get(f"rows:{split}", 0) / per_shard))
                        for split, sid in (("train", 0), ("validation", 1))}
    shards = []
    packed_files = [join(work, "packed", r["packed_file"]) for r in p2]
    if packed.get("rows:train", 0) + packed.get("rows:validation", 0):
        rows = ray.data.read_parquet([filesystem(p)[1] for p in packed_files],
                                     filesystem=filesystem(packed_files[0])[0], label_selector=on_cpu)
        shards = rows.map_batches(assign_shard, batch_format="pyarrow", fn_kwargs={"shards": shards_per_split},
                                  label_selector=on_cpu) \
            .groupby("group", num_partitions=sum(shards_per_split.values())).map_groups(write_shard, batch_format="pyarrow", fn_kwargs={"staging": staging},
                                         label_selector=on_cpu).take_all()
    return {"counts": counts, "packed": packed, "samples": samples, "index": sizes, "tokenizer": tok,
            "definition": definition, "shards": shards, "nodes": sorted({r["node"] for r in p1 + p2 + shards})}


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


def _commit(cfg, storage, staging, files, record, stats, dedup_files, started, cpus, total_bytes):
    counts, packed = stats["counts"], stats["packed"]
    docs = DocumentCounts(
        read=sum(counts.values()), kept=packed.get("kept", 0),
        filtered=sum(v for k, v in counts.items() if k.startswith("filtered:")),
        duplicate=packed.get("duplicate:exact", 0) + packed.get("duplicate:near", 0),
        rejected=sum(v for k, v in counts.items() if k.startswith("rejected:")),
        reasons=dict(sorted({**{k: v for k, v in counts.items() if k != "kept"},
                             **{k: v for k, v in packed.items() if k.startswith("duplicate:") and v}}.items())))
    if not docs.balanced() or counts.get("kept", 0) != docs.kept + docs.duplicate:
        raise RuntimeError(f"document accounting does not balance: {docs}")  # a bug, never bad input
    shards = sorted((Shard(path=s["path"], split=s["split"], rows=s["rows"], tokens=s["tokens"])
                     for s in stats["shards"]), key=lambda s: s.path)
    if not shards:
        raise DatasetError(f"no training rows: {docs.kept} of {docs.read} documents kept "
                           f"({docs.reasons}); nothing to publish")
    tok = stats["tokenizer"]
    if stats["definition"]:
        fs, p = filesystem(join(staging, TOKENIZER_FILE))
        with fs.open_output_stream(p) as f:
            f.write(stats["definition"].encode())
    seconds = time.time() - started
    tokens = packed.get("tokens:train", 0) + packed.get("tokens:validation", 0)
    table = {
        "documents": {k: getattr(docs, k) for k in ("read", "kept", "filtered", "duplicate", "rejected")},
        "filtered_by_rule": {k.split(":", 1)[1]: v for k, v in docs.reasons.items() if k.startswith("filtered:")},
        "duplicate": {"exact": packed.get("duplicate:exact", 0), "near": packed.get("duplicate:near", 0)},
        "rejected_by_reason": {k.split(":", 1)[1]: v for k, v in docs.reasons.items() if k.startswith("rejected:")},
        "bytes": total_bytes, "tokens": tokens, "tokens_dropped": packed.get("tokens_dropped", 0),
        "rows": {s: packed.get(f"rows:{s}", 0) for s in ("train", "validation")}, "shards": len(shards),
        "seconds": round(seconds, 2), "cpus": cpus,
        "mb_per_s_per_cpu": round(total_bytes / 1e6 / seconds / cpus, 3),
        "tokens_per_s_per_cpu": round(tokens / seconds / cpus),
    }
    write_json_atomic(join(staging, "rejects.json"), {"counts": docs.reasons, "samples": stats["samples"]})
    record.update(finished_at=time.time(), work_nodes=stats["nodes"])
    return commit(storage, cfg.dataset, staging, dict(
        tokenizer=tok.info(), seq_len=cfg.pack.seq_len, dtype=token_dtype(tok.vocab_size), shards=shards,
        documents=docs, tokens=tokens, inputs=files, run=record, stats=table, rejects="rejects.json",
        dedup={"params": cfg.dedup.params(), "files": dedup_files, "index_entries": stats["index"]}))


def _summary(version, stats) -> dict:
    m = version.manifest
    return {"dataset": m.dataset, "version": m.version, "path": version.path,
            "documents": m.stats["documents"], "reasons": m.documents.reasons, "tokens": m.tokens,
            "sequences": sum(s.rows for s in m.shards), "shards": len(m.shards), "stats": m.stats}


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
    lines += [f"{'input MB':<28}{stats['bytes'] / 1e6:>14,.1f}", f"{'tokens':<28}{stats['tokens']:>14,}",
              f"{'rows (train / validation)':<28}{stats['rows']['train']:>7,} / {stats['rows']['validation']:,}",
              f"{'shards':<28}{stats['shards']:>14,}", f"{'seconds':<28}{stats['seconds']:>14,.1f}",
              f"{'MB/s per CPU':<28}{stats['mb_per_s_per_cpu']:>14,.3f}",
              f"{'tokens/s per CPU':<28}{stats['tokens_per_s_per_cpu']:>14,}"]
    return "\n".join(lines)


def _log(msg: str) -> None:
    print(f"[preprocess] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m pipelines.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", required=True, help="dataset name under $STRATA_STORAGE/datasets")
    parser.add_argument("--preset", default="debug", choices=sorted(PRESETS), help="config preset (default: debug)")
    parser.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    for cls in STAGES.values():
        add_config_arguments(parser, cls)
    args = parser.parse_args(argv)
    try:
        cfg = PRESETS[args.preset](args.dataset, **{n: overrides(args, c) for n, c in STAGES.items()})
    except ValueError as e:
        parser.error(str(e))
    try:
        summary = run(cfg, Storage.from_env(args.storage))
    except (FileNotFoundError, DatasetError, ValueError) as e:
        sys.exit(f"error: {e}")
    _log(f"committed {summary['dataset']}@{summary['version']} at {summary['path']}\n{format_table(summary['stats'])}")
    return finish(summary, args.json)


if __name__ == "__main__":
    main()
