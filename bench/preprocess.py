"""Tier-1 throughput: the Ray Data pipeline against a hand-written multiprocessing baseline.

    python -m bench.preprocess [--mb 200] [--memory-gb 1] [--workdir DIR]

Both read the same generated JSONL corpus on the same cores, decode it, tokenize
it with the same BPE tokenizer.json (one process/actor per core, tokenizer
loaded once each) and pack documents into rows of seq_len + 1 ids written as
parquet. The baseline is a plain `multiprocessing.Pool` over files with
batched `encode_batch` and numpy packing. The pipeline runs with dedup off
(the baseline does none) but keeps everything else: accounting, cleaning, the
global seeded shuffle into shards and the atomic commit. It prints both
throughputs, MB/s per core, and the ratio pipeline/baseline as the last line.

With --memory-gb N it also runs the pipeline alone on an N GB corpus and
reports the peak resident memory of any worker process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing import Pool

import numpy as np

from strata.cluster.procs import processes, tree

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process or actor, in both systems

SEQ_LEN = 1024
VOCAB = 8192


def generate(root: str, mb: int, seed: int = 0) -> list[str]:
    """JSONL files of Zipf-distributed pseudo-words, ~32 MB each; reused if already there."""
    os.makedirs(root, exist_ok=True)
    done = os.path.join(root, f".done-{mb}")
    paths = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".jsonl"))
    if os.path.exists(done):
        return paths
    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "or", "is", "ve", "du", "ga", "th"]
    vocab = np.array(["".join(rng.choice(syllables, rng.integers(1, 4))) for _ in range(20000)])
    target, written, i = mb << 20, 0, 0
    while written < target:
        path = os.path.join(root, f"part-{i:04d}.jsonl")
        with open(path, "w") as f:
            size = 0
            while size < min(32 << 20, target - written):
                words = vocab[np.minimum(rng.zipf(1.2, rng.integers(150, 1500)), len(vocab)) - 1]
                line = json.dumps({"text": " ".join(words) + "."}) + "\n"
                f.write(line)
                size += len(line)
        written += size
        i += 1
    open(done, "w").close()
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".jsonl"))


class CpuSampler:
    """CPU seconds used by this process and all its descendants, by role (psutil, sampled every 0.2 s).

    Ray's own processes (raylet, GCS, dashboard, Ray Data's stats and
    autoscaling actors) share the cores with the work; this shows how much.
    A process that exits between two samples loses at most 0.2 s.
    """

    def __init__(self):
        self.seen: dict[int, tuple[str, float]] = {}
        self.start: dict[int, float] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self) -> None:
        procs = processes()
        for pid in tree(os.getpid(), procs):
            p = procs[pid]
            self.start.setdefault(pid, p.cpu_s if pid == os.getpid() or pid in self.seen else 0.0)
            self.seen[pid] = (p.cmdline, p.cpu_s)

    def _loop(self) -> None:
        while not self.stop_event.wait(0.2):
            self._sample()

    def __enter__(self):
        self._sample()
        self.start = {pid: cpu for pid, (_, cpu) in self.seen.items()}
        self.thread.start()
        return self

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.stop_event.set()
            self.thread.join()
            self._sample()

    def by_role(self, roles: dict[str, str]) -> dict[str, float]:
        """Core-seconds per role: the first role whose marker is in a process's command line; else `ray`."""
        out: dict[str, float] = {}
        for pid, (cmd, cpu) in self.seen.items():
            role = "driver" if pid == os.getpid() else next((r for r, m in roles.items() if m in cmd), "other")
            out[role] = out.get(role, 0.0) + cpu - self.start.get(pid, 0.0)
        return {k: round(v, 1) for k, v in out.items()}


# ---------------------------------------------------------------- the baseline

_TOK = None


def _init(tokenizer_path: str) -> None:
    global _TOK
    from strata.data.tokenizer import HFTokenizer

    _TOK = HFTokenizer.from_file(tokenizer_path)


def _baseline_file(args: tuple[str, str]) -> tuple[int, int]:
    """One file: decode, tokenize, pack, write parquet. Returns (rows, tokens)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, out_dir = args
    row_len = SEQ_LEN + 1
    eot = np.array([_TOK.eot_id], dtype=np.uint32)
    carry = np.zeros(0, dtype=np.uint32)
    rows = tokens = 0
    out = os.path.join(out_dir, os.path.basename(path) + ".parquet")
    schema = pa.schema([("tokens", pa.list_(pa.uint16(), row_len))])
    with open(path, "rb") as f, pq.ParquetWriter(out, schema) as writer:
        batch = []
        for line in f:
            try:
                text = json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                continue
            batch.append(text)
            if len(batch) == 1024:
                carry, r, t = _pack(batch, carry, eot, row_len, writer, schema)
                rows, tokens, batch = rows + r, tokens + t, []
        if batch:
            _, r, t = _pack(batch, carry, eot, row_len, writer, schema)
            rows, tokens = rows + r, tokens + t
    return rows, tokens


def _pack(texts, carry, eot, row_len, writer, schema):
    import pyarrow as pa

    parts = [carry]
    for ids in _TOK.encode_batch(texts):
        parts += [ids, eot]
    flat = np.concatenate(parts)
    n = len(flat) // row_len
    if n:
        values = pa.array(flat[: n * row_len].astype(np.uint16))
        writer.write_table(pa.Table.from_arrays([pa.FixedSizeListArray.from_arrays(values, row_len)], schema=schema))
    return flat[n * row_len:], n, len(flat) - len(carry)


def baseline(paths: list[str], tokenizer: str, out_dir: str, cores: int) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.perf_counter()
    with CpuSampler() as cpu, Pool(cores, initializer=_init, initargs=(tokenizer,)) as pool:
        results = pool.map(_baseline_file, [(p, out_dir) for p in paths], chunksize=1)
    return {"seconds": time.perf_counter() - t0, "rows": sum(r for r, _ in results),
            "tokens": sum(t for _, t in results), "cpu_s": cpu.by_role({"workers": "python"})}


# ---------------------------------------------------------------- the pipeline


def pipeline(paths: list[str], tokenizer: str, storage_root: str, name: str, cores: int) -> dict:
    from pipelines.config import debug
    from pipelines.driver import run
    from strata.cluster.connect import connect
    from strata.data.storage import Storage

    connect(num_cpus=cores)
    cfg = debug(name, read={"inputs": tuple(paths)}, dedup={"exact_dedup": False, "near_dedup": False},
                clean={"min_chars": 1}, pack={"tokenizer": tokenizer, "seq_len": SEQ_LEN, "shard_bytes": 128 << 20})
    t0 = time.perf_counter()
    with CpuSampler() as cpu:
        out = run(cfg, Storage(storage_root))
    roles = {"pack": "DedupTokenizePack", "shards": "write_shard", "ray-data": "ray::_", "ray": "ray"}
    return {"seconds": time.perf_counter() - t0, "cpu_s": cpu.by_role(roles), "rows": out["sequences"], "tokens": out["tokens"],
            "peak_worker_rss_mb": out["stats"]["peak_worker_rss_mb"], "documents": out["documents"],
            "pack_worker_utilization": out["stats"]["pack_worker_utilization"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=200, help="corpus size for the comparison (default 200)")
    parser.add_argument("--memory-gb", type=float, default=0, help="also run the pipeline on this many GB")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="cores for both systems")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "strata-bench-preprocess"),
                        help="corpus cache and outputs")
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the ratio")
    args = parser.parse_args(argv)

    from strata.data.tokenizer import train_bpe

    paths = generate(os.path.join(args.workdir, f"corpus-{args.mb}mb"), args.mb)
    mb = sum(os.path.getsize(p) for p in paths) / 1e6
    tok_path = os.path.join(args.workdir, "tokenizer.json")
    if not os.path.exists(tok_path):
        with open(paths[0]) as f:
            sample = [json.loads(next(f))["text"] for _ in range(2000)]
        with open(tok_path, "w") as f:
            f.write(train_bpe(iter(sample), VOCAB).definition)
    out = os.path.join(args.workdir, "out")
    shutil.rmtree(out, ignore_errors=True)
    print(f"corpus: {len(paths)} JSONL files, {mb:.1f} MB; tokenizer: BPE {VOCAB}; seq_len {SEQ_LEN}; "
          f"{args.cores} cores", flush=True)

    base = baseline(paths, tok_path, os.path.join(out, "baseline"), args.cores)
    pipe = pipeline(paths, tok_path, os.path.join(out, "storage"), "bench", args.cores)
    result = {"mb": round(mb, 1), "cores": args.cores, "baseline": base, "pipeline": pipe}
    for name, r in (("baseline", base), ("pipeline", pipe)):
        print(f"{name:9} {r['seconds']:7.1f} s  {mb / r['seconds']:7.2f} MB/s  {mb / r['seconds'] / args.cores:6.2f} "
              f"MB/s/core  {r['tokens'] / r['seconds'] / 1e6:6.2f} M tokens/s  {r['rows']:,} rows")
    print(f"pipeline pack workers busy {pipe['pack_worker_utilization']:.0%} of the packing pass's wall time")
    for name, r in (("baseline", base), ("pipeline", pipe)):
        if r["cpu_s"]:
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["cpu_s"].items(), key=lambda kv: -kv[1]))
            print(f"{name} CPU core-seconds: {parts} (of {r['seconds'] * args.cores:.1f} available)")
    if abs(pipe["tokens"] - base["tokens"]) > 0.01 * base["tokens"]:
        print(f"warning: token counts differ: pipeline {pipe['tokens']:,} vs baseline {base['tokens']:,}")
    if args.memory_gb:
        big = generate(os.path.join(args.workdir, f"corpus-{int(args.memory_gb * 1024)}mb"), int(args.memory_gb * 1024))
        mem = pipeline(big, tok_path, os.path.join(out, "storage"), "bench-memory", args.cores)
        result["memory"] = mem
        print(f"memory: {args.memory_gb:g} GB input, peak worker RSS {mem['peak_worker_rss_mb']:.0f} MB "
              f"({mem['seconds']:.0f} s)")
    if args.json:
        print(json.dumps(result))
    print(f"ratio pipeline/baseline throughput: {base['seconds'] / pipe['seconds']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
