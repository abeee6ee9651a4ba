"""The record of a serving no command waits on: a Serve config's application (a RayService's serveConfigV2,
`serve deploy`), built by `infer.serve:app`. Each ingress replica writes its own as it stops, under
servings/NAME/replicas/REPLICA.json and records/, in the shape of every run's record (strata/accounting/records.py):
what it answered by status, its tokens and latency, and its replica-hours. A command's serving
(`python -m infer serve`) writes one record for all its replicas instead (infer/serve.py).
"""

from __future__ import annotations

import time
from dataclasses import asdict

from infer.admission import Ledger
from infer.schemas import ServeConfig


def write_replica_record(record: dict, replica: str, started: float, ledger: Ledger, limits: ServeConfig) -> dict:
    from strata.accounting.records import check_record
    from strata.accounting.runinfo import run_info
    from strata.data.storage import Storage, check_name, join, write_json_atomic

    name = check_name(record["name"], "a serving's name")
    storage = Storage(record["root"])
    ended = time.time()
    seconds = ended - started
    figures = ledger.figures()
    tokens = figures["prompt_tokens"] + figures["completion_tokens"]
    figures.update(replica=replica, replicas=1, models=len(record["models"]), seconds=round(seconds, 3),
                   replica_hours=round(seconds / 3600, 6), requests_per_s=figures["requests"] / max(seconds, 1e-9),
                   tokens=tokens)
    beside = join(storage.servings(name), "replicas", f"{check_name(replica, 'a replica id')}.json")
    out = {**run_info("serve", {"models": record["models"], "via": "infer.serve:app", **asdict(limits)}),
           "name": name, "outputs": beside.rsplit("/", 1)[0], "started_at": started, "ended_at": ended,
           "seconds": round(seconds, 1), "node_hours": 0.0, "nodes": [], "by_type": {}, "cost": None,
           "utilization": {"cpu_busy": None, "gpu_busy": None, "mfu": None}, "figures": figures, "lost_nodes": []}
    check_record(out, beside)  # what `strata runs` will read back
    write_json_atomic(beside, out)
    write_json_atomic(join(storage.records(), f"serve-{name}-{replica}-{int(started)}.json"), out)
    return out
