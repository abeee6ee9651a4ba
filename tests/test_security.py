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

from strata.data.signing import Untrusted
from strata.data.tokenizer import ByteTokenizer
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


SHARD = "shard-00001-model-00001-of-00001.safetensors"


def _loaders(d, cfg):
    """Every way strata reads a checkpoint: training's resume, the run's pre-check, sampling (and through it
    infer and --init-from), and the weights alone (export)."""
    from train.checkpoint import check_checkpoint, load_model_state

    return [lambda: load(str(d), *_fresh(cfg), rank=0), lambda: check_checkpoint(str(d)),
            lambda: load_for_sampling(str(d)), lambda: load_model_state(str(d), GPT(cfg))]


def test_a_checkpoint_holds_no_pickle_and_no_loader_unpickles(checkpoint, monkeypatch):
    """Every file is JSON or safetensors; every loader runs with pickle and torch.load made to fail."""
    from safetensors import safe_open

    d, cfg, *_ = checkpoint
    names = sorted(os.listdir(d))
    assert {SHARD, "rng-0.safetensors", "meta.json", "optim-groups.json", "signed-0.json"} == set(names)
    for name in names:
        if name.endswith(".json"):
            json.loads((d / name).read_text())
        else:
            with safe_open(str(d / name), framework="pt") as f:
                assert list(f.keys())
    assert json.loads((d / "meta.json").read_text())["format"] == 2

    import threading

    me = threading.current_thread()

    def refusing(original):
        def refuse(*a, **k):  # in this test's thread (Ray's own threads, if a Ray is up, go on as they were)
            if threading.current_thread() is me:
                raise AssertionError("something was unpickled")
            return original(*a, **k)
        return refuse

    for mod, attr in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(mod, attr, refusing(getattr(mod, attr)))
    for load_it in _loaders(d, cfg):
        load_it()
    groups = json.loads((d / "optim-groups.json").read_text())
    assert groups[0]["lr"] == 1e-3 and groups[0]["params"]


@pytest.mark.parametrize("planted", [SHARD, "rng-0.safetensors", "optim-groups.json", "meta.json"])
def test_a_pickle_planted_in_a_checkpoint_is_refused_naming_the_file_and_never_runs(checkpoint, tmp_path, planted):
    """The red team's repro: the first bytes of a file overwritten with a pickle that would run code."""
    d, cfg, *_ = checkpoint
    marker = tmp_path / "ran"
    payload = pickle.dumps(Payload(str(marker)))
    data = (d / planted).read_bytes()
    (d / planted).write_bytes(payload + data[len(payload):])
    for load_it in _loaders(d, cfg)[:1] + ([_loaders(d, cfg)[2]] if planted in (SHARD, "meta.json") else []):
        with pytest.raises(Untrusted, match=f"{re.escape(planted)} does not match its signed SHA-256"):
            load_it()
    assert not marker.exists(), "the planted pickle ran"


def test_swapped_weights_and_added_files_are_refused(checkpoint):
    d, cfg, *_ = checkpoint
    shard = d / SHARD
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # one byte of a tensor: a weight, not code
    shard.write_bytes(bytes(data))
    with pytest.raises(Untrusted, match=f"{SHARD} does not match"):
        load(str(d), *_fresh(cfg), rank=0)
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    load(str(d), *_fresh(cfg), rank=0)  # restored: it loads again
    (d / "shard-00002-model-00001-of-00001.safetensors").write_bytes(b"planted")
    with pytest.raises(Untrusted, match="shard-00002-model-00001-of-00001.safetensors is in no signed list"):
        load(str(d), *_fresh(cfg), rank=0)
    os.remove(d / "shard-00002-model-00001-of-00001.safetensors")
    os.remove(d / "signed-0.json")
    with pytest.raises(Untrusted, match="has no signed list of its files"):
        load_for_sampling(str(d))


def test_a_checkpoint_signed_with_another_key_names_both_keys_and_the_keyring_verifies(checkpoint, monkeypatch,
                                                                                       tmp_path):
    from strata.data import signing

    d, cfg, *_ = checkpoint
    old_secret, old_id = signing.secret(), signing.key_id()
    monkeypatch.setenv("STRATA_SIGNING_KEY", "another cluster's key")
    with pytest.raises(Untrusted, match=f"signed with key {old_id}; this machine has key {signing.key_id()}.*keyring"):
        load(str(d), *_fresh(cfg), rank=0)
    ring = tmp_path / "keyring"
    ring.write_bytes(b"# keys of earlier years\n" + old_secret + b"\n")
    monkeypatch.setenv("STRATA_SIGNING_KEYRING", str(ring))
    assert load(str(d), *_fresh(cfg), rank=0)["step"] == 1


def test_token_files_that_appear_after_training_change_nothing(checkpoint, monkeypatch, tmp_path):
    """M6: the key was the first token file that existed; Ray and the README's own step create them."""
    d, cfg, *_ = checkpoint
    home = _own_home(tmp_path, monkeypatch)
    for path in (home / ".ray" / "auth_token", home / ".strata" / "ray-token"):
        path.parent.mkdir(exist_ok=True)
        path.write_text("a fresh ray token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a rotated token")
    for load_it in _loaders(d, cfg):
        load_it()


def _own_home(tmp_path, monkeypatch) -> pathlib.Path:
    """A home of the test's own holding this machine's signing key (as it was when the fixture signed): its
    token files must not be the session's, which the session's Ray reads when it starts a worker."""
    import shutil

    home = tmp_path / "home"
    (home / ".strata").mkdir(parents=True)
    shutil.copy(pathlib.Path(os.environ["HOME"]) / ".strata" / "signing-key", home / ".strata" / "signing-key")
    monkeypatch.setenv("HOME", str(home))
    return home


def _format_1(dest, model, opt, meta, secret: bytes):
    """A checkpoint as strata wrote them before 2026-12-04: DCP's default files (a pickled .metadata),
    torch.save'd RNG, and a signed list without a key's fingerprint, keyed by `secret`."""
    import hashlib
    import hmac

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from train.checkpoint import _groups_to_json, _sha256

    ms, os_ = get_state_dict(model, opt)
    dcp.save({"model": ms, "optim": {"state": os_["state"]}}, checkpoint_id=str(dest), no_dist=True)
    torch.save({"torch": torch.get_rng_state()}, dest / "rng-0.pt")
    (dest / "meta.json").write_text(json.dumps({"step": 1, **meta, "tied_embeddings": True}))
    (dest / "optim-groups.json").write_text(json.dumps(_groups_to_json(os_["param_groups"])))
    files = {n: _sha256(str(dest / n)) for n in sorted(os.listdir(dest))}
    k = hmac.new(secret, b"strata file signatures v1", hashlib.sha256).digest()
    sig = hmac.new(k, json.dumps(files, sort_keys=True).encode(), hashlib.sha256).hexdigest()
    (dest / "signed-0.json").write_text(json.dumps({"files": files, "signature": sig}))


def _register(run_dir: pathlib.Path, name: str) -> None:
    """List a checkpoint in the run's Ray Train record, as Ray Train does when it commits one."""
    snap = run_dir / "checkpoint_manager_snapshot.json"
    state = json.loads(snap.read_text()) if snap.exists() else {"checkpoint_results": [],
                                                              "checkpoint_report_indices": []}
    state["checkpoint_results"].append({"checkpoint_dir_name": name})
    state["checkpoint_report_indices"].append(len(state["checkpoint_report_indices"]))
    state["latest_checkpoint_result"] = {"checkpoint_dir_name": name}
    snap.write_text(json.dumps(state))


def test_a_format_1_checkpoint_signed_with_the_ray_token_never_runs_and_converts_only_explicitly(
        checkpoint, tmp_path, monkeypatch, capsys):
    """Issue 57, 1 (critical): a format-1 checkpoint (a pickled .metadata) whose list names no key verified under
    the Ray token; planted as a run's newest checkpoint, its payload ran in `train.sample --run` and in a serve
    following the run. Now every command refuses it without unpickling, `--run` takes the newest one that
    verifies and names the one it skipped, and only `python -m train.convert`, given the old secret, converts a
    real format-1 checkpoint (reading .metadata with DCP's classes alone: a payload there is refused)."""
    from train.committed import committed_checkpoints, newest
    from train.convert import main as convert
    from train.sample import load_newest

    d, cfg, model, opt = checkpoint
    meta = json.loads((d / "meta.json").read_text())
    home = _own_home(tmp_path, monkeypatch)
    token = b"the cluster's ray token"
    for path in (home / ".ray" / "auth_token", home / ".strata" / "ray-token"):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(token + b"\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN", token.decode())
    run = tmp_path / "storage" / "runs" / "r"
    run.mkdir(parents=True)
    write_checkpoint(run / "checkpoint-00000001", model, 1, meta, opt)  # the run's own, signed for run r
    _register(run, "checkpoint-00000001")
    marker = tmp_path / "ran"
    planted = run / "checkpoint-00000099"
    planted.mkdir()
    _format_1(planted, model, opt, {**meta, "step": 99}, token)
    (planted / ".metadata").write_bytes(pickle.dumps(Payload(str(marker))))
    _format_1_sign(planted, token)  # the payload, signed under the token as format 1 signed
    _register(run, "checkpoint-00000099")
    assert [pathlib.Path(c).name for c in committed_checkpoints(str(run))][-1] == "checkpoint-00000099"

    for load_it in _loaders(planted, cfg):
        with pytest.raises(Untrusted, match=r"without a key fingerprint .*python -m train\.convert"):
            load_it()
    found, (_, _, step) = load_newest(str(run), what="--run r")
    assert found.endswith("checkpoint-00000001") and step == 1
    assert "skipped checkpoint-00000099" in capsys.readouterr().err
    assert newest(str(run))[2][0][0] == "checkpoint-00000099"  # a follower passes it over, naming it
    with pytest.raises(Untrusted, match=r"\.metadata names \w+\.open, which is not one of DCP's metadata classes"):
        from train.convert import convert as convert_one

        convert_one(str(planted), token)
    assert not marker.exists(), "the planted pickle ran"

    # A real format-1 checkpoint converts, given its old secret, and then loads whole.
    old = run / "checkpoint-00000002"
    old.mkdir()
    _format_1(old, model, opt, {**meta, "step": 2}, token)
    assert convert([str(old)]) == 1  # no secret given: refused, nothing written
    assert (old / ".metadata").exists()
    (tmp_path / "wrong").write_text("another secret")
    assert convert([str(old), "--old-secret-file", str(tmp_path / "wrong")]) == 1
    (tmp_path / "old").write_bytes(token)
    assert convert([str(old), "--old-secret-file", str(tmp_path / "old")]) == 0
    assert not any(n.endswith((".distcp", ".pt")) or n == ".metadata" for n in os.listdir(old))
    fresh, fresh_opt = _fresh(cfg)
    assert load(str(old), fresh, fresh_opt, rank=0)["step"] == 2
    assert torch.equal(fresh.blocks[0].attn.qkv.weight, model.blocks[0].attn.qkv.weight)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def _format_1_sign(dest: pathlib.Path, secret: bytes) -> None:
    """Format 1's signed list over the files `dest` holds now, keyed by `secret` (no fingerprint)."""
    import hashlib
    import hmac

    from train.checkpoint import _sha256

    files = {n: _sha256(str(dest / n)) for n in sorted(os.listdir(dest)) if not n.startswith("signed-")}
    k = hmac.new(secret, b"strata file signatures v1", hashlib.sha256).digest()
    sig = hmac.new(k, json.dumps(files, sort_keys=True).encode(), hashlib.sha256).hexdigest()
    (dest / "signed-0.json").write_text(json.dumps({"files": files, "signature": sig}))


def test_a_checkpoint_is_bound_to_its_run_and_step(checkpoint, tmp_path):
    """Issue 57, 6: a signed checkpoint copied into another run's folder, or renamed to another step, served as
    that run or step; the signed lists now name both."""
    import shutil

    d, cfg, model, opt = checkpoint
    meta = json.loads((d / "meta.json").read_text())
    runs = tmp_path / "runs"
    write_checkpoint(runs / "r1" / "checkpoint-00000001", model, 1, meta, opt)
    load_for_sampling(str(runs / "r1" / "checkpoint-00000001"))
    shutil.copytree(runs / "r1" / "checkpoint-00000001", runs / "r9" / "checkpoint-00000001")
    with pytest.raises(Untrusted, match="signed for run 'r1', not 'r9'"):
        load_for_sampling(str(runs / "r9" / "checkpoint-00000001"))
    shutil.copytree(runs / "r1" / "checkpoint-00000001", runs / "r1" / "checkpoint-00000005")
    with pytest.raises(Untrusted, match="signed as step 1, not 5"):
        load_for_sampling(str(runs / "r1" / "checkpoint-00000005"))


def _resign(d: pathlib.Path, listed: dict) -> None:
    """A signed list written again over `listed`'s files, run and step, as a holder of the key could."""
    from strata.data.signing import signature
    from train.checkpoint import _canonical

    body = {"files": listed["files"], "run": listed["run"], "step": listed["step"]}
    (d / "signed-0.json").write_text(json.dumps({**body, **signature(_canonical(body))}))


def test_crafted_metadata_is_refused_before_a_model_is_built(checkpoint):
    """m3: meta.json's model_config decides what is allocated; it is checked against its signature first,
    then against what the weight files can hold."""
    from train.checkpoint import _sha256

    d, cfg, *_ = checkpoint
    meta = json.loads((d / "meta.json").read_text())
    meta["model_config"]["n_layer"] = 1_000_000
    (d / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(Untrusted, match="meta.json does not match its signed SHA-256"):
        load_for_sampling(str(d))
    listed = json.loads((d / "signed-0.json").read_text())  # re-signed by a holder of the key: still refused
    listed["files"]["meta.json"] = _sha256(str(d / "meta.json"))
    _resign(d, listed)
    with pytest.raises(Untrusted, match="more than its weight files"):
        load_for_sampling(str(d))
    for bad in (1e9, "12", None):
        meta["model_config"]["n_layer"] = bad
        (d / "meta.json").write_text(json.dumps(meta))
        listed["files"]["meta.json"] = _sha256(str(d / "meta.json"))
        _resign(d, listed)
        with pytest.raises(Untrusted, match="model_config"):
            load_for_sampling(str(d))


def test_plain_http_to_another_machine_is_refused_unless_asked():
    from strata.commands.submit import check_address

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
    from strata.commands.submit import check_token_mode

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
    from strata.data import signing

    for var in ("STRATA_SIGNING_KEY", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    signing.ensure_local_key()  # as an embedded Ray's start, or `strata head start`, makes it
    first = signing.key()
    assert os.stat(tmp_path / ".strata" / "signing-key").st_mode & 0o777 == 0o600
    assert os.stat(tmp_path / ".strata").st_mode & 0o777 == 0o700
    assert signing.key() == first  # the same key next time


def test_the_demo_and_the_ray_start_lock_use_private_folders_and_never_follow_links(tmp_path, monkeypatch):
    """The red team planted links at the fixed temp paths the demo and the embedded Ray's start lock used."""
    import stat
    import tempfile

    from strata.cluster.connect import _start_lock, private_dir
    from strata.commands.demo import demo_corpus
    from strata.data.storage import Storage

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
    from strata.commands.report import report
    from strata.data.storage import Storage, write_json_atomic

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


def test_ray_client_to_another_machine_is_refused_while_a_token_is_set(monkeypatch):
    """M5: Ray Client sends `authorization: Bearer <token>` in its gRPC headers, in the clear without TLS."""
    from strata.commands.submit import check_address

    monkeypatch.delenv("RAY_USE_TLS", raising=False)
    with pytest.raises(ValueError, match=r"Ray Client \(ray://\) to another machine without TLS"):
        check_address("ray://198.18.0.9:10001")
    check_address("ray://198.18.0.9:10001", token_set=False)  # nothing secret to send
    check_address("ray://127.0.0.1:10001")
    monkeypatch.setenv("RAY_USE_TLS", "1")
    check_address("ray://198.18.0.9:10001")


def test_strata_submit_refuses_ray_client_in_the_clear_before_sending_anything(tmp_path):
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "RAY_ADDRESS": "ray://198.18.0.9:10001", "RAY_AUTH_TOKEN": "t0ken"}
    env.pop("RAY_USE_TLS", None)
    out = subprocess.run([sys.executable, "-m", "strata", "submit", "preprocess", "--", "--dataset", "d"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2 and "without TLS" in out.stderr and "t0ken" not in out.stderr + out.stdout


def test_a_link_out_of_the_upload_is_refused(tmp_path):
    """m10: the upload carried the target of a symlinked *.py."""
    from strata.commands.submit import check_links

    work = tmp_path / "work"
    (work / "strata").mkdir(parents=True)
    (work / "strata" / "ok.py").write_text("x = 1\n")
    os.symlink(work / "strata" / "ok.py", work / "strata" / "alias.py")  # inside: fine
    check_links(str(work))
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    os.symlink(secret, work / "strata" / "keys.py")
    with pytest.raises(ValueError, match=r"keys.py is a link to .*id_rsa, outside"):
        check_links(str(work))


def test_the_signing_key_never_travels_in_a_jobs_environment_and_never_follows_token_files(monkeypatch, tmp_path):
    """Issue 57, 2: `strata submit` put the key in the job's runtime env, which `GET /api/jobs/` shows every token
    holder; and a driver joining a cluster with no key minted one of its own."""
    from strata.commands.submit import runtime_env
    from strata.data import signing

    monkeypatch.setenv("HOME", str(tmp_path))
    for var in ("STRATA_SIGNING_KEY", "STRATA_SIGNING_KEY_FILE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(signing.NoKey, match="no signing key"):
        signing.key_id()  # nothing is minted behind the user's back
    import subprocess
    import sys

    from conftest import REPO

    joined = subprocess.run([sys.executable, "-c", "from strata.cluster.connect import connect; connect(address='127.0.0.1:1')"],
                            cwd=REPO, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "HOME": str(tmp_path)})  # a driver of its own: none connected yet
    assert joined.returncode == 1 and "the Ray cluster at 127.0.0.1:1 holds no signing key" in joined.stderr, \
        joined.stderr[-2000:]  # refused before it even tries the address
    assert not (tmp_path / ".strata").exists()
    signing.ensure_local_key()  # a laptop's first embedded run
    mine = signing.key_id()
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("ray's own token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "another")
    assert signing.key_id() == mine
    env = runtime_env("", None)["env_vars"]
    secret = signing.secret().decode()
    assert "STRATA_SIGNING_KEY" not in env and not any(secret in str(v) for v in env.values())
    own = tmp_path / "env.yaml"
    own.write_text(f"env_vars: {{STRATA_SIGNING_KEY: {secret}}}\n")
    with pytest.raises(Exception, match="never travels in a job's environment"):
        runtime_env("", str(own))


def test_keys_trust_by_fingerprint_and_rotate_keeping_the_old_key(checkpoint, tmp_path, monkeypatch):
    """`strata keys`: a laptop trusts a cluster's key only when its fingerprint matches; rotating keeps what the
    old key signed verifiable."""
    import subprocess
    import sys

    from conftest import REPO

    from strata.data import signing

    d, cfg, *_ = checkpoint
    home = _own_home(tmp_path, monkeypatch)
    cluster = tmp_path / "cluster-key"
    cluster.write_text("the cluster's signing secret\n")
    fp = signing.fingerprint_of_secret(cluster.read_bytes())

    def keys(*args):
        return subprocess.run([sys.executable, "-m", "strata", "keys", *args], cwd=REPO, capture_output=True,
                              text=True, env={**os.environ, "HOME": str(home)}, timeout=120)

    shown = json.loads(keys("show", "--json").stdout)
    assert shown["key"]["fingerprint"] == signing.key_id() and shown["keyring"]["keys"] == []
    wrong = keys("trust", str(cluster), "--fingerprint", "0" * 12)
    assert wrong.returncode == 1 and f"holds the key {fp}, not {'0' * 12}" in wrong.stderr
    assert keys("trust", str(cluster), "--fingerprint", fp).returncode == 0
    assert json.loads(keys("show", "--json").stdout)["keyring"]["keys"] == [fp]
    before = signing.key_id()
    rotated = keys("rotate")
    assert rotated.returncode == 0 and before in rotated.stderr
    assert signing.key_id() != before and before in signing.keyring()
    assert oct((home / ".strata" / "signing-key").stat().st_mode & 0o777) == "0o600"
    load(str(d), *_fresh(cfg), rank=0)  # signed with the old key: it still verifies


def test_a_fenced_off_generation_publishes_nothing_whatever_the_timing(checkpoint, tmp_path):
    """Fencing, not timing (issue 44, 11): checkpoints an earlier lease generation hands over after a later one
    took the run are ignored by every reader, however late Ray Train registers them."""
    import shutil

    from train.committed import committed_checkpoints, fence, forget_missing

    d, *_ = checkpoint
    run = tmp_path / "run"
    run.mkdir()

    def add(step: int, gen: int) -> str:
        name = f"checkpoint-{step:08d}"
        shutil.copytree(d, run / name)
        meta = json.loads((run / name / "meta.json").read_text())
        (run / name / "meta.json").write_text(json.dumps({**meta, "step": step, "lease_gen": gen}))
        snap = run / "checkpoint_manager_snapshot.json"
        state = json.loads(snap.read_text()) if snap.exists() else {"checkpoint_results": [],
                                                                  "checkpoint_report_indices": []}
        state["checkpoint_results"].append({"checkpoint_dir_name": name})
        state["checkpoint_report_indices"].append(step)
        state["latest_checkpoint_result"] = {"checkpoint_dir_name": name}
        snap.write_text(json.dumps(state))
        return name

    names = lambda: [os.path.basename(c) for c in committed_checkpoints(str(run))]  # noqa: E731
    add(2, gen=1)
    fence(str(run), 2)  # generation 2 takes the run: it saw step 2
    add(4, gen=1)  # generation 1's workers had handed step 4 over before they saw the lease go
    add(6, gen=1)
    assert names() == ["checkpoint-00000002"]
    add(8, gen=2)  # the new holder's own
    assert names() == ["checkpoint-00000002", "checkpoint-00000008"]
    fence(str(run), 3)  # a third generation lists what counts, and keeps ignoring the stale ones
    add(10, gen=1)
    assert names() == ["checkpoint-00000002", "checkpoint-00000008"]
    assert sorted(forget_missing(str(run))) == ["checkpoint-00000004", "checkpoint-00000006", "checkpoint-00000010"]
    assert names() == ["checkpoint-00000002", "checkpoint-00000008"]


def test_a_planted_fence_closes_nothing(checkpoint, tmp_path, caplog):
    """Issue 57, 5: one crafted `fences/g99999999.json` made every checkpoint "missing or incomplete": training
    restarted from step 0 and `--run` found none. A fence counts only when the run's lease holder signed it, for
    this run and its generation; any other is named and ignored."""
    import shutil

    from train.committed import committed_checkpoints, fence, forget_missing

    d, cfg, model, opt = checkpoint
    run = tmp_path / "runs" / "r"
    other = tmp_path / "runs" / "other"
    other.mkdir(parents=True)
    meta = json.loads((d / "meta.json").read_text())
    write_checkpoint(run / "checkpoint-00000001", model, 1, {**meta, "lease_gen": 1}, opt)  # lease generation 1's
    _register(run, "checkpoint-00000001")
    fence(str(run), 2)
    write_checkpoint(run / "checkpoint-00000002", model, 2, {**meta, "lease_gen": 2}, opt)  # the holder's own
    _register(run, "checkpoint-00000002")
    fence(str(other), 7)  # signed, but another run's
    (run / "fences" / "g99999999.json").write_text(json.dumps({"gen": 99999999, "checkpoints": []}))
    shutil.copy(other / "fences" / "g00000007.json", run / "fences" / "g00000007.json")
    forged = json.loads((run / "fences" / "g00000002.json").read_text())
    (run / "fences" / "g00000003.json").write_text(json.dumps({**forged, "gen": 3, "checkpoints": []}))
    names = [pathlib.Path(c).name for c in committed_checkpoints(str(run))]
    assert names == ["checkpoint-00000001", "checkpoint-00000002"]
    assert not forget_missing(str(run))
    said = caplog.text
    assert "g99999999.json counts for nothing" in said and "g00000007.json counts for nothing" in said
    assert "g00000003.json counts for nothing" in said


def test_sampling_a_refused_checkpoint_is_one_line(checkpoint, tmp_path):
    """train.sample printed a 25-line traceback where infer printed one line."""
    import subprocess
    import sys

    from conftest import REPO

    d, *_ = checkpoint
    out = subprocess.run([sys.executable, "-m", "train.sample", "--checkpoint", str(d), "--tokens", "2"], cwd=REPO,
                         env={**os.environ, "STRATA_SIGNING_KEY": "another machine's key"}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [x for x in out.stderr.strip().splitlines() if "signed with key" in x]


def test_sweep_state_signed_without_a_key_is_refused_until_converted_with_its_old_secret(tmp_path):
    """Issue 57, 1: Tune's saved state (which `Tuner.restore` unpickles) had the same fallback to the Ray token.
    A list that names no key is refused, naming the command that re-signs it; that command checks every file
    against the old secret first, and signs nothing when one does not match."""
    import hashlib
    import hmac

    from tune.convert import main as resign
    from tune.trust import check_tune_state

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "tuner.pkl").write_bytes(pickle.dumps({"a": 1}))
    old = b"the ray token of the cluster that ran it"
    k = hmac.new(old, b"strata file signatures v1", hashlib.sha256).digest()
    sig = hmac.new(k, (sweep / "tuner.pkl").read_bytes(), hashlib.sha256).hexdigest()
    (sweep / "strata-signatures-tuner.json").write_text(json.dumps({"files": {"tuner.pkl": sig}}))
    with pytest.raises(Untrusted, match=r"without a key fingerprint.*python -m tune\.convert"):
        check_tune_state(str(sweep))
    (tmp_path / "wrong").write_text("another secret")
    with pytest.raises(SystemExit, match="does not verify under the secret"):
        resign([str(sweep), "--old-secret-file", str(tmp_path / "wrong")])
    with pytest.raises(Untrusted):
        check_tune_state(str(sweep))
    (tmp_path / "old").write_bytes(old)
    assert resign([str(sweep), "--old-secret-file", str(tmp_path / "old")]) == 0
    check_tune_state(str(sweep))
    (sweep / "tuner.pkl").write_bytes(pickle.dumps({"a": 2}))
    with pytest.raises(Untrusted, match="does not match its signature"):
        check_tune_state(str(sweep))


def test_a_trial_checkpoint_is_signed_for_its_trial(tmp_path):
    """A trial's checkpoint (its book of results and model state) was read as it was: a swapped pack.json changed
    a sweep's results. Its files are signed for the trial, and checked before a restore or the sweep's summary."""
    import shutil

    from tune.trust import sign_trial, trial_files

    d = tmp_path / "checkpoint_000001"
    d.mkdir()
    (d / "pack.json").write_text(json.dumps({"current": {"curve": [2.5]}, "restores": []}))
    torch.save({"step": torch.tensor(3)}, d / "state.pt")
    sign_trial(str(d), "trial_a")

    def read(directory):
        return lambda name: (directory / name).read_bytes()

    assert json.loads(trial_files(read(d), str(d), "trial_a")["pack.json"])["current"]["curve"] == [2.5]
    with pytest.raises(Untrusted, match="signed for trial 'trial_a', not 'trial_b'"):
        trial_files(read(d), str(d), "trial_b")
    swapped = tmp_path / "swapped"
    shutil.copytree(d, swapped)
    (swapped / "pack.json").write_text(json.dumps({"current": {"curve": [0.1]}, "restores": []}))
    with pytest.raises(Untrusted, match="pack.json does not match its signed SHA-256"):
        trial_files(read(swapped), str(swapped), "trial_a")
    (swapped / "signed.json").unlink()
    with pytest.raises(Untrusted, match="has no signed list"):
        trial_files(read(swapped), str(swapped), None)


def test_a_follower_passes_over_a_bad_newest_checkpoint_and_finds_later_good_ones(checkpoint, tmp_path):
    """Issue 57, 6: a bad newest checkpoint was retried forever by RUN@latest and hid every later good one. The
    follower skips what fails (naming it once) and moves to the newest checkpoint that verifies."""
    from infer.replicas import _newest
    from strata.data.storage import Storage

    d, cfg, model, opt = checkpoint
    meta = json.loads((d / "meta.json").read_text())
    root = tmp_path / "storage"
    run = root / "runs" / "r"
    for step in (1, 2):
        write_checkpoint(run / f"checkpoint-{step:08d}", model, step, {**meta, "step": step}, opt)
        _register(run, f"checkpoint-{step:08d}")
    write_checkpoint(run / "checkpoint-00000099", model, 99, {**meta, "step": 99}, opt)
    (run / "checkpoint-00000099" / "meta.json").write_text(json.dumps({**meta, "step": 99, "x": 1}))  # tampered
    _register(run, "checkpoint-00000099")
    spec, found, refused = _newest("r", Storage(str(root)), frozenset())
    assert spec == "r@2" and [n for n, _ in refused] == ["checkpoint-00000099"]
    assert "meta.json does not match its signed SHA-256" in refused[0][1]
    write_checkpoint(run / "checkpoint-00000003", model, 3, {**meta, "step": 3}, opt)  # a later good one
    _register(run, "checkpoint-00000003")
    assert _newest("r", Storage(str(root)), frozenset({"checkpoint-00000099"}))[:2] == (
        "r@3", str(run / "checkpoint-00000003"))


def test_ray_trains_record_names_nothing_outside_its_run(checkpoint, tmp_path, caplog):
    """Issue 57, 6: Ray Train's record was read without the containment check: `../r1/checkpoint-...` served r1's
    weights as r9's. Every name in it goes through strata.data.storage.inside and must be a checkpoint's."""
    from train.committed import committed_checkpoints

    d, cfg, model, opt = checkpoint
    meta = json.loads((d / "meta.json").read_text())
    runs = tmp_path / "runs"
    write_checkpoint(runs / "r1" / "checkpoint-00000007", model, 7, {**meta, "step": 7}, opt)
    _register(runs / "r1", "checkpoint-00000007")
    (runs / "r9").mkdir()
    for name in ("../r1/checkpoint-00000007", "/etc", "checkpoint-00000001/../../r1/checkpoint-00000007", "junk"):
        _register(runs / "r9", name)
    assert committed_checkpoints(str(runs / "r9")) == []
    assert "left out" in caplog.text
    assert [pathlib.Path(c).name for c in committed_checkpoints(str(runs / "r1"))] == ["checkpoint-00000007"]
