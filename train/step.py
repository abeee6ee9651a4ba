"""One optimizer step and one evaluation, on any strategy: the optimizer, the model wrapped for DDP or
FSDP2 (blocks compiled when asked), the step over micro-batches, evaluation without grad."""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import numpy as np
import torch
from torch.profiler import record_function

from train.config import TrainConfig
from train.model import GPT


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused on GPU; no weight decay on vectors (norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=params[0].device.type == "cuda")


def parallelize(model: GPT, strategy: str, device: torch.device, bf16: bool, world: int, *,
                compile_blocks: bool = False, one_node: bool = True) -> torch.nn.Module:
    """DDP (when world > 1) or FSDP2 over the model on `device`; FSDP2 shards the blocks, then the rest.
    Blocks are compiled first, each on its own (FSDP2 then wraps compiled blocks; compile is per block,
    so its time does not grow with depth)."""
    if compile_blocks:
        for block in model.blocks:
            block.compile()
        model.compiled = True  # the loss's chunks and evaluation compile too (train/model.py)
    if strategy == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # bf16: the blocks' weights are gathered in bf16 (half the bytes), but their inputs are not cast, so
        # the residual stream stays fp32 as under DDP's autocast, and the norms follow their fp32 input
        # (train.model.LayerNorm); the embeddings, the final norm and the head (the root) stay fp32.
        # Gradients are reduced in fp32. (bf16 inputs and norms were 5-7x further from fp32's gradients.)
        block_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                        cast_forward_inputs=False)
        # Within one node the all-gather is cheap next to memory traffic: keep blocks unsharded from
        # forward to backward (ZeRO-2-like) instead of gathering them twice.
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=not one_node, **({"mp_policy": block_mp} if bf16 else {}))
        fully_shard(model, reshard_after_forward=not one_node)
        return model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
        if bf16 and device.type == "cuda":  # gradients travel in bf16: half the all-reduce bytes
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

            ddp.register_comm_hook(None, bf16_compress_hook)
        return ddp
    return model


@contextlib.contextmanager
def grad_sync(model: torch.nn.Module, enabled: bool):
    """Skip the gradient all-reduce/reduce-scatter on all but the last micro-batch."""
    if enabled:
        yield
    elif hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


OPTIMIZER_RANGE = "strata::optimizer"  # the profiler range around clipping and the optimizer's step


IGNORE = -1  # a target the loss leaves out: the padding of a dataset's last row (`--final`)


def to_xy(batch: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T+1) packed rows to inputs and next-token targets, each (B, T). The pad value of the rows' type
    (strata.data.dataset.pad_value), which fills the end of a padded row, is never a target (IGNORE) and as an
    input reads as id 0 (after the row's last token: causal attention keeps it out of every real target)."""
    t = torch.from_numpy(batch.astype(np.int64))
    if device.type == "cuda":
        t = t.pin_memory()
    t = t.to(device, non_blocking=True)
    x, y = t[:, :-1], t[:, 1:]
    if batch.dtype.kind == "u":
        pad = int(np.iinfo(batch.dtype).max)
        x, y = x.masked_fill(x == pad, 0), y.masked_fill(y == pad, IGNORE)
    return x, y


def train_step(model, optimizer, micro_batches: list[np.ndarray], lr: float, cfg: TrainConfig, device,
               bf16: bool = False, progress=None) -> torch.Tensor:
    """One optimizer step over `micro_batches`; returns their mean loss (a tensor: no device sync here).
    `progress(done, of)` is told after each micro-batch (a long accumulating step says how far it is)."""
    unwrap(model).check_tied()  # an identity check: costs nothing
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.zeros((), device=device)
    for i, batch in enumerate(micro_batches):
        x, y = to_xy(batch, device)
        with grad_sync(model, i == len(micro_batches) - 1), autocast(device, bf16):
            _, loss = model(x, y)
            (loss / len(micro_batches)).backward()
        total += loss.detach().float()
        if progress is not None:
            progress(i + 1, len(micro_batches))
    with record_function(OPTIMIZER_RANGE):
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return total / len(micro_batches)


def unwrap(model: torch.nn.Module) -> GPT:
    """The GPT inside a DDP wrapper (FSDP2 shards the model in place: it is its own)."""
    return getattr(model, "module", model)


def autocast(device: torch.device, bf16: bool):
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[np.ndarray], device, bf16: bool = False,
             token_bytes: torch.Tensor | None = None) -> tuple[float, float | None]:
    """(mean loss, bits per byte) over `batches`: one forward per batch (the validation batches are
    micro-batches), the logits made a chunk at a time, and one host sync at the end. Bits per byte divide
    the loss on targets that stand for text by the UTF-8 bytes of that text (`token_bytes` per id; special
    tokens count 0 and are left out), so they compare across tokenizers."""
    model.eval()
    try:
        losses, nats, nbytes = [], torch.zeros((), device=device), torch.zeros((), device=device)
        with autocast(device, bf16):
            for b in batches:
                x, y = to_xy(b, device)
                _, nll = model(x, y, per_token=True)  # (B*T,), 0 at padding
                valid = y.flatten() != IGNORE
                losses.append(nll.sum() / valid.sum().clamp(min=1))
                if token_bytes is not None:
                    size = token_bytes[y.flatten().clamp(min=0)] * valid
                    nats += (nll * (size > 0)).sum()
                    nbytes += size.sum()
        mean, nats, nbytes = torch.stack([torch.stack(losses).mean(), nats, nbytes.float()]).tolist()
    finally:
        model.train()
        reshard(model)
    return mean, (nats / math.log(2) / nbytes if nbytes else None)


def reshard(model: torch.nn.Module) -> None:
    """Free FSDP2's gathered weights: a forward that no backward follows (evaluation) leaves them whole
    when blocks are not resharded after forward (within a node); nothing to do otherwise."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def compiler_kind(device: torch.device) -> str:
    return "C compiler" if device.type == "cuda" else "C++ compiler"


def code_compiler(device: torch.device) -> str | None:
    """The compiler torch.compile's generated code needs on `device` (Triton builds its GPU launchers with a
    C compiler, Inductor's CPU kernels need C++), or None when there is none."""
    names = ("CC", "cc", "gcc", "clang") if device.type == "cuda" else ("CXX", "c++", "g++", "clang++")
    for name in (os.environ.get(names[0]), *names[1:]):
        if name and (path := shutil.which(name)):
            return path
    return None
