"""Export to safetensors + a GPT-2 config that Hugging Face transformers loads with the same logits."""

import json
import os
from dataclasses import asdict

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import write_checkpoint

from strata.data.dataset import DatasetError
from strata.data.storage import Storage
from strata.data.tokenizer import ByteTokenizer
from train.checkpoint import sign_files
from train.export import export, main
from train.model import GPT, preset
from train.sample import load as load_for_sampling


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
    d = write_checkpoint(tmp_path / "checkpoint-00000007", model, 7,
                         {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())})
    return d, model


def test_export_writes_safetensors_and_a_gpt2_config(tmp_path, checkpoint):
    ckpt, model = checkpoint
    out = export(ckpt, str(tmp_path / "hf"))
    assert out["step"] == 7
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors",
                                                   "strata.json", "tokenizer.json", "tokenizer_config.json"]
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


def test_transformers_tokenizes_and_generates_from_the_export_as_strata_does(tmp_path, checkpoint):
    """An export's tokenizer gave transformers a GPT2Tokenizer that encoded "def hello" as []: now its own
    tokenizer.json gives strata's ids, and `pipeline("text-generation")` greedy text is `infer generate`'s."""
    transformers = pytest.importorskip("transformers")
    from infer.generate import run_generate
    from infer.model import resolve

    ckpt, model = checkpoint
    export(ckpt, str(tmp_path / "hf"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tok("def hello é")["input_ids"] == list("def hello é".encode())
    assert tok.decode(list("naïve".encode())) == "naïve" and tok.eos_token_id == 256
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    for prompt in ("def ", "import os\n"):
        theirs = pipe(prompt, max_new_tokens=12, do_sample=False, return_full_text=False)[0]["generated_text"]
        ours = run_generate(resolve(str(tmp_path / "hf"), Storage(str(tmp_path))), [prompt], max_tokens=12,
                            temperature=0.0, top_k=0, seed=0, cpus=1, device="cpu")["completions"][0]
        assert theirs == ours, (prompt, theirs, ours)


def _hf_gpt2(path, vocab=257, n_positions=128):
    """A tiny randomly initialised GPT2LMHeadModel, biases included, saved as safetensors."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=n_positions, n_embd=32,
                                                              n_layer=2, n_head=2))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)  # GPT-2 initialises them at zero: make them count
    hf.save_pretrained(str(path), safe_serialization=True)
    return hf.eval()


def test_a_hugging_face_gpt2_imports_with_the_same_logits(tmp_path):
    from train.pretrained import apply, read_gpt2

    hf = _hf_gpt2(tmp_path / "hf")
    p = read_gpt2(str(tmp_path / "hf"))
    assert p.cfg.bias and (p.cfg.n_layer, p.cfg.n_embd, p.cfg.vocab_size, p.cfg.seq_len) == (2, 32, 257, 128)
    cfg, weights = p.for_dataset(64, "any", 257)  # a shorter context keeps the first position rows
    model = GPT(cfg, init=False)
    apply(model, weights)
    idx = torch.randint(0, 257, (2, 64))
    with torch.no_grad():
        assert torch.allclose(model.eval()(idx), hf(idx).logits, atol=1e-5)
    with pytest.raises(DatasetError, match="longer than"):
        p.for_dataset(256, "any", 257)
    with pytest.raises(DatasetError, match="embeds 257"):
        p.for_dataset(64, "any", 300)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        read_gpt2(str(tmp_path / "hf"))


def test_fine_tuning_from_a_gpt2_and_exporting_again_round_trips_exactly(local_ray, dataset, tmp_path):
    from train.__main__ import main as train_main
    from train.pretrained import load, read_gpt2

    _hf_gpt2(tmp_path / "hf")
    out = train_main(["--dataset", dataset["ref"], "--init-from", str(tmp_path / "hf"), "--max-steps", "2",
                      "--batch-size", "4", "--run", "tuned", "--no-use-gpu", "--json"])
    with open(os.path.join(out["path"], "run.json")) as f:
        config = json.load(f)["config"]
    assert config["init_from"] == str(tmp_path / "hf") and config["model"]["bias"]
    assert config["model"]["n_embd"] == 32 and config["model"]["vocab_size"] == 257  # the shape of the weights
    main(["--run", "tuned", "--out", str(tmp_path / "again")])
    tuned, _, step = load_for_sampling(out["checkpoint"])
    again = read_gpt2(str(tmp_path / "again"))
    assert step == 2 and again.cfg == tuned.cfg
    # Two small steps from the imported weights stay near them (a fresh init would be ~0.05 away: N(0, 0.05) biases).
    hf = read_gpt2(str(tmp_path / "hf")).weights
    assert np.abs(again.weights["blocks.0.attn.qkv.bias"] - hf["blocks.0.attn.qkv.bias"]).max() < 0.015
    assert np.abs(again.weights["blocks.0.attn.qkv.bias"] - hf["blocks.0.attn.qkv.bias"]).max() > 0  # and trained
    for k, v in tuned.state_dict().items():
        if k != "head.weight":
            assert torch.equal(torch.from_numpy(again.weights[k]), v), k  # exact, not close
    from_run = load("tuned@2", Storage.from_env())
    assert all(np.array_equal(from_run.weights[k], again.weights[k]) for k in again.weights)
    # The export names its tokenizer: a dataset tokenized otherwise is refused.
    with pytest.raises(DatasetError, match="trained with tokenizer"):
        again.for_dataset(128, "f" * 16, 257)


def test_a_model_built_as_training_builds_it_is_tied_and_counted_once():
    """The trainer makes its model on the meta device and materialises it (`to_empty`), which gives every
    parameter new storage: the output layer must be the embedding again before init."""
    from train.model import build, describe

    cfg = preset("debug", n_layer=1, n_embd=32, n_head=2, seq_len=16)
    built = build(cfg, "cpu")
    assert built.tied and built.head.weight.data_ptr() == built.wte.weight.data_ptr()
    assert built.num_params() == GPT(cfg).num_params() == describe(cfg)["params"]
    assert built.num_params() == sum(p.numel() for n, p in built.state_dict().items() if n != "head.weight")
    # GPT-2 124M as published: 124,439,808 parameters (its linear biases and 50,257-token vocabulary), the
    # embedding counted once.
    gpt2 = preset("gpt2-124m", vocab_size=50257, bias=True)
    assert build(gpt2, "meta").num_params() == describe(gpt2)["params"] == 124_439_808


@pytest.fixture
def untied_checkpoint(tmp_path):
    """A checkpoint as strata wrote them before the fix: the output layer trained apart from the embedding."""
    cfg = preset("debug", n_layer=1, n_embd=32, n_head=2, seq_len=16)
    model = GPT(cfg)
    model.head.weight = torch.nn.Parameter(torch.randn_like(model.wte.weight) * 0.02)
    d = tmp_path / "checkpoint-00000005"
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save({"model": model.state_dict()}, storage_writer=HuggingFaceStorageWriter(str(d), save_distributed=True),
             no_dist=True)
    (d / "meta.json").write_text(json.dumps({"format": 2, "step": 5, "model_config": asdict(cfg),
                                             "tokenizer": asdict(ByteTokenizer().info())}))
    sign_files(str(d), 0)
    return str(d)


def test_a_checkpoint_trained_untied_is_refused_never_silently_retied(tmp_path, untied_checkpoint, checkpoint):
    from train.checkpoint import UntiedCheckpoint, check_tied

    for load_it in (load_for_sampling, check_tied, lambda c: export(c, str(tmp_path / "out"))):
        with pytest.raises(UntiedCheckpoint, match="differs from its token embedding.*train a new run"):
            load_it(untied_checkpoint)
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(SystemExit, match="differs from its token embedding"):
        main(["--checkpoint", untied_checkpoint, "--out", str(tmp_path / "out")])
    check_tied(checkpoint[0])  # a tied one written without the flag (meta.json) is read and passes
    assert load_for_sampling(checkpoint[0])[0].tied


def test_the_model_trained_is_the_model_sampled_and_exported(local_ray, dataset, tmp_path):
    """Training's reported validation loss equals the loss of the checkpoint as `train.sample` loads it and
    of the export as transformers loads it, on the same validation rows."""
    import torch.nn.functional as F
    from conftest import train_run as run

    from strata.data.dataset import resolve
    from train.config import TrainConfig
    from train.data import Source, validation_batches

    transformers = pytest.importorskip("transformers")
    storage = Storage.from_env()
    cfg = TrainConfig(max_steps=8, batch_size=4, warmup_steps=2, lr=1e-2, log_every=4, eval_every=8,
                      eval_batches=2)
    out = run(preset("debug", n_layer=2, n_embd=64, n_head=4), cfg, dataset=dataset["ref"], run_name="same-model",
              storage=storage, workers=1, use_gpu=False)
    rows = validation_batches(Source.of(resolve(storage, dataset["ref"]), 1.0).val_shards, cfg)
    assert rows, "the dataset has a validation split"

    def loss_of(logits_of) -> float:
        with torch.no_grad():
            return float(np.mean([F.cross_entropy(logits_of(torch.from_numpy(b[:, :-1].astype(np.int64))).flatten(0, 1),
                                                  torch.from_numpy(b[:, 1:].astype(np.int64)).flatten()).item()
                                  for b in rows]))

    sampled, _, step = load_for_sampling(out["checkpoint"])
    assert step == 8 and sampled.tied
    export(out["checkpoint"], str(tmp_path / "hf"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert out["val_loss"] == pytest.approx(loss_of(sampled), abs=1e-4)
    assert out["val_loss"] == pytest.approx(loss_of(lambda x: hf(x).logits), abs=1e-4)
    assert out["val_loss"] < out["first_loss"] - 0.5  # it learned: a different model would not score the same


def test_a_damaged_export_record_is_left_out_with_a_warning(tmp_path, caplog):
    """`strata lineage doc` lists a run's exports from their records; one that is not JSON, or not an export's,
    is named in a warning and left out, and the others are listed."""
    from train.export import EXPORTS, exports

    folder = tmp_path / "run" / EXPORTS
    folder.mkdir(parents=True)
    (folder / "1.json").write_text(json.dumps({"checkpoint": "c", "step": 4, "path": "/models/a", "at": 1.0}))
    (folder / "2.json").write_text("{not json")
    (folder / "3.json").write_text(json.dumps(["a", "list"]))
    (folder / "4.json").write_bytes(b"\xff\xfe")
    with caplog.at_level("WARNING"):
        assert [e["path"] for e in exports(str(tmp_path / "run"))] == ["/models/a"]
    assert sum("is not an export record" in r.getMessage() for r in caplog.records) == 3
