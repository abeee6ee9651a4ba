"""What is read from storage never runs as code (no Ray)."""

import json
import os
import pathlib
import pickle
import re
from dataclasses import asdict

import pytest
import torch
from conftest import write_checkpoint

from strata.signing import Untrusted
from strata.tokenizer import ByteTokenizer
from train.checkpoint import load
from train.model import GPT, preset
from train.sample import load as load_for_sampling


class Payload:
    """Unpickled, it creates `marker`: proof that a planted file ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def checkpoint(tmp_path):
    """A checkpoint as training writes it, of a model and optimizer one step in."""
    cfg = preset("debug", n_layer=1, n_embd=32, n_head=2, seq_len=16)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    model(torch.zeros(1, 16, dtype=torch.long)).float().mean().backward()
    opt.step()
    d = write_checkpoint(tmp_path / "checkpoint-00000001", model, 1,
                         {"model_config": asdict(cfg), "tokenizer": asdict(ByteTokenizer().info())}, opt)
    return pathlib.Path(d), cfg, model, opt


def _fresh(cfg):
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters(), lr=5.0)


def test_a_signed_checkpoint_loads_whole(checkpoint):
    d, cfg, model, opt = checkpoint
    fresh, fresh_opt = _fresh(cfg)
    assert load(str(d), fresh, fresh_opt, rank=0)["step"] == 1
    assert torch.equal(fresh.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)
    assert fresh_opt.param_groups[0]["lr"] == 1e-3 and fresh_opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    assert load_for_sampling(str(d))[2] == 1


def test_nothing_in_a_checkpoint_is_pickled_beside_the_tensors(checkpoint):
    """DCP pickles non-tensor values and unpickles them with weights_only=False: the optimizer's param groups
    go to JSON, so every entry DCP holds is a tensor."""
    d, *_ = checkpoint
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(d)).read_metadata()
    assert metadata.state_dict_metadata and all(isinstance(m, TensorStorageMetadata)
                                                for m in metadata.state_dict_metadata.values())
    groups = json.loads((d / "optim-groups.json").read_text())
    assert groups[0]["lr"] == 1e-3 and groups[0]["params"]


@pytest.mark.parametrize("planted", [".metadata", "rng-0.pt", "__0_0.distcp", "optim-groups.json"])
def test_a_pickle_planted_in_a_checkpoint_is_refused_naming_the_file_and_never_runs(checkpoint, tmp_path, planted):
    """The red team's repro: the first bytes of a file overwritten with a pickle that would run code."""
    d, cfg, *_ = checkpoint
    marker = tmp_path / "ran"
    payload = pickle.dumps(Payload(str(marker)))
    data = (d / planted).read_bytes()
    (d / planted).write_bytes(payload + data[len(payload):])
    loaders = [lambda: load(str(d), *_fresh(cfg), rank=0)]
    if planted in (".metadata", "__0_0.distcp"):  # what sampling reads of a checkpoint
        loaders.append(lambda: load_for_sampling(str(d)))
    for load_it in loaders:
        with pytest.raises(Untrusted, match=f"{re.escape(planted)} does not match its signed SHA-256"):
            load_it()
    assert not marker.exists(), "the planted pickle ran"


def test_swapped_weights_and_added_files_are_refused(checkpoint):
    d, cfg, *_ = checkpoint
    shard = d / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte of a tensor: a weight, not code
    shard.write_bytes(bytes(data))
    with pytest.raises(Untrusted, match="__0_0.distcp does not match"):
        load(str(d), *_fresh(cfg), rank=0)
    shard.write_bytes(bytes(data[: len(data) // 2]) + bytes([data[len(data) // 2] ^ 0xFF]) + bytes(data[len(data) // 2 + 1:]))
    load(str(d), *_fresh(cfg), rank=0)  # restored: it loads again
    (d / "__1_0.distcp").write_bytes(b"planted")
    with pytest.raises(Untrusted, match="__1_0.distcp is in no signed list"):
        load(str(d), *_fresh(cfg), rank=0)
    os.remove(d / "__1_0.distcp")
    os.remove(d / "signed-0.json")
    with pytest.raises(Untrusted, match="has no signed list of its files"):
        load_for_sampling(str(d))


def test_a_checkpoint_signed_with_another_key_is_refused(checkpoint, monkeypatch):
    d, cfg, *_ = checkpoint
    monkeypatch.setenv("STRATA_SIGNING_KEY", "another cluster's key")
    with pytest.raises(Untrusted, match="another key"):
        load(str(d), *_fresh(cfg), rank=0)


def test_plain_http_to_another_machine_is_refused_unless_asked():
    from strata.submit import check_address

    for ok in ("http://127.0.0.1:8265", "http://localhost:8265", "https://head.example.invalid:443", "127.0.0.1:8265"):
        check_address(ok)
    for bad in ("http://10.0.0.5:8265", "http://strata-head-svc:8265", "10.0.0.5:8265"):
        with pytest.raises(ValueError, match="in the clear"):
            check_address(bad)
        check_address(bad, insecure_http=True)


def test_strata_submit_refuses_plain_http_before_sending_anything(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    out = subprocess.run([sys.executable, "-m", "strata", "submit", "preprocess", "--address", "http://10.255.255.1:8265",
                          "--", "--dataset", "d"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "in the clear" in out.stderr


def test_a_token_file_others_can_read_is_named_and_fixed(tmp_path, capsys):
    from strata.submit import check_token_mode

    token = tmp_path / "ray-token"
    token.write_text("s3cr3t-token-value\n")
    os.chmod(token, 0o644)
    assert not check_token_mode(str(token), fix=False)
    said = capsys.readouterr().err
    assert "can be read by others" in said and "s3cr3t" not in said
    assert os.stat(token).st_mode & 0o777 == 0o644
    assert check_token_mode(str(token), fix=True) and os.stat(token).st_mode & 0o777 == 0o600
    assert "is now 0600" in capsys.readouterr().err
    assert check_token_mode(str(token), fix=False)  # private now: nothing to say
    assert capsys.readouterr().err == ""


def test_the_local_signing_key_is_private(tmp_path, monkeypatch):
    from strata import signing

    for var in ("STRATA_SIGNING_KEY", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = signing.key()
    assert os.stat(tmp_path / ".strata" / "signing-key").st_mode & 0o777 == 0o600
    assert signing.key() == first  # the same key next time


def test_the_demo_and_the_ray_start_lock_use_private_folders_and_never_follow_links(tmp_path, monkeypatch):
    """The red team planted links at the fixed temp paths the demo and the embedded Ray's start lock used."""
    import stat
    import tempfile

    from strata.connect import _start_lock, private_dir
    from strata.demo import demo_corpus
    from strata.storage import Storage

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    victim = tmp_path / "victim"
    victim.write_text("not strata's")
    os.symlink(victim, tmp_path / "strata-demo-inputs")  # the old fixed name of the demo's damaged inputs
    first, second = demo_corpus(Storage(str(tmp_path / "root")))[-1], demo_corpus(Storage(str(tmp_path / "root")))[-1]
    assert first != second and all(stat.S_IMODE(os.stat(d).st_mode) == 0o700 for d in (first, second))
    assert not any(os.path.islink(os.path.join(first, n)) for n in os.listdir(first))
    assert victim.read_text() == "not strata's"
    with _start_lock():
        assert os.path.isfile(os.path.join(private_dir(), "ray-start.lock"))
    os.remove(os.path.join(private_dir(), "ray-start.lock"))
    os.symlink(victim, os.path.join(private_dir(), "ray-start.lock"))
    with pytest.raises(OSError), _start_lock():
        pass
    folder = private_dir()
    os.remove(os.path.join(folder, "ray-start.lock"))
    os.rmdir(folder)
    os.symlink(tmp_path, folder)  # the private folder itself planted as a link
    with pytest.raises(OSError, match="not a private folder"):
        private_dir()
    assert victim.read_text() == "not strata's"


def test_a_report_goes_under_the_storage_root_whatever_its_record_says(tmp_path):
    from strata.report import report
    from strata.storage import Storage, write_json_atomic

    storage = Storage(str(tmp_path / "root"))
    outside = tmp_path / "outside"
    outside.mkdir()
    record = {"kind": "train", "name": "planted", "outputs": str(outside), "started_at": 1.0, "ended_at": 2.0,
              "seconds": 1.0, "code_version": "x", "libraries": {}, "by_type": {}, "node_hours": 0.0, "cost": None,
              "currency": None, "prices_as_of": None, "nodes": [], "figures": {}, "config": {},
              "utilization": {"cpu_busy": None, "gpu_busy": None, "mfu": None}}
    write_json_atomic(os.path.join(storage.records(), "train-planted-1.json"), record)
    _, path = report("train/planted", storage)
    assert path.startswith(storage.root + os.sep) and os.path.exists(path)
    assert os.listdir(outside) == []
    _, chosen = report("train/planted", storage, out=str(tmp_path / "mine.html"))  # --out is the user's to choose
    assert chosen == str(tmp_path / "mine.html") and os.path.exists(chosen)
