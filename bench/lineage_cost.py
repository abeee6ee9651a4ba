"""What lineage costs tier 1: this tree's `pipelines.preprocess` against the commit before lineage existed,
or against this commit with lineage taken out.

    python -m bench.lineage_cost [--before a93d172^ | --ablate] [--pairs 6] [--workload A --workload B] [--mb 100]

Lineage (pipelines/lineage.py: which documents each row holds, where each row landed, one file per version)
has no switch: it is part of every version. Its cost is measured as the difference between this tree and
the commit before it (a git worktree of `--before`, run from its own directory with this environment), on
bench.peer's real corpus and tokenizer: workload A (tokenize: dedup off) and B (exact and near dedup, then
tokenize). The two trees run alternately, `--pairs` times, each a whole process timed on the wall clock with
its own embedded Ray. Everything added since that commit (input digests, the web readers) is inside the
difference too, so the share printed is an upper bound on lineage's. `--ablate` compares with this commit
instead (HEAD, in a worktree) with lineage's work made no-ops (`ABLATION`: no spans kept or written, no places,
no records, no lineage file): the difference is lineage's own. The target is under 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from bench.peer import REPO, SEQ_LEN, real_corpus, tokenizer


def worktree(rev: str, where: str) -> str:
    """A checkout of `rev` at `where` (made once; reused while it is at that commit)."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    if os.path.isdir(where):
        now = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True).stdout.strip()
        if now == sha:
            return where
        subprocess.run(["git", "worktree", "remove", "--force", where], cwd=REPO, capture_output=True)
        shutil.rmtree(where, ignore_errors=True)
    subprocess.run(["git", "worktree", "add", "--force", "--detach", where, sha], cwd=REPO, capture_output=True,
                   check=True)
    return where


ABLATION = {  # file: (text, what replaces it): lineage's work in each pass, made a no-op
    "pipelines/lineage.py": [
        ("    def add(self, doc_id: str, exact: int, tokens: int) -> None:\n",
         "    def add(self, doc_id: str, exact: int, tokens: int) -> None:\n        return\n"),
        ("    def extend(self, other: DocRuns) -> None:\n", "    def extend(self, other: DocRuns) -> None:\n        return\n"),
        ("    def cut(self, keys: np.ndarray, row_len: int) -> pa.Table:\n",
         "    def cut(self, keys: np.ndarray, row_len: int) -> pa.Table:\n        return SPANS.empty_table()\n"),
        ("def write_spans(work_dir: str, name: str, tables: list[pa.Table]) -> None:\n",
         "def write_spans(work_dir: str, name: str, tables: list[pa.Table]) -> None:\n    return\n"),
        ("def write_records(work_dir: str, name: str, records: list[tuple[str, str]]) -> None:\n",
         "def write_records(work_dir: str, name: str, records: list[tuple[str, str]]) -> None:\n    return\n"),
        ("def write_places(work_dir: str, shard: str, keys: pa.Array) -> None:\n",
         "def write_places(work_dir: str, shard: str, keys: pa.Array) -> None:\n    return\n"),
    ],
    "pipelines/driver.py": [("lineage = passes.build_lineage(run) if shards else {}", "lineage = {}")],
}


def ablated(where: str) -> str:
    """A checkout of HEAD at `where` with `ABLATION` applied (each text must be there once: a refactor that
    moves one makes this fail, not measure something else)."""
    where = worktree("HEAD", where)
    subprocess.run(["git", "checkout", "--", "."], cwd=where, capture_output=True, check=True)
    for name, edits in ABLATION.items():
        path = os.path.join(where, name)
        with open(path) as f:
            text = f.read()
        for old, new in edits:
            if text.count(old) != 1:
                raise SystemExit(f"bench.lineage_cost --ablate: {name} no longer has {old.strip()!r} once; update ABLATION")
            text = text.replace(old, new)
        with open(path, "w") as f:
            f.write(text)
    return where


def run(tree: str, corpus: str, tok: str, storage: str, workload: str) -> float:
    """One `python -m pipelines.preprocess` from `tree`: its wall seconds."""
    shutil.rmtree(storage, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", corpus, "--dataset", "cost", "--tokenizer", tok,
           "--seq-len", str(SEQ_LEN), "--min-chars", "1", "--json"]
    if workload == "A":
        cmd += ["--no-exact-dedup", "--no-near-dedup"]
    env = {**os.environ, "PYTHONPATH": tree, "STRATA_STORAGE": storage, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{tree}: preprocess failed:\n{proc.stderr[-3000:]}")
    json.loads(proc.stdout.strip().splitlines()[-1])  # it printed its summary: the run completed
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lineage_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="a93d172^", help="the commit before lineage (default a93d172^)")
    p.add_argument("--ablate", action="store_true",
                   help="compare with this commit with lineage's work made no-ops, not with --before")
    p.add_argument("--pairs", type=int, default=6, help="alternating runs of each tree, per workload (default 6)")
    p.add_argument("--workload", choices=["A", "B"], action="append", help="A, B or both (default both)")
    p.add_argument("--mb", type=int, default=100, help="size of the real corpus (default 100)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "strata-bench-peer"))
    a = p.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    corpus = real_corpus(os.path.join(a.workdir, f"real-{a.mb}mb"), a.mb)
    tok = tokenizer(os.path.join(a.workdir, "tokenizer.json"), corpus)
    before = ablated(os.path.join(a.workdir, "lineage-ablated")) if a.ablate else \
        worktree(a.before, os.path.join(a.workdir, "before-lineage"))
    other = "without lineage" if a.ablate else "before lineage"
    corpus_dir = os.path.dirname(corpus[0])
    results = {}
    for workload in a.workload or ["A", "B"]:
        times: dict[str, list[float]] = {"now": [], "before": []}
        for i in range(a.pairs):
            for name, tree in (("now", REPO), ("before", before))[:: 1 if i % 2 == 0 else -1]:
                times[name].append(run(tree, corpus_dir, tok, os.path.join(a.workdir, f"cost-{name}"), workload))
            print(f"[lineage_cost] {workload} pair {i + 1}/{a.pairs}: now {times['now'][-1]:.2f} s, "
                  f"{other} {times['before'][-1]:.2f} s", file=sys.stderr, flush=True)
        now, then = statistics.median(times["now"]), statistics.median(times["before"])
        # Each pair ran back to back: the median of the pairs' ratios follows the machine's load as it drifts.
        paired = statistics.median(n / b for n, b in zip(times["now"], times["before"], strict=True))
        results[workload] = {"now_s": round(now, 2), "before_s": round(then, 2), "share": round(now / then - 1, 4),
                             "paired_share": round(paired - 1, 4), "runs": times}
        print(f"workload {workload}: now {now:.2f} s, {other} {then:.2f} s (medians of {a.pairs}): "
              f"{now / then - 1:+.1%}; median of the pairs' ratios {paired - 1:+.1%}")
    print(json.dumps({k: {x: v[x] for x in ("now_s", "before_s", "share", "paired_share")} for k, v in results.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
