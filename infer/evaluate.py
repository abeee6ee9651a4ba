"""Evaluation for `python -m infer eval`: multiple-choice tasks (train/tasks.py: acc and acc_norm as
lm-evaluation-harness defines them, shared with evaluations during training) and loss and bits per byte on
held-out text."""

from __future__ import annotations

import math

from infer.score import score_ids
from train.tasks import TaskError, evaluate, load_task

__all__ = ["TaskError", "evaluate", "heldout", "load_task"]


def heldout(model, tok, texts: list[str], *, stride: int, batch_tokens: int = 8192, device: str = "cpu") -> dict:
    """Loss (nats per token) and bits per byte of held-out texts, each scored whole."""
    scored = score_ids(model, [tok.encode(t) for t in texts if t], tok.eot_id, stride=stride,
                       batch_tokens=batch_tokens, device=device)
    tokens, nll = sum(s.tokens for s in scored), sum(s.nll for s in scored)
    return {"heldout_documents": len(scored), "heldout_tokens": tokens,
            "loss": nll / tokens if tokens else math.nan,
            "bpb": nll / math.log(2) / max(1, sum(len(t.encode()) for t in texts if t))}
