"""Growth laws of tier 1 and of training reads: what a version costs as history and input grow.

    python -m bench.scale [--mb 2] [--versions 16] [--window 4] [--all-versions 8] [--sizes 1,4,16]
                          [--storage local,s3] [--takedown-versions 100] [--takedown-datasets 3] [--json]

Each run is the real command, `python -m pipelines.preprocess`, in its own process with its own
embedded Ray, timed on the wall clock. On `s3` the storage root is on moto's S3 API server on
127.0.0.1, reached through a proxy that logs every request (bench/s3proxy.py); on `local` it is a
directory (no requests to count).

- History: versions 1..N of one dataset under `--dedup-window W`, each adding `--mb` MB of new input (a
  tenth of it copies of the previous version's documents, for dedup to find). Per version: requests by
  kind, MB read and written, peak RSS of the driver, of the largest worker and of the dedup index,
  wall seconds.
- The same under `--dedup-window all` (`--all-versions` of them, on s3): the law that mode's dedup
  reads follow, fitted over its versions: MB of dedup state read = a + b x keys compared.
- Input: one version of `--mb` x each of `--sizes`: the same figures.
- Lineage: each version's lineage file as a share of all the bytes the version added (`lineage_share`:
  shards, dedup index, tails, records; target <= 0.05) and of its shard bytes alone (`lineage_shard_share`);
  and one document of version 1 looked up across the history: row groups read (of how many) and, on s3,
  requests.
- Takedown (on s3): one request against `--takedown-datasets` datasets of `--takedown-versions` versions
  each (bench/takedown.py): open, plan and apply, each the real command, with its requests and seconds.
- Resume: row groups a training reader reads to give its first batch at the start of an epoch and at
  its last batch (`train.data.TokenBatches` over the newest version's shards).

Small work units and shards (`--split-bytes 524288 --shard-bytes 1048576`) give the file counts of a
large input from a small one. The targets: once the window is full (version W+1, the steady state),
every later version costs at most 1.2x it in requests and bytes read, and none more than 1.5x in
requests or bytes; memory stays within 1.2x; requests and bytes grow at most linearly with input; a
resume at the end of an epoch reads at most one row group more than one at its start (the shuffle
buffer's rows, read back, may straddle one more). The last line prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "results"
KNOBS = ["--split-bytes", str(512 << 10), "--shard-bytes", str(1 << 20)]
WORDS = [f"{a}{b}{c}" for a in ("ka", "lo", "mi", "ne", "ru", "ta", "po", "el") for b in ("n", "r", "s", "t", "")
         for c in ("a", "e", "i", "o", "u", "y", "an", "or")]


def corpus(path: Path, mb: float, seed: int, copies_of: list[str] | None = None) -> list[str]:
    """`mb` MB of JSONL documents; a tenth of the documents copied from `copies_of`. Returns its own
    (not copied) texts."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    texts, size = [], 0
    with open(path / "part.jsonl", "w") as f:
        while size < mb * 2**20:
            if copies_of and rng.random() < 0.1:
                text = rng.choice(copies_of)
            else:
                text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 300))) + f" {seed}-{len(texts)}."
                texts.append(text)
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)
    return texts


class Sampler:
    """Peak RSS of a process (the driver) and of the largest of its descendants (Ray's workers)."""

    def __init__(self, pid: int):
        self.pid, self.driver, self.worker, self.stop = pid, 0.0, 0.0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from strata.cluster.procs import processes, tree

        while not self.stop.wait(0.25):
            procs = processes()
            if self.pid not in procs:
                continue
            self.driver = max(self.driver, procs[self.pid].rss_mb)
            workers = [procs[p].rss_mb for p in tree(self.pid, procs) if procs[p].cmdline.startswith("ray::")]
            self.worker = max([self.worker, *workers])

    def done(self) -> tuple[float, float]:
        self.stop.set()
        self.thread.join()
        return round(self.driver, 1), round(self.worker, 1)


def preprocess(inputs: Path, dataset: str, root: str, env: dict, proxy=None, window: str = "24") -> dict:
    """One run of the command; its figures."""
    first = len(proxy.log) if proxy else 0
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.preprocess", "--input", str(inputs), "--dataset",
                             dataset, "--json", "--dedup-window", window, *KNOBS], cwd=REPO,
                            env={**env, "STRATA_STORAGE": root},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    out, err = proc.communicate()
    wall = time.time() - started
    driver, worker = sampler.done()
    if proc.returncode:
        raise RuntimeError(f"preprocess failed: {err[-3000:]}")
    summary = json.loads(out.strip().splitlines()[-1])
    row = {"wall_s": round(wall, 2), "driver_rss_mb": driver, "worker_rss_mb": worker,
           "index_rss_mb": summary["stats"]["peak_index_rss_mb"], "index_entries": summary["dedup_index_entries"],
           "keys_compared": summary["dedup_keys_compared"],
           "shards": summary["shards"],
           "lineage_share": (summary.get("lineage") or {}).get("share_of_version_bytes"),
           "lineage_shard_share": (summary.get("lineage") or {}).get("share_of_shard_bytes"),
           "work_units": summary["units"]["total"], "version": summary["version"]}
    if proxy:
        from bench.s3proxy import tally

        log = proxy.log[first:]
        t = tally(log)
        row.update(requests=t["requests"], total_requests=sum(t["requests"].values()),
                   read_mb=round(t["read_bytes"] / 2**20, 3), written_mb=round(t["written_bytes"] / 2**20, 3),
                   dedup_read_mb=round(tally(log, "/dedup/")["read_bytes"] / 2**20, 3),
                   delta_read_mb=round(tally(log, "/_delta_log/")["read_bytes"] / 2**20, 3),
                   requests_by_kind={k: sum(1 for r in log if kind_of(r) == k) for k in KINDS})
    return row


KINDS = ("listings", "work files", "dedup state", "consumed", "delta log", "leases", "other")


def lineage_lookup(root: str, dataset: str, doc_id: str, env: dict, proxy=None) -> dict:
    """`strata lineage doc` of one document in a dataset of many versions: the row groups of the versions'
    lineage files it read (of how many), and its requests to them (on s3)."""
    from bench.s3proxy import tally

    first = len(proxy.log) if proxy else 0
    proc = subprocess.run([sys.executable, "-m", "strata", "lineage", "doc", "--doc-id", doc_id, "--dataset", dataset,
                           "--storage", root, "--json"], cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"lineage doc failed: {proc.stderr[-3000:]}")
    out = json.loads(proc.stdout)
    env_root = {**env, "STRATA_STORAGE": root}
    count = subprocess.run([sys.executable, "-c", _GROUPS, dataset], cwd=REPO, env=env_root, capture_output=True,
                           text=True, check=True)
    groups, versions = json.loads(count.stdout)
    row = {"versions": versions, "row_groups": groups, "row_groups_read": out["row_groups_read"],
           "versions_holding": len(out["versions"])}
    if proxy:
        log = [r for r in proxy.log[first:] if "lineage.parquet" in r.path]
        row.update(lineage_requests=len(log), lineage_read_kb=round(tally(log)["read_bytes"] / 1024, 1))
    return row


_GROUPS = """
import json, sys
import pyarrow.parquet as pq
from strata.data.dataset import history
from strata.data.storage import Storage, filesystem
groups = 0
versions = history(Storage.from_env(), sys.argv[1])
for v in versions:
    fs, p = filesystem(v.file(v.manifest.lineage["file"]))
    groups += pq.ParquetFile(fs.open_input_file(p)).metadata.num_row_groups
print(json.dumps([groups, len(versions)]))
"""


def kind_of(r) -> str:
    """What a request was for, from its object's key."""
    if "list-type" in r.query:
        return "listings"
    for kind, part in (("work files", "/_work/"), ("dedup state", "/dedup/"), ("consumed", "/consumed/"),
                       ("leases", "/_lease/"), ("delta log", "/_delta_log/")):
        if part in r.path:
            return kind
    return "other"


def resume_reads(root: str, dataset: str) -> dict:
    """Row groups read to give the first batch at the start of an epoch and at its last batch."""
    from strata.data.dataset import resolve
    from strata.data.rows import read_rows
    from strata.data.storage import Storage
    from train.data import ShardRef, TokenBatches

    v = resolve(Storage(root), dataset)
    refs = [ShardRef(v.file(s.path), s.rows) for s in v.shards if s.split == "train"]
    groups: set = set()

    def read(path, start=0, stop=None):
        rows = read_rows(path, start, stop)
        groups.update((path, r // 1024) for r in range(start, start + len(rows)))
        return rows

    loader = TokenBatches(refs, batch_size=8, rank=0, world_size=1, seed=3, shuffle_buffer=2048, read=read)
    out = {}
    for name, at in (("start", 0), ("end", loader.steps_per_epoch - 1)):
        groups.clear()
        next(loader.epoch(1, at))
        out[name] = len(groups)
    return {"row_groups_at_start": out["start"], "row_groups_at_end": out["end"], "rows": sum(r.rows for r in refs)}


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=2.0, help="new input per version, MB (default 2)")
    p.add_argument("--versions", type=int, default=16)
    p.add_argument("--window", type=int, default=4, help="--dedup-window of the history runs (default 4)")
    p.add_argument("--all-versions", type=int, default=8,
                   help="versions under --dedup-window all, on s3, for its law (default 8; 0: none)")
    p.add_argument("--sizes", default="1,4,16", help="input multiples for the single-version runs")
    p.add_argument("--storage", default="local,s3")
    p.add_argument("--takedown-versions", type=int, default=100, help="versions of each takedown dataset, on s3 "
                   "(bench/takedown.py; 0: no takedown; default 100)")
    p.add_argument("--takedown-datasets", type=int, default=3, help="datasets holding the taken-down file (default 3)")
    p.add_argument("--out", default=str(OUT), help="results directory (default bench/results)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.versions < a.window + 2:
        p.error("--versions must be at least --window + 2: the steady state starts at version window + 1")
    sizes = [int(x) for x in a.sizes.split(",")] if a.sizes else []
    work = Path(tempfile.mkdtemp(prefix="strata-scale-"))
    # Input prefixes sort in the order they arrive, as dated ones do (a scheduled run's new hour).
    previous = corpus(work / "in" / "v001", a.mb, seed=1)
    for v in range(2, max(a.versions, a.all_versions) + 1):
        previous = corpus(work / "in" / f"v{v:03d}", a.mb, seed=v, copies_of=previous)
    for k in sizes:
        corpus(work / "in" / f"x{k}", a.mb * k, seed=100 + k)
    results: dict = {"mb_per_version": a.mb, "knobs": KNOBS, "window": a.window, "history": {}, "input": {}}
    server = proxy = None
    try:
        for kind in a.storage.split(","):
            env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
            if kind == "s3":
                from bench.s3proxy import s3_server

                server, proxy, s3_env = s3_server("scale")
                env.update(s3_env)
                root = "s3://scale/strata"
            else:
                root = str(work / "local")
            runs = [(kind, "grow", a.versions, str(a.window))]
            if kind == "s3" and a.all_versions:
                runs.append(("s3 all", "grow-all", a.all_versions, "all"))
            for label, dataset, count, window in runs:
                history = results["history"][label] = []
                for v in range(1, count + 1):
                    history.append(preprocess(work / "in" / f"v{v:03d}", dataset, root, env, proxy, window))
                    print(f"[scale] {label} version {v}: {json.dumps(history[-1])}", file=sys.stderr, flush=True)
            # One document of the first version, looked up across the whole history.
            results.setdefault("lineage", {})[kind] = lineage_lookup(root, "grow", f"{work / 'in' / 'v001' / 'part.jsonl'}:0",
                                                                     env, proxy)
            print(f"[scale] {kind} lineage lookup: {json.dumps(results['lineage'][kind])}", file=sys.stderr, flush=True)
            results["input"][kind] = {}
            for k in sizes:
                results["input"][kind][k] = preprocess(work / "in" / f"x{k}", f"x{k}", root, env, proxy)
                print(f"[scale] {kind} input x{k}: {json.dumps(results['input'][kind][k])}", file=sys.stderr, flush=True)
            if kind == "local":
                results["resume"] = resume_reads(root, "grow")
            if kind == "s3" and a.takedown_versions:
                from bench.takedown import takedown_at_scale, text

                results["takedown"] = takedown_at_scale(work, root, env, proxy, a.takedown_datasets,
                                                        a.takedown_versions)
                print(f"[scale] {text(results['takedown'])}", file=sys.stderr, flush=True)
    finally:
        if proxy:
            proxy.close()
        if server:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if "s3 all" in results["history"]:
        results["law"] = law(results["history"]["s3 all"])
    results["ratios"] = ratios(results, sizes)
    results["date"] = time.strftime("%Y-%m-%d")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "scale.md").write_text(tables(results) + "\n")
    print(tables(results))
    if a.json:
        print(json.dumps(results))
    missed = [k for k, v in results["ratios"].items() if v > target(k)]
    print(f"ratio targets met {len(results['ratios']) - len(missed)}/{len(results['ratios'])}"
          + (f"; not met: {', '.join(missed)}" if missed else ""))
    return 0


def law(history: list[dict]) -> dict:
    """Under --dedup-window all: the least-squares line of dedup state read against the earlier keys each
    version compared with, and of all its bytes read; b is the cost of one more earlier key."""
    import numpy as np

    x = np.array([r["keys_compared"] for r in history], dtype=float)
    out = {"versions": len(history), "keys_compared_last": int(x[-1])}
    for key in ("dedup_read_mb", "read_mb"):
        y = np.array([r[key] for r in history], dtype=float) * 2**20
        b, a = np.polyfit(x, y, 1) if x.std() else (0.0, float(y.mean()))
        out[key.replace("_mb", "")] = {"bytes_per_earlier_key": round(float(b), 2), "intercept_mb": round(a / 2**20, 3)}
    return out


STEADY_KEYS = ("total_requests", "read_mb")
PEAK_KEYS = ("total_requests", "read_mb", "written_mb")
MEMORY_KEYS = ("driver_rss_mb", "worker_rss_mb", "index_rss_mb")


def target(key: str) -> float:
    """After the steady state: each version <= 1.2x it in requests and bytes read, the highest <= 1.5x in
    requests or bytes, memory <= 1.2x (wall time is not a target: it is noisy on a shared machine); the
    cost per MB of a 16x input / a 1x input <= 1.05 (linear), and the resume's row groups end / (start + 1) <= 1."""
    if "wall_s" in key:
        return float("inf")
    if "highest" in key:
        return 1.5
    if "lineage" in key:  # the target is on the dataset's bytes; its shards' alone are shown beside it
        return float("inf") if "shard bytes" in key else 0.05 if "bytes" in key else 1.0
    return 1.2 if "worst of" in key else 1.05 if "per MB" in key else 1.0


def ratios(results: dict, sizes: list[int]) -> dict:
    """Against the steady state (version window + 1): the worst later version, per figure (<= 1.2), and the
    highest version of all (<= 1.5); the largest input's cost per MB / the smallest's (<= 1.05), and the
    resume's row groups at the end / (at the start + 1) (<= 1)."""
    out = {}
    steady = results["window"] + 1
    for kind in ("local", "s3"):
        if not (history := results["history"].get(kind)):
            continue
        base, later = history[steady - 1], history[steady:]
        for key in (*STEADY_KEYS, "written_mb", *MEMORY_KEYS, "wall_s"):
            if key in base:
                out[f"{kind} worst of v{steady + 1}-v{len(history)} / v{steady} {key}"] = max(
                    ratio(r[key], base[key]) for r in later)
        for key in PEAK_KEYS:
            if key in base:
                out[f"{kind} highest version / v{steady} {key}"] = max(ratio(r[key], base[key]) for r in history)
        if kind in results["input"] and sizes:
            small, big = results["input"][kind][sizes[0]], results["input"][kind][sizes[-1]]
            for key in ("total_requests", "read_mb", "written_mb", "wall_s"):
                if key in small:
                    out[f"{kind} x{sizes[-1]}/x{sizes[0]} {key} per MB"] = ratio(big[key] / sizes[-1], small[key] / sizes[0])
    for key, what in (("lineage_share", "the version's bytes"), ("lineage_shard_share", "its shard bytes")):
        if shares := [r[key] for h in results["history"].values() for r in h if r.get(key)]:
            out[f"lineage bytes / {what}, largest of any version"] = max(shares)
    for kind, r in results.get("lineage", {}).items():  # a lookup reads at most a row group per version
        out[f"{kind} lineage row groups read / versions"] = ratio(r["row_groups_read"], r["versions"])
    if "resume" in results:
        out["resume end/(start+1) row groups"] = ratio(results["resume"]["row_groups_at_end"],
                                                      results["resume"]["row_groups_at_start"] + 1)
    return out


def tables(results: dict) -> str:
    lines = []
    cols = ("total_requests", *KINDS, "read_mb", "dedup_read_mb", "delta_read_mb", "written_mb", "driver_rss_mb", "worker_rss_mb",
            "index_rss_mb", "index_entries", "keys_compared", "wall_s", "shards", "lineage_share", "lineage_shard_share")
    flat = lambda r: {**r, **r.get("requests_by_kind", {})}  # noqa: E731
    for label, history in results["history"].items():
        history = [flat(r) for r in history]
        shown = [c for c in cols if c in history[0]]
        window = "all" if label.endswith(" all") else results["window"]
        lines += [f"History on {label.split()[0]}, --dedup-window {window} ({results['mb_per_version']} MB new input "
                  "per version):", "", "| version | " + " | ".join(shown) + " |", "|---" * (len(shown) + 1) + "|"]
        lines += [f"| {i + 1} | " + " | ".join(str(r[c]) for c in shown) + " |" for i, r in enumerate(history)]
        lines.append("")
    for kind, by_size in results["input"].items():
        rows = [flat(r) for r in by_size.values()]
        if not rows:  # --sizes ""
            continue
        shown = [c for c in cols if c in rows[0]]
        lines += [f"Input size on {kind}:", "", "| input | " + " | ".join(shown) + " |", "|---" * (len(shown) + 1) + "|"]
        lines += [f"| x{k} | " + " | ".join(str(r[c]) for c in shown) + " |" for k, r in zip(by_size, rows, strict=True)]
        lines.append("")
    if "law" in results:
        w = results["law"]
        lines.append(f"Under --dedup-window all ({w['versions']} versions): dedup state read = "
                     f"{w['dedup_read']['intercept_mb']} MB + {w['dedup_read']['bytes_per_earlier_key']} bytes x earlier "
                     f"keys compared; all bytes read = {w['read']['intercept_mb']} MB + "
                     f"{w['read']['bytes_per_earlier_key']} bytes x earlier keys ({w['keys_compared_last']:,} at the last).")
    for kind, r in results.get("lineage", {}).items():
        lines.append(f"Lineage on {kind}: one document of version 1 looked up in {r['versions']} versions read "
                     f"{r['row_groups_read']} of their {r['row_groups']} lineage row groups"
                     + (f" ({r['lineage_requests']} requests, {r['lineage_read_kb']} KB)" if "lineage_requests" in r else "")
                     + f"; {r['versions_holding']} versions hold it.")
    if "takedown" in results:
        from bench.takedown import text

        lines.append(text(results["takedown"]))
    if "resume" in results:
        r = results["resume"]
        lines.append(f"Resume: {r['row_groups_at_start']} row groups read for the first batch of an epoch, "
                     f"{r['row_groups_at_end']} for its last ({r['rows']:,} train rows).")
    lines += ["", "| ratio | measured | target |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {'-' if target(k) == float('inf') else f'<= {target(k)}'}"
              f"{'' if v <= target(k) else ' (not met)'} |" for k, v in results["ratios"].items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
