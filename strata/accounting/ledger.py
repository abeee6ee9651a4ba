"""The cost ledger (`python -m strata ledger`): what one model cost from raw text to its evaluations, and
what a dataset cost and which models drew on it, added up from the run records (strata/accounting/records.py).

A model's ledger holds, each with the share of its record that is the model's:

- `training`: every launch of the run (share 1);
- `data`: each version of every dataset snapshot it trained on (the preprocessing run that committed it),
  at the share tokens read / tokens produced: the run read `read` tokens of a snapshot of `produced`, so
  it owes read / produced of each of its versions' preprocessing, one whole at most (a second pass over
  the data costs no more preprocessing);
- `sweep`: the sweep its config came from (`--from-sweep`), whole: the sweep chose this model's config;
- `score`, `eval`, `generate`: the runs that used one of its checkpoints (share 1).

Totals are the parts' sums, in money and node-hours, and by tier (cluster.yaml's labels of each node
type); a record without a price (a node type prices.yaml does not list) is named in `unpriced`, and the
money is the priced parts'. Tokens: `kept` in the snapshots, `read` (the part of them the data's share
stands for), `trained`, `scored`. Unit costs: preprocessing per kept token (the data's share over the
tokens it stands for), training per trained token, scoring per million scored tokens, the sweep per trial,
and the whole model per trained token.
"""

from __future__ import annotations

import math
import re
import time

from strata.accounting.cost import cluster_types
from strata.accounting.records import list_records

USES = ("score", "eval", "generate")
_VERSION = re.compile(r"v(\d+)$")


def _count(value) -> int:
    """A count a record gives (records are data: anything else counts 0)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    return int(value) if ok else 0


def _config(r: dict) -> dict:
    return r["config"] if isinstance(r.get("config"), dict) else {}


def model_of(r: dict) -> tuple[str, float]:
    """The training run whose model a score, eval or generate record used, and the step of its checkpoint:
    its `--model RUN[@STEP]`, or what an exported directory was made from (`origin`). ("", inf) for a model
    from elsewhere; the step is infinity when unknown (the newest), so a use is never left out."""
    model = _config(r).get("origin") or _config(r).get("model")
    if not isinstance(model, str):
        return "", float("inf")
    run, _, at = model.partition("@")
    return run, int(at) if at.isdigit() else float("inf")


def _tier(node_type: str, types: dict) -> str:
    """The tier a node type serves (its labels in cluster.yaml): `local` for the embedded Ray, `head`
    for a type serving none, the type's own name for one cluster.yaml does not describe."""
    if node_type == "local":
        return "local"
    if node_type not in types:
        return node_type
    served = types[node_type]["tiers"]
    return served[0] if len(served) == 1 else "head" if not served else "+".join(served)


def _add(total, value):
    """Money added up over what has a price: None only while nothing had one."""
    return total if value is None else value if total is None else total + value


def part(r: dict, share: float, kind: str, what: str, types: dict) -> dict:
    """One record's share in a ledger: its cost and node-hours, and both by tier."""
    by_tier: dict[str, dict] = {}
    for name, t in sorted(r["by_type"].items()):
        entry = by_tier.setdefault(_tier(name, types), {"node_hours": 0.0, "cost": None})
        entry["node_hours"] += share * t["hours"]
        entry["cost"] = _add(entry["cost"], None if t["cost"] is None else share * t["cost"])
    return {"part": kind, "what": what, "record": f"{r['kind']}/{r['name']}", "started_at": r["started_at"],
            "share": share, "cost": None if r["cost"] is None else share * r["cost"],
            "node_hours": share * r["node_hours"], "by_tier": by_tier}


def totals(parts: list[dict]) -> dict:
    out = {"cost": None, "node_hours": 0.0, "by_tier": {}, "unpriced": sorted({p["record"] for p in parts
                                                                               if p["cost"] is None})}
    for p in parts:
        out["cost"] = _add(out["cost"], p["cost"])
        out["node_hours"] += p["node_hours"]
        for tier, t in p["by_tier"].items():
            entry = out["by_tier"].setdefault(tier, {"node_hours": 0.0, "cost": None})
            entry["node_hours"] += t["node_hours"]
            entry["cost"] = _add(entry["cost"], t["cost"])
    return out


def pinned(spec: str) -> list[tuple[str, int]]:
    """(dataset, version number) of a run's dataset spec: `NAME@vN[:WEIGHT][,...]`."""
    out = []
    for item in spec.split(","):
        ref = item.strip().rpartition(":")[0] if ":" in item else item.strip()
        name, _, version = ref.partition("@")
        m = _VERSION.fullmatch(version)
        if name and m:
            out.append((name, int(m.group(1))))
    return out


def trained_tokens(r: dict) -> int:
    """Tokens one launch trained on (older records: its throughput over its loop's time)."""
    f = r["figures"]
    if "tokens" in f:
        return _count(f["tokens"])
    return _count(round(_count(f.get("tokens_per_s")) * _count(f.get("loop_s"))))


def _versions(records: list[dict], dataset: str, upto: int | None, before: float) -> dict[int, dict]:
    """{version number: the preprocessing record that committed it}, as of `before` (a version deleted and
    made again is the newer record's)."""
    out: dict[int, dict] = {}
    for r in records:
        m = _VERSION.fullmatch(str(r["figures"].get("version") or ""))
        if (r["kind"] == "preprocess" and r["name"] == dataset and m and r["started_at"] < before
                and (upto is None or int(m.group(1)) <= upto)):
            out[int(m.group(1))] = r
    return dict(sorted(out.items()))


def _read_by_dataset(launches: list[dict], datasets: list[tuple[str, int]]) -> dict[str, int]:
    """Tokens the run read from each dataset: every launch's, by source for a mixture (the newest launch's
    running count), else the whole on the one dataset."""
    if len(datasets) == 1:
        return {datasets[0][0]: sum(trained_tokens(r) for r in launches)}
    by_source = launches[-1]["figures"].get("tokens_by_source") or {}
    if not isinstance(by_source, dict):
        return {}
    return {name: sum(_count(v) for k, v in by_source.items() if str(k).partition("@")[0] == name)
            for name, _ in datasets}


def model_ledger(run: str, records: list[dict] | None = None, storage=None, types: dict | None = None) -> dict:
    """The ledger of training run `run`: its parts, totals and unit costs (see the module's doc), from
    `records` (else those under `storage`) and cluster.yaml's node types (`types`, else read)."""
    records = records if records is not None else list_records(storage)
    types = types if types is not None else cluster_types()
    launches = [r for r in records if r["kind"] == "train" and r["name"] == run]
    if not launches:
        known = sorted({r["name"] for r in records if r["kind"] == "train"})
        raise FileNotFoundError(f"no training run named {run!r} is recorded"
                                + (f"; runs: {', '.join(known[-20:])}" if known else ""))
    parts = [part(r, 1.0, "training", f"launch {i} of run {run}", types) for i, r in enumerate(launches, 1)]
    trained = sum(trained_tokens(r) for r in launches)
    datasets = pinned(str(_config(launches[-1]).get("dataset") or ""))
    read = _read_by_dataset(launches, datasets)
    kept = read_share = 0.0  # tokens the snapshots hold; the part of them this run stands for
    for name, upto in datasets:
        versions = _versions(records, name, upto, launches[0]["started_at"])
        produced = sum(_count(r["figures"].get("tokens")) for r in versions.values())
        share = min(1.0, read.get(name, 0) / produced) if produced else 0.0
        kept += produced
        read_share += share * produced
        parts += [part(r, share, "data", f"dataset {name}@v{n:04d}", types) for n, r in versions.items()]
    trials = 0
    if sweep := _config(launches[-1]).get("from_sweep"):
        for r in records:
            if r["kind"] == "sweep" and r["name"] == sweep and r["started_at"] < launches[-1]["started_at"]:
                parts.append(part(r, 1.0, "sweep", f"sweep {sweep}", types))
                trials += _count(r["figures"].get("trials"))
    scored = 0
    for r in records:
        if r["kind"] in USES and model_of(r)[0] == run:
            parts.append(part(r, 1.0, r["kind"], f"{r['kind']} {r['name']} of {_config(r).get('model')}", types))
            scored += _count(r["figures"].get("tokens")) if r["kind"] == "score" else 0
    out = {"run": run, "parts": parts, **totals(parts),
           "tokens": {"kept": int(kept), "read": int(read_share), "trained": trained, "scored": scored},
           "trials": trials}

    def cost_of(kind: str) -> float | None:
        return totals([p for p in parts if p["part"] == kind])["cost"]

    def per(cost, count, scale=1):
        return None if cost is None or not count else cost / count * scale

    out["unit_costs"] = {"per_kept_token": per(cost_of("data"), read_share),
                         "per_trained_token": per(cost_of("training"), trained),
                         "per_million_scored_tokens": per(cost_of("score"), scored, 1e6),
                         "per_trial": per(cost_of("sweep"), trials),
                         "model_per_trained_token": per(out["cost"], trained)}
    return out


def dataset_ledger(name: str, records: list[dict] | None = None, storage=None) -> dict:
    """What every version of dataset `name` cost, and each training run's share of it."""
    records = records if records is not None else list_records(storage)
    types = cluster_types()
    versions = _versions(records, name, None, time.time() + 1)
    if not versions:
        raise FileNotFoundError(f"no preprocessing run of dataset {name!r} is recorded")
    parts = [part(r, 1.0, "data", f"dataset {name}@v{n:04d}", types) for n, r in versions.items()]
    kept = sum(_count(r["figures"].get("tokens")) for r in versions.values())
    out = {"dataset": name, "parts": parts, **totals(parts), "tokens": {"kept": kept}}
    out["unit_costs"] = {"per_kept_token": None if out["cost"] is None or not kept else out["cost"] / kept}
    readers = []
    for run in dict.fromkeys(r["name"] for r in records if r["kind"] == "train"):
        mine = [p for p in model_ledger(run, records, types=types)["parts"] if p["part"] == "data" and
                p["what"].startswith(f"dataset {name}@")]
        if mine:
            readers.append({"run": run, "cost": totals(mine)["cost"], "node_hours": totals(mine)["node_hours"],
                            "share": mine[0]["share"]})
    out["readers"] = readers
    return out


def _money(v, currency: str) -> str:
    if v is None:
        return "unpriced"
    return f"0 {currency}" if v == 0 else f"{v:.3g} {currency}" if v < 0.01 else f"{v:,.4f} {currency}"


def text(ledger: dict, currency: str = "USD") -> str:
    """The ledger as a person reads it."""
    head = f"model {ledger['run']}" if "run" in ledger else f"dataset {ledger['dataset']}"
    lines = [f"ledger of {head}: {_money(ledger['cost'], currency)} for {ledger['node_hours']:.4f} node-hours"]
    width = max(len(p["what"]) for p in ledger["parts"])
    for p in ledger["parts"]:
        lines.append(f"  {p['part']:<9} {p['what']:<{width}}  share {p['share']:>6.1%}  {p['node_hours']:.4f} node-h  "
                     f"{_money(p['cost'], currency)}")
    lines.append("  by tier   " + "; ".join(f"{tier} {t['node_hours']:.4f} node-h, {_money(t['cost'], currency)}"
                                            for tier, t in sorted(ledger["by_tier"].items())))
    t = ledger["tokens"]
    said = [f"{t['kept']:,} kept"] + [f"{t[k]:,} {k}" for k in ("read", "trained", "scored") if k in t]
    lines.append("  tokens    " + ", ".join(said) + (f"; {ledger['trials']} trials" if ledger.get("trials") else ""))
    names = {"per_kept_token": "per kept token", "per_trained_token": "per trained token",
             "per_million_scored_tokens": "per million scored tokens", "per_trial": "per trial",
             "model_per_trained_token": "the whole model per trained token"}
    units = [f"{_money(v, currency)} {names[k]}" for k, v in ledger["unit_costs"].items() if v is not None]
    if units:
        lines.append("  unit cost " + "; ".join(units))
    for r in ledger.get("readers", []):
        lines.append(f"  read by   run {r['run']}: {r['share']:.1%} of each version, {_money(r['cost'], currency)}")
    if ledger["unpriced"]:
        lines.append(f"  unpriced  {', '.join(ledger['unpriced'])}: prices.yaml has no price for a node type they ran "
                     "on; the money above leaves them out")
    return "\n".join(lines)
