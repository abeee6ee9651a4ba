"""Run records: what every preprocess, train and sweep run writes beside its outputs, and
again under `records/` so that `python -m strata runs` finds every run of any kind."""

from __future__ import annotations

from strata.cost import UsageMonitor, load_prices
from strata.storage import Storage, join, list_dir, read_json, write_json_atomic


def write_record(storage: Storage, info: dict, *, name: str, beside: str, usage: UsageMonitor,
                 work_nodes, figures: dict, started: float | None = None) -> dict:
    """The run's record: `info` (run_info: config, code and library versions, start) plus its end,
    the nodes that did its work with their node-hours, busy fractions and cost, and `figures`
    (throughput and the like). Written to `beside` and to records/KIND-NAME-START.json. `started`: when
    the command started (strata.shell.command_started), else when its work did."""
    nodes = usage.nodes(work_nodes)
    started = started or usage.started
    by_type: dict[str, dict] = {}
    for n in nodes:
        t = by_type.setdefault(n["type"], {"nodes": 0, "hours": 0.0, "cost": 0.0, "market": n["market"],
                                           "price_per_hour": n["price_per_hour"]})
        t["nodes"] += 1
        t["hours"] += n["hours"]
        t["cost"] = None if t["cost"] is None or n["cost"] is None else t["cost"] + n["cost"]
    costs = [n["cost"] for n in nodes]
    busy = [(n["cpu_busy"], n["hours"]) for n in nodes if n["cpu_busy"] is not None]
    gpu = [n["gpu_busy"] for n in nodes if n["gpu_busy"] is not None]
    prices = load_prices()
    record = {
        # The whole command's time (imports, Ray's start, the run): a person's wait, as they would time it.
        **info, "name": name, "outputs": beside.rsplit("/", 1)[0], "started_at": started,
        "ended_at": usage.ended, "seconds": round(usage.ended - started, 1),
        "work_started_at": usage.started, "work_seconds": round(usage.ended - usage.started, 1),
        "nodes": nodes, "by_type": by_type, "node_hours": sum(n["hours"] for n in nodes),
        "cost": None if not nodes or None in costs else sum(costs), "currency": prices.get("currency"),
        "prices_as_of": prices.get("as_of"),
        "utilization": {"cpu_busy": sum(b * h for b, h in busy) / sum(h for _, h in busy) if busy else None,
                        "gpu_busy": sum(gpu) / len(gpu) if gpu else None, "mfu": figures.get("mfu")},
        "figures": figures,
    }
    write_json_atomic(beside, record)
    write_json_atomic(join(storage.records(), f"{info['kind']}-{name}-{int(started)}.json"), record)
    return record


def list_records(storage: Storage) -> list[dict]:
    """Every run's record, oldest first."""
    names = [name for name, is_dir in list_dir(storage.records()) if not is_dir and name.endswith(".json")]
    records = [read_json(join(storage.records(), name)) for name in names]
    return sorted(records, key=lambda r: r.get("started_at", 0))


def find_record(storage: Storage, ref: str) -> dict:
    """The latest record named `ref` (or `kind/name`)."""
    kind, _, name = ref.rpartition("/")
    matches = [r for r in list_records(storage) if r["name"] == name and (not kind or r["kind"] == kind)]
    if not matches:
        known = sorted({f"{r['kind']}/{r['name']}" for r in list_records(storage)})
        raise FileNotFoundError(f"no run named {ref!r} under {storage.records()}"
                                + (f"; runs: {', '.join(known[-20:])}" if known else "; no runs recorded yet"))
    return matches[-1]
