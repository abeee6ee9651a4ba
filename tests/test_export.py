"""Export to safetensors + a GPT-2 config that Hugging Face transformers loads with the same logits."""

import json
import os
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp

from strata.tokenizer import ByteTokenizer
from train.checkpoint import sign_checkpoint
from train.export import export, main
from train.model import GPT, preset


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint in the trainer's format, of a model with non-trivial weights everywhere."""
    cfg = preset("debug", n_layer=2, n_embd=64, n_head=4, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("blocks.0.ln", "ln_f")):
                p.add_(torch.randn_like(p) * 0.1)  # norms away from (1, 0)
    d = tmp_path / "checkpoint-00000007"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(d), no_dist=True)
    sign_checkpoint(str(d))
    (d / "meta.json").write_text(json.dumps({"step": 7, "model_config": asdict(cfg),
                                             "tokenizer": asdict(ByteTokenizer().info())}))
    return str(d), model


def test_export_writes_safetensors_and_a_gpt2_config(tmp_path, checkpoint):
    ckpt, model = checkpoint
    out = export(ckpt, str(tmp_path / "hf"))
    assert out["step"] == 7
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "strata.json"]
    with open(tmp_path / "hf" / "config.json") as f:
        cfg = json.load(f)
    assert (cfg["n_layer"], cfg["n_embd"], cfg["n_positions"], cfg["vocab_size"]) == \
        (model.cfg.n_layer, model.cfg.n_embd, model.cfg.seq_len, model.cfg.vocab_size)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert torch.equal(weights["transformer.h.1.mlp.c_fc.weight"], model.blocks[1].mlp[0].weight.t())
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".export-")], "temporary folder left behind"
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["--checkpoint", ckpt, "--out", str(tmp_path / "hf")])


def test_transformers_loads_the_export_as_gpt2_with_the_same_logits(tmp_path, checkpoint):
    transformers = pytest.importorskip("transformers")
    ckpt, model = checkpoint
    export(ckpt, str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    assert type(hf).__name__ == "GPT2LMHeadModel"
    idx = torch.randint(0, 257, (3, model.cfg.seq_len))
    with torch.no_grad():
        ours = model.eval()(idx)
        theirs = hf.eval()(idx).logits
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
