"""The training loop: reads top to bottom, runs on every Ray Train worker.

Each worker builds the model, wraps it (DDP, or FSDP2's `fully_shard` per
block), restores the latest checkpoint if there is one, and trains on its
rank's slice of the data for a fixed number of steps (equal on every rank).
Batches are read ahead in a thread. Every rank evaluates (an FSDP2 forward
is a collective); rank 0 writes metrics.jsonl and TensorBoard events, and
every report goes to Ray Train.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch.profiler import record_function

from strata.cli import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, check_fields
from strata.lease import check_held
from strata.storage import JsonlWriter
from train.cadence import Cadence, Clock
from train.checkpoint import AsyncCheckpointer
from train.checkpoint import dir_name as checkpoint_dir_name
from train.checkpoint import load as load_checkpoint
from train.data import MixedBatches, ShardRef, TokenBatches
from train.hardware import device_name, peak_flops
from train.model import GPT, GPTConfig, build

STRATEGIES = ("auto", "ddp", "fsdp")
PRECISIONS = ("auto", "bf16", "fp32")
# DDP keeps on every device fp32 weights (4 B), gradients (4 B) and AdamW's two moments (8 B) per
# parameter; `auto` picks FSDP2 when that, with a quarter more for activations, exceeds the device's memory.
DDP_BYTES_PER_PARAM = 16 * 1.25


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


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to lr * min_lr_ratio at schedule_steps (or max_steps), then flat."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    total = cfg.schedule_steps or cfg.max_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW, fused on GPU; no weight decay on vectors (norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=params[0].device.type == "cuda")


def use_bf16(cfg: TrainConfig, device: torch.device) -> bool:
    return cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda")


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
    (strata.dataset.pad_value), which fills the end of a padded row, is never a target (IGNORE) and as an
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
               bf16: bool = False) -> torch.Tensor:
    """One optimizer step over `micro_batches`; returns their mean loss (a tensor: no device sync here)."""
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


def validation_batches(shards: list[dict], cfg: TrainConfig) -> list[np.ndarray]:
    """The fixed batches validation loss is measured on; a split smaller than a batch gives one smaller batch."""
    rows = sum(s["rows"] for s in shards)
    if not rows:
        return []
    val = TokenBatches([ShardRef(**s) for s in shards], batch_size=min(cfg.batch_size, rows), seed=cfg.seed,
                       shuffle_buffer=cfg.batch_size)
    return [b for _, b in zip(range(min(cfg.eval_batches, val.steps_per_epoch)), val.from_step(0), strict=False)]


class Prefetch:
    """Reads batches ahead in a thread (parquet decoding releases the GIL); counts time spent waiting."""

    def __init__(self, batches: Iterator[np.ndarray], depth: int = 4):
        self.q: queue.Queue = queue.Queue(depth)
        self.waited = self._taken = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._fill, args=(batches,), daemon=True)
        self.thread.start()

    def _fill(self, batches):
        try:
            for b in batches:
                while not self.stop.is_set():
                    try:
                        self.q.put(b, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # surfaces in the training thread
            self.q.put(e)

    def __next__(self) -> np.ndarray:
        t = time.perf_counter()
        item = self.q.get()
        self.waited += time.perf_counter() - t
        if isinstance(item, BaseException):
            raise item
        return item

    def take_waited(self) -> float:
        """Seconds waited since the last call."""
        waited, self._taken = self.waited - self._taken, self.waited
        return waited

    def close(self):
        self.stop.set()


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry: `config` holds `model`, `train`, `sources` (each dataset's `name`, `weight`, `shards`
    and `val_shards`), `run_dir`, `tokenizer`, `token_bytes`."""
    import ray.train

    w = _start(config)
    tcfg, checkpointer, batches = w.tcfg, w.checkpointer, w.batches
    clock = Clock()
    cadence = Cadence(max_steps=tcfg.max_steps, log_every=tcfg.log_every, report_every_s=tcfg.report_every_s,
                      checkpoint_every=tcfg.checkpoint_every, checkpoint_every_s=tcfg.checkpoint_every_s,
                      start_step=w.start_step, started=clock.start, drain_check_every_s=tcfg.drain_check_every_s)
    step_losses: list[torch.Tensor] = []  # since the last log point, on the device: no sync per step
    saved_for_preemption = False
    try:
        for step in range(w.start_step, tcfg.max_steps):
            step_losses.append(train_step(w.model, w.optimizer, [next(batches) for _ in range(tcfg.grad_accum)],
                                          lr_at(step, tcfg), tcfg, w.device, w.bf16))
            done = step + 1
            if not cadence.log_due(done):
                continue
            # Every rank reaches this point at the same steps; one all-reduce agrees on what comes next.
            clock.add("data", batches.take_waited())
            losses, (report_due, save_due, check_due), written = _agree(
                step_losses, cadence.timers(time.perf_counter()), checkpointer.written() or not checkpointer.pending,
                w.world)
            step_losses.clear()
            seconds, shares = clock.window()  # the device is synced: the window ends here
            metrics = w.meter.window(done, losses, seconds, shares, lr=lr_at(step, tcfg),
                                     epoch=step * tcfg.grad_accum // w.data.steps_per_epoch)
            if w.val_sets and (done == tcfg.max_steps or done % tcfg.eval_every == 0):
                with clock.timed("eval"):
                    metrics.update(_validate(w))
            if len(w.sources) > 1:
                metrics["tokens_by_source"] = dict(zip(w.sources, (n * w.raw.cfg.seq_len * w.world for n in
                                                                   w.data.rows_taken(done * tcfg.grad_accum)),
                                                       strict=True))
                metrics["repeats_by_source"] = dict(zip(w.sources, w.data.repeats(done * tcfg.grad_accum),
                                                        strict=True))
            preempted = False
            if check_due and not saved_for_preemption:  # every rank asks at the same log points: it is a barrier
                preempted = ray.train.get_preemption_info() is not None
                cadence.checked(time.perf_counter())
            decision = cadence.decide(done, report_due=report_due, save_due=save_due, preempted=preempted,
                                      checkpoint_written=bool(checkpointer.pending) and written)
            with clock.timed("checkpoint"):
                handover = _checkpoint(checkpointer, decision, done, metrics, config, tcfg, w.world, written)
            if decision.save:
                cadence.saved(time.perf_counter())
                saved_for_preemption = saved_for_preemption or preempted
            metrics["checkpoint_blocked"] = clock.total["checkpoint"] / (time.perf_counter() - clock.start)
            metrics["reported"] = decision.report or bool(handover)
            if metrics["reported"]:
                with clock.timed("report"):
                    for ckpt_step, local, sync in handover or [(None, None, False)]:
                        _report(metrics, ckpt_step, local, sync)
                cadence.reported(time.perf_counter())
            if preempted:  # the driver says so (train/progress.py)
                w.log.event({"event": "preempted", "step": done})
            w.log.step(metrics, losses)
        w.log.event({"event": "end", **w.meter.total(*clock.overall())})
    finally:
        batches.close()
        checkpointer.discard()
        w.log.close()


@dataclass
class _Worker:
    """What a worker trains with, made by `_start`."""

    rank: int
    world: int
    device: torch.device
    bf16: bool
    tcfg: TrainConfig
    raw: GPT
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    checkpointer: AsyncCheckpointer
    start_step: int
    batches: Prefetch
    data: TokenBatches | MixedBatches
    sources: list[str]  # the datasets trained on, by ref
    val_sets: list[tuple[str, float, list]]  # (source, weight, validation batches) of each source with some
    token_bytes: torch.Tensor | None
    meter: _Meter
    log: _Log


def _start(config: dict) -> _Worker:
    """The worker's model built and wrapped, its latest checkpoint restored, its micro-batch sized (or the
    run's kept), its data opened at the restored step, and the run's start logged."""
    import ray
    import ray.train

    rank, world, local_world, device = _worker(config)
    mcfg, tcfg = GPTConfig(**config["model"]), TrainConfig(**config["train"])
    bf16 = use_bf16(tcfg, device)
    memory = _min_over_ranks(device_memory(device, local_world), device, world)
    raw, model, strategy, params, compiled = _build(mcfg, tcfg, device, bf16, world, local_world, memory)
    optimizer = make_optimizer(model, tcfg)
    # Checkpoints travel on a gloo group of their own: the background write's collectives
    # must not interleave with training's.
    ckpt_pg = torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized() else None
    checkpointer = AsyncCheckpointer(model, optimizer, rank, ckpt_pg)
    start_step, resumed_from, meta = 0, None, {}
    if checkpoint := ray.train.get_checkpoint():
        with checkpoint.as_directory() as d:
            meta = load_checkpoint(d, model, optimizer, rank, ckpt_pg)
        start_step, resumed_from = meta["step"], checkpoint.path
    elif config.get("init_weights") is not None:  # fine-tuning: the weights the driver put in the object store
        from train.pretrained import apply

        apply(model, ray.get(config["init_weights"]))
    # The micro-batch and the accumulation are part of the data order: a run keeps those it started with.
    batch = tcfg.batch_size or meta.get("micro_batch") or micro_batch_for(
        mcfg, params, strategy, world, memory, bf16, device.type)
    tcfg = replace(tcfg, batch_size=batch,
                   grad_accum=tcfg.grad_accum or meta.get("grad_accum") or accumulation(tcfg, batch, world,
                                                                                           mcfg.seq_len))
    sources = config["sources"]
    streams = [TokenBatches([ShardRef(**s) for s in src["shards"]], batch_size=1 if len(sources) > 1 else batch,
                            rank=rank, world_size=world, seed=tcfg.seed) for src in sources]
    data = streams[0] if len(sources) == 1 else MixedBatches(streams, [s["weight"] for s in sources],
                                                             batch_size=batch)
    if tcfg.max_repeat:  # the driver checks a given batch size; one sized for the device is checked here
        end = tcfg.max_steps * tcfg.grad_accum
        repeats = data.repeats(end) if len(sources) > 1 else [end / data.steps_per_epoch]
        if over := [f"{s['name']} {r:.2f} times" for s, r in zip(sources, repeats, strict=True) if r > tcfg.max_repeat]:
            raise ValueError(f"{tcfg.max_steps} steps would repeat {', '.join(over)}, more than --max-repeat "
                             f"{tcfg.max_repeat:g}")
    meter = _Meter(raw.flops_per_token(), peak_flops(device, bf16), batch * tcfg.grad_accum * mcfg.seq_len * world,
                   world, start_step)
    log = _Log(config["run_dir"], rank)
    log.event({"event": "start", "start_step": start_step, "resumed_from": resumed_from, "world_size": world,
               "strategy": strategy, "bf16": bf16, "device": device_name(device), "peak_flops": meter.peak,
               "flops_per_token": meter.flops_per_token, "micro_batch": batch, "grad_accum": tcfg.grad_accum,
               "tokens_per_step": meter.tokens_per_step, "tokens_per_step_target": tcfg.tokens_per_step,
               "compiled": compiled})
    val_sets = [(s["name"], s["weight"], v) for s in sources if (v := validation_batches(s["val_shards"], tcfg))]
    token_bytes = torch.tensor(config["token_bytes"], device=device) if config.get("token_bytes") else None
    return _Worker(rank, world, device, bf16, tcfg, raw, model, optimizer, checkpointer, start_step,
                   Prefetch(data.from_step(start_step * tcfg.grad_accum)), data,
                   [s["name"] for s in sources], val_sets, token_bytes, meter, log)


def _validate(w: _Worker) -> dict:
    """val_loss and val_bpb: each source's, and their mean weighted as the mixture is."""
    by = {name: (weight, *evaluate(w.raw, batches, w.device, w.bf16, w.token_bytes))
          for name, weight, batches in w.val_sets}
    total = sum(weight for weight, _, _ in by.values())
    out = {"val_loss": sum(weight * loss for weight, loss, _ in by.values()) / total}
    if all(bpb is not None for _, _, bpb in by.values()):
        out["val_bpb"] = sum(weight * bpb for weight, _, bpb in by.values()) / total
    if len(w.sources) > 1:
        out["val_loss_by_source"] = {name: loss for name, (_, loss, _) in by.items()}
        if "val_bpb" in out:
            out["val_bpb_by_source"] = {name: bpb for name, (_, _, bpb) in by.items()}
    return out


def _worker(config: dict) -> tuple[int, int, int, torch.device]:
    """This worker's rank, world size, local world size and device; records where it runs, sets its
    threads, and lets fp32 matmuls use TF32 tensor cores."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank = ctx.get_world_rank()
    _record_node(config["run_dir"], rank)
    if config.get("threads"):
        torch.set_num_threads(config["threads"])
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return rank, ctx.get_world_size(), ctx.get_local_world_size(), ray.train.torch.get_device()


def _build(mcfg: GPTConfig, tcfg: TrainConfig, device: torch.device, bf16: bool, world: int,
           local_world: int, memory: int) -> tuple[GPT, torch.nn.Module, str, int, str]:
    """The model made on the meta device, materialized on `device`, initialized, and wrapped;
    returns (the plain model, the wrapped one, the strategy chosen, the parameters it was chosen by,
    whether the blocks compiled: "on", "off", or why not)."""
    torch.manual_seed(tcfg.seed)
    raw = build(mcfg, device)
    params = raw.num_params()  # the tied embedding counts once (train.model.build ties it)
    strategy = strategy_for(tcfg, params, memory)
    compiled = "on" if tcfg.compile == "on" or (tcfg.compile == "auto" and device.type == "cuda") else "off"
    if compiled == "on" and not code_compiler(device):
        compiled = f"off: no {compiler_kind(device)} on {os.uname().nodename}, so torch.compile cannot build kernels"
    model = parallelize(raw, strategy, device, bf16, world, one_node=local_world == world,
                        compile_blocks=compiled == "on")
    return raw, model, strategy, params, compiled


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


def _min_over_ranks(value: int, device: torch.device, world: int) -> int:
    if world == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def _checkpoint(checkpointer: AsyncCheckpointer, decision, done: int, metrics: dict, config: dict,
                tcfg: TrainConfig, world: int, written: bool) -> list[tuple]:
    """Start a checkpoint if decided, and return the written ones to hand to Ray, in order:
    (step, local dir, upload synchronously?)."""
    handover = []
    if checkpointer.pending and (written or decision.save):
        handover.append((*checkpointer.take(), False))
    if decision.save:
        checkpointer.start(done, {"loss": metrics["loss"], "reason": decision.reason,
                                  "data_position": done * tcfg.grad_accum, "world_size": world,
                                  "model_config": config["model"], "train_config": config["train"],
                                  "micro_batch": tcfg.batch_size, "grad_accum": tcfg.grad_accum,
                                  "tokenizer": config["tokenizer"],
                                  "tokenizer_definition": config.get("tokenizer_definition")})
        if decision.reason in ("end", "preemption"):  # must be registered before the run ends or the node goes
            handover.append((*checkpointer.take(), True))
    if handover and config.get("lease"):  # every rank, so all of them stop together: report is a barrier
        check_held(config["run_dir"], config["lease"]["gen"], config["lease"]["what"])
    return handover


class _Meter:
    """Throughput over wall time: each window's, and the whole loop's."""

    def __init__(self, flops_per_token: float, peak: float | None, tokens_per_step: int, world: int,
                 start_step: int):
        self.flops_per_token, self.peak, self.tokens_per_step = flops_per_token, peak, tokens_per_step
        self.world, self.start_step, self.last_step = world, start_step, start_step

    def _mfu(self, tps: float) -> float | None:
        return self.flops_per_token * tps / self.world / self.peak if self.peak else None

    def window(self, done: int, losses: list[float], seconds: float, shares: dict, **extra) -> dict:
        steps, self.last_step = done - self.last_step, done
        tps = self.tokens_per_step * steps / seconds
        return {"step": done, "start_step": self.start_step, "loss": sum(losses) / steps, **extra,
                "tokens_per_s": tps, "tokens_per_s_per_worker": tps / self.world, "mfu": self._mfu(tps),
                "data_wait": shares["data"], "world_size": self.world,
                **{f"share_{k}": v for k, v in shares.items()}}

    def total(self, seconds: float, shares: dict) -> dict:
        tokens = self.tokens_per_step * (self.last_step - self.start_step)
        return {"steps": self.last_step - self.start_step, "tokens": tokens, "loop_s": seconds,
                "tokens_per_s": tokens / seconds, "mfu": self._mfu(tokens / seconds),
                **{f"share_{k}": v for k, v in shares.items()}}


class _Log:
    """Rank 0's per-step metrics: metrics.jsonl (JsonlWriter) and TensorBoard; other ranks write nothing.
    On local disk each row is appended at once; on an object store, where an append is a PUT, step rows
    go out every FLUSH_S seconds, at reports and with events, so logging every step costs a PUT per
    interval, not per step. TensorBoard's own thread writes its events."""

    FLUSH_S = 5.0

    def __init__(self, run_dir: str, rank: int):
        self.jsonl = JsonlWriter(f"{run_dir}/metrics.jsonl") if rank == 0 else None
        self.tb = _tensorboard(run_dir) if rank == 0 else None
        self.rows: list[dict] = []
        self.flushed = time.perf_counter()

    def event(self, row: dict) -> None:
        if self.jsonl:
            self.rows.append({"time": time.time(), **row})
            self.flush()

    def step(self, metrics: dict, losses: list[float]) -> None:
        if not self.jsonl:
            return
        self.rows.append({"time": time.time(), **metrics, "step_losses": losses})
        if self.tb:
            for k, v in metrics.items():
                if isinstance(v, int | float) and not isinstance(v, bool) and k not in ("step", "start_step"):
                    self.tb.add_scalar(f"train/{k}", v, metrics["step"])
        if self.jsonl.local or time.perf_counter() - self.flushed >= self.FLUSH_S or metrics.get("reported"):
            self.flush()

    def flush(self) -> None:
        self.jsonl.extend(self.rows)
        self.rows, self.flushed = [], time.perf_counter()

    def close(self) -> None:
        if self.jsonl:
            self.flush()
        if self.tb:
            self.tb.close()


def _agree(step_losses: list[torch.Tensor], due: tuple[bool, ...], written: bool,
           world: int) -> tuple[list, tuple[bool, ...], bool]:
    """One all-reduce: (each step's loss averaged over ranks, each of `due` true on any rank, every
    rank's checkpoint write done)."""
    device = step_losses[0].device
    flags = torch.cat([torch.stack(step_losses).float(),
                       torch.tensor([*map(float, due), float(not written)], device=device)])
    if world > 1:
        torch.distributed.all_reduce(flags)
    values = flags.tolist()
    n = len(step_losses)
    return [v / world for v in values[:n]], tuple(v > 0 for v in values[n:-1]), values[-1] == 0


def _report(metrics: dict, ckpt_step: int | None, local: str | None, sync: bool) -> None:
    """Every rank reports (a barrier); with a checkpoint, each hands over its own part of it."""
    import ray.train
    from ray.train import CheckpointUploadMode

    if local is None:
        ray.train.report(metrics)
        return
    mode = CheckpointUploadMode.SYNC if sync else CheckpointUploadMode.ASYNC
    ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(local),
                     checkpoint_dir_name=checkpoint_dir_name(ckpt_step), checkpoint_upload_mode=mode,
                     delete_local_checkpoint_after_upload=True)


def _tensorboard(run_dir: str):
    """TensorBoard events under the run, when the run lives on a local or mounted filesystem."""
    import pyarrow.fs as pafs

    from strata.storage import filesystem

    fs, path = filesystem(run_dir)
    if not isinstance(fs, pafs.LocalFileSystem):
        return None
    from tensorboardX import SummaryWriter

    return SummaryWriter(os.path.join(path, "tensorboard"), flush_secs=10)  # its own thread writes the events


def _record_node(run_dir: str, rank: int) -> None:
    """Where this rank actually runs, for the run record (and the placement test)."""
    import ray

    from strata.storage import write_json_atomic

    rc = ray.get_runtime_context()
    write_json_atomic(f"{run_dir}/workers/rank-{rank}.json",
                      {"rank": rank, "node_id": rc.get_node_id(), "pid": os.getpid(), "time": time.time()})
