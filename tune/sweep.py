"""A sweep: many short trials of train's own loop, each config trained as a run of it would be.

Trials are plain function trainables (a `TorchTrainer` per trial costs seconds
of start-up each), placed on spot-tier nodes by label selector. A trial builds
its model, optimizer, schedule and batches through train's code (`ModelFit`):
a config's trial and `python -m train --from-sweep` see the same batches.

Scale: Ray Tune pays a fraction of a second of driver and raylet work per
trial, and a checkpoint per report. By default a sweep therefore runs a few
long-lived Tune trials, one per spot slot (*workers*), which pull configs
from the sweep's queue (tune/queued.py) until none is left. A config is
sampled from the space by its index, so anyone can recompute it; ASHA's rule
is applied by the queue across the whole sweep. A worker checkpoints
nothing: what it finished is with the queue, and what a lost worker held
goes back to the front of the queue. `--pack 1` (and `--search optuna`, whose
searcher proposes each config) runs one Tune trial per config instead, with
Tune's own scheduler and a checkpoint at every report.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from strata.cluster.connect import fetch_once
from strata.data.rows import read_rows
from strata.data.tokenizer import from_info
from train.config import (
    MODEL_KEYS,
    TRAIN_KEYS,
    TrainConfig,
    accumulation,
    as_swept,
    lr_at,
    with_hyperparameters,
)
from train.data import ShardCache, Source, open_batches
from train.memory import CPU_MICRO_BATCH
from train.mixture import MIX, swept
from train.model import GPTConfig, build
from train.pretrained import apply
from train.spec import RunSpec
from train.step import evaluate, make_optimizer, train_step
from tune.config import SweepConfig
from tune.queued import _log_for, _row, run_worker

STATE_FILE = "state.pt"  # a config's own trial's model and optimizer in its checkpoint, beside pack.json


DISTRIBUTIONS = {"loguniform": 2, "uniform": 2, "randint": 2, "choice": 1}

# Named spaces, in the file format: {param: {distribution: arguments}}.
SPACES = {
    "lr-batch": {"lr": {"loguniform": [3e-4, 3e-2]}, "batch_size": {"choice": [8, 16, 32]}},
    "small": {
        "lr": {"loguniform": [3e-4, 3e-2]}, "batch_size": {"choice": [8, 16, 32]},
        "n_layer": {"choice": [2, 4]}, "n_embd": {"choice": [64, 128]}, "n_head": {"choice": [2, 4]},
        "warmup_steps": {"randint": [0, 20]}, "weight_decay": {"uniform": [0.0, 0.2]},
        "dropout": {"choice": [0.0, 0.1]},
    },
}


def load_space(spec: str) -> dict:
    """A named space (see SPACES) or a .json/.yaml file in the same format, checked."""
    if spec in SPACES:
        raw = SPACES[spec]
    elif spec.endswith((".json", ".yaml", ".yml")):
        import yaml

        from strata.data.storage import filesystem

        fs, path = filesystem(spec)
        try:
            with fs.open_input_stream(path) as f:
                raw = yaml.safe_load(f.read())  # JSON is YAML
        except FileNotFoundError:
            raise ValueError(f"search space file {spec} does not exist") from None
    else:
        raise ValueError(f"search space {spec!r} is neither a name ({', '.join(SPACES)}) nor a .json/.yaml file")
    return check_space(raw, spec)


def check_space(raw, where: str) -> dict:
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{where}: a search space is a non-empty mapping of parameter -> {{distribution: args}}")
    for key, dist in raw.items():
        if key.startswith(MIX):
            if not (isinstance(dist, dict) and next(iter(dist), None) in ("uniform", "loguniform")
                    and len(dist[next(iter(dist))]) == 2 and min(dist[next(iter(dist))]) >= 0):
                raise ValueError(f"{where}: {key} (a mixture weight) needs uniform or loguniform [low, high], "
                                 "low >= 0")
            continue
        if key not in TRAIN_KEYS + MODEL_KEYS:
            raise ValueError(f"{where}: cannot tune {key!r}; tunable: {', '.join(TRAIN_KEYS + MODEL_KEYS)}")
        if not (isinstance(dist, dict) and len(dist) == 1 and next(iter(dist)) in DISTRIBUTIONS):
            raise ValueError(f"{where}: {key} needs one of {', '.join(DISTRIBUTIONS)}, e.g. {{choice: [1, 2]}}")
        name, args = next(iter(dist.items()))
        if not isinstance(args, list) or (name != "choice" and len(args) != 2) or not args:
            raise ValueError(f"{where}: {key}: {name} takes {'a list' if name == 'choice' else '[low, high]'}")
        if key in ("n_layer", "n_head", "n_embd") and name != "choice":
            raise ValueError(f"{where}: {key} must be a choice list (the shape has to be valid)")
    heads = raw.get("n_head", {}).get("choice")
    widths = raw.get("n_embd", {}).get("choice")
    for h in heads or []:
        for w in widths or []:
            if w % h:
                raise ValueError(f"{where}: n_embd {w} is not divisible by n_head {h}")
    return raw


def to_tune(space: dict) -> dict:
    """The checked file format as Ray Tune's sampling objects."""
    from ray import tune

    make = {"loguniform": tune.loguniform, "uniform": tune.uniform, "randint": tune.randint,
            "choice": lambda *a: tune.choice(list(a))}
    return {k: make[name](*args) for k, d in space.items() for name, args in d.items()}


def load_rows(source: Source, split: str, limit: int, last: bool = False) -> np.ndarray | None:
    """Up to `limit` rows (n, seq_len + 1) of a source's split, in manifest order: its first rows, or its
    `last`; None when the split has none."""
    refs = source.shards if split == "train" else source.val_shards
    out, n = [], 0
    for ref in reversed(refs) if last else refs:
        rows = read_rows(ref.path)
        out.append(rows[max(len(rows) - (limit - n), 0):] if last else rows[: limit - n])
        n += len(out[-1])
        if n >= limit:
            break
    if last:
        out.reverse()
    return np.concatenate(out) if out else None


@dataclass(frozen=True)
class TrialSpec:
    """What every trial of a sweep trains from, resolved once by the driver (in the object store once)."""

    run: RunSpec
    """The preset on the sweep's data (train.spec.resolve, every dataset at weight 1): each config varies
    its hyperparameters and mixture weights."""
    sweep: SweepConfig
    val_rows: np.ndarray  # the rows each report scores
    out: str = ""  # the sweep's directory: trials write their training losses under it
    task: tuple = ()  # with --metric task_acc or task_acc_norm: the --eval-task items each report scores

    def configs(self, hp: dict) -> tuple[GPTConfig, TrainConfig]:
        """A trial's model and train configs: the preset with the config's hyperparameters, for the sweep's
        steps and seed (train.config.as_swept, as `train --from-sweep` resolves them), on one CPU worker."""
        mcfg, tcfg = with_hyperparameters({k: v for k, v in hp.items() if not k.startswith(MIX)},
                                          self.run.model, self.run.train)
        tcfg = as_swept(replace(tcfg, max_steps=self.sweep.steps, batch_size=tcfg.batch_size or CPU_MICRO_BATCH),
                        seed=self.sweep.seed)
        return mcfg, replace(tcfg, grad_accum=accumulation(tcfg, tcfg.batch_size, 1, mcfg.seq_len))

    def sources_for(self, hp: dict) -> list[Source]:
        """The sources at the config's mixture weights (train.mixture.swept, as a run of it weighs them)."""
        weights = swept(hp, [(s.name, s.weight) for s in self.run.sources])
        return [replace(s, weight=w) for s, (_, w) in zip(self.run.sources, weights, strict=True)]


_SHARDS: dict[int, ShardCache] = {}  # per trial process: shards read once, for config after config


class ModelFit:
    """One config's training, with the data path, model build and step of a run's worker (train.loop): a
    trial and `python -m train --from-sweep` with the same config and seed train on the same batches in the
    same order and log the same losses. `advance` trains to the next report and scores it."""

    def __init__(self, hp: dict, state: dict | None, spec: TrialSpec):
        s = spec.sweep
        mcfg, self.tcfg = spec.configs(hp)
        self.every, self.steps, self.metric = s.report_every, s.steps, s.metric
        self.val_batches = [spec.val_rows[i: i + 32] for i in range(0, len(spec.val_rows), 32)]
        # A copy: the array from the object store is read-only.
        self.token_bytes = torch.tensor(spec.run.token_bytes) if s.metric == "val_bpb" else None
        self.device = torch.device("cpu")
        self.task = spec.task
        self.tok = from_info(spec.run.tokenizer, spec.run.tokenizer_definition) if spec.task else None
        torch.manual_seed(self.tcfg.seed)
        self.net = build(mcfg, self.device)
        if spec.run.init is not None and state is None:
            apply(self.net, fetch_once(spec.run.init))
        self.opt = make_optimizer(self.net, self.tcfg)
        self.step = 0
        if state is not None:
            self.net.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            torch.set_rng_state(state["torch_rng"])
            self.step = state["step"]
        read = _SHARDS.setdefault(s.max_rows, ShardCache(s.max_rows))
        data = open_batches(spec.sources_for(hp), batch_size=self.tcfg.batch_size, rank=0, world_size=1,
                            seed=self.tcfg.seed, read=read)
        self.batches = data.from_step(self.step * self.tcfg.grad_accum)

    def advance(self) -> tuple[float, list[float]]:
        """Train to the next report: (the sweep's metric there, each step's training loss)."""
        end, losses = min(self.steps, self.step + self.every), []
        while self.step < end:
            losses.append(train_step(self.net, self.opt, [next(self.batches) for _ in range(self.tcfg.grad_accum)],
                                     lr_at(self.step, self.tcfg), self.tcfg, self.device))
            self.step += 1
        if self.task:
            from train.tasks import evaluate as task_evaluate

            self.net.eval()
            acc = task_evaluate(self.net, self.tok, list(self.task))
            self.net.train()
            return acc[self.metric.removeprefix("task_")], torch.stack(losses).tolist()
        loss, bpb = evaluate(self.net, self.val_batches, self.device, token_bytes=self.token_bytes)
        return (bpb if self.metric == "val_bpb" else loss), torch.stack(losses).tolist()

    def state(self) -> dict:
        return {"model": self.net.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                "torch_rng": torch.get_rng_state()}


def trial(config: dict, *, spec: TrialSpec, space: dict) -> None:
    """The Tune trainable of a sweep with one Tune trial per config (--pack 1, --search optuna)."""
    run_trial(config, sweep=spec.sweep, make_fit=lambda hp, state: ModelFit(hp, state, spec), out=spec.out)


def work(config: dict, *, spec: TrialSpec, space: dict, queue: str) -> None:
    """The Tune trainable of a queued sweep: a worker (tune/queued.py)."""
    run_worker(sweep=spec.sweep, space=space, make_fit=lambda hp, state: ModelFit(hp, state, spec), queue=queue,
               out=spec.out)


def run_trial(config: dict, *, sweep: SweepConfig, make_fit, out: str = "") -> None:
    """Run a config as its own Tune trial, resuming from its checkpoint when it has one.

    It reports after every `report_every` steps with its full state, and Tune's scheduler decides. Each
    report's training losses go to `out`/trials/TRIAL/metrics.jsonl (`_row`, with index None).
    """
    import ray
    from ray import tune

    s = sweep
    logging.getLogger("ray.train._internal.storage").setLevel(logging.WARNING)  # a line per checkpoint otherwise
    node = ray.get_runtime_context().get_node_id()
    book, state = {"current": None, "restores": []}, None
    if (ckpt := tune.get_checkpoint()) is not None:
        from tune.trust import trial_files

        with ckpt.as_directory() as d:
            files = trial_files(lambda n: _read_local(os.path.join(d, n)), ckpt.path, tune.get_context().get_trial_id())
        book = json.loads(files["pack.json"])
        if STATE_FILE in files:  # tensors, numbers, dicts: weights_only unpickles nothing else
            state = torch.load(io.BytesIO(files[STATE_FILE]), weights_only=True)
        book["restores"].append(node)
    log = _log_for(out)
    clock = {"started": time.monotonic(), "report_s": 0.0}  # how much of the trial's wall time reports block
    cur = book["current"]
    if cur is None:
        cur = book["current"] = {"index": None, "config": config, "curve": []}
        state = None
    fit = make_fit(config, state)
    while len(cur["curve"]) < s.reports:
        metric, losses = fit.advance()
        cur["curve"].append(metric)
        if log:
            log.append(_row(None, config, fit.step, losses, s.metric, metric))
        cur["node"] = node  # where the config last trained
        # Tune's scheduler decides; every report but the last is a checkpoint to resume from.
        _report({s.metric: metric, "node_id": node}, book, fit.state() if len(cur["curve"]) < s.reports else None,
                clock)


def _read_local(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _report(metrics: dict, book: dict, state: dict | None, clock: dict) -> None:
    """tune.report with a checkpoint of the book (pack.json: the config's curve so far) and the model state;
    Tune persists it before returning.
    The book keeps the share of this trial's wall time spent in reports before this one (`report_share`)."""
    from ray import tune

    from tune.trust import sign_trial

    started = time.monotonic()
    book["report_share"] = clock["report_s"] / max(started - clock["started"], 1e-9)
    d = tempfile.mkdtemp(prefix="strata-trial-")
    try:
        with open(os.path.join(d, "pack.json"), "w") as f:
            json.dump(book, f)
        if state is not None:
            torch.save(state, os.path.join(d, STATE_FILE))
        sign_trial(d, tune.get_context().get_trial_id())
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        clock["report_s"] += time.monotonic() - started
