"""Scoring throughput: strata's scorer against Hugging Face transformers on the same model, documents and
cores, and the whole `python -m infer score` command at 1 actor and at one per core but one.

    python -m bench.infer [--docs 120] [--chars 3000] [--json]

The model has GPT-2's layout at a small size (4 layers, 256 wide, a context of 256) with random
weights, written as `python -m train.export` writes a model; the documents are generated text of about
`--chars` characters, byte-tokenized. Both sides score every document whole, in windows of the context
that move by half of it, and agree on the losses (checked here). The baseline is transformers'
GPT2LMHeadModel in the loop its documentation gives for the perplexity of a long text: one window a
forward pass, the loss from its logits. strata's scorer batches windows of like length, runs the last
block only where a loss is counted, and runs the blocks' linear layers through oneDNN with packed weights
(infer.model.PackedLinear: most of the gain on an AMD CPU, where the matmul transformers gets from MKL is
slow; less is to be expected where that matmul is fast). Both are timed on the wall clock in this process, with torch's threads
set to the cores, after a warm-up, alternating, median of 3.

The command is timed end to end (its own embedded Ray) on the same documents as files. On 2 cores the
second actor count equals the first (one CPU stays for reading), and only one is timed.

The last line is the ratio of tokens per second, strata / transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = ["model", "data", "train", "token", "shard", "the", "a", "of", "to", "and", "in", "is", "for", "on", "with", "cluster", "node", "batch", "loss", "step", "ray", "parquet", "spot", "tune", "layer"]


def make_model(directory: str) -> str:
    import torch

    from strata.data.tokenizer import ByteTokenizer
    from train.checkpoint import AsyncCheckpointer
    from train.export import export
    from train.model import GPT, preset

    cfg = preset("debug", n_layer=4, n_embd=256, n_head=4, seq_len=256)
    torch.manual_seed(0)
    model = GPT(cfg)
    ckpt = AsyncCheckpointer(model, torch.optim.AdamW(model.parameters()), 0)
    ckpt.start(1, {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())})
    _, local = ckpt.take()
    return export(local, os.path.join(directory, "model"))["out"]


def make_docs(n: int, chars: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        size = rng.randint(chars // 4, chars * 2)
        words = []
        while sum(len(w) + 1 for w in words) < size:
            words.append(rng.choice(WORDS))
        docs.append(" ".join(words) + ".")
    return docs


def hf_scores(hf, docs: list, eot_id: int, context: int, stride: int) -> list[float]:
    """Each document's summed NLL, transformers' way: a window a forward pass (no batching)."""
    import torch
    import torch.nn.functional as F

    from infer.score import windows

    out = []
    with torch.no_grad():
        for ids in docs:
            seq = torch.tensor([eot_id, *ids.tolist()])
            total = 0.0
            for begin, end, first in windows(len(ids), context, stride):
                logits = hf(seq[begin:end][None]).logits[0]
                targets = seq[begin + 1:end + 1].clone()
                targets[: first - (begin + 1)] = -100
                total += F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
            out.append(total)
    return out


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def command(model: str, corpus: str, storage: str, actors: int) -> float:
    env = {**os.environ, "STRATA_STORAGE": storage, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "infer", "score", "--model", model, "--input", corpus, "--name",
                           f"bench-{actors}", "--actors", str(actors), "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - started
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return wall


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.infer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=120)
    p.add_argument("--chars", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print a JSON result line before the ratio")
    a = p.parse_args(argv)
    import torch
    import transformers

    from infer.model import resolve
    from infer.score import CPU_BATCH_TOKENS, score_ids
    from strata.data.storage import Storage

    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    work = tempfile.mkdtemp(prefix="bench-infer-")
    model_dir = make_model(work)
    model, tok = resolve(model_dir, Storage(work)).build()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = make_docs(a.docs, a.chars)
    docs = [tok.encode(t) for t in texts]
    tokens = sum(len(d) for d in docs)
    context, stride = model.cfg.seq_len, model.cfg.seq_len // 2
    ours = score_ids(model, docs, tok.eot_id, stride=stride, batch_tokens=CPU_BATCH_TOKENS)  # also the warm-up
    theirs = hf_scores(hf, docs[:5], tok.eot_id, context, stride)
    worst = max(abs(o.nll - t) / max(1, o.tokens) for o, t in zip(ours, theirs, strict=False))
    times = {"strata": [], "transformers": []}
    for r in range(a.rounds):
        order = ("strata", "transformers") if r % 2 == 0 else ("transformers", "strata")
        for name in order:
            if name == "strata":
                times[name].append(timed(lambda: score_ids(model, docs, tok.eot_id, stride=stride, batch_tokens=CPU_BATCH_TOKENS)))
            else:
                times[name].append(timed(lambda: hf_scores(hf, docs, tok.eot_id, context, stride)))
    rate = {k: tokens / statistics.median(v) for k, v in times.items()}
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    for i, t in enumerate(texts):
        Path(corpus, f"doc{i:04d}.txt").write_text(t)
    counts = sorted({1, max(1, cores - 1)})
    walls = {n: command(model_dir, corpus, os.path.join(work, "storage"), n) for n in counts}
    result = {"cores": cores, "documents": len(docs), "tokens": tokens, "max_loss_difference": worst,
              "tokens_per_s": rate, "tokens_per_s_per_core": {k: v / cores for k, v in rate.items()},
              "command_wall_s_by_actors": walls, "command_tokens_per_s_by_actors": {n: tokens / w for n, w in walls.items()}}
    if a.json:
        print(json.dumps(result))
    print(f"command: {', '.join(f'{n} actor(s) {tokens / w:,.0f} tokens/s ({w:.1f} s)' for n, w in walls.items())}")
    print(f"ratio tokens/s per core, strata / transformers: {rate['strata'] / rate['transformers']:.2f} "
          f"({rate['strata'] / cores:,.0f} / {rate['transformers'] / cores:,.0f}; losses agree within {worst:.1e})")
    return result


if __name__ == "__main__":
    main()
