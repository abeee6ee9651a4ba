"""Tier 1 entry point: raw text files to a committed, versioned parquet dataset.

    python -m pipelines.preprocess --input DIR_OR_GLOB --dataset NAME [--json]

Reads files with Ray Data on cpu-tier nodes, decodes them tolerantly (every
document is kept, filtered or rejected with a reason), tokenizes and packs
them into rows of `seq_len + 1` ids, writes parquet shards into a staging
directory and commits them as the dataset's next version.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from strata import tiers
from strata.cli import add_config_arguments, build, finish, overrides
from strata.connect import connect
from strata.dataset import DatasetError, DocumentCounts, Shard, commit, token_dtype
from strata.runinfo import run_info
from strata.storage import Storage, check_name, filesystem, join, write_json_atomic
from strata.tokenizer import load_tokenizer


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    inputs: tuple[str, ...] = field(default=(), metadata={"flag": "--input"})
    """Input files, directories or globs (repeat the flag); .jsonl lines are documents."""
    dataset: str = ""
    """Dataset name under $STRATA_STORAGE/datasets."""
    tokenizer: str = "bytes"
    """Tokenizer spec: `bytes` (byte-level, 257 ids)."""
    seq_len: int = 128
    """Tokens a model sees per row; rows hold seq_len + 1 ids (inputs and shifted targets)."""
    validation_fraction: float = 0.05
    """Fraction of documents held out for validation, chosen by a stable hash."""
    min_chars: int = 16
    """Documents shorter than this after cleaning are filtered as too-short."""
    max_chars: int = 10_000_000
    """Documents longer than this are filtered as too-long."""
    text_field: str = "text"
    """The field that holds the text in .jsonl inputs."""
    docs_per_batch: int = 512
    """Documents packed together; each batch drops its last partial row."""
    seed: int = 0
    """Seed of the train/validation split."""

    def __post_init__(self):
        if not self.inputs:
            raise ValueError("give at least one --input")
        check_name(self.dataset, "dataset name")
        load_tokenizer(self.tokenizer)
        if self.seq_len < 1 or self.docs_per_batch < 1 or self.min_chars < 0:
            raise ValueError("seq_len and docs_per_batch must be >= 1, min_chars >= 0")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError("validation_fraction must be in [0, 1)")


def debug(**kw) -> PreprocessConfig:
    """Short rows, small batches: a laptop CPU in seconds."""
    return PreprocessConfig(**{"seq_len": 128, "docs_per_batch": 256, **kw})


def gpt2(**kw) -> PreprocessConfig:
    """GPT-2 length rows."""
    return PreprocessConfig(**{"seq_len": 1024, "docs_per_batch": 2048, **kw})


PRESETS = {"debug": debug, "gpt2": gpt2}


def _pool_size() -> int:
    """Tokenizer actors: the cpu tier's CPUs less one, so read tasks always get a CPU."""
    import ray

    cpus = sum(n["Resources"].get("CPU", 0) for n in ray.nodes()
               if n["Alive"] and tiers.Tier.CPU in tiers.tiers_of(n.get("Labels", {})))
    return max(1, int(cpus) - 1)


def run(cfg: PreprocessConfig, storage: Storage) -> dict:
    """Run the pipeline and commit a version; returns the summary."""
    import ray

    from pipelines.pack import PackAndWrite
    from pipelines.sources import decode_file, list_inputs

    started = time.time()
    files = list_inputs(list(cfg.inputs))
    print(f"[preprocess] {len(files)} input files, {sum(f['size'] for f in files) / 1e6:.1f} MB", file=sys.stderr)
    print(f"[preprocess] {connect()}", file=sys.stderr)
    tok = load_tokenizer(cfg.tokenizer)
    staging = storage.staging(cfg.dataset)
    fs, staging_path = filesystem(staging)
    fs.create_dir(staging_path)
    record = run_info("preprocess", cfg)
    write_json_atomic(join(staging, "run.json"), record)

    try:
        on_cpu = tiers.selector(tiers.Tier.CPU)
        ds = ray.data.read_binary_files([f["path"] for f in files], include_paths=True,
                                        override_num_blocks=min(len(files), 200), label_selector=on_cpu)
        docs = ds.flat_map(functools.partial(decode_file, text_field=cfg.text_field,
                                             min_chars=cfg.min_chars, max_chars=cfg.max_chars),
                           label_selector=on_cpu)
        stats = docs.map_batches(
            PackAndWrite, batch_size=cfg.docs_per_batch, batch_format="numpy",
            fn_constructor_kwargs=dict(staging=staging, tokenizer=cfg.tokenizer, seq_len=cfg.seq_len,
                                       validation_fraction=cfg.validation_fraction, seed=cfg.seed),
            compute=ray.data.ActorPoolStrategy(min_size=1, max_size=_pool_size()),
            label_selector=on_cpu,
        ).take_all()

        counts = DocumentCounts()
        reasons: Counter = Counter()
        shards, nodes, tokens, dropped = [], set(), 0, 0
        for s in stats:
            counts.read += s["read"]
            counts.kept += s["kept"]
            counts.filtered += s["filtered"]
            counts.rejected += s["rejected"]
            reasons.update(json.loads(s["reasons"]))
            shards += [Shard(**sh) for sh in json.loads(s["shards"])]
            nodes.update(json.loads(s["nodes"]))
            tokens += s["tokens"]
            dropped += s["tokens_dropped"]
        counts.reasons = dict(sorted(reasons.items()))
        if not counts.balanced():  # a bug, never bad input: refuse to publish miscounted data
            raise RuntimeError(f"document accounting does not balance: {counts}")
        if not shards:
            raise SystemExit(f"no training rows: {counts.kept} of {counts.read} documents kept, "
                             f"{tokens} tokens, fewer than one row of {cfg.seq_len + 1} per batch")
        record.update(finished_at=time.time(), work_nodes=sorted(nodes), tokens_dropped=dropped)
        version = commit(storage, cfg.dataset, staging, dict(
            tokenizer=tok.info(), seq_len=cfg.seq_len, dtype=token_dtype(tok.vocab_size),
            shards=sorted(shards, key=lambda s: s.path), documents=counts, tokens=tokens,
            inputs=files, run=record))
    except BaseException:
        fs.delete_dir(staging_path)  # a failed run leaves no staging behind
        raise
    m = version.manifest
    return {
        "dataset": m.dataset, "version": m.version, "path": version.path,
        "documents": {k: getattr(counts, k) for k in ("read", "kept", "filtered", "duplicate", "rejected")},
        "reasons": counts.reasons, "tokens": tokens,
        "sequences": sum(s.rows for s in shards), "shards": len(shards),
        "seconds": round(time.time() - started, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m pipelines.preprocess", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="debug", choices=sorted(PRESETS), help="config preset (default: debug)")
    parser.add_argument("--storage", help="storage root (default: $STRATA_STORAGE or ~/strata-data)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary as the last line of stdout")
    add_config_arguments(parser, PreprocessConfig)
    args = parser.parse_args(argv)
    try:
        cfg = build(PRESETS, args.preset, **overrides(args, PreprocessConfig))
    except ValueError as e:
        parser.error(str(e))
    try:
        summary = run(cfg, Storage.from_env(args.storage))
    except (FileNotFoundError, DatasetError) as e:
        sys.exit(f"error: {e}")
    d = summary["documents"]
    print(f"[preprocess] committed {summary['dataset']}@{summary['version']} at {summary['path']}\n"
          f"[preprocess] documents: {d['read']} read = {d['kept']} kept + {d['filtered']} filtered + "
          f"{d['duplicate']} duplicate + {d['rejected']} rejected {summary['reasons'] or ''}\n"
          f"[preprocess] {summary['tokens']:,} tokens -> {summary['sequences']:,} rows in "
          f"{summary['shards']} shards ({summary['seconds']} s)", file=sys.stderr)
    return finish(summary, args.json)


if __name__ == "__main__":
    main()
