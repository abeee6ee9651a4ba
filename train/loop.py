"""The training loop: reads top to bottom, runs on every Ray Train worker.

Each worker builds the model, restores the latest checkpoint if there is one,
and trains on its rank's slice of the data for a fixed number of steps (equal
on every rank). Rank 0 evaluates, logs metrics and writes checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

from train.data import ShardRef, TokenBatches
from train.model import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    max_steps: int = 200
    """Optimizer steps in total, counted across restarts."""
    batch_size: int = 16
    """Rows per worker per step."""
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
    """Validation batches per evaluation."""
    checkpoint_every: int = 100
    """Checkpoint every this many steps (and at the end)."""
    log_every: int = 10
    """Report metrics every this many steps."""
    seed: int = 0
    """Seed of model init and data order."""


# Train-loop defaults per model preset; flags override them.
TRAIN_PRESETS = {
    "debug": TrainConfig(max_steps=200, batch_size=16, lr=3e-3, warmup_steps=20),
    "gpt2-124m": TrainConfig(max_steps=5000, batch_size=8, lr=6e-4, warmup_steps=500, eval_every=250,
                             checkpoint_every=500),
    "gpt2-350m": TrainConfig(max_steps=5000, batch_size=4, lr=3e-4, warmup_steps=500, eval_every=250,
                             checkpoint_every=500),
}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = torch.cuda.is_available() and next(model.parameters()).is_cuda
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=fused)


def to_xy(batch: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) packed rows to inputs and next-token targets, each (B, T)."""
    t = torch.from_numpy(batch.astype(np.int64)).to(device, non_blocking=True)
    return t[:, :-1], t[:, 1:]


def train_step(model, optimizer, batch: np.ndarray, lr: float, cfg: TrainConfig, device) -> float:
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = to_xy(batch, device)
    _, loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def evaluate(model: GPT, batches: list[np.ndarray], device) -> float:
    model.eval()
    losses = [model(*to_xy(b, device))[1].item() for b in batches]
    model.train()
    return float(np.mean(losses))


def validation_batches(shards: list[dict], cfg: TrainConfig) -> list[np.ndarray]:
    """The fixed batches validation loss is measured on; a split smaller than a batch gives one smaller batch."""
    rows = sum(s["rows"] for s in shards)
    if not rows:
        return []
    val = TokenBatches([ShardRef(**s) for s in shards], batch_size=min(cfg.batch_size, rows), seed=cfg.seed,
                       shuffle_buffer=cfg.batch_size)
    return [b for _, b in zip(range(min(cfg.eval_batches, val.steps_per_epoch)), val.from_step(0), strict=False)]


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry: `config` holds `model`, `train`, `shards`, `val_shards`, `run_dir`."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    mcfg, tcfg = GPTConfig(**config["model"]), TrainConfig(**config["train"])
    run_dir = config["run_dir"]
    _record_node(run_dir, rank)
    device = ray.train.torch.get_device()
    torch.manual_seed(tcfg.seed)
    raw = GPT(mcfg).to(device)
    optimizer = make_optimizer(raw, tcfg)

    start_step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), map_location=device, weights_only=False)
        raw.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_step = state["step"]
    model = ray.train.torch.prepare_model(raw)  # DDP when world > 1

    data = TokenBatches([ShardRef(**s) for s in config["shards"]], batch_size=tcfg.batch_size,
                        rank=rank, world_size=world, seed=tcfg.seed)
    val_batches = validation_batches(config["val_shards"], tcfg) if rank == 0 else []

    batches = data.from_step(start_step)
    tokens_per_step = tcfg.batch_size * mcfg.seq_len * world
    t_last, step_last = time.perf_counter(), start_step
    for step in range(start_step, tcfg.max_steps):
        lr = lr_at(step, tcfg)
        loss = train_step(model, optimizer, next(batches), lr, tcfg, device)
        done = step + 1
        last = done == tcfg.max_steps
        first = step == start_step
        if not (first or last or done % tcfg.log_every == 0 or done % tcfg.checkpoint_every == 0):
            continue
        now = time.perf_counter()
        metrics = {"step": done, "start_step": start_step, "loss": loss, "lr": lr, "epoch": step // data.steps_per_epoch,
                   "tokens_per_s": tokens_per_step * (done - step_last) / (now - t_last), "world_size": world}
        t_last, step_last = now, done
        if val_batches and (last or done % tcfg.eval_every == 0):
            metrics["val_loss"] = evaluate(raw, val_batches, device)
        if rank == 0:
            _append_metrics(run_dir, metrics)
        if last or done % tcfg.checkpoint_every == 0:
            with tempfile.TemporaryDirectory() as d:
                ckpt = None
                if rank == 0:
                    torch.save({"model": raw.state_dict(), "optimizer": optimizer.state_dict(), "step": done,
                                "model_config": config["model"], "tokenizer": config["tokenizer"],
                                "tokenizer_definition": config.get("tokenizer_definition")},
                               os.path.join(d, "state.pt"))
                    with open(os.path.join(d, "meta.json"), "w") as f:
                        json.dump({"step": done, "loss": loss}, f)
                    ckpt = ray.train.Checkpoint.from_directory(d)
                ray.train.report(metrics, checkpoint=ckpt)  # a barrier: every rank calls it
        else:
            ray.train.report(metrics)


def _append_metrics(run_dir: str, metrics: dict) -> None:
    import pyarrow.fs as pafs

    from strata.storage import filesystem

    fs, path = filesystem(run_dir + "/metrics.jsonl")
    line = (json.dumps({"time": time.time(), **metrics}) + "\n").encode()
    if isinstance(fs, pafs.LocalFileSystem):
        with open(path, "ab") as f:
            f.write(line)
        return
    old = b""  # object stores have no append: rewrite the (small) file
    if fs.get_file_info(path).type == pafs.FileType.File:
        with fs.open_input_stream(path) as f:
            old = f.read()
    with fs.open_output_stream(path) as f:
        f.write(old + line)


def _record_node(run_dir: str, rank: int) -> None:
    """Where this rank actually runs, for the run record (and the placement test)."""
    import ray

    from strata.storage import write_json_atomic

    rc = ray.get_runtime_context()
    write_json_atomic(f"{run_dir}/workers/rank-{rank}.json",
                      {"rank": rank, "node_id": rc.get_node_id(), "pid": os.getpid(), "time": time.time()})
