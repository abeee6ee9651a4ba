"""A training launch resolved once: dataset versions, mixture, tokenizer, model shape, initial weights and
hyperparameters, in one typed `RunSpec`.

`resolve` reads each manifest once and checks that every dataset fits the model before anything starts.
Every trainer of strata takes the spec as it is: the Ray Train worker loop (train/loop.py), a sweep's
trial (tune/sweep.py, which varies its hyperparameters and mixture weights per config) and the
benchmarks (bench/train).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from strata.accounting.runlog import read_launches
from strata.commands.shell import log
from strata.data.dataset import DatasetError, TokenizerInfo, check_compatible, check_not_forgotten
from strata.data.storage import Storage
from strata.data.tokenizer import from_info
from train import mixture, pretrained
from train.config import TrainConfig
from train.data import Source
from train.model import GPTConfig, fit_to_dataset

SHAPE = frozenset({"vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "bias"})


@dataclass(frozen=True)
class RunSpec:
    """What a run trains: everything a worker needs that is the same on every rank."""

    model: GPTConfig
    train: TrainConfig
    dataset: str
    """The mixture, every dataset pinned to its version (train.mixture.spec)."""
    sources: tuple[Source, ...]
    tokenizer: TokenizerInfo
    tokenizer_definition: str | None
    token_bytes: np.ndarray
    """Bytes each token id decodes to (bits per byte)."""
    init_from: str | None = None
    init: object = None
    """The starting weights (train.pretrained) when `init_from`, or an ObjectRef of them once put."""

    def repeats(self, rows_drawn: int, world: int) -> dict[str, float]:
        """Passes over each dataset's training rows after `rows_drawn` rows in all (every rank's)."""
        out = {}
        for s in self.sources:
            rows = sum(r.rows for r in s.shards) // world * world
            out[s.name] = rows_drawn * s.weight / rows if rows else float("inf")
        return out


def resolve(storage: Storage, dataset: str, model: GPTConfig, train: TrainConfig, *, model_flags: dict | None = None,
            init_from: str | None = None, weighted: bool = True, run_name: str | None = None,
            allow_change: bool = False, allow_tainted: bool = False) -> RunSpec:
    """The spec of training `model` (a preset, with any swept hyperparameters) with `train` on `dataset`.

    - The model is shaped for the dataset (its vocabulary and seq_len), or, with `init_from`, takes the
      shape of those weights; `model_flags` (given on the command line) win over both.
    - A continued run (`run_name` with launches) reads the snapshots it started on, unless `allow_change`.
    - `weighted=False`: a sweep's datasets at weight 1 each (its trials weigh them).
    """
    flags = model_flags or {}
    if run_name is not None and (launches := read_launches(storage.run(run_name))):
        dataset = continued_dataset(launches[-1]["config"].get("dataset", ""), dataset, run_name, allow_change)
    versions = mixture.resolve_all(storage, dataset, weighted)
    for v, _ in versions:  # a snapshot still holding rows a takedown removed is refused, in one line
        check_not_forgotten(storage, v)
    m = versions[0][0].manifest  # every dataset of a mixture shares its tokenizer and seq_len
    weights = None
    if init_from:
        if shaped := sorted(set(flags) & SHAPE):
            raise ValueError(f"--init-from takes the model's shape from the weights: drop --{shaped[0]}")
        source = pretrained.load(init_from, storage, allow_tainted)
        log("train").info(f"initialising from {pretrained.describe_source(source)}")
        shaped_cfg, weights = source.for_dataset(m.seq_len, m.tokenizer.hash, m.tokenizer.vocab_size)
        model = replace(shaped_cfg, dropout=model.dropout, **flags)  # a swept dropout stays
        init_from = source.source
    else:
        fitted = replace(fit_to_dataset(model, vocab=m.tokenizer.vocab_size, seq_len=m.seq_len,
                                        keep=frozenset(flags)), **flags)
        if changed := [f"{k} {getattr(model, k):,} -> {getattr(fitted, k):,}" for k in ("seq_len", "vocab_size")
                       if getattr(model, k) != getattr(fitted, k) and k not in flags]:
            from train.model import describe

            log("train").info(f"the model is shaped for dataset {versions[0][0].ref}: {', '.join(changed)} "
                              f"({describe(fitted)['params'] / 1e6:.2f}M parameters, the preset's "
                              f"{describe(model)['params'] / 1e6:.2f}M); --seq-len and --vocab-size set them")
        model = fitted
    for v, _ in versions:
        check_compatible(v, vocab_size=model.vocab_size, seq_len=model.seq_len)
        if not v.rows("train"):
            raise DatasetError(f"dataset {v.ref} has no training rows")
    definition = versions[0][0].tokenizer_definition()
    return RunSpec(model=model, train=train, dataset=mixture.spec([(v.ref, w) for v, w in versions]),
                   sources=tuple(Source.of(v, w) for v, w in versions), tokenizer=m.tokenizer,
                   tokenizer_definition=definition, token_bytes=from_info(m.tokenizer, definition).token_bytes(),
                   init_from=init_from, init=weights)


def continued_dataset(old: str, dataset: str, run_name: str, allow_change: bool) -> str:
    """The datasets a continued run that started on `old` reads: those snapshots, unless asked to change them."""
    if not old or dataset == old or allow_change:
        return dataset
    if mixture.spec(mixture.split(dataset)) == mixture.unpinned(old):
        log("train").info(f"run {run_name} continues on {old}, the snapshot it started on "
                          f"(--dataset {dataset}@vN --allow-change to move it to a newer one)")
        return old
    raise ValueError(f"run {run_name} trains on {old}, not {dataset}: continue it with --dataset {old}, "
                     "start a new --run, or pass --allow-change")
