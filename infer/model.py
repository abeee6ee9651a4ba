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
from torch import nn

from strata.data.dataset import TokenizerInfo
from strata.data.storage import Storage, exists, join, read_bytes, read_json
from train.model import GPT, GPTConfig


@dataclass
class Model:
    source: str
    cfg: GPTConfig
    weights: dict[str, np.ndarray]
    tokenizer: TokenizerInfo
    definition: str | None  # the tokenizer's file, for `hf` tokenizers
    origin: str = ""  # RUN@STEP: the run an exported directory was made from (its records say so: lineage, ledger)
    chat_template: str | None = None  # an exported directory's (tokenizer_config.json); None: strata.data.chat's default

    def build(self, device: str = "cpu", packed: bool = True) -> tuple[GPT, object]:
        """The model in eval mode on `device`, and its tokenizer. On a CPU its linear layers are `packed`
        for inference (see `pack`): it then runs under no_grad or inference_mode only."""
        from strata.data.tokenizer import from_info
        from train.pretrained import apply

        model = GPT(self.cfg, init=False)
        apply(model, self.weights)
        model = model.to(device).eval()
        if packed and str(device) == "cpu":
            pack(model)
        return model, from_info(self.tokenizer, self.definition)


class PackedLinear(nn.Module):
    """An nn.Linear for inference on a CPU: its weight reordered once into oneDNN's layout (what
    torch.compile's freezing does on a CPU), with the tanh GELU after it fused in when `gelu`.
    On 2 cores of an AMD EPYC it is about 3x as fast as nn.Linear's matmul for the blocks' shapes (MKL's
    sgemm takes a slow path there), and the scorer about 2x; it agrees with nn.Linear within float
    rounding (checked when packed)."""

    BATCH_HINT = 4096  # rows oneDNN plans the reorder for; any number of rows works

    def __init__(self, linear: nn.Linear, gelu: bool = False):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), self.BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.attr, self.algorithm = ("gelu", "tanh") if gelu else ("none", "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, self.attr, [], self.algorithm)


def pack(model: GPT) -> bool:
    """The blocks' linear layers (and each MLP's GELU) replaced by PackedLinear, in place, where this
    torch has oneDNN and the packed layers agree with the ones they replace; False where the model is
    left as it was."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        with torch.inference_mode():
            for block in model.blocks:
                fc, act, out = block.mlp
                fused = isinstance(act, nn.GELU) and act.approximate == "tanh"
                layers = {"qkv": (block.attn.qkv, False), "proj": (block.attn.proj, False), "fc": (fc, fused),
                          "out": (out, False)}
                packed = {k: PackedLinear(lin, gelu) for k, (lin, gelu) in layers.items()}
                x = torch.randn(3, fc.in_features)
                want, got = act(fc(x)) if fused else fc(x), packed["fc"](x)
                if not torch.allclose(want, got, rtol=1e-4, atol=1e-5):
                    return False
                block.attn.qkv, block.attn.proj = packed["qkv"], packed["proj"]
                block.mlp = nn.Sequential(packed["fc"], nn.Identity() if fused else act, packed["out"])
    except RuntimeError:  # a build whose oneDNN lacks the op for this dtype or machine
        return False
    return True


def resolve(spec: str, storage: Storage, flag: str = "--model", allow_tainted: bool | None = False) -> Model:
    """`RUN[@STEP]` under the storage root's runs, or an exported directory (`flag`: the option that named
    it, for the errors). A model a takedown tainted (train/taint.py) is refused unless `allow_tainted` (the
    use is then recorded); None: not checked here, because the driver that chose the model checked it."""
    from train.pretrained import load

    if exists(join(spec, "config.json")):
        if not exists(join(spec, "strata.json")):
            raise ValueError(f"{flag} {spec}: no strata.json beside config.json, so the tokenizer is unknown; "
                             "export the model with python -m train.export")
        meta = read_json(join(spec, "strata.json"))
        definition = read_bytes(join(spec, "tokenizer.json")).decode() if exists(join(spec, "tokenizer.json")) else None
        config = join(spec, "tokenizer_config.json")
        template = read_json(config).get("chat_template") if exists(config) else None
        origin = _origin(meta, storage)
        _gate(origin, storage, f"{flag} {spec}", allow_tainted)
        p = load(spec, storage)
        return Model(spec, p.cfg, p.weights, TokenizerInfo(**meta["tokenizer"]), definition, origin,
                     template if isinstance(template, str) else None)
    return _from_run(spec, storage, flag, allow_tainted)


def check(spec: str, storage: Storage, flag: str = "--model", allow_tainted: bool = False) -> str:
    """What `resolve(spec)` would load (its source: RUN@STEP, or the directory), checked without reading its
    weights: an exported directory's files and tokenizer, or the run's newest committed checkpoint (at STEP)
    whose signed lists and meta verify, and not tainted by a takedown (unless `allow_tainted`). The same
    errors as `resolve`."""
    if exists(join(spec, "config.json")):
        if not exists(join(spec, "strata.json")):
            raise ValueError(f"{flag} {spec}: no strata.json beside config.json, so the tokenizer is unknown; "
                             "export the model with python -m train.export")
        try:
            TokenizerInfo(**read_json(join(spec, "strata.json"))["tokenizer"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{flag} {spec}: strata.json names no usable tokenizer ({e})") from None
        if not exists(join(spec, "model.safetensors")):
            raise ValueError(f"{flag} {spec}: no model.safetensors: export the model with python -m train.export")
        _gate(_origin(read_json(join(spec, "strata.json")), storage), storage, f"{flag} {spec}", allow_tainted)
        return spec
    from train.checkpoint import SignedFiles
    from train.committed import newest

    run, step, run_dir = _run_of(spec, storage, flag)
    found, meta, refused = newest(run_dir, lambda c: SignedFiles(c).meta(), step=int(step) if step else None)
    if found is None:
        at = f" at step {step}" if step else ""
        raise ValueError(f"{flag} {spec}: no committed checkpoint{at} " + ("that verifies " if refused else "") +
                         f"in {run_dir}")
    _gate(f"{run}@{meta['step']}", storage, f"{flag} {spec}", allow_tainted)
    return f"{run}@{meta['step']}"


def _gate(source: str, storage: Storage, what: str, allow: bool | None) -> None:
    """Refuse (train.taint.Tainted) a model, RUN@STEP, that a takedown tainted, unless `allow`; None: the
    driver that chose it checked it."""
    if allow is None or not source:
        return
    from train.taint import check

    run, _, step = source.rpartition("@")
    check(storage.run(run), int(step), what, allow)


def _origin(meta: dict, storage: Storage) -> str:
    from train.taint import export_origin

    return export_origin(meta, storage)


def _run_of(spec: str, storage: Storage, flag: str) -> tuple[str, str, str]:
    """RUN[@STEP] as (run, step or "", the run's directory), or the ValueError that names what is wrong."""
    run, _, step = spec.partition("@")
    try:
        run_dir = storage.run(run)
    except ValueError:
        run_dir = None
    if not run_dir or not exists(run_dir):
        raise ValueError(f"{flag} {spec}: neither an exported model directory nor a run under {storage.runs()}")
    if step and not step.isdigit():
        raise ValueError(f"{flag} {spec}: the step after '@' must be a number")
    return run, step, run_dir


def _from_run(spec: str, storage: Storage, flag: str, allow_tainted: bool | None = False) -> Model:
    from train.sample import load_newest

    run, step, run_dir = _run_of(spec, storage, flag)
    try:
        _, (model, tok, at) = load_newest(run_dir, int(step) if step else None, what=f"{flag} {spec}")
    except FileNotFoundError as e:
        raise ValueError(f"{flag} {spec}: {e}") from None
    _gate(f"{run}@{at}", storage, f"{flag} {spec}", allow_tainted)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k != "head.weight"}
    return Model(f"{run}@{at}", model.cfg, weights, tok.info(), getattr(tok, "definition", None))


def threads(cpus: float) -> None:
    """Torch's threads on a worker: as many as the CPUs it was given (Ray sets none)."""
    torch.set_num_threads(max(1, int(cpus)))
