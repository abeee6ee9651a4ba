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

from train.step import (
    IGNORE,  # a target the model's per-token loss leaves at 0 (train/model.py token_losses)
)

# Tokens a batch of windows holds. On a CPU, 4096 scores about 20% more tokens/s than 8192 (measured on 2
# cores, 4 layers x 256: the activations stay in cache); a GPU wants far larger batches.
CPU_BATCH_TOKENS, GPU_BATCH_TOKENS = 4096, 65536


def batch_tokens_for(device: str, asked: int = 0) -> int:
    """`asked`, or the default for the device (0: the default)."""
    return asked or (GPU_BATCH_TOKENS if str(device).startswith("cuda") else CPU_BATCH_TOKENS)


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
    items = []  # (doc, inputs, targets with the ones not counted as IGNORE, how many of those lead)
    for d, ids in enumerate(docs):
        items += [(d, *w) for w in window_items(ids, eot_id, model.cfg.seq_len, stride)]
    nll = np.zeros(len(docs))
    for (d, *_), v in zip(items, score_items(model, [it[1:] for it in items], batch_tokens, device), strict=True):
        nll[d] += v
    return [Scored(len(ids), float(v)) for ids, v in zip(docs, nll, strict=True)]


def window_items(ids, eot_id: int, context: int, stride: int) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """A document's windows (`windows`) as the model takes them: (inputs, targets with those a previous window
    predicted as IGNORE, how many of those lead)."""
    seq = np.concatenate([[eot_id], np.asarray(ids, dtype=np.int64)])
    out = []
    for begin, end, first in windows(len(ids), context, stride):
        targets = seq[begin + 1:end + 1].copy()
        skip = first - (begin + 1)
        targets[:skip] = IGNORE
        out.append((seq[begin:end], targets, skip))
    return out


def score_items(model, items: list[tuple[np.ndarray, np.ndarray, int]], batch_tokens: int,
                device: str = "cpu") -> list[float]:
    """Each window's summed NLL (`window_items`' items, in their order), windows of like length batched."""
    # By length, and then by the targets left out first: a batch of windows that all leave out their first
    # `skip` targets asks the model for the rest only, and its last block computes no others.
    order = sorted(range(len(items)), key=lambda k: (len(items[k][0]), items[k][2]))
    nll = [0.0] * len(items)
    at = 0
    with torch.inference_mode():
        while at < len(order):
            width = len(items[order[at]][0])
            rows = max(1, batch_tokens // max(width, 1))
            # A batch holds windows of lengths [width, 2 * width) at most, padded to the longest.
            batch = [k for k in order[at:at + rows] if len(items[k][0]) < 2 * width] or order[at:at + 1]
            at += len(batch)
            T = max(len(items[k][0]) for k in batch)
            start = min(items[k][2] for k in batch)
            x = torch.zeros((len(batch), T), dtype=torch.long)
            y = torch.full((len(batch), T), IGNORE, dtype=torch.long)
            for i, k in enumerate(batch):
                inputs, targets, _ = items[k]
                x[i, : len(inputs)] = torch.from_numpy(inputs)
                y[i, : len(targets)] = torch.from_numpy(targets)
            _, losses = model(x.to(device), y.to(device), per_token=True, start=start)
            sums = losses.view(len(batch), T - start).sum(dim=1).double().cpu().numpy()
            for k, v in zip(batch, sums, strict=True):
                nll[k] = float(v)
    return nll


class Scorer:
    """A Ray Data actor: the model built once, then batches of documents scored (map_batches).

    A batch's rows have `text`, and may have `status` and `reason` (tier 1's readers: only `ok` rows are
    scored) and `skip` (true: passed through unscored); or `ids`, token ids to score as they are (a
    dataset's rows). Every other column passes through (and `skip`); each row gains
    `tokens`, `loss`, `bpb`, `bytes` and `unscored` (why it was not scored; empty when it was)."""

    def __init__(self, model, stride: int, batch_tokens: int, cpus: float, device: str = "cpu"):
        from infer.model import threads

        threads(cpus)
        self.model, self.tok = model.build(device)
        self.stride, self.batch_tokens, self.device = stride, batch_tokens_for(device, batch_tokens), device

    def __call__(self, batch: dict) -> dict:
        if "ids" in batch:  # token ids already (a dataset's rows): scored as they are
            ids = [np.asarray(x, np.int64) for x in batch["ids"]]
            n = len(ids)
            reason = ["" if len(x) else "rejected:empty" for x in ids]
            per_token = self.tok.token_bytes()
            size = np.array([int(per_token[x].sum()) for x in ids], np.int64)
        else:
            texts = list(batch["text"])
            n = len(texts)
            status = list(batch["status"]) if "status" in batch else ["ok"] * n
            skip = batch["skip"] if "skip" in batch else np.zeros(n, bool)
            reason = ["skipped" if skip[i] else f"{status[i]}:{batch['reason'][i]}" if status[i] != "ok"
                      else "" if texts[i] else "rejected:empty" for i in range(n)]
            ids = [self.tok.encode(t) if not r else np.zeros(0, np.int64) for t, r in zip(texts, reason, strict=True)]
            size = np.array([len(t.encode()) for t in texts], np.int64)
        ok = [i for i in range(n) if not reason[i]]
        scored = score_ids(self.model, [ids[i] for i in ok], self.tok.eot_id, stride=self.stride,
                           batch_tokens=self.batch_tokens, device=self.device)
        tokens, loss, bpb = np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan)
        for i, s in zip(ok, scored, strict=True):
            tokens[i], loss[i] = s.tokens, s.loss()
            bpb[i] = s.nll / math.log(2) / max(1, size[i])
        rest = {k: v for k, v in batch.items() if k not in ("text", "status", "reason", "ids")}
        return {**rest, "tokens": tokens, "loss": loss, "bpb": bpb, "bytes": size,
                "unscored": np.array(reason, dtype=object)}


def scoring(ds, model, *, tier: str, actors: int, stride: int, batch_tokens: int, docs_per_batch: int):
    """`ds` (rows with `text`) scored by `actors` Scorer actors on `tier` (cpu, or gpu: one GPU each)."""
    from ray.data import ActorPoolStrategy

    from strata.cluster import tiers

    gpu = tier == tiers.Tier.GPU
    return ds.map_batches(Scorer, batch_size=docs_per_batch, batch_format="numpy", compute=ActorPoolStrategy(size=actors),
                          num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, label_selector=tiers.selector(tier),
                          fn_constructor_kwargs={"model": model, "stride": stride, "batch_tokens": batch_tokens,
                                                 "cpus": 1, "device": "cuda" if gpu else "cpu"})


def default_actors(tier: str) -> int:
    """One scoring actor per GPU on the gpu tier; on the cpu tier one per CPU but one, which stays free for
    the tasks that read the documents (an actor pool that takes every CPU stalls Ray Data)."""
    import ray

    from strata.cluster import tiers

    resources = ray.cluster_resources()
    if tier == tiers.Tier.GPU:
        return max(1, int(resources.get("GPU", 1)))
    return max(1, int(resources.get("CPU", 2)) - 1)
