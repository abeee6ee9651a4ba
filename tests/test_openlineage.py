"""OpenLineage run events (strata/accounting/openlineage.py): each run's START and COMPLETE (or FAIL) to a JSON-lines file
under the run and to a receiver on loopback, as Marquez takes them; every event is checked with the
OpenLineage project's own Python client (openlineage-python), whose model is generated from the spec's JSON
schema: the event rebuilt in that model and written out by the client is the event strata wrote."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import make_corpus, train_run

from strata.data.storage import Storage, join, read_bytes


def _normal(x):
    """Without the empty facet maps and lists either side may leave out."""
    if isinstance(x, dict):
        return {k: _normal(v) for k, v in x.items() if v not in ({}, [], None)}
    if isinstance(x, list):
        return [_normal(v) for v in x]
    return x


def check_event(event: dict) -> None:
    """Rebuild `event` in openlineage-python's generated model (its validators check the run id, the time,
    the event type, the URIs; a missing required field cannot be built), and compare the client's JSON of it
    with ours: the facets' schema URLs are the client's own."""
    from openlineage.client import event_v2 as ol
    from openlineage.client.generated import (
        dataset_version_dataset,
        error_message_run,
        job_type_job,
        processing_engine_run,
    )
    from openlineage.client.serde import Serde

    kinds = {"processing_engine": processing_engine_run.ProcessingEngineRunFacet,
             "errorMessage": error_message_run.ErrorMessageRunFacet, "jobType": job_type_job.JobTypeJobFacet,
             "version": dataset_version_dataset.DatasetVersionDatasetFacet}

    def facets(given: dict) -> dict:
        return {k: kinds[k](producer=f["_producer"], **{n: v for n, v in f.items() if not n.startswith("_")})
                for k, f in given.items()}

    def datasets(given: list, cls) -> list:
        return [cls(namespace=d["namespace"], name=d["name"], facets=facets(d.get("facets", {}))) for d in given]

    built = ol.RunEvent(eventType=ol.RunState(event["eventType"]), eventTime=event["eventTime"],
                        producer=event["producer"],
                        run=ol.Run(runId=event["run"]["runId"], facets=facets(event["run"]["facets"])),
                        job=ol.Job(namespace=event["job"]["namespace"], name=event["job"]["name"],
                                   facets=facets(event["job"]["facets"])),
                        inputs=datasets(event["inputs"], ol.InputDataset),
                        outputs=datasets(event["outputs"], ol.OutputDataset))
    assert _normal(json.loads(Serde.to_json(built))) == _normal(event)


class Receiver(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).got.append((self.path, self.headers["Content-Type"], json.loads(body)))
        self.send_response(201)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def receiver():
    Receiver.got = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", Receiver.got
    server.shutdown()
    server.server_close()


def _events(path: str) -> list[dict]:
    return [json.loads(line) for line in read_bytes(path).decode().splitlines()]


@pytest.mark.ray
def test_preprocess_train_and_score_emit_run_events_to_the_file_and_the_receiver(local_ray, any_root, tmp_path,
                                                                                  receiver, monkeypatch):
    from infer.driver import ScoreConfig, score
    from pipelines.config import debug
    from pipelines.driver import run as preprocess
    from strata.accounting.openlineage import URL_ENV
    from train.config import TrainConfig
    from train.model import preset

    url, got = receiver
    monkeypatch.setenv(URL_ENV, url)
    monkeypatch.setenv("STRATA_STORAGE", any_root)
    storage = Storage(any_root)
    make_corpus(str(tmp_path / "in"), docs=12, seed=4)
    out = preprocess(debug("lineaged", read={"inputs": (str(tmp_path / "in"),)}), storage)
    tcfg = TrainConfig(max_steps=2, batch_size=2, warmup_steps=1, eval_every=100, eval_batches=1, checkpoint_every_s=0)
    train_run(preset("debug", n_layer=1, n_embd=32, n_head=2), tcfg, dataset=f"lineaged@{out['version']}",
              run_name="lineage-run", storage=storage, workers=1, use_gpu=False)
    score("lineage-run", [str(tmp_path / "in")], ScoreConfig(actors=1, docs_per_batch=16), storage, "lineage-scores")

    files = {"preprocess": join(storage.dataset("lineaged"), "_strata", "openlineage"),
             "train": storage.run("lineage-run"), "score": storage.scores("lineage-scores")}
    from strata.data.storage import list_dir

    (name,) = [n for n, d in list_dir(files["preprocess"]) if not d]
    files["preprocess"] = join(files["preprocess"], name)
    files["train"], files["score"] = join(files["train"], "openlineage.jsonl"), join(files["score"], "openlineage.jsonl")
    sent = [e for path, kind, e in got if path == "/api/v1/lineage" and kind == "application/json"]
    assert len(sent) == len(got) == 6
    for kind, path in files.items():
        events = _events(path)
        assert [e["eventType"] for e in events] == ["START", "COMPLETE"], kind
        assert len({e["run"]["runId"] for e in events}) == 1 and events[0]["job"]["name"].startswith(f"{kind}.")
        assert all(e in sent for e in events)  # each went to the receiver too
        for e in events:
            check_event(e)
    pre, train, scored = (_events(files[k])[-1] for k in ("preprocess", "train", "score"))
    dataset_ns = "file" if "://" not in any_root else any_root.partition("://")[0] + "://" + any_root.split("/")[2]
    assert [(d["namespace"], d["facets"]["version"]["datasetVersion"]) for d in pre["outputs"]] == [
        (dataset_ns, out["version"])]
    assert pre["inputs"][0]["name"] == str(tmp_path / "in")
    assert train["inputs"] == pre["outputs"]  # the version preprocess wrote is the one training read
    assert train["outputs"][0]["name"] == scored["inputs"][0]["name"]  # the run's model is what score read


def test_a_failed_run_says_so_and_a_receiver_that_is_down_costs_a_warning(tmp_path, monkeypatch, caplog):
    from strata.accounting.openlineage import URL_ENV, dataset
    from strata.commands.shell import Job, StrataError

    monkeypatch.setenv(URL_ENV, "http://127.0.0.1:9")  # nothing listens there
    storage = Storage(str(tmp_path / "root"))
    holds = str(tmp_path / "root" / "scores" / "broken")
    with pytest.raises(StrataError, match="the work failed"), \
            Job("score", "broken", storage, holds=holds, what="scores broken") as job:
        job.lineage([dataset(str(tmp_path / "in.txt"))], [dataset(holds)])
        raise StrataError("the work failed")
    events = _events(join(holds, "openlineage.jsonl"))
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    assert events[1]["run"]["facets"]["errorMessage"]["message"] == "StrataError: the work failed"
    for e in events:
        check_event(e)
    assert sum("not delivered" in r.message for r in caplog.records) == 2
