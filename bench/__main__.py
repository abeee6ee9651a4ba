"""Every benchmark, one results file: `python -m bench` (what `make bench` runs).

Runs each benchmark as its own process (its own embedded Ray), reads the JSON
line each prints with --json and the ratio line it prints last, and writes
bench/results/latest.json (everything, with the date and machine) and
bench/results/latest.md (a table of the ratios). The README quotes its figures
from there; `python -m strata plan` reads measured throughput from it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

OUT = Path(__file__).resolve().parent / "results"
# name -> (module, arguments, what its last line's ratio means, target)
BENCHMARKS = {
    "preprocess": ("bench.preprocess", ["--mb", "100", "--memory-gb", "0.5"],
                   "tier-1 throughput, pipeline / hand-written multiprocessing", ">= 0.9"),
    "peer": ("bench.peer", ["--mb", "100", "--memory-gb", "0.5"], "tier-1 throughput strata / datatrove, workload B (dedup + tokenize) "
             "per corpus; the line above it: workload A (tokenize)", ">= 1.2"),
    "scaling": ("bench.scaling", ["--mb", "50"], "tier-1 throughput per CPU, two 1-CPU nodes / one 2-CPU node "
                "(simulated cluster, workload B)", "~1"),
    "lid": ("bench.lid", ["--mb", "50"], "tier-1 wall time with --languages '*' (every document scored) / without, "
            "real corpus; the detector's docs/s per core above it", "<= 1.2"),
    "dedup": ("bench.dedup", [], "near-duplicate recall and precision at the threshold, measured / LSH's S-curve",
              "recall >= 0.99 at one-word edits (test); ~1"),
    "train.e2e": ("bench.train.e2e", [], "wall time per step of the whole command timed at two lengths, plain "
                  "PyTorch / python -m train (--log-every 1; the line above it: 10)", ">= 0.97"),
    "train.ingest": ("bench.train.ingest", [], "tokens/s delivered / consumed by the debug model", ">= 10"),
    "train.checkpoint": ("bench.train.checkpoint", [], "wall time blocked by checkpoints", "< 1%"),
    "train.startup": ("bench.train.startup", [], "time to the first step, plain PyTorch / python -m train "
                      "(debug preset, embedded Ray; median of 3 launches)", "first step <= 10 s"),
    "scale": ("bench.scale", [], "growth laws on local disk and the S3 API server: version 8 / version 1 (requests, "
              "bytes, memory), cost per MB of a 16x / 1x input, a resume's row groups at the end / start of an epoch",
              "<= 1.2; <= 1.05; <= 1"),
    "infer": ("bench.infer", [], "scoring tokens/s per core, strata / transformers' window-a-pass loop (same model, "
              "documents and cores); the line above it: the whole score command by actors", ">= 1.5"),
    "serve": ("bench.serve", [], "online serving under guidellm's load, strata serve (default configuration) / a plain "
              "FastAPI server on the same cores: embeddings c=1 p50 difference, completions gpt2-124m c=32 tokens/s, "
              "embeddings c=32 req/s, p99/p50 at c=32, memory at c=256", "<= +3 ms; >= 5; >= 1; <= 3; <= 1.2"),
    "tune": ("bench.tune", ["--asha-trials", "12"], "sweeps: overhead of real configs / a plain loop (64), per "
             "trivial config and driver memory extrapolated to 50,000, re-run share when 2 of 4 nodes are lost, "
             "driver CPU at 100 workers", "<= 1.1; <= 10 ms, <= 60 MB/1,000; <= 2%; < 1 core"),
}


def run_one(module: str, args: list[str]) -> dict:
    started = time.time()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run([sys.executable, "-m", module, *args, "--json"], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    result = next((json.loads(line) for line in reversed(lines) if line.startswith(("{", "["))), None)
    return {"ok": proc.returncode == 0, "seconds": round(time.time() - started, 1), "result": result,
            "last_line": lines[-1] if lines else "", "stdout": "\n".join(lines[-40:]),
            "stderr_tail": proc.stderr[-2000:] if proc.returncode else ""}


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {platform.machine()}, {platform.system()}"


def markdown(results: dict) -> str:
    lines = [f"# Benchmarks, {results['date']}", "", f"Machine: {results['machine']}. Total {results['seconds']:,.0f} s.",
             "", "| benchmark | measures | target | result (its last line) | seconds |", "|---|---|---|---|---|"]
    for name, (_, _, what, target) in BENCHMARKS.items():
        r = results["benchmarks"].get(name)
        if r is None:
            continue
        line = r["last_line"] if r["ok"] else f"FAILED: {r['stderr_tail'][-200:]}"
        lines.append(f"| {name} | {what} | {target} | {line.replace('|', '/')} | {r['seconds']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=sorted(BENCHMARKS), help="run just these (repeatable)")
    p.add_argument("--out", default=str(OUT), help="results directory (default bench/results)")
    a = p.parse_args(argv)
    started = time.time()
    out = Path(a.out)
    earlier = json.loads((out / "latest.json").read_text()) if a.only and (out / "latest.json").exists() else {}
    results = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "benchmarks": earlier.get("benchmarks", {})}
    for name, (module, args, _, _) in BENCHMARKS.items():
        if a.only and name not in a.only:
            continue
        print(f"[bench] {name}: python -m {module} {' '.join(args)}", file=sys.stderr, flush=True)
        r = results["benchmarks"][name] = run_one(module, args)
        print(f"[bench] {name}: {'ok' if r['ok'] else 'FAILED'} in {r['seconds']:,.0f} s: {r['last_line']}",
              file=sys.stderr, flush=True)
    results["seconds"] = round(time.time() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "latest.md").write_text(markdown(results))
    print(markdown(results))
    return 0 if all(r["ok"] for r in results["benchmarks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
