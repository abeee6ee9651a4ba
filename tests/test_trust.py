"""The third red-team pass (issue 44): metadata read back from storage never deletes, writes or loops
outside what it may, and junk in storage is one line naming the file (no Ray)."""

import json
import os
import subprocess
import sys
import threading

import pytest
from conftest import REPO, edit_manifest
from test_dataset_contract import _stage

from strata.data.commit import commit, delete_version
from strata.data.dataset import DatasetError, history, list_versions, resolve
from strata.data.storage import PathRefused, Storage, inside


def _edit_log(dataset_dir: str, number: int, edit) -> None:
    """Rewrite every action of Delta commit `number` with `edit(action)` (a crafted log entry)."""
    entry = os.path.join(dataset_dir, "_delta_log", f"{number:020d}.json")
    with open(entry) as f:
        actions = [json.loads(line) for line in f if line.strip()]
    with open(entry, "w") as f:
        f.write("".join(json.dumps(edit(a)) + "\n" for a in actions))


def _files(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names}


def test_one_containment_check_refuses_every_way_out(tmp_path):
    base = tmp_path / "base"
    (base / "ok").mkdir(parents=True)
    os.symlink(tmp_path, base / "link")
    assert inside(str(base), "ok/x.parquet", "t") == str(base / "ok" / "x.parquet")
    for bad in ("", ".", "..", "../x", "/etc/passwd", "ok/../../x", "ok/../x", "s3://b/k", "a\\b", "link/x",
                "ok//x", None, 7, ["ok"]):
        with pytest.raises(PathRefused, match="refused"):
            inside(str(base), bad, "a crafted manifest")


@pytest.mark.parametrize("crafted", ["{tag}/../v2.parquet", "_delta_log/v2.parquet", "data/{other}/train-0.parquet"])
def test_a_delete_removes_only_its_own_files_whatever_the_log_names(tmp_path, crafted):
    """M2: the add path of the newest version, crafted; nothing may be deleted, the refusal names it."""
    storage = Storage(str(tmp_path))
    first = commit(storage, "ds", *_stage(storage, "ds"))
    tag, fields = _stage(storage, "ds")
    commit(storage, "ds", tag, fields)
    root = storage.dataset("ds")
    other = first.manifest.files.split("/", 1)[1]
    path = crafted.format(tag=f"data/{tag}", other=other)
    _edit_log(root, 2, lambda a: {"add": {**a["add"], "path": path}} if "add" in a else a)
    before = _files(root)
    with pytest.raises(DatasetError, match="refused") as e:
        delete_version(storage, "ds", "v0002")
    assert repr(path)[1:-1] in str(e.value) or path in str(e.value)
    assert _files(root) - {f for f in _files(root) if f.startswith("_lease")} >= before - {
        f for f in before if f.startswith("_lease")}
    assert list_versions(storage, "ds") == ["v0001", "v0002"]


def test_a_delete_deletes_no_directory_a_manifest_names(tmp_path):
    storage = Storage(str(tmp_path))
    first = commit(storage, "ds", *_stage(storage, "ds"))
    commit(storage, "ds", *_stage(storage, "ds"))
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("not strata's")
    edit_manifest(storage.dataset("ds"), 2, lambda m: m.update(files="_strata/../../../../victim"))
    with pytest.raises(DatasetError, match="not _strata/<run>"):
        delete_version(storage, "ds", "v0002")
    edit_manifest(storage.dataset("ds"), 2, lambda m: m.update(files=first.manifest.files))  # another run's
    with pytest.raises(DatasetError, match="does not say this version committed run"):
        delete_version(storage, "ds", "v0002")
    assert (victim / "keep").read_text() == "not strata's" and os.path.exists(first.file(first.added[0].path))


def test_a_parent_chain_that_loops_is_an_error_naming_the_versions(tmp_path):
    """M3: a manifest whose parent is itself made history() loop forever."""
    storage = Storage(str(tmp_path))
    commit(storage, "ds", *_stage(storage, "ds"))
    commit(storage, "ds", *_stage(storage, "ds"))
    for parent in (3, "v0009", "v00x1", "v0002"):  # the self-loop last: the CLI below meets it
        edit_manifest(storage.dataset("ds"), 2, lambda m, p=parent: m.update(parent=p))
        done: list = []
        t = threading.Thread(target=lambda d=done: d.append(_raises(lambda: history(storage, "ds"))), daemon=True)
        t.start()
        t.join(30)
        assert done and isinstance(done[0], DatasetError), parent
        said = str(done[0])
        assert ("version v0002 names" in said and "not an earlier version" in said) or (
            parent == 3 and "ds@v0002: its manifest is not strata's (parent is int" in said), said
    out = subprocess.run([sys.executable, "-m", "pipelines.datasets", "list", "ds"], cwd=REPO, timeout=120,
                         env={**os.environ, "STRATA_STORAGE": str(tmp_path)}, capture_output=True, text=True)
    assert out.returncode == 1 and "not an earlier version" in out.stderr and "Traceback" not in out.stderr


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test looks at what it was
        return e
    return None


def test_a_legacy_manifest_cannot_empty_a_folder_outside_the_root(tmp_path):
    """M1: `strata migrate` trusted the legacy manifest's files field."""
    from test_delta import _legacy_dataset

    storage = Storage(str(tmp_path / "root"))
    root = storage.dataset("old")
    _legacy_dataset(root)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("not strata's")
    path = os.path.join(root, "v0002", "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m["files"] = "data/../../../../victim"
    with open(path, "w") as f:
        json.dump(m, f)
    before = _files(root)
    out = subprocess.run([sys.executable, "-m", "strata", "migrate", "old"], cwd=REPO, timeout=120,
                         env={**os.environ, "STRATA_STORAGE": storage.root}, capture_output=True, text=True)
    assert out.returncode == 1 and "v0002/manifest.json" in out.stderr and "refused" in out.stderr, out.stderr
    assert (victim / "precious").read_text() == "not strata's" and _files(root) >= before


def _record(**over) -> dict:
    return {"kind": "train", "name": "r", "outputs": "/nowhere", "started_at": 1.0, "ended_at": 2.0, "seconds": 1.0,
            "code_version": "x", "libraries": {}, "by_type": {}, "node_hours": 0.0, "cost": None, "currency": None,
            "prices_as_of": None, "nodes": [], "figures": {}, "config": {},
            "utilization": {"cpu_busy": None, "gpu_busy": None, "mfu": None}, **over}


def test_records_are_checked_and_one_bad_record_is_an_error_row(tmp_path):
    """M4 (a record's kind in the report's file name), m5 (a record that is not JSON broke every listing),
    m13 (generate and eval records listed as trials)."""
    from strata.data.storage import write_json_atomic

    storage = Storage(str(tmp_path / "root"))
    records = storage.records()
    write_json_atomic(os.path.join(records, "a.json"), _record(kind="../../../../victim/k", name="evil"))
    write_json_atomic(os.path.join(records, "b.json"), _record(kind="generate", name="gen",
                                                               figures={"prompts": 3, "tokens": 96}))
    write_json_atomic(os.path.join(records, "c.json"), _record(kind="eval", name="ev", started_at=3.0,
                                                               figures={"items": 20, "acc": 0.55}))
    write_json_atomic(os.path.join(records, "d.json"), _record(name="typed", seconds="soon"))
    os.makedirs(records, exist_ok=True)
    with open(os.path.join(records, "e.json"), "wb") as f:
        f.write(b"\xff not json")
    env = {**os.environ, "STRATA_STORAGE": storage.root}
    out = subprocess.run([sys.executable, "-m", "strata", "runs"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 prompts, 96 tokens generated" in out.stdout and "20 items, acc 0.5500" in out.stdout
    assert "trials" not in out.stdout
    errors = [line for line in out.stdout.splitlines() if line.startswith("error")]
    assert len(errors) == 3 and any("a.json" in e and "kind" in e for e in errors)
    assert any("d.json" in e and "seconds" in e for e in errors) and any("e.json" in e for e in errors)
    rep = subprocess.run([sys.executable, "-m", "strata", "report", "evil"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 1 and "no run named 'evil'" in rep.stderr
    assert not (tmp_path / "victim").exists()


def test_generate_output_never_lands_in_what_strata_manages(tmp_path):
    """m6: `infer generate --output` overwrote any file, a Delta log entry included; and m8: a non-UTF-8
    prompts file is named."""
    storage = Storage(str(tmp_path / "root"))
    commit(storage, "ds", *_stage(storage, "ds"))
    entry = os.path.join(storage.dataset("ds"), "_delta_log", f"{1:020d}.json")
    with open(entry, "rb") as f:
        before = f.read()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    env = {**os.environ, "STRATA_STORAGE": storage.root}
    out = subprocess.run([sys.executable, "-m", "infer", "generate", "--model", "nothing", "--prompts", str(prompts),
                          "--output", entry], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "which strata manages" in out.stderr and entry in out.stderr
    with open(entry, "rb") as f:
        assert f.read() == before
    prompts.write_bytes(b'{"prompt": "caf\xe9"}\n')
    out = subprocess.run([sys.executable, "-m", "infer", "generate", "--model", "nothing", "--prompts", str(prompts)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and f"--prompts {prompts}: not UTF-8 text" in out.stderr


def test_another_writer_shortening_log_retention_deletes_no_version(tmp_path, caplog):
    """M7: delta.logRetentionDuration set to 0 by another writer, then strata's next log checkpoint deleted
    every earlier entry, and the versions' manifests with them."""
    from deltalake import DeltaTable

    from strata.data.commit import SAFETY
    from strata.data.dataset import CHECKPOINT_INTERVAL

    storage = Storage(str(tmp_path))
    commit(storage, "ds", *_stage(storage, "ds"))
    root = storage.dataset("ds")
    DeltaTable(root).alter.set_table_properties({"delta.logRetentionDuration": "interval 0 seconds",
                                                 "delta.enableExpiredLogCleanup": "true"})
    for _ in range(CHECKPOINT_INTERVAL + 1):
        commit(storage, "ds", *_stage(storage, "ds"))
    log = sorted(n for n in os.listdir(os.path.join(root, "_delta_log")) if n.endswith(".json"))
    assert log[0] == f"{0:020d}.json" and len(log) >= CHECKPOINT_INTERVAL + 3
    assert any(n.endswith(".checkpoint.parquet") for n in os.listdir(os.path.join(root, "_delta_log")))
    assert len(list_versions(storage, "ds")) == CHECKPOINT_INTERVAL + 2
    conf = DeltaTable(root).metadata().configuration
    assert all(conf[k] == v for k, v in SAFETY.items())
    assert "another writer changed delta.logRetentionDuration" in caplog.text
    assert resolve(storage, "ds@v0001").manifest.version == "v0001"


def test_junk_in_storage_is_one_line_naming_it_and_the_other_datasets_still_list(tmp_path):
    """m5: wrong types in a manifest, a damaged log, a name with `..`: exit 1 with one line, never 70."""
    storage = Storage(str(tmp_path))
    commit(storage, "good", *_stage(storage, "good"))
    commit(storage, "typed", *_stage(storage, "typed"))
    edit_manifest(storage.dataset("typed"), 1, lambda m: m.update(seq_len="8", documents={"read": [1]}))
    junk = os.path.join(storage.dataset("junk"), "_delta_log")
    os.makedirs(junk)
    with open(os.path.join(junk, f"{0:020d}.json"), "w") as f:
        f.write("{junk\n")
    env = {**os.environ, "STRATA_STORAGE": str(tmp_path)}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "pipelines.datasets", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    listing = cli("list")
    assert listing.returncode == 0, listing.stderr
    rows = dict(line.split(None, 1) for line in listing.stdout.splitlines())
    assert rows["good"].startswith("1 version(s)") and "does not read" in rows["junk"]
    assert "typed@v0001: its manifest is not strata's (read is list, not int)" in rows["typed"]
    for ref, said in (("../../etc", "invalid dataset name '../../etc'"), ("junk", "does not read"),
                      ("typed", "its manifest is not strata's")):
        out = cli("show", ref)
        assert out.returncode == 1 and said in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_crafted_model_folder_is_one_line_before_anything_is_allocated(exported_model, tmp_path):
    """m5: a model folder whose config says n_layer 1e9, or whose weights are not safetensors."""
    import shutil

    from train.pretrained import load

    storage = Storage(str(tmp_path / "root"))
    for edit, said in (({"n_layer": 1e9}, "n_layer is 1000000000.0, not a positive integer"),
                       ({"n_layer": 10**9}, "has no tensor 'h.999999999.ln_1.weight'"),
                       ({"vocab_size": 7}, "wte.weight is (320, 64), not the (7, 64)")):
        d = tmp_path / f"m{len(os.listdir(tmp_path))}"
        shutil.copytree(exported_model, d)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=re_escape(said)):
            load(str(d), storage)
    d = tmp_path / "garbage"
    shutil.copytree(exported_model, d)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.safetensors is not a safetensors file"):
        load(str(d), storage)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "x"}\n')
    out = subprocess.run([sys.executable, "-m", "infer", "generate", "--model", str(d), "--prompts", str(prompts)],
                         cwd=REPO, env={**os.environ, "STRATA_STORAGE": storage.root}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "is not a safetensors file" in out.stderr and "Traceback" not in out.stderr


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


@pytest.mark.parametrize("flags, said", [
    (["--languages", "en,xx"], "--languages: xx is not a language the detector knows"),
    (["--languages", "eng"], "did you mean en"),
    (["--seq-len", "99999999999"], "--seq-len 99999999999: a row holds seq_len + 1 token ids"),
    (["--seq-len", "9000000", "--shard-bytes", "1000000"], "larger than --shard-bytes"),
])
def test_flags_are_checked_before_anything_runs(tmp_path, flags, said):
    """m8: --languages xx was accepted and filtered everything; --seq-len 99999999999 failed late."""
    from pipelines.clean import CleanConfig

    CleanConfig(languages="en,de,fr")  # codes the detector knows
    out = subprocess.run([sys.executable, "-m", "pipelines.preprocess", "--input", str(tmp_path), "--dataset", "x",
                          *flags], cwd=REPO, env={**os.environ, "STRATA_STORAGE": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "datasets")
