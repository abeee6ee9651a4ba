"""Export a checkpoint as a Hugging Face GPT-2: model.safetensors, config.json, tokenizer.

    python -m train.export --run NAME --out DIR [--json]
    python -m train.export --checkpoint CKPT_DIR --out DIR

The model is GPT-2's architecture (without linear biases unless it was
imported with them), so it maps onto `GPT2LMHeadModel`, with zero biases
where it has none (GPT-2's Conv1D keeps weights transposed).
`python -m train --init-from DIR` reads the export back (train/pretrained.py).
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads the result, and
`AutoTokenizer.from_pretrained(DIR)` its tokenizer with strata's ids: a
tokenizer.json dataset's own, or the byte tokenizer written as one (each UTF-8
byte its id, end-of-text 256), so `pipeline("text-generation", model=DIR)`
generates what `infer generate` does.
The export is written to a temporary folder and renamed into place, so a
crash leaves no half-written DIR.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict

import torch

from strata.commands.cli import parser as cli_parser
from strata.commands.shell import StrataError
from strata.commands.shell import log as _logger
from strata.data.chat import DEFAULT_TEMPLATE
from strata.data.storage import Storage
from train.model import GPT, GPTConfig
from train.sample import load, load_newest
from train.taint import check_checkpoint

_log = _logger("export")


def gpt2_config(cfg: GPTConfig, eot_id: int) -> dict:
    """config.json for transformers' GPT-2 with this model's shape."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": 4 * cfg.n_embd,
        "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """This model's weights under GPT-2's names and layouts (lm_head is tied to wte, so left out)."""
    sd = {"transformer.wte.weight": model.wte.weight, "transformer.wpe.weight": model.wpe.weight,
          "transformer.ln_f.weight": model.ln_f.weight, "transformer.ln_f.bias": model.ln_f.bias}
    for i, b in enumerate(model.blocks):
        p = f"transformer.h.{i}."
        linears = {"attn.c_attn": b.attn.qkv, "attn.c_proj": b.attn.proj, "mlp.c_fc": b.mlp[0], "mlp.c_proj": b.mlp[2]}
        for name, lin in linears.items():
            sd[p + name + ".weight"] = lin.weight.t()  # Conv1D: (in, out)
            sd[p + name + ".bias"] = lin.bias if lin.bias is not None else torch.zeros(lin.out_features)
        for name, ln in (("ln_1", b.ln1), ("ln_2", b.ln2)):
            sd[p + name + ".weight"], sd[p + name + ".bias"] = ln.weight, ln.bias
    return {k: v.detach().float().contiguous().clone() for k, v in sd.items()}


def export(checkpoint: str, out: str, loaded: tuple | None = None) -> dict:
    """Write `checkpoint` (`loaded`: its model, tokenizer and step, when already loaded) as a Hugging Face model."""
    from safetensors.torch import save_file

    model, tok, step = loaded or load(checkpoint)
    if os.path.exists(out) and os.listdir(out):
        raise FileExistsError(f"{out} exists and is not empty")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    try:
        save_file(gpt2_state_dict(model), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(gpt2_config(model.cfg, tok.eot_id), f, indent=2)
        files = ["model.safetensors", "config.json"]
        # The tokenizer as transformers loads it (AutoTokenizer), giving strata's ids: a Hugging Face one as
        # it is, the byte tokenizer as a tokenizer.json of its own (each byte its id, end-of-text 256).
        definition = getattr(tok, "definition", None) or (tok.hf_definition() if hasattr(tok, "hf_definition")
                                                           else None)
        if definition:
            with open(os.path.join(tmp, "tokenizer.json"), "w") as f:
                f.write(definition)
            from tokenizers import Tokenizer

            eot = Tokenizer.from_str(definition).id_to_token(tok.eot_id)
            with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
                json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot,
                           "model_max_length": model.cfg.seq_len, "chat_template": DEFAULT_TEMPLATE}, f, indent=2)
            files += ["tokenizer.json", "tokenizer_config.json"]
        # Generation as strata's: the rows past the tokenizer's ids (padding of the embedding) are never drawn.
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": tok.eot_id, "eos_token_id": tok.eot_id, "pad_token_id": tok.eot_id,
                       "suppress_tokens": list(range(tok.vocab_size, model.cfg.vocab_size))}, f, indent=2)
        files.append("generation_config.json")
        with open(os.path.join(tmp, "strata.json"), "w") as f:
            json.dump({"checkpoint": checkpoint, "step": step, "tokenizer_vocab_size": tok.vocab_size,
                       "tokenizer": asdict(tok.info()),
                       "eot_id": tok.eot_id, "note": f"ids >= {tok.vocab_size} are padding rows"}, f, indent=2)
        files.append("strata.json")
        if os.path.exists(out):
            os.rmdir(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _record(checkpoint, step, out)
    return {"checkpoint": checkpoint, "step": step, "out": out, "files": files}


EXPORTS = "exports"  # in a run's directory: a record per export made of its checkpoints (lineage lists them)


def _record(checkpoint: str, step: int, out: str) -> None:
    """Beside the run whose checkpoint this is (a checkpoint lives in its run's directory), a record of the
    export: a takedown finds every model that learned from a document, the exported ones too."""
    from strata.data.storage import exists, join, write_json_atomic

    run_dir = checkpoint.rstrip("/").rpartition("/")[0]
    if run_dir and exists(join(run_dir, "launches")):
        write_json_atomic(join(run_dir, EXPORTS, f"{time.time_ns()}.json"),
                          {"checkpoint": checkpoint, "step": step, "path": os.path.abspath(out), "at": time.time()})


def exports(run_dir: str) -> list[dict]:
    """The exports made of a run's checkpoints, oldest first. A record that is not one (damaged, or put
    there by hand) is left out with a warning naming it."""
    from strata.data.storage import join, list_dir, read_json

    out = []
    for name, is_dir in sorted(list_dir(join(run_dir, EXPORTS))):
        if is_dir or not name.endswith(".json"):
            continue
        try:
            record = read_json(join(run_dir, EXPORTS, name))
            if isinstance(record, dict) and isinstance(record.get("path"), str) and isinstance(record.get("step"), int):
                out.append(record)
                continue
        except (ValueError, UnicodeDecodeError):
            pass
        _log.warning(f"{join(run_dir, EXPORTS, name)} is not an export record: left out")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = cli_parser("python -m train.export", __doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", help="run name under $STRATA_STORAGE/runs (uses its latest checkpoint)")
    where.add_argument("--checkpoint", help="a checkpoint directory")
    parser.add_argument("--out", required=True, help="new directory to write the Hugging Face model to")
    parser.add_argument("--allow-tainted", action="store_true", help="export a checkpoint a takedown tainted anyway "
                        "(the use is recorded in its run)")
    args = parser.parse_args(argv)
    try:
        storage = Storage.from_env(args.storage)
        storage.check_output(args.out, "--out")
        if args.checkpoint:
            ckpt, loaded = args.checkpoint, load(args.checkpoint)
        else:
            ckpt, loaded = load_newest(storage.run(args.run), what=f"--run {args.run}")
        check_checkpoint(ckpt, loaded[2], "exporting", args.allow_tainted)
        result = export(ckpt, args.out, loaded)
    except (FileNotFoundError, FileExistsError, ValueError, StrataError) as e:
        sys.exit(f"error: {e}")
    _log.info(f"step {result['step']} of {ckpt} -> {args.out} ({', '.join(result['files'])})")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
