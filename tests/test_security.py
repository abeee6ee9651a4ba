"""What is read from storage never runs as code (no Ray)."""

import json
import os
import pickle
from dataclasses import asdict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from strata.signing import Untrusted
from strata.tokenizer import ByteTokenizer
from train.checkpoint import _rng_state, load, sign_checkpoint
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
    cfg = preset("debug", n_layer=1, n_embd=32, n_head=2, seq_len=16)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 16, dtype=torch.long)).float().mean().backward()
    opt.step()
    d = tmp_path / "checkpoint-00000001"
    model_state, optim_state = get_state_dict(model, opt)  # as AsyncCheckpointer saves them
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(d), no_dist=True)
    torch.save(_rng_state(), d / "rng-0.pt")
    (d / "meta.json").write_text(json.dumps({"step": 1, "model_config": asdict(cfg),
                                             "tokenizer": asdict(ByteTokenizer().info())}))
    sign_checkpoint(str(d))
    return d, cfg


def _fresh(cfg):
    model = GPT(cfg)
    return model, torch.optim.AdamW(model.parameters())


def test_a_signed_checkpoint_loads(checkpoint):
    d, cfg = checkpoint
    assert load(str(d), *_fresh(cfg), rank=0)["step"] == 1
    assert load_for_sampling(str(d))[2] == 1


@pytest.mark.parametrize("planted", [".metadata", "rng-0.pt"])
def test_a_pickle_planted_in_a_checkpoint_is_refused_and_never_runs(checkpoint, tmp_path, planted):
    d, cfg = checkpoint
    marker = tmp_path / "ran"
    with open(d / planted, "wb") as f:
        pickle.dump(Payload(str(marker)), f)
    with pytest.raises((Untrusted, pickle.UnpicklingError)):
        load(str(d), *_fresh(cfg), rank=0)
    if planted == ".metadata":
        with pytest.raises(Untrusted, match="does not match its signature"):
            load_for_sampling(str(d))
        os.remove(d / "signature.json")
        with pytest.raises(Untrusted, match="not signed"):
            load_for_sampling(str(d))
    assert not marker.exists(), "the planted pickle ran"


def test_a_checkpoint_signed_with_another_key_is_refused(checkpoint, monkeypatch):
    d, cfg = checkpoint
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


def test_a_token_file_others_can_read_is_named_and_fixed(tmp_path):
    import io

    from strata.submit import check_token_mode

    token = tmp_path / "ray-token"
    token.write_text("s3cr3t-token-value\n")
    os.chmod(token, 0o644)
    said = io.StringIO()
    assert not check_token_mode(str(token), fix=False, out=said)
    assert "can be read by others" in said.getvalue() and "s3cr3t" not in said.getvalue()
    assert os.stat(token).st_mode & 0o777 == 0o644
    assert check_token_mode(str(token), fix=True, out=said) and os.stat(token).st_mode & 0o777 == 0o600
    assert check_token_mode(str(token), fix=False, out=io.StringIO())  # private now: nothing to say


def test_the_local_signing_key_is_private(tmp_path, monkeypatch):
    from strata import signing

    for var in ("STRATA_SIGNING_KEY", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    first = signing.key()
    assert os.stat(tmp_path / ".strata" / "signing-key").st_mode & 0o777 == 0o600
    assert signing.key() == first  # the same key next time
