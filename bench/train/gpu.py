"""Tokens/s and MFU of the GPT presets in bf16 on one GPU: plain PyTorch, synthetic tokens.

    bench/train/gpu.sh                      # gpt2-124m and gpt2-350m, about 5 minutes
    python -m bench.train.gpu [--presets gpt2-124m gpt2-350m] [--seconds 45] [--no-compile]

For each preset: the model on the device, train/loop.py's `train_step`
(bf16 autocast, fused AdamW, gradient clipping) on random token rows, after
torch.compile and a warm-up; then as many steps as fit in `--seconds`,
timed between device synchronizations. MFU = FLOPs per token x tokens/s /
the device's peak (train/hardware.py; STRATA_PEAK_TFLOPS overrides). The last
line is the lowest MFU over the target (0.40 on H100/H200-class GPUs): >= 1
meets it. `--device cpu --presets debug` runs it anywhere (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import time

BATCH = {"debug": 16, "gpt2-124m": 32, "gpt2-350m": 16, "gpt2-774m": 8, "1.3b": 4}
TARGET_MFU = 0.40


def measure(name: str, device, seconds: float, compile_model: bool, batch_size: int | None, warmup: int) -> dict:
    import numpy as np
    import torch

    from train.hardware import device_name, peak_flops
    from train.loop import TrainConfig, make_optimizer, train_step, use_bf16
    from train.model import GPT, preset

    cfg = preset(name)
    tcfg = TrainConfig(batch_size=batch_size or BATCH.get(name, 8), precision="auto", compile="on" if compile_model else "off")
    bf16 = use_bf16(tcfg, device)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    flops_per_token = model.flops_per_token()
    optimizer = make_optimizer(model, tcfg)
    step_fn = torch.compile(model) if compile_model else model
    rng = np.random.default_rng(0)
    batches = [rng.integers(0, cfg.vocab_size, (tcfg.batch_size, cfg.seq_len + 1)) for _ in range(8)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    for i in range(warmup):
        train_step(step_fn, optimizer, [batches[i % 8]], 1e-4, tcfg, device, bf16).item()
    sync()
    warm_s = time.perf_counter() - t0
    steps, started = 0, time.perf_counter()
    while steps < 3 or time.perf_counter() - started < seconds:
        loss = train_step(step_fn, optimizer, [batches[steps % 8]], 1e-4, tcfg, device, bf16)
        steps += 1
        if steps % 10 == 0:
            loss.item()
    sync()
    elapsed = time.perf_counter() - started
    tps = steps * tcfg.batch_size * cfg.seq_len / elapsed
    peak = peak_flops(device, bf16)
    out = {"preset": name, "device": device_name(device), "bf16": bf16, "compiled": compile_model,
           "batch_size": tcfg.batch_size, "seq_len": cfg.seq_len, "steps": steps, "step_ms": 1e3 * elapsed / steps,
           "tokens_per_s": tps, "flops_per_token": flops_per_token, "peak_flops": peak,
           "mfu": flops_per_token * tps / peak if peak else None, "warmup_s": warm_s}
    if device.type == "cuda":
        out["max_memory_gb"] = torch.cuda.max_memory_allocated(device) / 2**30
    del model, optimizer, step_fn
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["gpt2-124m", "gpt2-350m"])
    parser.add_argument("--seconds", type=float, default=45, help="timed seconds per preset")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation happens here)")
    parser.add_argument("--batch-size", type=int, help="rows per step (default: per preset)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the ratio")
    args = parser.parse_args(argv)

    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --device cpu for a smoke test")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    results = []
    for name in args.presets:
        r = measure(name, device, args.seconds, args.compile, args.batch_size, args.warmup)
        results.append(r)
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (unknown peak)"
        print(f"{name:10} {r['device']}: batch {r['batch_size']} x {r['seq_len']}, {r['step_ms']:.1f} ms/step, "
              f"{r['tokens_per_s']:,.0f} tokens/s, MFU {mfu} (warm-up {r['warmup_s']:.0f} s)", flush=True)
    if args.json:
        print(json.dumps(results))
    mfus = [r["mfu"] for r in results if r["mfu"] is not None]
    if mfus:
        print(f"ratio lowest MFU/target {TARGET_MFU:.2f}: {min(mfus) / TARGET_MFU:.2f}")
    else:
        print("ratio lowest MFU/target: n/a (no peak FLOP/s known for this device; set STRATA_PEAK_TFLOPS)")


if __name__ == "__main__":
    main()
