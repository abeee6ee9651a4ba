"""Evaluation for `python -m infer eval`: multiple-choice tasks (train/tasks.py: acc and acc_norm as
lm-evaluation-harness defines them, shared with evaluations during training) and loss and bits per byte on
held-out text."""

from __future__ import annotations

import math

from infer.score import batch_tokens_for, score_ids
from train.tasks import TaskError, evaluate, load_task

__all__ = ["TaskError", "evaluate", "heldout", "load_task"]


def heldout(model, tok, texts: list[str], *, stride: int, batch_tokens: int = 0, device: str = "cpu") -> dict:
    """Loss (nats per token) and bits per byte of held-out texts, each scored whole."""
    scored = score_ids(model, [tok.encode(t) for t in texts if t], tok.eot_id, stride=stride,
                       batch_tokens=batch_tokens_for(device, batch_tokens), device=device)
    tokens, nll = sum(s.tokens for s in scored), sum(s.nll for s in scored)
    return {"heldout_documents": len(scored), "heldout_tokens": tokens,
            "loss": nll / tokens if tokens else math.nan,
            "bpb": nll / math.log(2) / max(1, sum(len(t.encode()) for t in texts if t))}


def samples(items: list[dict], logliks: list[list[float]]) -> list[dict]:
    """Each item as it was judged (lm-evaluation-harness's --log_samples): its choices' log-likelihoods, the
    choice picked by each (acc: the highest; acc_norm: the highest per byte) and whether it was the gold."""
    import numpy as np

    out = []
    for k, (item, ll) in enumerate(zip(items, logliks, strict=True)):
        per_byte = np.array(ll) / np.array([max(1, len(c.encode())) for c in item["choices"]], dtype=float)
        pick, pick_norm = int(np.argmax(ll)), int(np.argmax(per_byte))
        out.append({"doc_id": k, "context": item["context"], "choices": item["choices"], "gold": item["gold"],
                    "logliks": [round(x, 6) for x in ll], "pred": pick, "pred_norm": pick_norm,
                    "acc": float(pick == item["gold"]), "acc_norm": float(pick_norm == item["gold"])})
    return out


def run_eval(model, items: list[dict], texts: list[str], *, stride: int, batch_tokens: int, cpus: float,
             device: str) -> dict:
    """`python -m infer eval`'s work, in a task on the tier it names: the task's figures, and the held-out
    texts' when there are any."""
    import time

    from infer.model import threads

    threads(cpus)
    started = time.time()
    net, tok = model.build(device)
    out = evaluate(net, tok, items, device=device, batch_tokens=batch_tokens_for(device, batch_tokens))
    out["samples"] = samples(items, out.pop("logliks"))
    if texts:
        out.update(heldout(net, tok, texts, stride=stride or max(1, net.cfg.seq_len // 2), batch_tokens=batch_tokens,
                           device=device))
    return {**out, "seconds": round(time.time() - started, 3)}
