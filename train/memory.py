"""The memory model: whether a replica fits a device (DDP) or must be sharded (FSDP2), and the micro-batch
that fills a device."""

from __future__ import annotations

import os

import torch

from train.config import TrainConfig
from train.model import GPTConfig

# DDP keeps on every device fp32 weights (4 B), gradients (4 B) and AdamW's two moments (8 B) per
# parameter; `auto` picks FSDP2 when that, with a quarter more for activations, exceeds the device's memory.
DDP_BYTES_PER_PARAM = 16 * 1.25


def strategy_for(cfg: TrainConfig, params: int, device_memory: int) -> str:
    """`auto` made concrete: DDP when a whole replica with its optimizer fits the device, else FSDP2."""
    if cfg.strategy != "auto":
        return cfg.strategy
    return "ddp" if params * DDP_BYTES_PER_PARAM <= device_memory else "fsdp"


# Activation bytes kept for backward per token, per layer and per unit of width, by a pre-norm GPT
# block with flash attention in bf16 autocast (Korthikanti et al. 2022, without the s^2 attention
# term); fp32 keeps twice as much.
ACTIVATION_BYTES = 34


CPU_MICRO_BATCH, MAX_MICRO_BATCH = 4, 64


RESERVED_BYTES = 2 << 30  # CUDA context, NCCL buffers, allocator fragmentation


def activation_bytes_per_row(mcfg: GPTConfig, bf16: bool) -> int:
    """Activation memory of one row through forward and backward (the blocks, plus embeddings and the
    fused loss's chunk, counted as two more layers)."""
    return ACTIVATION_BYTES * (1 if bf16 else 2) * mcfg.seq_len * mcfg.n_embd * (mcfg.n_layer + 2)


def micro_batch_for(mcfg: GPTConfig, params: int, strategy: str, world: int, memory: int, bf16: bool,
                    device_type: str) -> int:
    """Rows per micro-batch that fill about 80% of a device's memory: model states (fp32 weights,
    gradients and AdamW's moments: 16 B a parameter, sharded under FSDP2) and what is left for
    activations; a power of two, at most MAX_MICRO_BATCH. On CPU, CPU_MICRO_BATCH."""
    if device_type != "cuda":
        return CPU_MICRO_BATCH
    states = 16 * params / (world if strategy == "fsdp" else 1)
    rows = int((0.8 * memory - states - RESERVED_BYTES) // activation_bytes_per_row(mcfg, bf16))
    if rows < 1:
        raise ValueError(f"a micro-batch of one {mcfg.seq_len}-token row does not fit in {memory / 2**30:.0f} GiB "
                         f"beside the model's {states / 2**30:.1f} GiB of states: use --strategy fsdp, more "
                         "workers, or a smaller --seq-len")
    return min(MAX_MICRO_BATCH, 1 << (rows.bit_length() - 1))


def device_memory(device: torch.device, local_world: int) -> int:
    """Bytes one worker may use: its GPU's memory, or its share of the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(1, local_world)
