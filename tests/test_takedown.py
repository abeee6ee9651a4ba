"""Takedown requests (train/takedown.py): one request, every copy of its documents, across datasets and paths."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, make_corpus

from strata.data.storage import Storage


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """Dataset `alpha` from one corpus; dataset `beta` from another, into which alpha's files are copied
    under other names and another path."""
    from conftest import ensure_local_ray

    from pipelines.config import debug
    from pipelines.driver import run as preprocess

    ensure_local_ray()
    base = tmp_path_factory.mktemp("takedown")
    root, a, b = base / "storage", base / "a", base / "b" / "deep"
    make_corpus(str(a), docs=10, seed=5)
    make_corpus(str(b), docs=6, seed=6)
    copies = {}
    for i in range(10):
        shutil.copy(a / f"doc{i:03d}.txt", b / f"renamed{i}.txt")
        copies[str(a / f"doc{i:03d}.txt")] = str(b / f"renamed{i}.txt")
    # gamma: alpha's doc003 in other bytes but the same text up to case and spacing, and doc005 edited (its
    # last word changed), beside documents of its own.
    c = base / "c"
    make_corpus(str(c), docs=4, seed=7)
    (c / "upper3.txt").write_text("  " + (a / "doc003.txt").read_text().upper() + "\n")
    edited = (a / "doc005.txt").read_text().split()
    (c / "edited5.txt").write_text(" ".join([*edited[:-1], "changed."]))
    for i in range(3):  # documents of 140 bytes: two rows of the debug preset's 129 tokens at most
        (c / f"short{i}.txt").write_text((f"short document {i} " * 20)[:140])
    storage = Storage(str(root))
    for name, where in (("alpha", a), ("beta", b), ("gamma", c)):
        read = {"inputs": (str(where),), **({"license": "CC-BY-4.0", "origin": "public"} if name == "beta" else {})}
        preprocess(debug(name, read=read, pack={"validation_fraction": 0.2}), storage)
    return {"storage": storage, "original": str(a / "doc003.txt"), "copy": str(b / "renamed3.txt"), "copies": copies,
            "upper": str(c / "upper3.txt"), "edited": str(c / "edited5.txt"), "edited_from": str(a / "doc005.txt")}


def _takedown(root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "strata", "takedown", *args, "--storage", root], cwd=REPO,
                          env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.ray
def test_one_request_finds_every_copy_by_file_by_digest_and_by_record_id(two_datasets, tmp_path):
    from train.takedown import open_request, read

    storage, original, copy = two_datasets["storage"], two_datasets["original"], two_datasets["copy"]
    ids = sorted([f"{original}:0", f"{copy}:0", f"{two_datasets['upper']}:0"])
    by_file = open_request(storage, reason="erasure request 17", source=original)
    assert sorted(c["path"] for c in by_file["copies"]) == sorted([original, copy])
    assert {c["version"] for c in by_file["copies"]} == {"alpha@v0001", "beta@v0001"}
    assert sorted(d["doc_id"] for d in by_file["documents"]) == ids
    assert [v["ref"] for v in by_file["versions"]] == ["alpha@v0001", "beta@v0001", "gamma@v0001"]
    assert read(storage, by_file["id"]) == by_file  # read back, its signature verified

    digest = hashlib.sha256(Path(original).read_bytes()).hexdigest()
    by_digest = open_request(storage, reason="copyright claim", sha256=digest.upper())
    assert sorted(d["doc_id"] for d in by_digest["documents"]) == ids and by_digest["id"] != by_file["id"]
    by_record = open_request(storage, reason="the same record, asked by id", doc_ids=[f"{original}:0"])
    assert sorted(d["doc_id"] for d in by_record["documents"]) == ids  # its copy under another path too

    assert by_file["same_text"] == [f"{two_datasets['upper']}:0"]  # other bytes, the same text: found by exact key
    assert f"{two_datasets['upper']}:0" in {d["doc_id"] for d in by_file["documents"]}

    nothing = tmp_path / "unknown.txt"
    nothing.write_text("never ingested anywhere")
    none = open_request(storage, reason="not ours", source=str(nothing))
    assert none["copies"] == [] and none["documents"] == [] and none["versions"] == []


@pytest.mark.ray
def test_near_copies_are_found_with_near_and_decoded_text_is_the_text(two_datasets):
    from pipelines.clean import CleanConfig, normalize
    from strata.data.dataset import resolve
    from strata.data.lineage import document_tokens, find
    from strata.data.tokenizer import from_info
    from train.takedown import open_request

    storage, edited, source = two_datasets["storage"], f"{two_datasets['edited']}:0", two_datasets["edited_from"]
    plain = open_request(storage, reason="exact copies only", source=source)
    assert edited not in {d["doc_id"] for d in plain["documents"]} and plain["near"] == []
    near = open_request(storage, reason="and edited copies", source=source, near=True)
    assert near["near"] == [edited] and edited in {d["doc_id"] for d in near["documents"]}

    # With the input file gone, a document's text comes from its rows: exact for one of up to two rows, or of
    # three that starts inside its first (lineage keeps which span is last; one that starts inside a row is
    # first).
    v = resolve(storage, "gamma@v0001")
    rows = [r for h in find(storage, source=f"{os.path.dirname(two_datasets['edited'])}/*")["versions"]
            if h["ref"] == v.ref for r in h["rows"]]
    tokens = document_tokens(v, rows)
    tok = from_info(v.manifest.tokenizer, v.tokenizer_definition())
    spans = {d: [r for r in rows if r["doc_id"] == d] for d in tokens}
    short = [d for d, s in spans.items() if (len(s) <= 2 or len(s) == 3 and sum(r["start"] > 0 for r in s[:-1]) == 1)
             and tok.eot_id in tokens[d] and d.endswith(".txt:0")]  # a whole file is one document
    assert short
    for d in short:
        text = normalize(Path(d.rpartition(":")[0]).read_text(), CleanConfig())
        assert tok.decode([t for t in tokens[d].tolist() if t != tok.eot_id]) == text


@pytest.mark.ray
def test_the_command_shows_the_timeline_and_refuses_a_changed_request(two_datasets):
    root, original = two_datasets["storage"].root, two_datasets["original"]
    out = _takedown(root, "open", "--source", original, "--reason", "erasure request 18", "--json")
    assert out.returncode == 0, out.stderr
    request = json.loads(out.stdout)
    shown = _takedown(root, "status", request["id"])
    assert shown.returncode == 0, shown.stderr
    assert f"takedown {request['id']}: erasure request 18" in shown.stdout and "received" in shown.stdout
    assert "alpha@v0001, beta@v0001" in shown.stdout
    listed = _takedown(root, "list")
    assert request["id"] in listed.stdout
    assert json.loads(_takedown(root, "status", request["id"], "--json").stdout) == request

    path = os.path.join(root, "takedowns", f"{request['id']}.json")
    with open(path) as f:
        doc = json.load(f)
    doc["request"]["reason"] = "something else"
    with open(path, "w") as f:
        json.dump(doc, f)
    changed = _takedown(root, "status", request["id"])
    assert changed.returncode == 1 and "does not match its signature" in changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1
    missing = _takedown(root, "open", "--reason", "no document named")
    assert missing.returncode == 1 and "--source PATH, --sha256 HEX or --doc-ids FILE" in missing.stderr
    bad = _takedown(root, "open", "--sha256", "abc", "--reason", "x")
    assert bad.returncode == 1 and "64 hex digits" in bad.stderr


@pytest.mark.ray
@pytest.mark.slow("trains a run, forgets in two datasets, retrains without the documents")
def test_a_takedown_from_request_to_retrained_model(two_datasets, monkeypatch, capsys):
    from conftest import train_run

    from infer.model import check as check_model
    from strata.data.dataset import resolve
    from train import taint
    from train.config import TrainConfig
    from train.lineage import documents, step_rows
    from train.model import preset
    from train.pretrained import load as init_from
    from train.sample import main as sample
    from train.takedown import apply, delete_tainted, open_request, plan, read, retrain

    storage = two_datasets["storage"]
    # A file alpha holds (dedup kept it, not its planted duplicate) whose copy in beta has rows in its train
    # split: the run below trains on beta, over all of its rows. (Not doc003: gamma holds its text too.)
    pairs = sorted((o, c) for o, c in two_datasets["copies"].items() if o != two_datasets["original"])
    rows = [(h["dataset"], r) for h in documents(storage, doc_ids=[f"{x}:0" for p in pairs for x in p])["versions"]
            for r in h["rows"]]
    kept = {r["doc_id"] for d, r in rows if d == "alpha"}
    trained = {r["doc_id"] for d, r in rows if d == "beta" and r["split"] == "train"}
    original, copy = next((o, c) for o, c in pairs if f"{o}:0" in kept and f"{c}:0" in trained)
    monkeypatch.setenv("STRATA_STORAGE", storage.root)
    beta = resolve(storage, "beta@v0001")
    steps = -(-beta.rows("train") // 4) + 1  # one pass and a step
    tcfg = TrainConfig(max_steps=steps, batch_size=4, warmup_steps=1, log_every=1, eval_every=100, eval_batches=1,
                       checkpoint_every=2, checkpoint_every_s=0, keep_checkpoints=steps)
    train_run(preset("debug", n_layer=1, n_embd=32, n_head=2), tcfg, dataset="beta@v0001", run_name="copier",
              storage=storage, workers=1, use_gpu=False)
    request = open_request(storage, reason="erasure request 19", source=original)
    before = plan(storage, request)
    assert [(d["dataset"], d["done"], d["command"]) for d in before["datasets"]] == [
        ("alpha", False, f"strata takedown apply {request['id']} --dataset alpha"),
        ("beta", False, f"strata takedown apply {request['id']} --dataset beta")]
    (run,) = [r for r in before["runs"] if r["run"] == "copier"]
    learned = documents(storage, doc_ids=[f"{copy}:0"])["runs"]
    first = run["first_step"]
    assert first and first == next(r["first_step"] for r in learned if r["run"] == "copier")
    made = sorted({*range(2, steps + 1, 2), steps})
    assert [c["step"] for c in run["checkpoints"]] == [s for s in made if s >= first]

    done = apply(storage, request["id"])
    assert sorted(done["applied"]) == ["alpha@v0002", "beta@v0002"]
    assert done["marked"] == [{"run": "copier", "from_step": first}]
    for name in ("alpha", "beta"):
        assert resolve(storage, name).manifest.forget["reason"] == f"takedown {request['id']}: erasure request 19"
    assert [e["event"] for e in read(storage, request["id"])["events"]] == ["received", "applied", "applied", "marked"]
    after = plan(storage, request)
    assert all(d["done"] and d["command"] is None for d in after["datasets"])
    held = {h["ref"] for h in documents(storage, doc_ids=[f"{original}:0", f"{copy}:0"])["versions"]}
    assert held == {"alpha@v0001", "beta@v0001"}  # only the versions before the takedown

    # Every way the tainted weights leave the run refuses, naming the request; --allow-tainted is recorded.
    with pytest.raises(SystemExit, match=f"taken down by request {request['id']} .erasure request 19. from step {first}"):
        sample(["--run", "copier", "--tokens", "2"])
    with pytest.raises(taint.Tainted, match=f"--model copier: copier@{steps} learned from documents taken down"):
        check_model("copier", storage)
    with pytest.raises(taint.Tainted, match="retrain with `strata takedown retrain"):
        init_from("copier", storage)
    clean = max(s for s in [0, *made] if s < first)
    if clean:
        assert check_model(f"copier@{clean}", storage) == f"copier@{clean}"  # before the documents: clean
    assert check_model("copier", storage, allow_tainted=True) == f"copier@{steps}"
    (use,) = taint.allowances(storage.run("copier"))
    assert use["what"] == "--model copier" and use["step"] == steps and use["requests"] == [request["id"]]

    # Retraining: from the newest clean checkpoint, on the newest (clean) versions; its data order never
    # holds the forgotten documents.
    (plan_,) = retrain(storage, request["id"])
    assert plan_["init_from"] == (clean or None) and plan_["dataset"] == "beta"
    assert ("--init-from" in plan_["command"]) == bool(clean)
    capsys.readouterr()
    retrain(storage, request["id"], start=True)
    new = plan_["new_run"]
    forgotten = {d["doc_id"] for d in request["documents"]}
    for step in range(1, int(plan_["command"][plan_["command"].index("--max-steps") + 1]) + 1):
        for rank in step_rows(storage, new, step)["ranks"]:
            assert rank["rows"] and not forgotten & {d["doc_id"] for r in rank["rows"] for d in r["documents"]}
    assert check_model(new, storage).startswith(f"{new}@")  # not tainted

    # The training-content summary: beta's sources, as recorded, under the template's sections; the retrained
    # model's lists the takedown its data honored.
    from train.summary import summary

    first_summary = summary(storage, "copier")
    (source,) = first_summary["2 Data sources"]["2.1 Publicly available datasets"]
    assert (source["dataset"], source["version"], source["license"]) == ("beta", "v0001", "CC-BY-4.0")
    assert (source["files"], source["bytes"]) == (len(beta.manifest.inputs), sum(f["size"] for f in beta.manifest.inputs))
    sizes = first_summary["1 General information"]["1.3 Modalities and size"]
    assert sizes["training_data_tokens"] == beta.manifest.totals["packed_tokens"] and sizes["size_band"].startswith("less")
    assert first_summary["3 Data processing"]["3.1 Opt-outs and takedowns honored"] == []
    honored = summary(storage, new)["3 Data processing"]["3.1 Opt-outs and takedowns honored"]
    assert honored == [{"dataset": "beta", "version": "v0002", "reason": f"takedown {request['id']}: erasure request 19",
                        "documents": len([d for d in request["documents"] if "/b/" in d["doc_id"]])}]
    shown = subprocess.run([sys.executable, "-m", "strata", "lineage", "summary", new, "--storage", storage.root],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "## 2. Data sources" in shown.stdout and "license: CC-BY-4.0" in shown.stdout

    gone = delete_tainted(storage, request["id"])["deleted"]
    assert sorted(gone) == sorted(c["path"] for c in run["checkpoints"])
    assert [e["event"] for e in read(storage, request["id"])["events"]][-2:] == ["retrained", "deleted"]
    if clean:  # what is left of the run is what it learned before
        assert check_model("copier", storage) == f"copier@{clean}"
    from train.takedown import TakedownError

    with pytest.raises(TakedownError, match="holds none of takedown"):
        apply(storage, request["id"], dataset="alpha")
    from train.takedown import report

    forged = os.path.join(storage.root, "takedowns", "td-forged.json")
    with open(os.path.join(storage.root, "takedowns", f"{request['id']}.json")) as f:
        doc = json.load(f)
    with open(forged, "w") as f:  # honored, it says, and signed by no key of ours
        json.dump({**doc, "request": {**doc["request"], "id": "td-forged"}}, f)
    rows = {r["id"]: r for r in report(storage, time.strftime("%Y-%m-%d", time.gmtime(request["received_at"])))}
    assert "does not match its signature" in rows["td-forged"]["refused"]
    events = [e for e in read(storage, request["id"])["events"] if e["event"] in ("received", "applied")]
    assert rows[request["id"]]["hours_to_honor"] == round((events[-1]["at"] - events[0]["at"]) / 3600, 3)
    assert sorted(rows[request["id"]]["commits"]) == ["alpha@v0002", "beta@v0002"]
    assert [r for r in report(storage, "2999-01-01") if "refused" not in r] == []


@pytest.mark.ray
@pytest.mark.s3
def test_on_s3_a_request_finds_copies_near_copies_and_is_applied_and_marks_runs(s3_root, tmp_path):
    from conftest import ensure_local_ray

    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from strata.data.dataset import resolve
    from train import taint
    from train.takedown import apply, open_request, plan, read

    ensure_local_ray()
    storage = Storage(s3_root)
    a, b = tmp_path / "a", tmp_path / "b"
    make_corpus(str(a), docs=6, seed=11)
    make_corpus(str(b), docs=3, seed=12)
    shutil.copy(a / "doc002.txt", b / "copy.txt")
    words = (a / "doc004.txt").read_text().split()
    (b / "edited.txt").write_text(" ".join([*words[:-1], "changed."]))
    for name, where in (("alpha", a), ("beta", b)):
        preprocess(debug(name, read={"inputs": (str(where),)}, pack={"validation_fraction": 0.0}), storage)  # all rows trained on
    copied = open_request(storage, reason="erasure on s3", source=str(a / "doc002.txt"))
    assert sorted(c["path"] for c in copied["copies"]) == sorted([str(a / "doc002.txt"), str(b / "copy.txt")])
    edited = open_request(storage, reason="edited copy on s3", source=str(a / "doc004.txt"), near=True)
    assert edited["near"] == [f"{b / 'edited.txt'}:0"]
    assert read(storage, copied["id"]) == copied
    assert [d["dataset"] for d in plan(storage, copied)["datasets"]] == ["alpha", "beta"]
    # A run on beta, in the object store: marked by apply, its summary and its retraining read from there.
    from conftest import train_run

    from train.config import TrainConfig
    from train.model import preset
    from train.summary import summary
    from train.takedown import retraining

    beta = resolve(storage, "beta")
    tcfg = TrainConfig(max_steps=-(-beta.rows("train") // 4) + 1, batch_size=4, warmup_steps=1, eval_every=100,
                       eval_batches=1, checkpoint_every_s=0)
    train_run(preset("debug", n_layer=1, n_embd=32, n_head=2), tcfg, dataset=beta.ref, run_name="s3-run",
              storage=storage, workers=1, use_gpu=False)
    done = apply(storage, copied["id"])
    assert sorted(done["applied"]) == ["alpha@v0002", "beta@v0002"]
    assert [m["run"] for m in done["marked"]] == ["s3-run"]
    assert resolve(storage, "beta").manifest.forget["reason"] == f"takedown {copied['id']}: erasure on s3"
    (source,) = summary(storage, "s3-run")["2 Data sources"]["2.6 Other sources of data"]
    assert (source["dataset"], source["files"]) == ("beta", len(beta.manifest.inputs))
    (again,) = retraining(storage, read(storage, copied["id"]))
    assert again["run"] == "s3-run" and again["dataset"] == "beta" and "--max-steps" in again["command"]

    run_dir = storage.run("somebody")  # a run's marks and recorded uses, in the object store
    taint.mark(run_dir, copied, 3)
    assert taint.check(run_dir, 2, "sampling") == []
    with pytest.raises(taint.Tainted, match=f"somebody@3 learned from documents taken down by request {copied['id']}"):
        taint.check(run_dir, 3, "sampling")
    assert [m["request"] for m in taint.check(run_dir, 4, "exporting", allow=True)] == [copied["id"]]
    assert [u["what"] for u in taint.allowances(run_dir)] == ["exporting"]


def test_requests_opened_in_the_same_second_get_ids_of_their_own(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from train.takedown import _create, read

    storage, at = Storage(str(tmp_path / "root")), time.time()
    with ThreadPoolExecutor(8) as pool:
        made = list(pool.map(lambda i: _create(storage, {"id": "", "reason": f"request {i}", "received_at": at,
                                                         "events": []}), range(8)))
    assert len({r["id"] for r in made}) == 8
    assert all(read(storage, r["id"]) == r for r in made)  # each file is its own request, whole
