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
    p.add_argument("--workload", choices=["A", "B", "web", "reseed"], required=True)
    p.add_argument("--input", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--ngrams", type=int, default=5)
    p.add_argument("--bands", type=int, default=14)
    p.add_argument("--rows", type=int, default=9)
    p.add_argument("--seed", type=int, default=1, help="reseed: the MinHash seed")
    p.add_argument("--eos", default="<|endoftext|>")
    p.add_argument("--blocklist", help="web: the URL blocklist file (one domain a line)")
    p.add_argument("--lid-model", help="web: the fastText lid.176 model file (strata's, so both read the same)")
    p.add_argument("--language-chars", type=int, default=1000)
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
    if a.workload == "reseed":
        print(json.dumps({"kept": reseeded(a, run)}))
        return
    if a.workload == "web":
        kept, passed = web(a, run, tokenizer)
        print(json.dumps({"tokens": _tokens(a.out), "kept": kept, "passed": passed}))
        return
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
    print(json.dumps({"tokens": _tokens(a.out), "removed": sorted(removed)}))


def _tokens(out: str) -> int:
    return sum(os.path.getsize(p) // 2 for p in glob.glob(f"{out}/tokens/*.ds"))  # 2 bytes an id below 65,536


def web(a, run, tokenizer) -> list[str]:
    """FineWeb's pipeline as datatrove's own example runs it, with strata's web preset's thresholds and
    extractor: WARC -> URL filter -> resiliparse main text -> language ID -> Gopher repetition and quality ->
    C4 -> FineWeb -> MinHash (four stages) -> PII formatting -> tokenizer. Returns the kept documents' URLs, and
    those of the documents that passed the filters (before MinHash)."""
    from datatrove.pipeline.dedup import MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
    )
    from datatrove.pipeline.extractors.base import BaseExtractor
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
        LambdaFilter,
        LanguageFilter,
        URLFilter,
    )
    from datatrove.pipeline.formatters import PIIFormatter
    from datatrove.pipeline.readers import JsonlReader, WarcReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.lid import FastTextLID

    class Resiliparse(BaseExtractor):  # datatrove 0.10 ships trafilatura's; strata's default is resiliparse
        name = "resiliparse"

        def __init__(self, timeout: float = 1):
            super().__init__(timeout)

        def extract(self, text: str) -> str:
            from resiliparse.extract.html2text import extract_plain_text
            from resiliparse.parse.html import HTMLTree

            return extract_plain_text(HTMLTree.parse(text), preserve_formatting=True, main_content=True,
                                      list_bullets=False, alt_texts=False, comments=False)

    class LocalLID(FastTextLID):  # the same model file as strata's, read from disk (never downloaded)
        def __init__(self, path: str, chars: int):
            super().__init__(["en"])
            self.path, self.chars = path, chars

        @property
        def model(self):
            if self._model is None:
                from fasttext.FastText import _FastText

                self._model = _FastText(self.path)
            return self._model

        def __getstate__(self):  # loaded in the process that reads, never pickled to the next stage's
            return {**self.__dict__, "_model": None}

        def predict(self, doc):
            langs, scores = self.model.predict(" ".join(doc.text[: self.chars].split()), k=1)
            best = (langs[0].split("__")[2], float(scores[0]))
            return best, {"en": best[1] if best[0] == "en" else 0.0}

    with open(a.blocklist) as f:
        domains = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    urls = URLFilter(extra_domains=domains, use_integrated_lists=False)
    from tldextract import TLDExtract

    urls.tldextractor = TLDExtract(suffix_list_urls=())  # the bundled suffix list: no fetch
    language = LanguageFilter(languages=["en"], language_threshold=0.65)
    language.model = LocalLID(a.lid_model, a.language_chars)
    bad = ("lorem ipsum", "javascript", "cookie policy", "terms of use", "privacy policy")

    cfg = MinhashConfig(n_grams=a.ngrams, num_buckets=a.bands, hashes_per_bucket=a.rows)
    tasks = len(glob.glob(f"{a.input}/*.warc.gz"))
    s1 = run([WarcReader(a.input, glob_pattern="*.warc.gz"), urls, Resiliparse(), language,
              GopherRepetitionFilter(dup_line_frac=0.3, dup_para_frac=None, dup_line_char_frac=None,
                                     dup_para_char_frac=None, top_n_grams=((2, 0.2),), dup_n_grams=((5, 0.15),)),
              GopherQualityFilter(min_stop_words=None),
              C4QualityFilter(remove_citations=False, filter_no_terminal_punct=False, min_num_sentences=-1,
                              min_words_per_line=-1, max_word_length=-1, filter_javascript=False, filter_policy=False),
              LambdaFilter(lambda doc: not any(p in doc.text.lower() for p in bad)),  # strata's C4 phrases: the document
              FineWebQualityFilter(char_duplicates_ratio=0.1, new_line_ratio=1e9),
              JsonlWriter(f"{a.out}/filtered")], tasks, "filter")
    s2 = run([JsonlReader(f"{a.out}/filtered"), MinhashDedupSignature(output_folder=f"{a.out}/sigs", config=cfg)],
             tasks, "signatures", depends=s1)
    s3 = run([MinhashDedupBuckets(input_folder=f"{a.out}/sigs", output_folder=f"{a.out}/buckets", config=cfg)],
             a.bands, "buckets", depends=s2)
    s4 = run([MinhashDedupCluster(input_folder=f"{a.out}/buckets", output_folder=f"{a.out}/remove", config=cfg)],
             1, "clusters", depends=s3)
    s5 = run([JsonlReader(f"{a.out}/filtered"), MinhashDedupFilter(input_folder=f"{a.out}/remove"), PIIFormatter(),
              url_writer(f"{a.out}/kept"), tokenizer()], tasks, "dedup-tokenize", depends=s4)
    s5.run()
    kept, passed = _urls(f"{a.out}/kept"), []
    for path in glob.glob(f"{a.out}/filtered/*.jsonl.gz"):  # what passed the filters, before MinHash
        with gzip.open(path, "rt") as f:
            passed += [json.loads(line)["metadata"]["url"] for line in f]
    return sorted(kept), sorted(passed)


def url_writer(folder: str):
    """A pipeline step that writes each document's URL to `folder`, a file per rank, and passes it on."""
    def keep_urls(data, rank: int = 0, world_size: int = 1):
        os.makedirs(folder, exist_ok=True)
        with open(f"{folder}/{rank:05d}.txt", "w") as f:
            for doc in data:
                f.write(doc.metadata["url"] + "\n")
                yield doc

    return keep_urls


def _urls(folder: str) -> list[str]:
    urls = []
    for path in glob.glob(f"{folder}/*.txt"):
        with open(path) as f:
            urls += f.read().split()
    return sorted(urls)


def reseeded(a, run) -> list[str]:
    """datatrove's four MinHash stages alone, seeded with `--seed`, over the documents a web run passed
    (`--input`: its `filtered` folder): the URLs they keep. Two seeds of one MinHash part ways on pairs near
    the threshold, so their agreement is the most any two implementations can be expected to reach."""
    from datatrove.pipeline.dedup import MinhashDedupSignature
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
    )
    from datatrove.pipeline.readers import JsonlReader

    cfg = MinhashConfig(n_grams=a.ngrams, num_buckets=a.bands, hashes_per_bucket=a.rows, seed=a.seed)
    tasks = len(glob.glob(f"{a.input}/*.jsonl.gz"))
    s1 = run([JsonlReader(a.input), MinhashDedupSignature(output_folder=f"{a.out}/sigs", config=cfg)], tasks, "signatures")
    s2 = run([MinhashDedupBuckets(input_folder=f"{a.out}/sigs", output_folder=f"{a.out}/buckets", config=cfg)],
             a.bands, "buckets", depends=s1)
    s3 = run([MinhashDedupCluster(input_folder=f"{a.out}/buckets", output_folder=f"{a.out}/remove", config=cfg)],
             1, "clusters", depends=s2)
    run([JsonlReader(a.input), MinhashDedupFilter(input_folder=f"{a.out}/remove"), url_writer(f"{a.out}/kept")],
        tasks, "filter", depends=s3).run()
    return _urls(f"{a.out}/kept")


if __name__ == "__main__":
    main()
