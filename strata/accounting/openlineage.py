"""OpenLineage run events (spec 2-0-2) for every run a `Job` holds: preprocess, train, score, eval, serve.

A run says what it reads and writes once it knows (`Job.lineage(inputs, outputs)`): that is its START
event; its end is COMPLETE, or FAIL with the error's message (an interrupted run's too). Each event goes to
the run's own JSON-lines file (`openlineage.jsonl` in the directory the command names, written whole at
each event, so a reader sees the events up to the last one), and, with `--openlineage-url URL` (or
$STRATA_OPENLINEAGE_URL), is posted to URL/api/v1/lineage, the endpoint Marquez serves. A receiver that
is down or refuses costs a warning, never the run: the file has every event.

Datasets are named as OpenLineage's naming conventions name files: a local path in namespace `file`, an
object in `s3://BUCKET` (or gs://, ...) with its key as the name. A dataset version carries the
`version` facet (NAME@VERSION's version); the job, `jobType` (BATCH, or STREAMING for serving).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid

URL_ENV = "STRATA_OPENLINEAGE_URL"
NAMESPACE_ENV = "STRATA_OPENLINEAGE_NAMESPACE"
FILE = "openlineage.jsonl"
PRODUCER = "urn:strata"  # a URI, as the spec asks; strata has no public home to point at
SPEC = "https://openlineage.io/spec/2-0-2/OpenLineage.json"
FACETS = "https://openlineage.io/spec/facets"
_warn = logging.getLogger("strata.openlineage").warning  # the `strata` logger's handler prints it


def dataset(path: str, version: str | None = None) -> dict:
    """An input or output dataset of `path` (a file, folder or URI), with its version when it has one."""
    if "://" in path:
        scheme, _, rest = path.partition("://")
        bucket, _, key = rest.partition("/")
        namespace, name = f"{scheme}://{bucket}", key or "/"
    else:
        namespace, name = "file", os.path.abspath(path)
    facets = {}
    if version:
        facets["version"] = _facet("1-0-1/DatasetVersionDatasetFacet.json#/$defs/DatasetVersionDatasetFacet",
                                   datasetVersion=version)
    return {"namespace": namespace, "name": name, "facets": facets}


def _facet(schema: str, **fields) -> dict:
    return {"_producer": PRODUCER, "_schemaURL": f"{FACETS}/{schema}", **fields}


class Emitter:
    """One run's events: `start`, then `complete` or `fail`, each to the file and to the URL."""

    def __init__(self, kind: str, name: str, path: str, inputs: list[dict], outputs: list[dict], write,
                 url: str | None = None, streaming: bool = False):
        """`write(path, data)`: how the events file is written (the storage layer's atomic write)."""
        from strata import __version__

        self.run_id = str(uuid.uuid4())
        self.kind, self.name, self.path = kind, name, path.replace("{run}", self.run_id)  # a path may name the run
        self.inputs, self.outputs = inputs, outputs
        self.url = (url if url is not None else os.environ.get(URL_ENV, "")).rstrip("/")
        self.namespace = os.environ.get(NAMESPACE_ENV, "strata")
        self.job_facets = {"jobType": _facet("2-0-4/JobTypeJobFacet.json#/$defs/JobTypeJobFacet",
                                             processingType="STREAMING" if streaming else "BATCH",
                                             integration="STRATA", jobType=kind.upper())}
        self.engine = _facet("1-1-1/ProcessingEngineRunFacet.json#/$defs/ProcessingEngineRunFacet",
                             version=__version__, name="strata")
        self.events: list[dict] = []
        self.ended, self.write = False, write

    def event(self, kind: str, error: str | None = None) -> dict:
        facets = {"processing_engine": self.engine}
        if error is not None:
            facets["errorMessage"] = _facet("1-0-1/ErrorMessageRunFacet.json#/$defs/ErrorMessageRunFacet",
                                            message=error, programmingLanguage="python")
        now = time.time()
        return {"eventType": kind, "eventTime": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) +
                f".{int(now * 1000) % 1000:03d}Z", "producer": PRODUCER,
                "schemaURL": f"{SPEC}#/$defs/RunEvent", "run": {"runId": self.run_id, "facets": facets},
                "job": {"namespace": self.namespace, "name": f"{self.kind}.{self.name}", "facets": self.job_facets},
                "inputs": self.inputs, "outputs": self.outputs}

    def emit(self, kind: str, error: str | None = None) -> None:
        e = self.event(kind, error)
        self.events.append(e)
        try:
            self.write(self.path, "".join(json.dumps(x) + "\n" for x in self.events).encode())
        except OSError as err:
            _warn(f"could not write {self.path} ({err}): the run goes on")
        if self.url:
            self._post(e)

    def _post(self, e: dict) -> None:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"{self.url}/api/v1/lineage", data=json.dumps(e).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
        except (urllib.error.URLError, OSError) as err:
            _warn(f"--openlineage-url {self.url}: {e['eventType']} not delivered ({err}); {self.path} has it")

    def start(self) -> None:
        self.emit("START")

    def end(self, error: BaseException | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        if error is None:
            self.emit("COMPLETE")
        else:
            self.emit("FAIL", f"{type(error).__name__}: {error}"[:2000] or type(error).__name__)
