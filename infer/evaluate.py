"""Multiple-choice evaluation, with acc and acc_norm as lm-evaluation-harness defines them, and loss and
bits per byte on held-out text.

A task file holds one JSON object a line: {"context": str, "choices": [str, ...], "gold": int}. Each
choice is scored by the summed log-likelihood of its tokens after the context's (the context alone when
it is not empty, else an end-of-text id; the left of a pair longer than the model's context is cut).
`acc` takes the most likely choice; `acc_norm` the most likely per byte of the choice. Each comes with
its standard error over the task's items (the sample standard deviation over the square root of n).
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch

from infer.score import IGNORE


class TaskError(ValueError):
    """A task file that is not what evaluation reads."""


def load_task(path: str) -> list[dict]:
    from strata.storage import read_bytes

    items = []
    for n, line in enumerate(read_bytes(path).decode().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}:{n}: not JSON ({e.msg})") from None
        ok = (isinstance(item, dict) and isinstance(item.get("context"), str) and isinstance(item.get("choices"), list)
              and len(item["choices"]) >= 2 and all(isinstance(c, str) and c for c in item["choices"])
              and isinstance(item.get("gold"), int) and 0 <= item["gold"] < len(item["choices"]))
        if not ok:
            raise TaskError(f"{path}:{n}: an item needs a context (a string), at least two non-empty choices and "
                            "a gold index among them")
        items.append(item)
    if not items:
        raise TaskError(f"{path} holds no item")
    return items


def continuation_logliks(model, pairs: list[tuple[np.ndarray, np.ndarray]], eot_id: int, *,
                         batch_tokens: int = 8192, device: str = "cpu") -> list[float]:
    """The summed log-likelihood of each continuation's tokens after its context's."""
    context = model.cfg.seq_len
    items = []
    for i, (ctx, cont) in enumerate(pairs):
        seq = np.concatenate([np.asarray(ctx if len(ctx) else [eot_id], np.int64), np.asarray(cont, np.int64)])
        seq = seq[-(context + 1):]
        targets = seq[1:].copy()
        targets[: len(targets) - len(cont)] = IGNORE
        items.append((i, seq[:-1], targets))
    items.sort(key=lambda it: len(it[1]))
    out = np.zeros(len(pairs))
    with torch.no_grad():
        at = 0
        while at < len(items):
            width = len(items[at][1])
            batch = [it for it in items[at:at + max(1, batch_tokens // width)] if len(it[1]) < 2 * width] or items[at:at + 1]
            at += len(batch)
            T = max(len(it[1]) for it in batch)
            x = torch.zeros((len(batch), T), dtype=torch.long)
            y = torch.full((len(batch), T), IGNORE, dtype=torch.long)
            for r, (_, inputs, targets) in enumerate(batch):
                x[r, : len(inputs)], y[r, : len(targets)] = torch.from_numpy(inputs), torch.from_numpy(targets)
            _, losses = model(x.to(device), y.to(device), per_token=True)
            for (i, _, _), s in zip(batch, losses.view(len(batch), T).sum(dim=1).double().cpu().numpy(), strict=True):
                out[i] = -s
    return out.tolist()


def _stderr(hits: np.ndarray) -> float:
    return float(np.std(hits, ddof=1) / math.sqrt(len(hits))) if len(hits) > 1 else math.nan


def evaluate(model, tok, items: list[dict], *, batch_tokens: int = 8192, device: str = "cpu") -> dict:
    """acc and acc_norm with their standard errors, and each item's choice log-likelihoods."""
    pairs, owner = [], []
    for k, item in enumerate(items):
        ctx = tok.encode(item["context"]) if item["context"] else np.zeros(0, np.int64)
        for c in item["choices"]:
            pairs.append((ctx, tok.encode(c)))
            owner.append(k)
    lls = continuation_logliks(model, pairs, tok.eot_id, batch_tokens=batch_tokens, device=device)
    acc, acc_norm, per_item, at = [], [], [], 0
    for item in items:
        ll = np.array(lls[at: at + len(item["choices"])])
        at += len(item["choices"])
        lengths = np.array([len(c.encode()) for c in item["choices"]], dtype=float)
        acc.append(float(np.argmax(ll) == item["gold"]))
        acc_norm.append(float(np.argmax(ll / lengths) == item["gold"]))
        per_item.append(ll.tolist())
    acc, acc_norm = np.array(acc), np.array(acc_norm)
    return {"items": len(items), "acc": float(acc.mean()), "acc_stderr": _stderr(acc),
            "acc_norm": float(acc_norm.mean()), "acc_norm_stderr": _stderr(acc_norm), "logliks": per_item}


def heldout(model, tok, texts: list[str], *, stride: int, batch_tokens: int = 8192, device: str = "cpu") -> dict:
    """Loss (nats per token) and bits per byte of held-out texts, each scored whole."""
    from infer.score import score_ids

    scored = score_ids(model, [tok.encode(t) for t in texts if t], tok.eot_id, stride=stride,
                       batch_tokens=batch_tokens, device=device)
    tokens, nll = sum(s.tokens for s in scored), sum(s.nll for s in scored)
    return {"heldout_documents": len(scored), "heldout_tokens": tokens,
            "loss": nll / tokens if tokens else math.nan,
            "bpb": nll / math.log(2) / max(1, sum(len(t.encode()) for t in texts if t))}
