"""Wall time blocked on checkpoints at the default interval, from measured blocking per checkpoint.

    python -m bench.train.checkpoint [--presets debug gpt2-124m] [--repeats 3] [--interval-s 300]

For each preset, on CPU: the model and AdamW after one step (so the optimizer
state exists), in a one-process gloo group as under Ray Train. Each repeat
takes an asynchronous sharded checkpoint the way training does
(train/checkpoint.py: stage to CPU, write in the background) and times what
training waits for, then lets the write finish and times that too. For
comparison, the same state saved synchronously with torch.save (what
training would wait for without async checkpoints). The blocked fraction is
the mean blocking time over `--interval-s` (the default checkpoint interval,
5 minutes); the last line gives it per preset (target < 1%).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import tempfile
import time


def _process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)


def measure(name: str, repeats: int) -> dict:
    import numpy as np
    import torch

    from train.checkpoint import AsyncCheckpointer
    from train.config import TrainConfig
    from train.model import GPT, preset
    from train.step import make_optimizer, train_step

    cfg = preset(name)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = make_optimizer(model, TrainConfig())
    batch = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    train_step(model, optimizer, [batch], 1e-4, TrainConfig(), torch.device("cpu"))
    checkpointer = AsyncCheckpointer(model, optimizer, rank=0)
    blocked, written, sync = [], [], []
    for i in range(repeats):
        t = time.perf_counter()
        checkpointer.start(i, {"bench": True})
        blocked.append(time.perf_counter() - t)
        _, local = checkpointer.take()
        written.append(time.perf_counter() - t)
        size = sum(os.path.getsize(os.path.join(local, f)) for f in os.listdir(local))
        shutil.rmtree(local)
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, os.path.join(d, "s.pt"))
            sync.append(time.perf_counter() - t)
    return {"preset": name, "params": model.num_params(), "checkpoint_mb": size / 1e6,
            "blocked_s": sum(blocked) / repeats, "written_s": sum(written) / repeats, "sync_save_s": sum(sync) / repeats}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["debug", "gpt2-124m"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval-s", type=float, default=None,
                        help="checkpoint interval (default: TrainConfig's checkpoint_every_s)")
    parser.add_argument("--json", action="store_true", help="print a JSON result line before the last line")
    args = parser.parse_args(argv)

    import torch

    from train.config import TrainConfig

    interval = args.interval_s or TrainConfig().checkpoint_every_s
    torch.set_num_threads(os.cpu_count() or 1)
    _process_group()
    results = []
    for name in args.presets:
        r = measure(name, args.repeats)
        r["blocked_fraction"] = r["blocked_s"] / interval
        r["sync_fraction"] = r["sync_save_s"] / interval
        results.append(r)
        print(f"{name:10} {r['params'] / 1e6:7.1f}M params, {r['checkpoint_mb']:8.1f} MB: training blocked "
              f"{r['blocked_s'] * 1e3:8.1f} ms per checkpoint (written in {r['written_s']:.2f} s in the background); "
              f"a synchronous torch.save blocks {r['sync_save_s'] * 1e3:.1f} ms", flush=True)
    if args.json:
        print(json.dumps(results))
    parts = ", ".join(f"{r['preset']} {r['blocked_fraction']:.3%} (sync save: {r['sync_fraction']:.3%})" for r in results)
    print(f"wall time blocked on checkpoints every {interval:g} s: {parts}")


if __name__ == "__main__":
    main()
