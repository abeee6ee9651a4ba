"""Starting weights for fine-tuning: `python -m train --init-from DIR | RUN[@STEP]`.

DIR is a GPT-2-layout model: what `train.export` writes, or a Hugging Face
GPT-2 checkpoint directory (config.json and model.safetensors, on local disk
or in the object store). RUN[@STEP] is a strata run's newest committed
checkpoint (or the one at STEP). Nothing is downloaded from a model hub: the
weights are read from the path given, once, by the driver, and reach the
workers through Ray's object store.

The model's shape comes from the weights. A model whose linear layers carry
non-zero biases keeps them (`GPTConfig.bias`). A context of n_positions can
train on a dataset with a shorter seq_len (the first seq_len position rows
are kept). When the weights name their tokenizer (an export's tokenizer.json
or strata.json, a run's checkpoint), a dataset with another tokenizer hash is
refused.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from strata.data.dataset import DatasetError
from strata.data.storage import Storage, exists, join, read_bytes, read_json
from train.model import GPTConfig

GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # GPT-2's tanh GELU, as the model's


@dataclass
class Pretrained:
    source: str
    cfg: GPTConfig  # seq_len is the weights' context (n_positions)
    weights: dict[str, np.ndarray]  # this model's parameter names
    tokenizer_hash: str | None  # None when the weights do not say

    def for_dataset(self, seq_len: int, tokenizer_hash: str, vocab: int) -> tuple[GPTConfig, dict[str, np.ndarray]]:
        """The config and weights to train on a dataset with this seq_len, tokenizer and vocabulary."""
        if self.tokenizer_hash and self.tokenizer_hash != tokenizer_hash:
            raise DatasetError(f"{self.source} was trained with tokenizer {self.tokenizer_hash}; the dataset's is "
                               f"{tokenizer_hash}: its token ids would mean different things")
        if vocab > self.cfg.vocab_size:
            raise DatasetError(f"the dataset's tokenizer has {vocab} ids but {self.source} embeds {self.cfg.vocab_size}")
        if seq_len > self.cfg.seq_len:
            raise DatasetError(f"the dataset's seq_len {seq_len} is longer than {self.source}'s context "
                               f"{self.cfg.seq_len}")
        weights = {**self.weights, "wpe.weight": self.weights["wpe.weight"][:seq_len]}
        return GPTConfig(**{**vars(self.cfg), "seq_len": seq_len}), weights


def load(spec: str, storage: Storage, allow_tainted: bool = False) -> Pretrained:
    """A GPT-2-layout directory, or RUN[@STEP] under the storage root's runs. Weights a takedown tainted
    (train/taint.py), a run's or exported from one, are refused unless `allow_tainted` (the use recorded)."""
    from train.taint import check_export

    if exists(join(spec, "config.json")):
        check_export(spec, storage, f"--init-from {spec}", allow_tainted)
        return read_gpt2(spec)
    run, _, step = spec.partition("@")
    try:
        run_dir = storage.run(run)
    except ValueError:  # not a run name either
        run_dir = None
    if run_dir and exists(run_dir):
        if step and not step.isdigit():
            raise ValueError(f"--init-from {spec}: the step after '@' must be a number")
        return read_run(run_dir, int(step) if step else None, spec, allow_tainted)
    raise ValueError(f"--init-from {spec}: neither a directory with config.json and model.safetensors nor a run "
                     f"under {storage.runs()}")


def read_gpt2(directory: str) -> Pretrained:
    """A GPT-2 checkpoint directory (config.json, model.safetensors) under this model's names."""
    from safetensors.numpy import load as load_safetensors

    try:
        config = read_json(join(directory, "config.json"))
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{join(directory, 'config.json')} is not JSON") from None
    if not isinstance(config, dict):
        raise ValueError(f"{join(directory, 'config.json')} is not a JSON object")
    problems = []
    if config.get("model_type") != "gpt2":
        problems.append(f"model_type is {config.get('model_type')!r}, not 'gpt2'")
    if config.get("activation_function", "gelu_new") not in GPT2_ACTIVATIONS:
        problems.append(f"activation {config.get('activation_function')!r} is not GPT-2's tanh GELU")
    if config.get("n_inner") not in (None, 4 * config.get("n_embd", 0)):
        problems.append(f"n_inner {config['n_inner']} is not 4 x n_embd")
    if abs(config.get("layer_norm_epsilon", 1e-5) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon {config['layer_norm_epsilon']} is not 1e-5")
    if config.get("scale_attn_by_inverse_layer_idx") or config.get("reorder_and_upcast_attn"):
        problems.append("attention scaled by layer index or reordered")
    if problems:
        raise ValueError(f"{directory} is not a GPT-2 this model can load: " + "; ".join(problems))
    for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        if isinstance(config.get(k), bool) or not isinstance(config.get(k), int) or config[k] < 1:
            raise ValueError(f"{join(directory, 'config.json')}: {k} is {config.get(k)!r}, not a positive integer")
    try:
        raw = load_safetensors(read_bytes(join(directory, "model.safetensors")))
    except FileNotFoundError:
        raise ValueError(f"{directory} has no model.safetensors") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: the file is not safetensors
        raise ValueError(f"{join(directory, 'model.safetensors')} is not a safetensors file "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    raw = {k.removeprefix("transformer."): v for k, v in raw.items()}
    n_layer = config["n_layer"]
    try:
        return _from_gpt2(directory, config, raw, n_layer)
    except KeyError as e:
        raise ValueError(f"{join(directory, 'model.safetensors')} has no tensor {e.args[0]!r}, which its "
                         f"config.json ({n_layer} layers) needs") from None


def _from_gpt2(directory: str, config: dict, raw: dict, n_layer: int) -> Pretrained:
    if f"h.{n_layer - 1}.ln_1.weight" not in raw:  # before a loop over a crafted layer count
        raise KeyError(f"h.{n_layer - 1}.ln_1.weight")
    weights = {"wte.weight": raw["wte.weight"], "wpe.weight": raw["wpe.weight"],
               "ln_f.weight": raw["ln_f.weight"], "ln_f.bias": raw["ln_f.bias"]}
    for k, shape in (("wte.weight", (config["vocab_size"], config["n_embd"])),
                     ("wpe.weight", (config["n_positions"], config["n_embd"]))):
        if tuple(np.shape(raw[k])) != shape:
            raise ValueError(f"{join(directory, 'model.safetensors')}: {k} is {tuple(np.shape(raw[k]))}, not the "
                             f"{shape} its config.json says")
    if "lm_head.weight" in raw and not np.array_equal(raw["lm_head.weight"], raw["wte.weight"]):
        raise ValueError(f"{directory}: lm_head is not tied to the token embeddings, as this model's is")
    biases = []
    for i in range(n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        for theirs, ours in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.0"),
                             ("mlp.c_proj", "mlp.2")):
            weights[f"{b}{ours}.weight"] = np.ascontiguousarray(raw[f"{h}{theirs}.weight"].T)  # Conv1D: (in, out)
            weights[f"{b}{ours}.bias"] = raw[f"{h}{theirs}.bias"]
            biases.append(raw[f"{h}{theirs}.bias"])
        for theirs, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
            weights[f"{b}{ours}.weight"], weights[f"{b}{ours}.bias"] = raw[f"{h}{theirs}.weight"], raw[f"{h}{theirs}.bias"]
    bias = any(np.any(x != 0) for x in biases)
    if not bias:  # strata's own export: zero biases, which this model leaves out
        weights = {k: v for k, v in weights.items() if not (k.startswith("blocks.") and ".ln" not in k
                                                            and k.endswith(".bias"))}
    cfg = GPTConfig(vocab_size=config["vocab_size"], seq_len=config["n_positions"], n_layer=n_layer,
                    n_head=config["n_head"], n_embd=config["n_embd"], bias=bias)
    return Pretrained(directory, cfg, {k: np.asarray(v, dtype=np.float32) for k, v in weights.items()},
                      _tokenizer_hash(directory))


def _tokenizer_hash(directory: str) -> str | None:
    """The tokenizer the weights were trained with, when the directory says (strata's hash)."""
    if exists(join(directory, "strata.json")):
        info = read_json(join(directory, "strata.json")).get("tokenizer") or {}
        if info.get("hash"):
            return info["hash"]
    if exists(join(directory, "tokenizer.json")):
        return hashlib.sha256(read_bytes(join(directory, "tokenizer.json"))).hexdigest()[:16]
    return None


def read_run(run_dir: str, step: int | None, spec: str, allow_tainted: bool = False) -> Pretrained:
    """A run's newest committed checkpoint, or the one at `step`."""
    from train.sample import load_newest
    from train.taint import check

    try:
        found, (model, tok, at) = load_newest(run_dir, step, what=f"--init-from {spec}")
    except FileNotFoundError as e:
        raise ValueError(f"--init-from {spec}: {e}") from None
    check(run_dir, at, f"--init-from {spec}", allow_tainted)
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items() if k != "head.weight"}
    return Pretrained(f"{spec} ({found})", model.cfg, weights, tok.info().hash)


def apply(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Load full (unsharded) weights into a plain, DDP or FSDP2 model on any device."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = {k: torch.from_numpy(np.asarray(v)) for k, v in weights.items()}
    state["head.weight"] = state["wte.weight"]  # tied
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def describe_source(p: Pretrained) -> str:
    c = p.cfg
    return (f"{p.source}: {c.n_layer} layers x {c.n_embd} wide, {c.n_head} heads, vocab {c.vocab_size}, "
            f"context {c.seq_len}{', with biases' if c.bias else ''}")

