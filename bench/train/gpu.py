"""The prepared GPU check: tokens/s and MFU of the GPT presets through the real training step, an
FSDP2 bf16 step of a large preset with a checkpoint saved and loaded, and a profile of where a step's
time goes. Plain PyTorch on one device, synthetic tokens: no Ray, no dataset, no network.

    bench/train/gpu.sh                      # the whole check, about 6 minutes on one H100/H200
    python -m bench.train.gpu [--presets gpt2-124m gpt2-350m] [--seconds 20] [--no-compile]
    python -m bench.train.gpu --device cpu --presets debug --fsdp-preset debug --seconds 0.5   # smoke test

For each preset, at its default micro-batch (train/memory.py's `micro_batch_for`:
what the loop picks on this device) and at twice it where that is estimated to fit
(else half of it): the model built as the training loop builds it (meta device,
tied, `parallelize` with each block compiled), train/step.py's `train_step` (bf16
autocast, fused AdamW, the fused loss, compiled); warm-up steps compile, after
which a recompile is an error; then as many steps as fit in `--seconds`, timed
between device synchronizations. MFU = FLOPs per token (6N + 12·L·d·T, the tied
embedding counted once) x tokens/s / the device's peak (train/hardware.py;
STRATA_PEAK_TFLOPS overrides). Then the loss's share of a step: the fused loss
alone (forward and backward) timed against the whole step and against a plain
`cross_entropy` over the full logits. Then one FSDP2 bf16 step of `--fsdp-preset`
(gpt2-774m) with training's fused AdamW, a sharded checkpoint saved and loaded
back (train/checkpoint.py; the process group is `cpu:gloo,cuda:nccl` and the
checkpoint has a gloo group of its own, as in training), and a 5-step profile
whose device time is split by what launched it (then the inference case: infer's scorer
and key/value-cached decoding on the first preset, tokens/s): the loss and the optimizer by
the profiler ranges training opens around them, attention and matmul by the
aten op that launched the kernel (on Hopper cuBLAS kernels are `nvjet_*`), the
rest other, and idle. The last line is the lowest MFU over its target
(gpt2-124m 0.45, gpt2-350m 0.50): >= 1 meets every target. Without a C
compiler (Triton needs one) the check runs eager and says so.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import secrets
import shutil
import tempfile
import time

TARGET_MFU = {"gpt2-124m": 0.45, "gpt2-350m": 0.50}
KINDS = ("matmul", "attention", "loss", "optimizer", "other")
# What launched a kernel, by the profiler events around it (innermost first): training's ranges first
# (train/model.py's LOSS_RANGE, train/step.py's OPTIMIZER_RANGE, the fused loss's backward node), then
# the aten op. Kernel names are not used: they change with the GPU and the library (nvjet_* on Hopper).
ATTENTION_OPS = ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product", "aten::_flash_attention",
                 "aten::_efficient_attention", "aten::_cudnn_attention")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
              "aten::_scaled_mm", "aten::addmv", "aten::mv")


def environment(device) -> dict:
    """What the figures depend on: GPU, driver, torch, CUDA, and whether the flash attention kernel runs."""
    import subprocess

    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": str(device)}
    if device.type != "cuda":
        return env
    env["gpu"] = torch.cuda.get_device_name(device)
    try:
        env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        env["driver"] = "unknown (no nvidia-smi)"
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 4, 128, 64, device=device, dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        env["flash_attention"] = "used"
    except RuntimeError as e:
        env["flash_attention"] = f"not available: {str(e).splitlines()[0][:120]}"
    return env


def build(name: str, device, batch_size: int, compile_model: bool, strategy: str = "ddp"):
    """Model, optimizer and config, made the way the training loop makes them (fused AdamW on GPU, also
    on FSDP2's sharded parameters)."""
    import torch

    from train.config import TrainConfig, use_bf16
    from train.model import build as build_model
    from train.model import preset
    from train.step import make_optimizer, parallelize

    cfg = preset(name)
    tcfg = TrainConfig(batch_size=batch_size, precision="auto", compile="on" if compile_model else "off",
                       strategy=strategy, grad_accum=1)
    bf16 = use_bf16(tcfg, device) or strategy == "fsdp"
    torch.manual_seed(0)
    raw = build_model(cfg, device)  # tied, as training builds it
    model = parallelize(raw, strategy, device, bf16, 1, compile_blocks=compile_model)
    return raw, model, make_optimizer(model, tcfg), cfg, tcfg, bf16


def micro_batches(name: str, device) -> tuple[int, int]:
    """(the loop's default micro-batch for `name` on `device`, a second one: twice it if that is
    estimated to fit in 80% of the device's memory, else half of it)."""
    from train.memory import activation_bytes_per_row, device_memory, micro_batch_for
    from train.model import describe, preset

    cfg = preset(name)
    params = describe(cfg)["params"]
    memory = device_memory(device, 1)
    default = micro_batch_for(cfg, params, "ddp", 1, memory, True, device.type)
    fits = 16 * params + 2 * default * activation_bytes_per_row(cfg, True) < 0.8 * memory
    return default, 2 * default if fits or device.type != "cuda" else max(1, default // 2)


def _batches(cfg, batch_size: int):
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)) for _ in range(8)]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(name: str, device, seconds: float, compile_model: bool, batch_size: int, warmup: int) -> dict:
    import torch

    from train.hardware import device_name, peak_flops
    from train.step import train_step

    raw, model, optimizer, cfg, tcfg, bf16 = build(name, device, batch_size, compile_model)
    batches = _batches(cfg, batch_size)
    t0 = time.perf_counter()
    for i in range(warmup):
        train_step(model, optimizer, [batches[i % 8]], 1e-4, tcfg, device, bf16).item()
    _sync(device)
    warm_s = time.perf_counter() - t0
    torch._dynamo.config.error_on_recompile = compile_model  # compiled once: a recompile now is a bug
    try:
        steps, started = 0, time.perf_counter()
        while steps < 3 or time.perf_counter() - started < seconds:
            loss = train_step(model, optimizer, [batches[steps % 8]], 1e-4, tcfg, device, bf16)
            steps += 1
            if steps % 10 == 0:
                loss.item()
        _sync(device)
    finally:
        torch._dynamo.config.error_on_recompile = False
    elapsed = time.perf_counter() - started
    tps = steps * batch_size * cfg.seq_len / elapsed
    peak = peak_flops(device, bf16)
    out = {"preset": name, "device": device_name(device), "bf16": bf16, "compiled": compile_model,
           "batch_size": batch_size, "seq_len": cfg.seq_len, "steps": steps, "step_ms": 1e3 * elapsed / steps,
           "tokens_per_s": tps, "flops_per_token": raw.flops_per_token(), "peak_flops": peak,
           "mfu": raw.flops_per_token() * tps / peak if peak else None, "warmup_s": warm_s}
    if device.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def loss_share(name: str, device, compile_model: bool, reps: int = 10) -> dict:
    """The fused loss's share of a training step, timed on the same shapes: the step (train_step at the
    default micro-batch), the loss alone (forward and backward of `linear_cross_entropy` on the step's
    (rows, width) hidden states), and a plain `cross_entropy` over the whole logits (None where it does
    not fit in memory)."""
    import torch
    import torch.nn.functional as F

    from train.model import linear_cross_entropy
    from train.step import autocast, train_step

    raw, model, optimizer, cfg, tcfg, bf16 = build(name, device, micro_batches(name, device)[0], compile_model)
    batches = _batches(cfg, tcfg.batch_size)
    rows = tcfg.batch_size * cfg.seq_len
    h = torch.randn(rows, cfg.n_embd, device=device, requires_grad=True)
    w = raw.head.weight.detach().clone().requires_grad_(True)
    targets = torch.from_numpy(batches[0][:, 1:].reshape(-1)).to(device)

    def step():
        train_step(model, optimizer, [batches[0]], 1e-4, tcfg, device, bf16)

    def fused():
        with autocast(device, bf16):
            loss = linear_cross_entropy(h, w, targets, compiled=compile_model)
        loss.backward()

    def plain():
        with autocast(device, bf16):
            loss = F.cross_entropy((h @ w.t()).float(), targets)
        loss.backward()

    out = {"preset": name, "batch_size": tcfg.batch_size}
    for key, fn in (("step_ms", step), ("loss_ms", fused), ("plain_ms", plain)):
        try:
            out[key] = _timed(fn, device, reps)
        except torch.OutOfMemoryError:
            out[key] = None
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["share"] = out["loss_ms"] / out["step_ms"]
    out["vs_plain"] = out["loss_ms"] / out["plain_ms"] if out["plain_ms"] else None
    return out


def _timed(fn, device, reps: int) -> float:
    """Milliseconds per call of `fn`, after two untimed calls (compilation), between device syncs."""
    for _ in range(2):
        fn()
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - t) / reps


def fsdp_step_and_checkpoint(name: str, device, compile_model: bool, backend: str | None = None) -> dict:
    """One FSDP2 bf16 step with training's optimizer, then a sharded checkpoint saved and loaded back.
    The process group is made with `backend` (default: gloo for CPU tensors, NCCL for CUDA ones); the
    checkpoint gets a gloo group of its own, as training's does, so it works on any default group."""
    import torch
    import torch.distributed as dist

    from strata.data import signing
    from train.checkpoint import AsyncCheckpointer, load
    from train.step import train_step

    if not signing.has_key():  # a GPU machine holds no strata key: this check's own checkpoint, read only here,
        os.environ[signing.KEY_ENV] = secrets.token_hex(32)  # is signed with a key that ends with the process

    if not dist.is_initialized():
        path = tempfile.mktemp(prefix="strata-gpu-check-")
        atexit.register(lambda: os.path.exists(path) and os.remove(path))  # the store outlives the group
        store = dist.FileStore(path, 1)
        dist.init_process_group(backend or ("cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"),
                                store=store, rank=0, world_size=1)
    ckpt_pg = dist.new_group(backend="gloo")
    raw, model, optimizer, cfg, tcfg, bf16 = build(name, device, 4, compile_model, strategy="fsdp")
    batch = _batches(cfg, tcfg.batch_size)[0]
    t = time.perf_counter()
    loss = train_step(model, optimizer, [batch], 1e-4, tcfg, device, bf16).item()
    _sync(device)
    step_s = time.perf_counter() - t
    ckpt = AsyncCheckpointer(model, optimizer, 0, ckpt_pg)
    t = time.perf_counter()
    ckpt.start(1, {"loss": loss})
    _, local = ckpt.take()
    save_s = time.perf_counter() - t
    saved = [p.full_tensor().float().sum().item() for p in list(model.parameters())[:3]]
    with torch.no_grad():  # change the weights, so that only a working load brings them back
        for p in model.parameters():
            p.add_(1.0)
    t = time.perf_counter()
    meta = load(local, model, optimizer, 0, ckpt_pg)
    load_s = time.perf_counter() - t
    loaded = [p.full_tensor().float().sum().item() for p in list(model.parameters())[:3]]
    shutil.rmtree(local, ignore_errors=True)
    out = {"preset": name, "loss": loss, "step_s": step_s, "save_s": save_s, "load_s": load_s,
           "restored_step": meta["step"], "weights_match": saved == loaded,
           "fused_adamw": all(g.get("fused") for g in optimizer.param_groups)}
    del raw, model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def profile(name: str, device, compile_model: bool, steps: int = 5) -> dict:
    """Where `steps` steps' wall time goes, as shares: matmul, attention, loss, optimizer, other, idle."""
    import torch
    from torch.profiler import ProfilerActivity

    from train.step import train_step

    _, model, optimizer, cfg, tcfg, bf16 = build(name, device, micro_batches(name, device)[0], compile_model)
    batches = _batches(cfg, tcfg.batch_size)
    for i in range(3):  # compile and warm up outside the profile
        train_step(model, optimizer, [batches[i]], 1e-4, tcfg, device, bf16).item()
    _sync(device)
    gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if gpu else [ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        t = time.perf_counter()
        for i in range(steps):
            train_step(model, optimizer, [batches[i % 8]], 1e-4, tcfg, device, bf16)
        _sync(device)
        wall_us = (time.perf_counter() - t) * 1e6
    spent = shares_of(prof.events(), gpu)
    busy = sum(spent.values())
    shares = {k: v / max(wall_us, busy) for k, v in spent.items()}
    shares["idle"] = max(0.0, 1.0 - sum(shares.values()))
    return {"preset": name, "steps": steps, "wall_ms": wall_us / 1e3, "shares": shares}


def shares_of(events, gpu: bool) -> dict:
    """Microseconds of device time (of CPU time, without a GPU) by kind (KINDS): each CPU event's own time
    (its kernels', on a GPU) goes to the kind of what launched it (`kind_of`); kernels no event claims
    are other."""
    from torch.autograd import DeviceType

    spent = dict.fromkeys(KINDS, 0.0)
    claimed = 0.0
    for e in events:
        if e.device_type != DeviceType.CPU or e.is_async:
            continue
        us = e.self_device_time_total if gpu else e.self_cpu_time_total
        if us > 0:
            spent[kind_of(e)] += us
            claimed += us
    if gpu:
        kernels = sum(e.device_time_total for e in events if e.device_type == DeviceType.CUDA)
        spent["other"] += max(0.0, kernels - claimed)
    return spent


def kind_of(event) -> str:
    """The kind of an event's work, by the events around it (itself, then its parents outward): inside
    training's loss or optimizer range (or the fused loss's backward) it is that; else attention or
    matmul by the aten op that launched it; else other."""
    from train.model import LOSS_RANGE
    from train.step import OPTIMIZER_RANGE

    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    for n in names:
        if n == LOSS_RANGE or "LinearCrossEntropy" in n:
            return "loss"
        if n == OPTIMIZER_RANGE:
            return "optimizer"
    if any(n.startswith(ATTENTION_OPS) or "ScaledDotProduct" in n for n in names):
        return "attention"
    if any(n in MATMUL_OPS for n in names):
        return "matmul"
    return "other"


def inference(name: str, device, seconds: float, docs: int = 64, doc_tokens: int = 3000) -> dict:
    """The inference case: infer's scorer (windows of the context at half stride, batched by length,
    GPU_BATCH_TOKENS a batch on a GPU) over synthetic documents, and batched greedy decoding with the
    key/value cache (infer/generate.py), each in tokens/s on the preset's model (fp32 weights, TF32)."""
    import numpy as np
    import torch

    from infer.generate import decode
    from infer.score import batch_tokens_for, score_ids
    from train.model import GPT, preset

    cfg = preset(name)
    torch.manual_seed(0)
    model = GPT(cfg).to(device).eval()
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, cfg.vocab_size - 1, doc_tokens) for _ in range(docs)]
    batch = batch_tokens_for(device.type)
    score_ids(model, documents[:2], cfg.vocab_size - 1, stride=cfg.seq_len // 2, batch_tokens=batch,
              device=device.type)  # warm-up
    _sync(device)
    started, scored = time.perf_counter(), 0
    while scored == 0 or time.perf_counter() - started < seconds:
        score_ids(model, documents, cfg.vocab_size - 1, stride=cfg.seq_len // 2, batch_tokens=batch, device=device.type)
        scored += docs * doc_tokens
    _sync(device)
    score_s = time.perf_counter() - started
    prompts = [rng.integers(0, cfg.vocab_size - 1, 32).tolist() for _ in range(32)]
    new = min(128, cfg.seq_len - 33)
    decode(model, prompts[:2], max_tokens=4, eot_id=cfg.vocab_size - 1, vocab_limit=cfg.vocab_size)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    made = decode(model, prompts, max_tokens=new, eot_id=cfg.vocab_size - 1, vocab_limit=cfg.vocab_size)
    _sync(device)
    gen_s = time.perf_counter() - t0
    return {"preset": name, "device": str(device), "batch_tokens": batch, "score_tokens_per_s": scored / score_s,
            "generate_prompts": len(prompts), "generate_tokens_per_s": sum(len(m) for m in made) / gen_s}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["gpt2-124m", "gpt2-350m"])
    parser.add_argument("--seconds", type=float, default=20, help="timed seconds per preset and micro-batch")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch-size", type=int, help="rows per step (default: the loop's for the preset and device), timed also at twice it")
    parser.add_argument("--fsdp-preset", default="gpt2-774m", help="the preset of the FSDP2 step (none: skip)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--inference", action=argparse.BooleanOptionalAction, default=True,
                        help="the inference case: infer's scorer and decoding on the first preset")
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the ratio")
    args = parser.parse_args(argv)

    import torch

    from train.step import code_compiler, compiler_kind

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu for a smoke test")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    env = environment(device)
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if args.compile and not code_compiler(device):  # Triton builds its launchers with one at run time
        args.compile = False
        print(f"compile: off, no {compiler_kind(device)} (set CC, or install gcc or clang): the steps run eager",
              flush=True)
    results = []
    for name in args.presets:
        for batch_size in (args.batch_size, 2 * args.batch_size) if args.batch_size else micro_batches(name, device):
            r = measure(name, device, args.seconds, args.compile, batch_size, args.warmup)
            results.append(r)
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (unknown peak)"
            print(f"{name:10} {r['device']}: batch {r['batch_size']} x {r['seq_len']}, {r['step_ms']:.1f} ms/step, "
                  f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu} (warm-up {r['warmup_s']:.0f} s)", flush=True)
    share = loss_share(args.presets[0], device, args.compile)
    print(f"loss of {share['preset']} batch {share['batch_size']}: {share['loss_ms']:.1f} ms of a "
          f"{share['step_ms']:.1f} ms step ({share['share']:.1%}); a plain cross_entropy "
          + (f"{share['plain_ms']:.1f} ms (fused/plain {share['vs_plain']:.2f})" if share["plain_ms"]
             else "does not fit in memory"), flush=True)
    fsdp = None
    if args.fsdp_preset != "none":
        fsdp = fsdp_step_and_checkpoint(args.fsdp_preset, device, compile_model=False)  # one step: no compile
        print(f"fsdp2 bf16 {fsdp['preset']}: step {fsdp['step_s']:.2f} s, loss {fsdp['loss']:.3f}; checkpoint save "
              f"{fsdp['save_s']:.2f} s, load {fsdp['load_s']:.2f} s, step {fsdp['restored_step']} restored, "
              f"weights {'match' if fsdp['weights_match'] else 'DIFFER'}; "
              f"{'fused' if fsdp['fused_adamw'] else 'unfused'} AdamW", flush=True)
    prof = profile(args.presets[0], device, args.compile)
    print(f"profile of {prof['steps']} {prof['preset']} steps ({prof['wall_ms']:.0f} ms): "
          + ", ".join(f"{k} {v:.0%}" for k, v in prof["shares"].items()), flush=True)
    infer = None
    if args.inference:
        infer = inference(args.presets[0], device, args.seconds)
        print(f"inference {infer['preset']} {infer['device']}: scoring {infer['score_tokens_per_s']:,.0f} tokens/s "
              f"({infer['batch_tokens']} tokens a batch), greedy decoding {infer['generate_tokens_per_s']:,.0f} "
              f"tokens/s ({infer['generate_prompts']} prompts, key/value cache)", flush=True)
    if args.json:
        print(json.dumps({"environment": env, "compiled": args.compile, "runs": results, "loss": share,
                          "fsdp": fsdp, "profile": prof, "inference": infer}))
    scored = [(r["mfu"] / TARGET_MFU[r["preset"]], r) for r in results
              if r["mfu"] is not None and r["preset"] in TARGET_MFU]
    if scored:
        worst, r = min(scored, key=lambda s: s[0])
        print(f"ratio lowest MFU/target: {worst:.2f} ({r['preset']} batch {r['batch_size']}: MFU {r['mfu']:.1%} "
              f"against {TARGET_MFU[r['preset']]:.2f})")
    else:
        print("ratio lowest MFU/target: n/a (no preset with a target ran on a device of known peak)")


if __name__ == "__main__":
    main()
