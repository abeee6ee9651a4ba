"""A sweep: many short trials of train's step function on a shared slice of a dataset.

Trials are plain function trainables (a `TorchTrainer` per trial costs seconds
of start-up each), placed on spot-tier nodes by label selector. The rows they
train on are read once by the driver and shared through the object store.

Scale: Ray Tune pays about 0.2-0.6 s of driver and raylet work per trial and
holds each trial's state on the driver. A large sweep therefore runs its
configs in *packs*: one Tune trial trains `pack` configs one after another,
sampled from the space by their index (so anyone can recompute them), with
ASHA's rule applied inside the pack. Every Tune trial, packed or not,
checkpoints what it has done (`pack.json`, plus the model state while a
single config is in flight), so a lost spot node or a killed driver costs at
most a checkpoint interval.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from strata.cli import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, check_fields
from strata.connect import fetch_once
from strata.dataset import DatasetVersion, read_rows
from train.loop import (
    CPU_MICRO_BATCH,
    MODEL_KEYS,
    TRAIN_KEYS,
    TrainConfig,
    evaluate,
    lr_at,
    make_optimizer,
    train_step,
    with_hyperparameters,
)
from train.model import GPT, GPTConfig


@dataclass(frozen=True, kw_only=True)
class SweepConfig:
    num_samples: int = 8
    """Trials to run."""
    max_concurrent: int = 0
    """Trials running at once (0: as many as the spot tier's CPUs hold)."""
    steps: int = 40
    """Optimizer steps per trial (if not stopped early)."""
    report_every: int = 10
    """Steps between reports; ASHA decides at these points."""
    scheduler: str = "asha"
    """`asha` (early stopping) or `fifo` (every trial runs to the end)."""
    search: str = "random"
    """`random` (seeded random sampling) or `optuna` (Optuna's TPE; needs the optuna package)."""
    space: str = "lr-batch"
    """Search space: a name (lr-batch, small) or a .json/.yaml file of {param: {distribution: args}}."""
    max_rows: int = 4096
    """Training rows loaded once and shared by all trials."""
    eval_rows: int = 64
    """Validation rows each report is scored on."""
    seed: int = 0
    """Seed of the search and of every trial's init and data order."""
    pack: int = 0
    """Configs per Tune trial (0: 1 up to 1,000 trials, else enough to keep Tune at 1,000 trials)."""
    checkpoint_every_s: float = 30.0
    """A pack checkpoints what it has done at the first config boundary after this many seconds."""
    max_failures: int = 3
    """Times a trial is restarted from its checkpoint after its node is lost."""
    cpus_per_trial: float = 1.0
    """CPUs each trial reserves on its spot node."""
    init_from: str = ""
    """Fine-tune: every trial starts from these weights (a GPT-2-layout directory or RUN[@STEP]); the model's
    shape is theirs."""
    metric: str = "val_loss"
    """What ranks trials: val_loss, or val_bpb (bits per byte: comparable across tokenizers)."""

    def __post_init__(self):
        if self.scheduler not in ("asha", "fifo"):
            raise ValueError(f"scheduler must be asha or fifo, not {self.scheduler!r}")
        if self.metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}, not {self.metric!r}")
        if self.search not in ("random", "optuna"):
            raise ValueError(f"search must be random or optuna, not {self.search!r}")
        check_fields(self, {**dict.fromkeys(("num_samples", "steps", "report_every", "max_rows", "eval_rows"),
                                            AT_LEAST_ONE), "cpus_per_trial": POSITIVE,
                            **dict.fromkeys(("max_concurrent", "pack", "seed", "checkpoint_every_s"), NON_NEGATIVE),
                            "max_failures": (lambda v: v >= -1, ">= 0, or -1 for no limit")})
        if self.search == "optuna" and self.pack_size > 1:
            raise ValueError("--search optuna proposes one config per Tune trial: use --pack 1 "
                             "(or sweep at most 1,000 trials)")

    @property
    def pack_size(self) -> int:
        if self.pack:
            return self.pack
        return 1 if self.num_samples <= TUNE_TRIALS else math.ceil(self.num_samples / TUNE_TRIALS)

    @property
    def packs(self) -> int:
        """Tune trials the sweep needs."""
        return math.ceil(self.num_samples / self.pack_size)

    @property
    def reports(self) -> int:
        """Reports (ASHA's time unit) of a config that runs to the end."""
        return math.ceil(self.steps / self.report_every)

    def pack_range(self, pack: int) -> range:
        """The config indices of pack number `pack`."""
        return range(pack * self.pack_size, min((pack + 1) * self.pack_size, self.num_samples))


METRICS = ("val_loss", "val_bpb")
MIX = "mix."  # a space parameter mix.NAME is dataset NAME's weight in a mixture sweep (normalised per trial)
TUNE_TRIALS = 1000  # Tune trials a packed sweep aims at: few enough for the driver, enough to spread
GRACE, REDUCTION = 2, 2  # ASHA: first rung after 2 reports, keep the best half at each rung


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

        from strata.storage import filesystem

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


def sample(space: dict, seed: int, index: int) -> dict:
    """Config number `index` of a packed sweep: a pure function of (space, seed, index)."""
    rng = np.random.default_rng([seed, index])
    out = {}
    for key in sorted(space):
        (name, args), = space[key].items()
        if name == "loguniform":
            v = float(math.exp(rng.uniform(math.log(args[0]), math.log(args[1]))))
        elif name == "uniform":
            v = float(rng.uniform(args[0], args[1]))
        elif name == "randint":  # Tune's convention: high excluded
            v = int(rng.integers(args[0], args[1]))
        else:
            v = args[int(rng.integers(len(args)))]
        out[key] = v
    return out


def rungs(max_t: int) -> list[int]:
    """ASHA's milestones (in reports) below max_t: GRACE, GRACE*REDUCTION, ..."""
    out, t = [], min(GRACE, max_t)
    while t < max_t:
        out.append(t)
        t *= REDUCTION
    return out


def asha_keeps(recorded: list[float], metric: float) -> bool:
    """ASHA's rule for a metric to minimise: go on unless worse than the best 1/REDUCTION recorded so far."""
    if not recorded:
        return True
    return not metric > float(np.nanpercentile(recorded, 100 / REDUCTION))


def load_rows(version: DatasetVersion, split: str, limit: int) -> np.ndarray:
    """Up to `limit` rows (n, seq_len + 1) of a split, in manifest order."""
    out, n = [], 0
    for path in version.shard_paths(split):
        rows = read_rows(path)[: limit - n]
        out.append(rows)
        n += len(rows)
        if n >= limit:
            break
    width = version.manifest.seq_len + 1
    return np.concatenate(out) if out else np.zeros((0, width), dtype=np.uint16)


def initial_weights(ref) -> dict[str, torch.Tensor]:
    """The sweep's starting weights (train.pretrained), fetched from the object store once per trial actor
    process: every config it trains after the first reuses them."""

    def to_torch(weights):
        out = {k: torch.from_numpy(np.array(v)) for k, v in weights.items()}
        return {**out, "head.weight": out["wte.weight"]}  # tied

    return fetch_once(ref, to_torch)


def mixture_weights(hp: dict, names: list[str], fixed: list[float]) -> list[float]:
    """A trial's mixture: its mix.NAME parameters normalised, else the sweep's fixed weights."""
    if not any(k.startswith(MIX) for k in hp):
        return fixed
    raw = [max(float(hp.get(f"{MIX}{n}", 0.0)), 0.0) for n in names]
    total = sum(raw)
    return [w / total for w in raw] if total > 0 else [1 / len(names)] * len(names)


class ModelFit:
    """One config's training on the shared rows; `advance` trains to the next report and scores it.
    A mixture sweep's rows are one array per dataset, drawn from in proportion to the trial's weights."""

    def __init__(self, hp: dict, state: dict | None, *, rows: list[np.ndarray], val_rows: np.ndarray, model: dict,
                 train: dict, sweep: dict, names: list[str], weights: list[float], token_bytes: np.ndarray,
                 init: dict | None = None):
        s = SweepConfig(**sweep)
        base = TrainConfig(**train)
        base = replace(base, max_steps=s.steps, warmup_steps=min(base.warmup_steps, s.steps // 4),
                       batch_size=base.batch_size or CPU_MICRO_BATCH)  # trials train on CPU
        mcfg, self.tcfg = with_hyperparameters({k: v for k, v in hp.items() if not k.startswith(MIX)},
                                               GPTConfig(**model), base)
        self.rows, self.every, self.steps, self.metric = rows, s.report_every, s.steps, s.metric
        self.weights = mixture_weights(hp, names, weights)
        self.val_batches = [val_rows[i: i + 32] for i in range(0, len(val_rows), 32)]
        # A copy: the array from the object store is read-only.
        self.token_bytes = torch.tensor(token_bytes) if s.metric == "val_bpb" else None
        self.device = torch.device("cpu")
        torch.manual_seed(s.seed)
        self.net = GPT(mcfg)
        if init and state is None:
            self.net.load_state_dict(initial_weights(init["weights"]))
        self.opt = make_optimizer(self.net, self.tcfg)
        self.rng = np.random.default_rng(s.seed)
        self.step = 0
        if state is not None:
            self.net.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.rng.bit_generator.state = state["rng"]
            torch.set_rng_state(state["torch_rng"])
            self.step = state["step"]

    def _batch(self) -> np.ndarray:
        n = self.tcfg.batch_size
        if len(self.rows) == 1:
            return self.rows[0][self.rng.integers(0, len(self.rows[0]), n)]
        src = self.rng.choice(len(self.rows), size=n, p=self.weights)
        return np.stack([self.rows[i][self.rng.integers(0, len(self.rows[i]))] for i in src])

    def advance(self) -> float:
        end = min(self.steps, self.step + self.every)
        while self.step < end:
            train_step(self.net, self.opt, [self._batch()], lr_at(self.step, self.tcfg), self.tcfg, self.device)
            self.step += 1
        loss, bpb = evaluate(self.net, self.val_batches, self.device, token_bytes=self.token_bytes)
        return bpb if self.metric == "val_bpb" else loss

    def state(self) -> dict:
        return {"model": self.net.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                "rng": self.rng.bit_generator.state, "torch_rng": torch.get_rng_state()}


def trial(config: dict, *, rows: list[np.ndarray], val_rows: np.ndarray, model: dict, train: dict, sweep: dict,
          space: dict, names: list[str], weights: list[float], token_bytes: np.ndarray, init: dict | None = None) -> None:
    """The sweep's Tune trainable: one config, or a pack of them, of train's loop on the shared rows."""

    def make_fit(hp, state):
        return ModelFit(hp, state, rows=rows, val_rows=val_rows, model=model, train=train, sweep=sweep,
                        names=names, weights=weights, token_bytes=token_bytes, init=init)

    run_trial(config, sweep=sweep, space=space, make_fit=make_fit)


def run_trial(config: dict, *, sweep: dict, space: dict, make_fit) -> None:
    """Run a Tune trial's configs, resuming from its checkpoint when it has one.

    A single config (`config` is the hyperparameters) reports after every
    `report_every` steps with its full state, and Tune's scheduler decides.
    A pack (`config` is {"pack": i}) trains its configs in turn, applies ASHA's
    rule at the rungs, and checkpoints its book of finished configs at config
    boundaries every `checkpoint_every_s`, and at the end.
    """
    import ray
    from ray import tune

    s = SweepConfig(**sweep)
    logging.getLogger("ray.train._internal.storage").setLevel(logging.WARNING)  # a line per checkpoint otherwise
    node = ray.get_runtime_context().get_node_id()
    single = "pack" not in config
    book, state = {"done": [], "current": None, "rungs": {}, "restores": []}, None
    if (ckpt := tune.get_checkpoint()) is not None:
        with ckpt.as_directory() as d:
            with open(os.path.join(d, "pack.json")) as f:
                book = json.load(f)
            if os.path.exists(os.path.join(d, "state.pt")):
                state = torch.load(os.path.join(d, "state.pt"), weights_only=True)  # tensors, numbers, dicts
        book["restores"].append(node)
    todo = [(None, config)] if single else [(i, sample(space, s.seed, i)) for i in s.pack_range(config["pack"])]
    finished = {r["index"] for r in book["done"]}
    milestones = set(rungs(s.reports)) if s.scheduler == "asha" else set()
    last_checkpoint = time.monotonic()
    clock = {"started": time.monotonic(), "report_s": 0.0}  # how much of the trial's wall time reports block
    for index, hp in todo:
        if index in finished:
            continue
        cur = book["current"]
        if cur is None or cur["index"] != index:
            cur = book["current"] = {"index": index, "config": hp, "curve": []}
            state = None
        fit = make_fit(hp, state)
        status = "completed"
        while len(cur["curve"]) < s.reports:
            metric = fit.advance()
            cur["curve"].append(metric)
            cur["node"] = node  # where the config last trained
            t = len(cur["curve"])
            if single:  # Tune's scheduler decides; every report is a checkpoint to resume from
                _report({s.metric: metric, "node_id": node}, book, fit.state(), clock)
            elif t in milestones:
                recorded = book["rungs"].setdefault(str(t), [])
                keep = asha_keeps(recorded, metric)
                recorded.append(metric)
                if not keep:
                    status = "stopped early"
                    break
        if single:
            return
        book["done"].append({**cur, "status": status})
        book["current"] = None
        if index == todo[-1][0] or time.monotonic() - last_checkpoint >= s.checkpoint_every_s:
            best = min(min(r["curve"]) for r in book["done"])
            _report({s.metric: best, "configs_done": len(book["done"]), "node_id": node}, book, None, clock)
            last_checkpoint = time.monotonic()


def _report(metrics: dict, book: dict, state: dict | None, clock: dict) -> None:
    """tune.report with a checkpoint of the book (and the in-flight state); Tune persists it before returning.
    The book keeps the share of this trial's wall time spent in reports before this one (`report_share`)."""
    from ray import tune

    started = time.monotonic()
    book["report_share"] = clock["report_s"] / max(started - clock["started"], 1e-9)
    d = tempfile.mkdtemp(prefix="strata-trial-")
    try:
        with open(os.path.join(d, "pack.json"), "w") as f:
            json.dump(book, f)
        if state is not None:
            torch.save(state, os.path.join(d, "state.pt"))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
        clock["report_s"] += time.monotonic() - started
