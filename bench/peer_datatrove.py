"""The peer: datatrove on a JSONL corpus, as a team choosing a CPU pipeline would run it.

    .venv-peer/bin/python bench/peer_datatrove.py --workload A|B --input DIR --tokenizer tokenizer.json --out DIR

Runs in its own environment (`make bench` builds `.venv-peer` with the pinned datatrove); it imports
nothing of strata. Workload A: `JsonlReader -> DocumentTokenizer`. Workload B: datatrove's four MinHash
stages (signatures, buckets, clusters, filter) with the given shingle size and band layout, the filter
writing the removed documents, then `DocumentTokenizer`. `LocalPipelineExecutor` with `--tasks` tasks on
`--workers` processes per stage. The last line is JSON: documents, tokens, removed ids.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", choices=["A", "B"], required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--ngrams", type=int, default=5)
    p.add_argument("--bands", type=int, default=14)
    p.add_argument("--rows", type=int, default=9)
    p.add_argument("--eos", default="<|endoftext|>")
    a = p.parse_args()

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.tokens import DocumentTokenizer

    def tokenizer():
        return DocumentTokenizer(output_folder=f"{a.out}/tokens", tokenizer_name_or_path=a.tokenizer,
                                 eos_token=a.eos, local_working_dir=f"{a.out}/tokens-tmp")

    def run(pipeline, tasks, name, depends=None):
        ex = LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(a.workers, tasks),
                                   logging_dir=f"{a.out}/logs/{name}", depends=depends)
        return ex

    removed = []
    if a.workload == "A":
        run([JsonlReader(a.input), tokenizer()], a.tasks, "tokenize").run()
    else:
        from datatrove.pipeline.dedup import MinhashDedupSignature
        from datatrove.pipeline.dedup.minhash import (
            MinhashConfig,
            MinhashDedupBuckets,
            MinhashDedupCluster,
            MinhashDedupFilter,
        )
        from datatrove.pipeline.writers import JsonlWriter

        cfg = MinhashConfig(n_grams=a.ngrams, num_buckets=a.bands, hashes_per_bucket=a.rows)
        s1 = run([JsonlReader(a.input), MinhashDedupSignature(output_folder=f"{a.out}/sigs", config=cfg)],
                 a.tasks, "signatures")
        s2 = run([MinhashDedupBuckets(input_folder=f"{a.out}/sigs", output_folder=f"{a.out}/buckets", config=cfg)],
                 a.bands, "buckets", depends=s1)
        s3 = run([MinhashDedupCluster(input_folder=f"{a.out}/buckets", output_folder=f"{a.out}/remove", config=cfg)],
                 1, "clusters", depends=s2)
        s4 = run([JsonlReader(a.input), MinhashDedupFilter(input_folder=f"{a.out}/remove",
                                                           exclusion_writer=JsonlWriter(f"{a.out}/removed")),
                  tokenizer()], a.tasks, "filter-tokenize", depends=s3)
        s4.run()
        for path in glob.glob(f"{a.out}/removed/*.jsonl.gz"):
            with gzip.open(path, "rt") as f:
                removed += [json.loads(line)["id"] for line in f]
    tokens = 0
    for path in glob.glob(f"{a.out}/tokens/*.ds"):  # token ids, 2 bytes each below 65,536 ids
        tokens += os.path.getsize(path) // 2
    print(json.dumps({"tokens": tokens, "removed": sorted(removed)}))


if __name__ == "__main__":
    main()
