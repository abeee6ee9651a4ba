"""Run records: what every preprocess, train and sweep run writes beside its outputs, and
again under `records/` so that `python -m strata runs` finds every run of any kind."""

from __future__ import annotations

from strata.accounting.cost import UsageMonitor, load_prices
from strata.data.storage import Storage, join, list_dir, read_json, write_json_atomic


def write_record(storage: Storage, info: dict, *, name: str, beside: str, usage: UsageMonitor,
                 work_nodes, figures: dict, started: float | None = None) -> dict:
    """The run's record: `info` (run_info: config, code and library versions, start) plus its end,
    the nodes that did its work with their node-hours, busy fractions and cost, and `figures`
    (throughput and the like). Written to `beside` and to records/KIND-NAME-START.json. `started`: when
    the command started (strata.errors.command_started), else when its work did."""
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
        "figures": figures, "lost_nodes": usage.lost,
    }
    write_json_atomic(beside, record)
    write_json_atomic(join(storage.records(), f"{info['kind']}-{name}-{int(started)}.json"), record)
    return record


KINDS = ("preprocess", "train", "sweep", "score", "eval", "generate", "serve")
_NUMBERS = ("started_at", "ended_at", "seconds", "node_hours")


def check_record(r, path: str) -> dict:
    """A record read back from storage, its fields' types checked (a record is data anyone with write
    access to the root could have written): the record, or ValueError naming the file and the field."""
    def bad(what: str):
        return ValueError(f"record {path}: {what}; not a strata run record")

    if not isinstance(r, dict):
        raise bad("not a JSON object")
    if r.get("kind") not in KINDS:
        raise bad(f"kind {r.get('kind')!r} is not one of {', '.join(KINDS)}")
    name = r.get("name")
    if not isinstance(name, str) or not name or not all(c.isascii() and (c.isalnum() or c in "._-@") for c in name):
        raise bad(f"name {name!r} is not a run name")
    for k in _NUMBERS:
        if isinstance(r.get(k), bool) or not isinstance(r.get(k), int | float):
            raise bad(f"{k} is {r.get(k)!r}, not a number")
    if r.get("cost") is not None and (isinstance(r["cost"], bool) or not isinstance(r["cost"], int | float)):
        raise bad(f"cost is {r['cost']!r}, not a number")
    for k in ("utilization", "figures", "by_type"):
        if not isinstance(r.get(k), dict):
            raise bad(f"{k} is not an object")
    if not isinstance(r.get("outputs"), str):
        raise bad("outputs is not a path")
    return r


def _read(storage: Storage, name: str) -> dict:
    """One record, or an error row ({"error": ..., "file": ...}) that says why it is not one."""
    path = join(storage.records(), name)
    try:
        return check_record(read_json(path), path)
    except (ValueError, UnicodeDecodeError, OSError) as e:
        said = str(e).splitlines()[0] if str(e) else type(e).__name__
        return {"error": said if path in said else f"record {path}: not JSON ({said})", "file": path}


def list_records(storage: Storage, errors: bool = False) -> list[dict]:
    """Every run's record, oldest first; with `errors`, a file that is not a record comes as an error row
    (`error`, `file`) after them, instead of being left out."""
    names = [name for name, is_dir in list_dir(storage.records()) if not is_dir and name.endswith(".json")]
    read = [_read(storage, name) for name in names]
    records = sorted((r for r in read if "error" not in r), key=lambda r: r["started_at"])
    return records + ([r for r in read if "error" in r] if errors else [])


def find_record(storage: Storage, ref: str, records: list[dict] | None = None) -> dict:
    """The latest record named `ref` (or `kind/name`), among `records` when the caller has listed them."""
    kind, _, name = ref.rpartition("/")
    records = list_records(storage) if records is None else records
    matches = [r for r in records if r["name"] == name and (not kind or r["kind"] == kind)]
    if not matches:
        known = sorted({f"{r['kind']}/{r['name']}" for r in records})
        raise FileNotFoundError(f"no run named {ref!r} under {storage.records()}"
                                + (f"; runs: {', '.join(known[-20:])}" if known else "; no runs recorded yet"))
    return matches[-1]
