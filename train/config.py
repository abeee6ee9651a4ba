"""What a training run is configured with: `TrainConfig`, the presets' defaults, the hyperparameters a sweep
may tune, and the learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from strata.commands.cli import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, check_fields
from train.model import GPTConfig

STRATEGIES = ("auto", "ddp", "fsdp")


PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = 200
    """Optimizer steps in total, counted across restarts."""
    schedule_steps: int = 0
    """Steps the learning rate decays over (0: max_steps). A continued run with another --max-steps keeps the
    schedule it started with (then lr * min_lr_ratio) unless --reschedule."""
    batch_size: int = 0
    """Rows per worker per micro-batch; 0: sized for the device (`micro_batch_for`), kept across restarts."""
    grad_accum: int = 0
    """Micro-batches per optimizer step (gradient accumulation); 0: as many as bring a step closest to
    tokens_per_step on this run's world size and micro-batch (1 when tokens_per_step is 0)."""
    tokens_per_step: int = 0
    """The tokens per optimizer step the learning rate was chosen for: the presets take their recipe's
    (GPT-3's table 2.1, which GPT-2's reproductions use: 0.5M, 1M for 1.3B). 0: no target."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on norms and biases)."""
    grad_clip: float = 1.0
    """Clip the gradient norm to this (0 disables)."""
    eval_every: int = 50
    """Validation loss every this many steps (and at the end)."""
    eval_batches: int = 4
    """Validation batches per evaluation (per dataset of a mixture)."""
    eval_task: str = ""
    """A multiple-choice task file (JSONL: context, choices, gold): acc and acc_norm of the checkpoint saved
    every --eval-every steps, evaluated by a task on the cpu tier, off the training workers. Training never
    waits for it; one that fails or runs out of memory is recorded failed (train/tasks.py)."""
    max_repeat: float = 0.0
    """Refuse a run that would pass over any of its datasets more than this many times (0: no limit)."""
    checkpoint_every: int = 0
    """Also checkpoint every this many steps (0: by time only). There is always one at the end."""
    checkpoint_every_s: float = 300.0
    """Checkpoint when this many seconds passed since the last one (checked at each report; 0: off)."""
    keep_checkpoints: int = 3
    """Registered checkpoints to keep (Ray Train deletes older ones)."""
    log_every: int = 10
    """Sync and write metrics (metrics.jsonl, TensorBoard) every this many steps."""
    report_every_s: float = 10.0
    """Report to Ray Train at most this often (never faster than its controller polls), and at checkpoints."""
    drain_check_every_s: float = 2.0
    """Ask Ray whether a node of the run is being drained (a spot reclaim) at most this often, at log
    points; each ask is a barrier through an actor (about 15 ms). 0: at every log point."""
    seed: int = 0
    """Seed of model init and data order."""
    strategy: str = "auto"
    """ddp, fsdp (FSDP2 fully_shard per block), or auto: fsdp when DDP's copy would not fit a device's memory."""
    precision: str = "auto"
    """bf16 (autocast; FSDP2 mixed precision), fp32, or auto: bf16 on GPU, fp32 on CPU."""
    compile: str = "auto"
    """torch.compile each block (before FSDP2 wraps it): on, off, or auto (on GPU only)."""

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile must be auto, on or off, not {self.compile!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        check_fields(self, {
            **dict.fromkeys(("max_steps", "eval_every", "eval_batches", "log_every",
                             "keep_checkpoints"), AT_LEAST_ONE),
            "lr": POSITIVE, "min_lr_ratio": FRACTION,
            **dict.fromkeys(("batch_size", "grad_accum", "tokens_per_step", "schedule_steps", "warmup_steps", "weight_decay", "grad_clip", "max_repeat",
                             "checkpoint_every", "checkpoint_every_s", "report_every_s", "drain_check_every_s",
                             "seed"), NON_NEGATIVE)})


def accumulation(cfg: TrainConfig, micro_batch: int, world: int, seq_len: int) -> int:
    """Micro-batches per optimizer step: --grad-accum when given, else the count whose tokens per step
    (micro-batch x seq_len x world x it) come closest to cfg.tokens_per_step."""
    if cfg.grad_accum:
        return cfg.grad_accum
    if not cfg.tokens_per_step:
        return 1
    return max(1, round(cfg.tokens_per_step / (micro_batch * seq_len * world)))


# Train-loop defaults per model preset; flags override them.
TRAIN_PRESETS = {
    "debug": TrainConfig(max_steps=200, batch_size=16, lr=3e-3, warmup_steps=20),
    "gpt2-124m": TrainConfig(max_steps=5000, lr=6e-4, warmup_steps=500, eval_every=250, tokens_per_step=1 << 19),
    "gpt2-350m": TrainConfig(max_steps=5000, lr=3e-4, warmup_steps=500, eval_every=250, tokens_per_step=1 << 19),
    "gpt2-774m": TrainConfig(max_steps=5000, lr=2.5e-4, warmup_steps=500, eval_every=250, tokens_per_step=1 << 19),
    "1.3b": TrainConfig(max_steps=5000, lr=2e-4, warmup_steps=500, eval_every=250, tokens_per_step=1 << 20),
}


# The hyperparameters a sweep may tune: TrainConfig fields and model-shape fields.
TRAIN_KEYS = ("lr", "batch_size", "warmup_steps", "weight_decay", "grad_clip", "min_lr_ratio")


MODEL_KEYS = ("n_layer", "n_head", "n_embd", "dropout")


def with_hyperparameters(config: dict, model: GPTConfig, train: TrainConfig) -> tuple[GPTConfig, TrainConfig]:
    """A sweep's config (a trial's, or the best) applied to a model and a train config."""
    unknown = set(config) - set(TRAIN_KEYS + MODEL_KEYS)
    if unknown:
        raise ValueError(f"unknown hyperparameters {sorted(unknown)}; known: {', '.join(TRAIN_KEYS + MODEL_KEYS)}")
    m = {k: v for k, v in config.items() if k in MODEL_KEYS}
    t = {k: v for k, v in config.items() if k in TRAIN_KEYS}
    return replace(model, **m), replace(train, **t)  # each config checks itself


def as_swept(cfg: TrainConfig, *, seed: int, keep: frozenset = frozenset()) -> TrainConfig:
    """A sweep's config as its trials train it and `train --from-sweep` runs it: with the sweep's seed,
    and a warmup of at most a quarter of the steps (a preset's warmup is sized for its full length).
    Fields in `keep` (given on the command line) stay as they are."""
    swept = {"seed": seed, "warmup_steps": min(cfg.warmup_steps, cfg.max_steps // 4)}
    return replace(cfg, **{k: v for k, v in swept.items() if k not in keep})


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at schedule_steps (or max_steps), then flat."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    total = cfg.schedule_steps or cfg.max_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")
