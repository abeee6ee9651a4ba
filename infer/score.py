"""Documents scored under a model: mean negative log-likelihood per token (nats) and bits per byte.

A document is tokenized as tier 1 tokenizes it and scored whole, after an end-of-text id (the context a
packed row gives a document's first token). A document longer than the model's context is scored in
windows of the context that move by `stride`: each token is predicted once, by the first window that
reaches it, with at least context - stride tokens before it (all of them inside the first window).
Windows of like length are batched together, up to `batch_tokens` tokens a batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

IGNORE = -1  # a target the model's per-token loss leaves at 0 (train/model.py token_losses)


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first) over a document of `n` tokens after an end-of-text id (n + 1 ids): the window's
    inputs are ids[begin:end], its targets ids[begin + 1:end + 1], and it counts targets from position
    `first` on (earlier ones a previous window predicted)."""
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be between 1 and the context ({context}), not {stride}")
    out, begin, done = [], 0, 0  # done: the targets predicted so far are ids[1:done + 1]
    while done < n:
        end = min(begin + context, n)
        out.append((begin, end, done + 1))
        done = end
        begin += stride
    return out


@dataclass
class Scored:
    tokens: int
    nll: float  # summed over the tokens, in nats

    def loss(self) -> float:
        return self.nll / self.tokens if self.tokens else math.nan


def score_ids(model, docs: list[np.ndarray], eot_id: int, *, stride: int, batch_tokens: int,
              device: str = "cpu") -> list[Scored]:
    """Each document's (tokens, summed NLL): `docs` are token ids, without the end-of-text id before them."""
    context = model.cfg.seq_len
    items = []  # (doc, inputs, targets with the ones not counted as IGNORE)
    for d, ids in enumerate(docs):
        seq = np.concatenate([[eot_id], np.asarray(ids, dtype=np.int64)])
        for begin, end, first in windows(len(ids), context, stride):
            targets = seq[begin + 1:end + 1].copy()
            targets[: first - (begin + 1)] = IGNORE
            items.append((d, seq[begin:end], targets))
    items.sort(key=lambda it: len(it[1]))
    nll = np.zeros(len(docs))
    at = 0
    with torch.no_grad():
        while at < len(items):
            width = len(items[at][1])
            rows = max(1, batch_tokens // max(width, 1))
            # A batch holds windows of lengths [width, 2 * width) at most, padded to the longest.
            batch = [it for it in items[at:at + rows] if len(it[1]) < 2 * width] or items[at:at + 1]
            at += len(batch)
            T = max(len(it[1]) for it in batch)
            x = torch.zeros((len(batch), T), dtype=torch.long)
            y = torch.full((len(batch), T), IGNORE, dtype=torch.long)
            for i, (_, inputs, targets) in enumerate(batch):
                x[i, : len(inputs)] = torch.from_numpy(inputs)
                y[i, : len(targets)] = torch.from_numpy(targets)
            _, losses = model(x.to(device), y.to(device), per_token=True)
            sums = losses.view(len(batch), T).sum(dim=1).double().cpu().numpy()
            for (d, _, _), s in zip(batch, sums, strict=True):
                nll[d] += s
    return [Scored(len(ids), float(v)) for ids, v in zip(docs, nll, strict=True)]


class Scorer:
    """A Ray Data actor: the model built once, then batches of documents scored (map_batches)."""

    def __init__(self, model, stride: int, batch_tokens: int, cpus: float, device: str = "cpu"):
        from infer.model import threads

        threads(cpus)
        self.model, self.tok = model.build(device)
        self.stride, self.batch_tokens, self.device = stride, batch_tokens, device

    def __call__(self, batch: dict) -> dict:
        texts, status = list(batch["text"]), list(batch["status"])
        ok = [i for i, s in enumerate(status) if s == "ok" and texts[i]]
        ids = [self.tok.encode(texts[i]) for i in ok]
        scored = score_ids(self.model, ids, self.tok.eot_id, stride=self.stride, batch_tokens=self.batch_tokens,
                           device=self.device)
        n = len(texts)
        tokens, loss, bpb = np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan)
        for i, s in zip(ok, scored, strict=True):
            tokens[i], loss[i] = s.tokens, s.loss()
            bpb[i] = s.nll / math.log(2) / max(1, len(texts[i].encode()))
        scored_ok = set(ok)
        reason = ["" if i in scored_ok else f"{status[i]}:{batch['reason'][i]}" if status[i] != "ok" else "rejected:empty"
                  for i in range(n)]
        return {"doc_id": batch["doc_id"], "source": batch["source"], "tokens": tokens, "loss": loss, "bpb": bpb,
                "bytes": np.array([len(t.encode()) for t in texts], np.int64), "unscored": np.array(reason, dtype=object)}
