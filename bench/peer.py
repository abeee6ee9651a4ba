"""Tier 1 against its peer: strata and datatrove on the same corpora, tokenizer and cores.

    python -m bench.peer [--mb 100] [--repeats 1] [--workload A|B|web] [--corpus generated|real] [--no-head]

Two corpora: the generated one of `bench.preprocess` (short English-like documents) and a real one,
the .py/.md/.rst/.txt files of the installed Python packages, one document per file, as JSONL (no
download: every machine has them). One byte-level BPE tokenizer.json (32,768 ids), trained here, for
every system. Workload A: read JSONL, tokenize, write (strata with dedup off; datatrove `JsonlReader ->
DocumentTokenizer`). Workload B: exact and MinHash near dedup, then tokenize (strata's defaults;
datatrove's four MinHash stages with the same 5-word shingles, bands and rows as strata's defaults, then the
tokenizer).
The hand-written multiprocessing pipeline of `bench.preprocess` runs A as the physical reference.
Workload web (`--workload web`, on its own corpus: bench/webcorpus.py, `--web-mb` MB of WARC built from the
machine's HTML documentation with exact and near copies planted): FineWeb's pipeline, WARC -> URL blocklist ->
resiliparse's main text -> language ID (lid.176, en) -> Gopher -> C4 -> FineWeb -> MinHash -> PII -> tokenize,
strata's `--preset web` against datatrove's own steps set to the same thresholds, extractor, model file and
MinHash bands; it reports the documents each kept and how far the two sets agree, and, as the yardstick
for that agreement, how far datatrove's own MinHash agrees with itself seeded 2 instead of 1.

Every run is a whole process timed on the wall clock, the systems alternating, on --cores cores
(datatrove: 16 tasks on that many workers). datatrove runs in its own environment, `.venv-peer`
(`make bench` builds it with the pinned version: not a dependency of strata). strata runs twice: with its own
embedded Ray, as a laptop command does, and joining a head that is already up (`strata head start`, started
once by the bench), as a scheduled job on a cluster does. The last lines are the throughput ratios
strata/datatrove for A and for B, per corpus, embedded and on the head (the targets: >= 1.5 embedded and
>= 2 on a head for A on the real corpus).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

from strata.cluster.procs import processes, tree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_PYTHON = os.path.join(REPO, ".venv-peer", "bin", "python")
VOCAB, SEQ_LEN = 32768, 1024
SUFFIXES = (".py", ".md", ".rst", ".txt")


def real_corpus(root: str, mb: int) -> list[str]:
    """The installed packages' text files, in path order, until `mb` MB: JSONL parts of ~8 MB."""
    done = os.path.join(root, f".done-{mb}")
    if not os.path.exists(done):
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        site = sysconfig.get_paths()["purelib"]
        paths = sorted(os.path.join(d, f) for d, _, fs in os.walk(site) for f in fs if f.endswith(SUFFIXES))
        parts, total, part_size = [[]], 0, 0
        for i, path in enumerate(paths):
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            if not text.strip():
                continue
            line = json.dumps({"id": f"doc-{i:07d}", "text": text}) + "\n"
            if part_size > 8 << 20:
                parts.append([])
                part_size = 0
            parts[-1].append(line)
            part_size += len(line)
            total += len(line)
            if total >= mb << 20:
                break
        for n, lines in enumerate(parts):
            with open(os.path.join(root, f"part-{n:04d}.jsonl"), "w") as f:
                f.writelines(lines)
        open(done, "w").close()
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".jsonl"))


def web_tokenizer(path: str, warcs: list[str]) -> str:
    """A byte-level BPE of VOCAB ids trained on the main text of the first pages of the web corpus."""
    if not os.path.exists(path):
        from strata.data.tokenizer import train_bpe
        from strata.data.web import documents

        texts = []
        with open(warcs[0], "rb") as f:
            for status, row in documents(f, warcs[0], "warc", library="fastwarc", extractor="resiliparse",
                                         limit=1 << 26, compressed=True):
                if status == "ok":
                    texts.append(row["text"][:20000])
                if len(texts) == 3000:
                    break
        with open(path, "w") as f:
            f.write(train_bpe(iter(texts), VOCAB).definition)
    return path


def _lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def tokenizer(path: str, sample_from: list[str]) -> str:
    """A byte-level BPE of VOCAB ids trained on the first documents of both corpora."""
    if not os.path.exists(path):
        from strata.data.tokenizer import train_bpe

        texts = []
        for p in sample_from:
            with open(p) as f:
                texts += [json.loads(line)["text"][:20000] for _, line in zip(range(1500), f, strict=False)]
        with open(path, "w") as f:
            f.write(train_bpe(iter(texts), VOCAB).definition)
    return path


LARGEST = {"mb": 0.0}  # the largest resident set of any process of the last timed command


def _tree_rss_mb(root: int) -> float:
    """The largest resident set (MB) of `root` and its descendants now."""
    procs = processes()
    return max((procs[p].rss_mb for p in tree(root, procs)), default=0.0)


def timed(cmd: list[str], env: dict | None = None) -> tuple[float, str]:
    """Run `cmd` to its end; its wall seconds and stdout, and in LARGEST its largest process (sampled 4/s)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})}, stdout=out, stderr=err, text=True)
        LARGEST["mb"] = 0.0
        while proc.poll() is None:
            LARGEST["mb"] = max(LARGEST["mb"], _tree_rss_mb(proc.pid))
            time.sleep(0.25)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed:\n{stderr[-3000:]}")
    return seconds, stdout


def running_head(work: str, cores: int) -> tuple[dict, callable]:
    """`strata head start` on free ports with a home of its own: (the environment a command needs to join it,
    RAY_ADDRESS and that home; a function that stops it)."""
    import re
    import socket

    def free() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    home = tempfile.mkdtemp(prefix="head-home-", dir=work)
    env = {**os.environ, "HOME": home, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    out = subprocess.run([sys.executable, "-m", "strata", "head", "start", f"--port={free()}",
                          f"--dashboard-port={free()}", f"--agent-port={free()}", f"--client-port={free()}",
                          f"--num-cpus={cores}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"strata head start failed: {out.stderr[-3000:]}")
    gcs = re.search(r"GCS (\S+),", out.stdout + out.stderr).group(1)

    def stop() -> None:
        subprocess.run([sys.executable, "-m", "strata", "head", "stop"], cwd=REPO, env=env, capture_output=True,
                       timeout=300)
        shutil.rmtree(home, ignore_errors=True)

    return {"HOME": home, "RAY_ADDRESS": gcs}, stop


def run_strata(corpus: str, tok: str, work: str, workload: str, cores: int, head: dict | None = None) -> dict:
    """One `python -m pipelines.preprocess`, with its own embedded Ray, or joining `head` (running_head's)."""
    storage = os.path.join(work, "strata")
    shutil.rmtree(storage, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", corpus, "--dataset", "peer", "--tokenizer", tok,
           "--seq-len", str(SEQ_LEN), "--min-chars", "1", "--json"]
    if workload == "A":
        cmd += ["--no-exact-dedup", "--no-near-dedup"]
    seconds, out = timed(cmd, {"STRATA_STORAGE": storage, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(head or {})})
    s = json.loads(out.strip().splitlines()[-1])
    return {"seconds": seconds, "tokens": s["tokens"], "documents": s["documents"],
            "removed": _removed_ids(storage, f"{s['dataset']}@{s['version']}"),
            "largest_mb": LARGEST["mb"],
            "stages": s["stats"].get("cpu_s_by_stage", {}), "steps": s["stats"].get("wall_s_by_step", []),
            "peak_worker_rss_mb": s["stats"]["peak_worker_rss_mb"]}


def run_strata_web(corpus: str, blocklist: str, tok: str, work: str, head: dict | None = None) -> dict:
    """One `python -m pipelines.preprocess --preset web` over the crawl: the kept pages' URLs, from its lineage."""
    storage = os.path.join(work, "strata")
    shutil.rmtree(storage, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", corpus, "--dataset", "web", "--tokenizer", tok,
           "--seq-len", str(SEQ_LEN), "--preset", "web", "--languages", "en", "--url-blocklist", blocklist,
           "--html-extractor", "resiliparse", "--json"]
    seconds, out = timed(cmd, {"STRATA_STORAGE": storage, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **(head or {})})
    s = json.loads(out.strip().splitlines()[-1])
    kept, removed = _kept_urls(storage, f"{s['dataset']}@{s['version']}")
    return {"seconds": seconds, "tokens": s["tokens"], "documents": s["documents"], "reasons": s["reasons"],
            "kept": kept, "passed": sorted(kept + removed), "largest_mb": LARGEST["mb"],
            "stages": s["stats"].get("cpu_s_by_stage", {}), "steps": s["stats"].get("wall_s_by_step", []),
            "peak_worker_rss_mb": s["stats"]["peak_worker_rss_mb"]}


def _kept_urls(storage: str, ref: str) -> tuple[list[str], list[str]]:
    """The URLs of the pages a version holds (its lineage names each record's file and offset, and the record's
    header its URL), and of those its dedup removed (the removed list beside the version names them alike)."""
    import pyarrow.parquet as pq

    from strata.data.dataset import resolve
    from strata.data.storage import Storage

    v = resolve(Storage(storage), ref)
    places = pq.read_table(v.file(v.manifest.lineage["file"]), columns=["source", "position"])
    kept = [_url_at(s, p) for s, p in zip(places["source"].to_pylist(), places["position"].to_pylist(), strict=True)]
    removed = v.manifest.dedup.get("removed")
    parts = sorted(glob.glob(os.path.join(v.file(removed), "*.parquet"))) if removed else []
    ids = pq.read_table(parts).column("doc_id").to_pylist() if parts else []
    return sorted(kept), sorted(_url_at(*i.rsplit(":", 1)) for i in ids)


def _url_at(path: str, offset) -> str:
    """The WARC-Target-URI of the record (its own gzip member) at `offset` of `path`."""
    import zlib

    with open(path, "rb") as f:
        f.seek(int(offset))
        head = zlib.decompressobj(31).decompress(f.read(1 << 16), 1 << 14)
    return next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                if line.lower().startswith(b"warc-target-uri:"))


def _removed_ids(storage: str, ref: str) -> list[str]:
    """The corpus ids of the documents strata's dedup removed: its list beside the version names records
    `PATH:OFFSET`, and each record's `id` is read back from there."""
    import pyarrow.parquet as pq

    from strata.data.dataset import resolve
    from strata.data.storage import Storage

    v = resolve(Storage(storage), ref)
    removed = v.manifest.dedup.get("removed")
    parts = sorted(glob.glob(os.path.join(v.file(removed), "*.parquet"))) if removed else []
    if not parts:  # nothing removed: the directory has no parts
        return []
    ids = []
    for doc_id in pq.read_table(parts).column("doc_id").to_pylist():
        path, offset = doc_id.rsplit(":", 1)
        with open(path, "rb") as f:
            f.seek(int(offset))
            ids.append(json.loads(f.readline()).get("id", doc_id))
    return ids


def run_peer(corpus: str, tok: str, work: str, workload: str, cores: int) -> dict:
    out = os.path.join(work, "datatrove")
    shutil.rmtree(out, ignore_errors=True)
    from pipelines.dedup import DedupConfig

    bands, rows = DedupConfig().lsh()  # the same LSH as strata's defaults
    seconds, stdout = timed([PEER_PYTHON, os.path.join(REPO, "bench", "peer_datatrove.py"), "--workload", workload,
                             "--input", corpus, "--tokenizer", tok, "--out", out, "--workers", str(cores),
                             "--bands", str(bands), "--rows", str(rows)])
    r = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": seconds, "tokens": r["tokens"], "removed": r["removed"], "largest_mb": LARGEST["mb"]}


def run_peer_web(corpus: str, blocklist: str, tok: str, work: str, cores: int) -> dict:
    from pipelines.clean import LID_MODEL
    from pipelines.dedup import DedupConfig

    out = os.path.join(work, "datatrove")
    shutil.rmtree(out, ignore_errors=True)
    bands, rows = DedupConfig().lsh()
    model = os.path.join(os.path.dirname(__import__(LID_MODEL[0]).__file__), LID_MODEL[1])
    seconds, stdout = timed([PEER_PYTHON, os.path.join(REPO, "bench", "peer_datatrove.py"), "--workload", "web",
                             "--input", corpus, "--tokenizer", tok, "--out", out, "--workers", str(cores),
                             "--bands", str(bands), "--rows", str(rows), "--blocklist", blocklist,
                             "--lid-model", model])
    r = json.loads(stdout.strip().splitlines()[-1])
    return {"seconds": seconds, "tokens": r["tokens"], "kept": r["kept"], "passed": r["passed"],
            "largest_mb": LARGEST["mb"]}


def run_peer_reseeded(work: str, seed: int, cores: int) -> list[str]:
    """datatrove's MinHash alone with another seed over what its last web run passed (not timed): the URLs kept."""
    from pipelines.dedup import DedupConfig

    bands, rows = DedupConfig().lsh()
    out = os.path.join(work, f"datatrove-seed{seed}")
    shutil.rmtree(out, ignore_errors=True)
    _, stdout = timed([PEER_PYTHON, os.path.join(REPO, "bench", "peer_datatrove.py"), "--workload", "reseed",
                       "--input", os.path.join(work, "datatrove", "filtered"), "--tokenizer", "-", "--out", out,
                       "--workers", str(cores), "--bands", str(bands), "--rows", str(rows), "--seed", str(seed)])
    return json.loads(stdout.strip().splitlines()[-1])["kept"]


def run_baseline(corpus: str, tok: str, work: str, cores: int) -> dict:
    out = os.path.join(work, "baseline")
    shutil.rmtree(out, ignore_errors=True)
    code = ("import glob, json, sys; from bench.preprocess import baseline; "
            f"r = baseline(sorted(glob.glob({corpus!r} + '/*.jsonl')), {tok!r}, {out!r}, {cores}); "
            "print(json.dumps(r))")
    seconds, stdout = timed([sys.executable, "-c", code], {"TOKENIZERS_PARALLELISM": "false"})
    return {"seconds": seconds, "tokens": json.loads(stdout.strip().splitlines()[-1])["tokens"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=100, help="size of each corpus (default 100)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each system; the median is kept (default 1)")
    p.add_argument("--workload", "--only", dest="only", choices=["A", "B", "web"], action="append",
                   help="one workload, or several (default A and B)")
    p.add_argument("--web-mb", type=int, default=200, help="size of the web workload's WARC corpus (default 200)")
    p.add_argument("--corpus", choices=["generated", "real"], action="append", help="one corpus (default both)")
    p.add_argument("--memory-gb", type=float, default=0,
                   help="also run workload A on a generated corpus of this many GB and print each one's largest process")
    p.add_argument("--cores", type=int, default=os.cpu_count())
    p.add_argument("--head", action=argparse.BooleanOptionalAction, default=True,
                   help="also run strata against a running head (strata head start), as a scheduled job on a "
                        "cluster does: it pays no Ray start (default: on)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "strata-bench-peer"))
    a = p.parse_args(argv)
    if not os.path.exists(PEER_PYTHON):
        sys.exit(f"no {PEER_PYTHON}: `make bench` builds it (datatrove, pinned, in its own environment)")
    from bench.preprocess import generate

    os.makedirs(a.workdir, exist_ok=True)
    workloads = a.only or ["A", "B"]
    tabular = [w for w in workloads if w != "web"]
    corpora = {}
    if tabular:
        corpora = {"generated": os.path.dirname(generate(os.path.join(a.workdir, f"generated-{a.mb}mb"), a.mb)[0]),
                   "real": os.path.dirname(real_corpus(os.path.join(a.workdir, f"real-{a.mb}mb"), a.mb)[0])}
        corpora = {k: v for k, v in corpora.items() if not a.corpus or k in a.corpus}
    ratios, results = {}, {}
    head, stop_head = running_head(a.workdir, a.cores) if a.head else ({}, None)
    try:
        if tabular:
            tok = tokenizer(os.path.join(a.workdir, "tokenizer.json"),
                            [sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".jsonl"))[0]
                             for d in corpora.values()])
            _workloads(a, tabular, corpora, tok, head, ratios, results)
        if "web" in workloads:
            _web(a, head, ratios, results)
    finally:
        if stop_head:
            stop_head()
    if a.memory_gb:
        big = os.path.dirname(generate(os.path.join(a.workdir, f"generated-{int(a.memory_gb * 1024)}mb"),
                                       int(a.memory_gb * 1024))[0])
        s, d = run_strata(big, tok, a.workdir, "A", a.cores), run_peer(big, tok, a.workdir, "A", a.cores)
        results["memory"] = {"gb": a.memory_gb, "strata": s, "datatrove": d}
        print(f"memory, workload A on {a.memory_gb:g} GB: largest process strata {s['largest_mb']:.0f} MB (largest "
              f"worker {s['peak_worker_rss_mb']:.0f} MB), datatrove {d['largest_mb']:.0f} MB; "
              f"{s['seconds']:.0f} s / {d['seconds']:.0f} s", flush=True)
    with open(os.path.join(a.workdir, "result.json"), "w") as f:
        json.dump(results, f, indent=1)
    for workload in tabular:
        parts = ", ".join(f"{c} {ratios[(workload, c)]:.2f}" for c in corpora)
        if a.head:
            parts += "; against a running head: " + ", ".join(f"{c} {ratios[(workload, c, 'head')]:.2f}" for c in corpora)
        print(f"workload {workload} throughput strata/datatrove: {parts}")
    if "web" in workloads:
        print(f"workload web throughput strata/datatrove: {ratios['web']:.2f}"
              + (f"; against a running head: {ratios['web', 'head']:.2f}" if a.head else "")
              + f"; kept documents agree on {results['web']['agreement']:.1%} (on {results['web']['filter_agreement']:.1%} "
              f"before dedup; datatrove with another MinHash seed, {results['web']['reseeded_agreement']:.1%})")
    return 0


def _web(a, head: dict, ratios: dict, results: dict) -> None:
    """The web workload: strata (embedded, and on the head) and datatrove, alternating, on the crawl."""
    from bench.webcorpus import build

    warcs, blocklist = build(os.path.join(a.workdir, f"web-{a.web_mb}mb"), a.web_mb)
    corpus = os.path.dirname(warcs[0])
    tok = web_tokenizer(os.path.join(a.workdir, "tokenizer-web.json"), warcs)
    print(f"corpus web: {sum(os.path.getsize(w) for w in warcs) / 1e6:.1f} MB of WARC in {len(warcs)} files; "
          f"BPE {VOCAB}; seq_len {SEQ_LEN}; {a.cores} cores", flush=True)
    runs = {"strata": [], "strata on a head": [], "datatrove": []}
    for _ in range(a.repeats):
        runs["strata"].append(run_strata_web(corpus, blocklist, tok, a.workdir))
        if head:
            runs["strata on a head"].append(run_strata_web(corpus, blocklist, tok, a.workdir, head))
        runs["datatrove"].append(run_peer_web(corpus, blocklist, tok, a.workdir, a.cores))
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items() if v}
    s, d = runs["strata"][-1], runs["datatrove"][-1]
    mine, theirs = set(s["kept"]), set(d["kept"])
    agreement = len(mine & theirs) / max(len(mine | theirs), 1)
    reseeded = set(run_peer_reseeded(a.workdir, 2, a.cores))
    floor = len(reseeded & theirs) / max(len(reseeded | theirs), 1)
    passed = {k: set(r["passed"]) for k, r in (("strata", s), ("datatrove", d))}
    both = passed["strata"] & passed["datatrove"]
    filters = len(both) / max(len(passed["strata"] | passed["datatrove"]), 1)
    print(f"  web: strata {med['strata']:.1f} s" + (f" (on a running head {med['strata on a head']:.1f} s)" if head else "")
          + f", datatrove {med['datatrove']:.1f} s; records {s['documents']['read']:,}; kept: strata {len(mine):,}, "
          f"datatrove {len(theirs):,}, both {len(mine & theirs):,} (agreement {agreement:.1%}); tokens "
          f"{s['tokens']:,} / {d['tokens']:,}; largest process {s['largest_mb']:.0f} / {d['largest_mb']:.0f} MB",
          flush=True)
    print(f"     passed the filters (before dedup): strata {len(passed['strata']):,}, datatrove "
          f"{len(passed['datatrove']):,}, both {len(both):,} (agreement {filters:.1%}); dedup removed strata "
          f"{len(passed['strata']) - len(mine):,}, datatrove {len(passed['datatrove']) - len(theirs):,}", flush=True)
    print(f"     datatrove against itself, its MinHash seeded 2 instead of 1 on the same passed pages: kept "
          f"{len(reseeded):,}, both {len(reseeded & theirs):,} (agreement {floor:.1%}): MinHash is a random "
          "estimate, and pages near the threshold fall either way", flush=True)
    print("     strata's reasons: " + ", ".join(f"{k} {v:,}" for k, v in sorted(s["reasons"].items())))
    if s["stages"]:
        print("     strata CPU s by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in s["stages"].items()))
        print("     strata wall s, critical path: " + ", ".join(f"{k} {v:.1f}" for k, v in s["steps"]))
    ratios["web"] = med["datatrove"] / med["strata"]
    if head:
        ratios["web", "head"] = med["datatrove"] / med["strata on a head"]
    results["web"] = {"median_s": med, "agreement": agreement, "filter_agreement": filters, "reseeded_agreement": floor, "strata": {**s, "kept": len(mine)},
                      "datatrove": {**d, "kept": len(theirs)}, "only_strata": sorted(mine - theirs)[:50],
                      "only_datatrove": sorted(theirs - mine)[:50]}


def _workloads(a, workloads: list[str], corpora: dict, tok: str, head: dict, ratios: dict, results: dict) -> None:
    """Each workload on each corpus: strata (embedded, and joining the head when there is one), datatrove and
    the multiprocessing baseline, alternating; the ratios and results, filled in."""
    for name, corpus in corpora.items():
        mb = sum(os.path.getsize(os.path.join(corpus, f)) for f in os.listdir(corpus)) / 1e6
        docs = sum(_lines(os.path.join(corpus, f)) for f in os.listdir(corpus) if f.endswith(".jsonl"))
        print(f"corpus {name}: {mb:.1f} MB, {docs:,} documents; BPE {VOCAB}; seq_len {SEQ_LEN}; {a.cores} cores",
              flush=True)
        for workload in workloads:
            runs = {"strata": [], "strata on a head": [], "datatrove": [], "baseline": []}
            for _ in range(a.repeats):  # alternating, so drift on a shared machine hits both
                runs["strata"].append(run_strata(corpus, tok, a.workdir, workload, a.cores))
                if head:
                    runs["strata on a head"].append(run_strata(corpus, tok, a.workdir, workload, a.cores, head))
                runs["datatrove"].append(run_peer(corpus, tok, a.workdir, workload, a.cores))
                if workload == "A":
                    runs["baseline"].append(run_baseline(corpus, tok, a.workdir, a.cores))
            med = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items() if v}
            s, d = runs["strata"][-1], runs["datatrove"][-1]
            line = (f"  {workload}: strata {med['strata']:.1f} s"
                    + (f" (on a running head {med['strata on a head']:.1f} s)" if head else "")
                    + f", datatrove {med['datatrove']:.1f} s"
                    + (f", multiprocessing {med['baseline']:.1f} s" if "baseline" in med else "")
                    + f"; tokens {s['tokens']:,} / {d['tokens']:,}; largest process {s['largest_mb']:.0f} / "
                    f"{d['largest_mb']:.0f} MB (strata's largest worker {s['peak_worker_rss_mb']:.0f} MB)")
            if workload == "B":
                a_, b_ = set(s["removed"]), set(d["removed"])
                line += (f"; removed: strata {len(a_):,}, datatrove {len(b_):,}, both {len(a_ & b_):,} "
                         f"(agreement {len(a_ & b_) / max(len(a_ | b_), 1):.1%} of either's)")
            print(line, flush=True)
            if s["stages"]:
                print("     strata CPU s by stage: " + ", ".join(f"{k} {v:.1f}" for k, v in s["stages"].items()))
                print("     strata wall s, critical path: " + ", ".join(f"{k} {v:.1f}" for k, v in s["steps"])
                      + f"; the rest (imports, Ray's shutdown) {med['strata'] - sum(v for _, v in s['steps']):.1f}")
            ratios[(workload, name)] = med["datatrove"] / med["strata"]
            if head:
                ratios[(workload, name, "head")] = med["datatrove"] / med["strata on a head"]
            results[f"{workload}:{name}"] = {"median_s": med, "strata": s, "datatrove": d,
                                             **({"strata_on_a_head": runs["strata on a head"][-1]} if head else {})}


if __name__ == "__main__":
    sys.exit(main())
