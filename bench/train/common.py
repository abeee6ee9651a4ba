"""Shared by the training benchmarks: a small real dataset made by the tier-1 pipeline, once per workdir."""

from __future__ import annotations

import argparse
import os
import random
import tempfile

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "they", "this", "which", "model", "data", "token", "layer", "batch", "train", "shard", "cluster", "node", "loss", "step", "sweep", "spot", "parquet", "version"]


def make_dataset(workdir: str, mb: float = 4.0, seq_len: int = 128) -> tuple[str, str]:
    """(storage root, dataset ref): `mb` MB of generated text preprocessed with the debug preset (bytes)."""
    from pipelines.config import debug
    from pipelines.driver import run
    from strata.cluster.connect import shutdown
    from strata.data.dataset import list_versions
    from strata.data.storage import Storage

    storage = Storage(os.path.join(workdir, "storage"))
    name = f"bench-{int(mb * 1000)}kb-{seq_len}"
    if versions := list_versions(storage, name):
        return storage.root, f"{name}@{versions[-1]}"
    corpus = os.path.join(workdir, "corpus", name)
    os.makedirs(corpus, exist_ok=True)
    rng = random.Random(0)
    with open(os.path.join(corpus, "docs.jsonl"), "w") as f:
        size = 0
        while size < mb * 1e6:
            line = '{"text": "' + " ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 600))) + '."}\n'
            f.write(line)
            size += len(line)
    out = run(debug(name, read={"inputs": (corpus,)}, pack={"seq_len": seq_len}), storage, dashboard=False)
    shutdown()  # the embedded Ray that made it would share the cores with what the benchmark times
    return storage.root, f"{name}@{out['version']}"


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser with the flags they share: --batch-size, --threads, --workdir, --json."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "strata-bench-train"))
    p.add_argument("--json", action="store_true", help="print a JSON result line before the ratio")
    return p


def debug_spec(storage_root: str, ref: str, batch_size: int, steps: int):
    """The run spec (train.spec.RunSpec) of the debug preset on the dataset, resolved as `python -m train`
    resolves a launch, with this micro-batch and number of steps."""
    from dataclasses import replace

    from strata.data.storage import Storage
    from train.config import TRAIN_PRESETS
    from train.model import preset
    from train.spec import resolve

    tcfg = replace(TRAIN_PRESETS["debug"], batch_size=batch_size, max_steps=steps)
    return resolve(Storage(storage_root), ref, preset("debug"), tcfg)


def plain_loop(spec, threads: int, warmup: int = 0, sync_every: int = 10):
    """The training loop without Ray: train/step.py's `train_step` on the spec's batches (train.data's
    `open_batches`, as a worker reads them), read ahead by the same `Prefetch`, the loss synced every
    `sync_every` steps (as the trainer syncs at its log points). Returns (the model, mean seconds per step
    after `warmup` steps)."""
    import time

    import torch

    from train.config import lr_at
    from train.data import Prefetch, open_batches
    from train.model import GPT
    from train.step import make_optimizer, train_step

    torch.set_num_threads(threads)
    mcfg, tcfg = spec.model, spec.train
    torch.manual_seed(tcfg.seed)
    model = GPT(mcfg)
    optimizer = make_optimizer(model, tcfg)
    data = open_batches(spec.sources, batch_size=tcfg.batch_size, rank=0, world_size=1, seed=tcfg.seed)
    batches = Prefetch(data.from_step(0))
    device, loss = torch.device("cpu"), torch.zeros(())
    started = time.perf_counter()
    try:
        for step in range(tcfg.max_steps):
            if step == warmup:
                loss.item()
                started = time.perf_counter()
            loss += train_step(model, optimizer, [next(batches)], lr_at(step, tcfg), tcfg, device)
            if (step + 1) % sync_every == 0:
                loss.item()
                loss.zero_()
        return model, (time.perf_counter() - started) / max(1, tcfg.max_steps - warmup)
    finally:
        batches.close()
