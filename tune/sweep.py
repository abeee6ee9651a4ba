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
from train.loop import (
    MODEL_KEYS,
    TRAIN_KEYS,
    TrainConfig,
    evaluate,
    lr_at,
    make_optimizer,
    train_step,
    with_hyperparameters,
)
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
    search: str = "random"
    """`random` (seeded random sampling) or `optuna` (Optuna's TPE; needs the optuna package)."""
    space: str = "lr-batch"
    """Search space: a name (lr-batch, small) or a .json/.yaml file of {param: {distribution: args}}."""
    max_rows: int = 4096
    """Training rows loaded once and shared by all trials."""
    eval_rows: int = 64
    """Validation rows each report is scored on."""
    seed: int = 0
    """Seed of the search and of every trial's init and data order."""

    def __post_init__(self):
        if self.scheduler not in ("asha", "fifo"):
            raise ValueError(f"scheduler must be asha or fifo, not {self.scheduler!r}")
        if self.search not in ("random", "optuna"):
            raise ValueError(f"search must be random or optuna, not {self.search!r}")


DISTRIBUTIONS = {"loguniform": 2, "uniform": 2, "randint": 2, "choice": 1}

# Named spaces, in the file format: {param: {distribution: arguments}}.
SPACES = {
    "lr-batch": {"lr": {"loguniform": [3e-4, 3e-2]}, "batch_size": {"choice": [8, 16, 32]}},
    "small": {
        "lr": {"loguniform": [3e-4, 3e-2]}, "batch_size": {"choice": [8, 16, 32]},
        "n_layer": {"choice": [2, 4]}, "n_embd": {"choice": [64, 128]}, "n_head": {"choice": [2, 4]},
        "warmup_steps": {"randint": [0, 20]}, "weight_decay": {"uniform": [0.0, 0.2]},
        "dropout": {"choice": [0.0, 0.1]},
    },
}


def load_space(spec: str) -> dict:
    """A named space (see SPACES) or a .json/.yaml file in the same format, checked."""
    if spec in SPACES:
        raw = SPACES[spec]
    elif spec.endswith((".json", ".yaml", ".yml")):
        import yaml

        from strata.storage import filesystem

        fs, path = filesystem(spec)
        try:
            with fs.open_input_stream(path) as f:
                raw = yaml.safe_load(f.read())  # JSON is YAML
        except FileNotFoundError:
            raise ValueError(f"search space file {spec} does not exist") from None
    else:
        raise ValueError(f"search space {spec!r} is neither a name ({', '.join(SPACES)}) nor a .json/.yaml file")
    return check_space(raw, spec)


def check_space(raw, where: str) -> dict:
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where}: a search space is a non-empty mapping of parameter -> {{distribution: args}}")
    for key, dist in raw.items():
        if key not in TRAIN_KEYS + MODEL_KEYS:
            raise ValueError(f"{where}: cannot tune {key!r}; tunable: {', '.join(TRAIN_KEYS + MODEL_KEYS)}")
        if not (isinstance(dist, dict) and len(dist) == 1 and next(iter(dist)) in DISTRIBUTIONS):
            raise ValueError(f"{where}: {key} needs one of {', '.join(DISTRIBUTIONS)}, e.g. {{choice: [1, 2]}}")
        name, args = next(iter(dist.items()))
        if not isinstance(args, list) or (name != "choice" and len(args) != 2) or not args:
            raise ValueError(f"{where}: {key}: {name} takes {'a list' if name == 'choice' else '[low, high]'}")
        if key in ("n_layer", "n_head", "n_embd") and name != "choice":
            raise ValueError(f"{where}: {key} must be a choice list (the shape has to be valid)")
    heads = raw.get("n_head", {}).get("choice")
    widths = raw.get("n_embd", {}).get("choice")
    for h in heads or []:
        for w in widths or []:
            if w % h:
                raise ValueError(f"{where}: n_embd {w} is not divisible by n_head {h}")
    return raw


def to_tune(space: dict) -> dict:
    """The checked file format as Ray Tune's sampling objects."""
    from ray import tune

    make = {"loguniform": tune.loguniform, "uniform": tune.uniform, "randint": tune.randint,
            "choice": lambda *a: tune.choice(list(a))}
    return {k: make[name](*args) for k, d in space.items() for name, args in d.items()}


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
    base = replace(TrainConfig(**train), max_steps=s.steps,
                   warmup_steps=min(TrainConfig(**train).warmup_steps, s.steps // 4))
    mcfg, tcfg = with_hyperparameters(config, GPTConfig(**model), base)
    torch.manual_seed(s.seed)
    net = GPT(mcfg)
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

