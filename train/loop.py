"""The worker's loop: reads top to bottom, runs on every Ray Train worker.

Each worker builds the model, wraps it (DDP, or FSDP2's `fully_shard` per
block), restores the latest checkpoint if there is one, and trains on its
rank's slice of the data for a fixed number of steps (equal on every rank).
Batches are read ahead in a thread. Every rank evaluates (an FSDP2 forward
is a collective); rank 0 writes metrics.jsonl and TensorBoard events, and
every report goes to Ray Train. What it is made of lives beside it: the
configs in train/config.py, the memory model in train/memory.py, the step
and evaluation in train/step.py, the batches in train/data.py, the metrics
in train/metrics.py, when to do what in train/cadence.py.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import asdict, dataclass, replace

import torch

from strata.data.lease import check_held
from strata.data.storage import basename
from train.cadence import Cadence, Clock
from train.checkpoint import AsyncCheckpointer
from train.checkpoint import dir_name as checkpoint_dir_name
from train.checkpoint import load as load_checkpoint
from train.config import TrainConfig, accumulation, lr_at, use_bf16
from train.data import (
    MixedBatches,
    Prefetch,
    TokenBatches,
    open_batches,
    validation_batches,
)
from train.hardware import device_name, peak_flops
from train.memory import device_memory, micro_batch_for, strategy_for
from train.metrics import Meter, MetricsLog
from train.model import GPT, GPTConfig, build
from train.spec import RunSpec
from train.step import (
    code_compiler,
    compiler_kind,
    evaluate,
    make_optimizer,
    parallelize,
    train_step,
)


def train_loop_per_worker(config: dict) -> None:
    """Ray Train entry: `config` holds `spec` (train.spec.RunSpec, as it is), `run_dir`, `lease` and
    `threads`."""
    import ray.train

    w = _start(config)
    tcfg, checkpointer, batches = w.tcfg, w.checkpointer, w.batches
    clock = Clock()
    cadence = Cadence(max_steps=tcfg.max_steps, log_every=tcfg.log_every, report_every_s=tcfg.report_every_s,
                      checkpoint_every=tcfg.checkpoint_every, checkpoint_every_s=tcfg.checkpoint_every_s,
                      task_every=tcfg.eval_every if tcfg.eval_task else 0, start_step=w.start_step, started=clock.start, drain_check_every_s=tcfg.drain_check_every_s)
    step_losses: list[torch.Tensor] = []  # since the last log point, on the device: no sync per step
    saved_for_preemption = False
    try:
        micro = MicroProgress(w.log) if w.rank == 0 and tcfg.grad_accum > 1 else None
        for step in range(w.start_step, tcfg.max_steps):
            if micro:
                micro.begin(step + 1)
            step_losses.append(train_step(w.model, w.optimizer, [next(batches) for _ in range(tcfg.grad_accum)],
                                          lr_at(step, tcfg), tcfg, w.device, w.bf16, progress=micro))
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


class MicroProgress:
    """Says how far a long accumulating step is (rank 0, into the run's log, which the driver shows): the
    first micro-batch's time and what the whole step will take, once, when that is over a minute; then a
    line every EVERY_S seconds. A step that takes seconds says nothing."""

    EVERY_S = 30.0

    def __init__(self, log, clock=time.perf_counter):
        self.log, self.clock, self.first, self.step, self.began, self.said = log, clock, True, 0, 0.0, 0.0

    def begin(self, step: int) -> None:
        self.step, self.began = step, self.clock()
        self.said = self.began

    def __call__(self, done: int, of: int) -> None:
        now = self.clock()
        if self.first:
            self.first = False
            if (now - self.began) * of > 60:
                self.log.event({"event": "slow_step", "step": self.step, "first_micro_s": now - self.began,
                                "micro_batches": of})
                self.said = now
        if done < of and now - self.said >= self.EVERY_S:
            self.log.event({"event": "micro", "step": self.step, "done": done, "of": of, "seconds": now - self.began})
            self.said = now


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
    meter: Meter
    log: MetricsLog


def _start(config: dict) -> _Worker:
    """The worker's model built and wrapped, its latest checkpoint restored, its micro-batch sized (or the
    run's kept), its data opened at the restored step, and the run's start logged."""
    import ray
    import ray.train

    rank, world, local_world, device = _worker(config)
    spec: RunSpec = config["spec"]
    mcfg, tcfg = spec.model, spec.train
    bf16 = use_bf16(tcfg, device)
    memory = _min_over_ranks(device_memory(device, local_world), device, world)
    raw, model, strategy, params, compiled = _build(mcfg, tcfg, device, bf16, world, local_world, memory)
    optimizer = make_optimizer(model, tcfg)
    # Checkpoints travel on a gloo group of their own: the background write's collectives
    # must not interleave with training's.
    ckpt_pg = torch.distributed.new_group(backend="gloo") if torch.distributed.is_initialized() else None
    checkpointer = AsyncCheckpointer(model, optimizer, rank, ckpt_pg, run=basename(config["run_dir"]))
    start_step, resumed_from, meta = 0, None, {}
    if checkpoint := ray.train.get_checkpoint():
        with checkpoint.as_directory() as d:
            meta = load_checkpoint(d, model, optimizer, rank, ckpt_pg, origin=checkpoint.path)
        start_step, resumed_from = meta["step"], checkpoint.path
    elif spec.init is not None:  # fine-tuning: the weights the driver put in the object store
        from train.pretrained import apply

        apply(model, ray.get(spec.init))
    # The micro-batch and the accumulation are part of the data order: a run keeps those it started with.
    batch = tcfg.batch_size or meta.get("micro_batch") or micro_batch_for(
        mcfg, params, strategy, world, memory, bf16, device.type)
    tcfg = replace(tcfg, batch_size=batch,
                   grad_accum=tcfg.grad_accum or meta.get("grad_accum") or accumulation(tcfg, batch, world,
                                                                                           mcfg.seq_len))
    sources = spec.sources
    data = open_batches(sources, batch_size=batch, rank=rank, world_size=world, seed=tcfg.seed)
    if tcfg.max_repeat:  # the driver checks a given batch size; one sized for the device is checked here
        end = tcfg.max_steps * tcfg.grad_accum
        repeats = data.repeats(end) if len(sources) > 1 else [end / data.steps_per_epoch]
        if over := [f"{s.name} {r:.2f} times" for s, r in zip(sources, repeats, strict=True) if r > tcfg.max_repeat]:
            raise ValueError(f"{tcfg.max_steps} steps would repeat {', '.join(over)}, more than --max-repeat "
                             f"{tcfg.max_repeat:g}")
    meter = Meter(raw.flops_per_token(), peak_flops(device, bf16), batch * tcfg.grad_accum * mcfg.seq_len * world,
                   world, start_step)
    log = MetricsLog(config["run_dir"], rank)
    log.event({"event": "start", "start_step": start_step, "resumed_from": resumed_from, "world_size": world,
               "strategy": strategy, "bf16": bf16, "device": device_name(device), "peak_flops": meter.peak,
               "flops_per_token": meter.flops_per_token, "micro_batch": batch, "grad_accum": tcfg.grad_accum,
               "tokens_per_step": meter.tokens_per_step, "tokens_per_step_target": tcfg.tokens_per_step,
               "compiled": compiled})
    val_sets = [(s.name, s.weight, v) for s in sources if (v := validation_batches(s.val_shards, tcfg))]
    token_bytes = torch.tensor(spec.token_bytes, device=device) if len(spec.token_bytes) else None
    return _Worker(rank, world, device, bf16, tcfg, raw, model, optimizer, checkpointer, start_step,
                   Prefetch(data.from_step(start_step * tcfg.grad_accum)), data,
                   [s.name for s in sources], val_sets, token_bytes, meter, log)


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
    spec: RunSpec = config["spec"]
    handover = []
    if checkpointer.pending and (written or decision.save):
        handover.append((*checkpointer.take(), False))
    if decision.save:
        checkpointer.start(done, {"loss": metrics["loss"], "reason": decision.reason,
                                  "data_position": done * tcfg.grad_accum, "world_size": world,
                                  "model_config": asdict(spec.model), "train_config": asdict(spec.train),
                                  "micro_batch": tcfg.batch_size, "grad_accum": tcfg.grad_accum,
                                  "tokenizer": asdict(spec.tokenizer),
                                  "tokenizer_definition": spec.tokenizer_definition,
                                  "lease_gen": (config.get("lease") or {}).get("gen")})
        if decision.reason in ("end", "preemption"):  # must be registered before the run ends or the node goes
            handover.append((*checkpointer.take(), True))
    if handover and config.get("lease"):  # every rank, so all of them stop together: report is a barrier
        try:
            check_held(config["run_dir"], config["lease"]["gen"], config["lease"]["what"])
        except BaseException:  # nothing is handed over: the local copies go now (they were left in the temp dir)
            for _, local, _ in handover:
                shutil.rmtree(local, ignore_errors=True)
            raise
    return handover


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


def _record_node(run_dir: str, rank: int) -> None:
    """Where this rank actually runs, for the run record (and the placement test)."""
    import ray

    from strata.data.storage import write_json_atomic

    rc = ray.get_runtime_context()
    write_json_atomic(f"{run_dir}/workers/rank-{rank}.json",
                      {"rank": rank, "node_id": rc.get_node_id(), "pid": os.getpid(), "time": time.time()})
