"""A trained model for inference: what `--model` names, resolved once on the driver, built on each worker.

`--model RUN[@STEP]` is a training run's newest committed checkpoint (or the one at STEP);
`--model DIR` a GPT-2-layout directory that `python -m train.export` wrote (its strata.json names the
tokenizer). The weights travel to the workers through Ray's object store: a worker never reads the
checkpoint itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.dataset import TokenizerInfo
from strata.storage import Storage, exists, join, read_bytes, read_json
from train.model import GPT, GPTConfig


@dataclass
class Model:
    source: str
    cfg: GPTConfig
    weights: dict[str, np.ndarray]
    tokenizer: TokenizerInfo
    definition: str | None  # the tokenizer's file, for `hf` tokenizers

    def build(self, device: str = "cpu") -> tuple[GPT, object]:
        """The model in eval mode on `device`, and its tokenizer."""
        from strata.tokenizer import from_info
        from train.pretrained import apply

        model = GPT(self.cfg, init=False)
        apply(model, self.weights)
        return model.to(device).eval(), from_info(self.tokenizer, self.definition)


def resolve(spec: str, storage: Storage, flag: str = "--model") -> Model:
    """`RUN[@STEP]` under the storage root's runs, or an exported directory (`flag`: the option that named
    it, for the errors)."""
    from train.pretrained import load

    if exists(join(spec, "config.json")):
        if not exists(join(spec, "strata.json")):
            raise ValueError(f"{flag} {spec}: no strata.json beside config.json, so the tokenizer is unknown; "
                             "export the model with python -m train.export")
        info = read_json(join(spec, "strata.json"))["tokenizer"]
        definition = read_bytes(join(spec, "tokenizer.json")).decode() if exists(join(spec, "tokenizer.json")) else None
        p = load(spec, storage)
        return Model(spec, p.cfg, p.weights, TokenizerInfo(**info), definition)
    return _from_run(spec, storage, flag)


def _from_run(spec: str, storage: Storage, flag: str) -> Model:
    from train.checkpoint import committed_checkpoints, read_meta
    from train.sample import load as load_checkpoint

    run, _, step = spec.partition("@")
    try:
        run_dir = storage.run(run)
    except ValueError:
        run_dir = None
    if not run_dir or not exists(run_dir):
        raise ValueError(f"{flag} {spec}: neither an exported model directory nor a run under {storage.runs()}")
    if step and not step.isdigit():
        raise ValueError(f"{flag} {spec}: the step after '@' must be a number")
    found = committed_checkpoints(run_dir)
    if step:
        found = [c for c in found if read_meta(c)["step"] == int(step)]
    if not found:
        raise ValueError(f"{flag} {spec}: no committed checkpoint{f' at step {step}' if step else ''} in {run_dir}")
    model, tok, at = load_checkpoint(found[-1])
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k != "head.weight"}
    return Model(f"{run}@{at}", model.cfg, weights, tok.info(), getattr(tok, "definition", None))


def threads(cpus: float) -> None:
    """Torch's threads on a worker: as many as the CPUs it was given (Ray sets none)."""
    torch.set_num_threads(max(1, int(cpus)))
