"""What language identification costs tier 1 (`--languages`).

    python -m bench.lid [--mb 50] [--repeats 3] [--json]

1. The detector alone, in this process: documents per second on one core, at
   the default prefix (`--language-chars`, 1,000 characters) and on whole
   documents.
2. The real command, `python -m pipelines.preprocess` (dedup and tokenize,
   the default pipeline) on the same corpus, timed on the wall clock, without
   and with `--languages '*'` (every document scored and counted by language,
   none filtered, so the work after the rule is the same), alternating, the
   median of `--repeats` runs of each.

The last line is the ratio of the two commands' wall times, with / without
(the target is <= 1.2: within 20% of tier 1's throughput without it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from bench.peer import real_corpus, timed, tokenizer

SEQ_LEN = 1024


def detector_rate(paths: list[str], chars: int, limit: int = 3000) -> float:
    """Documents per second of the language rule on one core."""
    from pipelines.clean import CleanConfig, LanguageRule

    rule = LanguageRule(CleanConfig(languages="*", language_chars=chars))
    texts = []
    for p in paths:
        with open(p) as f:
            texts += [json.loads(line)["text"] for line in f]
        if len(texts) >= limit:
            break
    texts = texts[:limit]
    t0 = time.process_time()
    for t in texts:
        rule.detect(t)
    return len(texts) / (time.process_time() - t0)


def preprocess(corpus: str, tok: str, storage: str, languages: bool) -> tuple[float, dict]:
    shutil.rmtree(storage, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipelines.preprocess", "--input", corpus, "--dataset", "lid", "--tokenizer", tok,
           "--seq-len", str(SEQ_LEN), "--min-chars", "1", "--json"]
    if languages:
        cmd += ["--languages", "*"]
    seconds, out = timed(cmd, {"STRATA_STORAGE": storage, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    return seconds, json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=50, help="corpus size (installed packages' text; default 50)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each command (default 3)")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "strata-bench-lid"))
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the ratio")
    args = parser.parse_args(argv)

    corpus_dir = os.path.join(args.workdir, f"real-{args.mb}mb")
    paths = real_corpus(corpus_dir, args.mb)
    tok = tokenizer(os.path.join(args.workdir, "tokenizer.json"), paths)
    rates = {chars: detector_rate(paths, chars) for chars in (1000, 10**9)}
    print(f"detector: {rates[1000]:,.0f} docs/s per core on the first 1,000 characters, {rates[10**9]:,.0f} on "
          "whole documents", flush=True)
    times = {False: [], True: []}
    summary = {}
    for _ in range(args.repeats):
        for languages in (False, True):
            seconds, summary[languages] = preprocess(corpus_dir, tok, os.path.join(args.workdir, "storage"), languages)
            times[languages].append(seconds)
            print(f"preprocess {'with' if languages else 'without'} --languages: {seconds:.1f} s", flush=True)
    by_language = summary[True]["stats"].get("documents_by_language", {})
    top = ", ".join(f"{k} {v}" for k, v in list(by_language.items())[:5])
    print(f"{summary[True]['documents']['read']:,} documents; by language: {top}")
    without, with_ = statistics.median(times[False]), statistics.median(times[True])
    if args.json:
        print(json.dumps({"mb": args.mb, "docs_per_s_per_core": {"first_1000_chars": rates[1000],
                                                                  "whole": rates[10**9]},
                          "seconds": {"without": times[False], "with": times[True]}, "by_language": by_language}))
    print(f"ratio wall time with / without --languages: {with_ / without:.2f}")


if __name__ == "__main__":
    main()
