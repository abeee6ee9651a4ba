"""Near-duplicate recall and precision against Jaccard similarity, beside LSH's theoretical S-curve.

    python -m bench.dedup [--pairs 4000] [--words 100] [--vocab 2000] [--threshold 0.8]

Generated pairs: a document of about `--words` words from a `--vocab`-word
vocabulary, and a copy with a random share of its words replaced, from none
to all, so the pairs cover the whole range of similarity. Each pair's true
Jaccard similarity is measured on the same word shingles the pipeline uses;
whether the pair shares an LSH band is what the pipeline decides
(pipelines/dedup.py `MinHasher`, the default bands and rows for the
threshold). Printed: per similarity bin, the pairs, the share that
collided and the S-curve's chance at the bin's mean similarity; then recall
(pairs at or above the threshold that collide) and precision (colliding
pairs that are at or above it). The last line is recall and precision
against what the S-curve predicts for the same pairs.
"""

from __future__ import annotations

import argparse
import json
import random
import re

import numpy as np

from pipelines.dedup import DedupConfig, MinHasher, collision_probability


def shingles(text: str, k: int) -> set[tuple[str, ...]]:
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i: i + k]) for i in range(max(1, len(words) - k + 1))}


def pairs(n: int, words: int, vocab: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    vocabulary = [f"w{i}" for i in range(vocab)]
    out = []
    for _ in range(n):
        doc = [rng.choice(vocabulary) for _ in range(rng.randint(int(words * 0.8), int(words * 1.2)))]
        copy = list(doc)
        for i in rng.sample(range(len(doc)), int(len(doc) * rng.random() ** 2)):  # most pairs are close
            copy[i] = rng.choice(vocabulary)
        out.append((" ".join(doc), " ".join(copy)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--words", type=int, default=100)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--threshold", type=float, default=DedupConfig().threshold)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    cfg = DedupConfig(threshold=args.threshold)
    bands, rows = cfg.lsh()
    hasher = MinHasher(cfg)
    sims, hits = [], []
    for a, b in pairs(args.pairs, args.words, args.vocab, args.seed):
        sa, sb = shingles(a, cfg.shingle_words), shingles(b, cfg.shingle_words)
        sims.append(len(sa & sb) / len(sa | sb))
        ka, kb = hasher.band_keys(hasher.signature(a)), hasher.band_keys(hasher.signature(b))
        hits.append(bool(np.intersect1d(ka, kb).size))
    sims, hits = np.array(sims), np.array(hits)
    expected = collision_probability(sims, bands, rows)
    print(f"{args.pairs} pairs of ~{args.words}-word documents, {args.vocab}-word vocabulary, "
          f"{cfg.shingle_words}-word shingles; {bands} bands x {rows} rows of {cfg.num_perm} permutations "
          f"for threshold {cfg.threshold} (false-negative weight {cfg.false_negative_weight})")
    print(f"{'similarity':>12} {'pairs':>7} {'collided':>9} {'S-curve':>8}")
    table = []
    for lo in np.arange(0.0, 1.0, 0.1):
        hi = lo + 0.1 if lo < 0.85 else 1.0 + 1e-9
        sel = (sims >= lo) & (sims < hi)
        if sel.any():
            row = {"from": round(lo, 1), "pairs": int(sel.sum()), "collided": float(hits[sel].mean()),
                   "s_curve": float(collision_probability(sims[sel].mean(), bands, rows))}
            table.append(row)
            print(f"{lo:5.1f}-{min(hi, 1.0):4.1f}  {row['pairs']:7d} {row['collided']:9.3f} {row['s_curve']:8.3f}")
    above = sims >= cfg.threshold
    recall = hits[above].mean() if above.any() else float("nan")
    precision = above[hits].mean() if hits.any() else float("nan")
    recall_expected = expected[above].mean() if above.any() else float("nan")
    precision_expected = (expected * above).sum() / max(expected.sum(), 1e-12)
    print(f"recall {recall:.4f} (S-curve {recall_expected:.4f}), precision {precision:.4f} "
          f"(S-curve {precision_expected:.4f}) at similarity >= {cfg.threshold}")
    if args.json:
        print(json.dumps({"bands": bands, "rows": rows, "table": table, "recall": recall, "precision": precision,
                          "recall_s_curve": recall_expected, "precision_s_curve": precision_expected}))
    print(f"ratio measured/S-curve: recall {recall / recall_expected:.3f}, precision "
          f"{precision / precision_expected:.3f}")


if __name__ == "__main__":
    main()
