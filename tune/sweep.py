"""A sweep: many short trials of train's step function on a shared slice of a dataset.

Trials are plain function trainables (a `TorchTrainer` per trial costs seconds
of start-up each), placed on spot-tier nodes by label selector. The rows they
train on are read once by the driver and shared through the object store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import torch

from strata.dataset import DatasetVersion, read_rows
from train.loop import TrainConfig, evaluate, lr_at, make_optimizer, train_step
from train.model import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    num_samples: int = 8
    """Trials to run."""
    max_concurrent: int = 0
    """Trials running at once (0: as many as the spot tier's CPUs hold)."""
    steps: int = 40
    """Optimizer steps per trial (if not stopped early)."""
    report_every: int = 10
    """Steps between reports; ASHA decides at these points."""
    scheduler: str = "asha"
    """`asha` (early stopping) or `fifo` (every trial runs to the end)."""
    max_rows: int = 4096
    """Training rows loaded once and shared by all trials."""
    eval_rows: int = 64
    """Validation rows each report is scored on."""
    seed: int = 0
    """Seed of the search and of every trial's init and data order."""


def search_space(preset: str) -> dict:
    """The hyperparameters a preset sweeps over."""
    from ray import tune

    spaces = {
        "debug": {"lr": tune.loguniform(3e-4, 3e-2), "batch_size": tune.choice([8, 16, 32])},
    }
    if preset not in spaces:
        raise ValueError(f"no search space for preset {preset!r}; choose from: {', '.join(spaces)}")
    return spaces[preset]


def load_rows(version: DatasetVersion, split: str, limit: int) -> np.ndarray:
    """Up to `limit` rows (n, seq_len + 1) of a split, in manifest order."""
    out, n = [], 0
    for path in version.shard_paths(split):
        rows = read_rows(path)[: limit - n]
        out.append(rows)
        n += len(rows)
        if n >= limit:
            break
    width = version.manifest.seq_len + 1
    return np.concatenate(out) if out else np.zeros((0, width), dtype=np.uint16)


def trial(config: dict, *, rows: np.ndarray, val_rows: np.ndarray, model: dict, train: dict,
          sweep: dict) -> None:
    """One trial: train a fresh model for `steps` steps, reporting validation loss."""
    import ray
    from ray import tune

    s = SweepConfig(**sweep)
    tcfg = replace(TrainConfig(**train), lr=config["lr"], batch_size=config["batch_size"], max_steps=s.steps,
                   warmup_steps=min(TrainConfig(**train).warmup_steps, s.steps // 4))
    torch.manual_seed(s.seed)
    net = GPT(GPTConfig(**model))
    opt = make_optimizer(net, tcfg)
    rng = np.random.default_rng(s.seed)
    val_batches = [val_rows[i: i + 32] for i in range(0, len(val_rows), 32)]
    node = ray.get_runtime_context().get_node_id()
    device = torch.device("cpu")
    for step in range(s.steps):
        batch = rows[rng.integers(0, len(rows), tcfg.batch_size)]
        loss = train_step(net, opt, [batch], lr_at(step, tcfg), tcfg, device).item()
        if (step + 1) % s.report_every == 0 or step + 1 == s.steps:
            tune.report({"val_loss": evaluate(net, val_batches, device), "loss": loss, "step": step + 1,
                         "node_id": node, "pid": os.getpid()})

