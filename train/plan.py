"""`python -m strata plan` (or `python -m train.plan`): where should a run go? Wall time and cost per run
on each node type. It lives in train because it plans in model FLOPs (train.model) and GPU peaks
(train.hardware); `strata` imports none of the stage packages and starts it as a process.

    python -m strata plan --preprocess-tokens 2e10
    python -m strata plan --train gpt2-124m --tokens 1e10
    python -m strata plan --sweep-trials 50000 --steps 40 [--preset debug] [--batch-size 16]

Throughput comes from, in this order: past run records (`python -m strata runs`),
the last `make bench` results (bench/results/latest.json), and stated assumptions.
Training and sweeps are planned in FLOPs: a measured tokens/s becomes effective
FLOP/s per CPU core or per GPU (tokens/s x the model's training FLOPs per token),
which then serves any model size (an assumption: efficiency is taken as equal
across sizes). Cost per run = node-hours x the hourly price in prices.yaml; with
linear scaling it does not depend on how many nodes share the work, the wall time
does (shown for one node and for the type's max_workers).
"""

from __future__ import annotations

import argparse
import json
import math

from strata.accounting.cost import REPO, cluster_types, hourly_price, load_prices
from strata.commands.shell import Parser
from strata.data.storage import Storage
from train.hardware import PEAK_TFLOPS
from train.model import describe, preset

BENCH_RESULTS = REPO / "bench" / "results" / "latest.json"
ASSUMED = {
    "preprocess_tokens_per_s_per_core": (3.0e5, "about what tier 1 does per core on the build machine"),
    "cpu_flops_per_core": (2.0e10, "20 GFLOP/s of training per CPU core"),
    "gpu_mfu": (0.40, "40% MFU in bf16, a good single-node GPT-2 run"),
    "asha_compute": (0.5, "ASHA (halving every rung) uses about half the trial iterations"),
}


def _measure(storage: Storage) -> dict:
    """What past runs and the last benchmark measured: {key: (value, where from)}."""
    from strata.accounting.records import list_records

    out = {}
    results = json.loads(BENCH_RESULTS.read_text()) if BENCH_RESULTS.exists() else {}
    bench = {**results.get("benchmarks", {}), "date": results.get("date")}
    if (pre := bench.get("preprocess", {}).get("result", {}).get("pipeline")) and pre.get("seconds"):
        cores = bench["preprocess"]["result"]["cores"]
        out["preprocess_tokens_per_s_per_core"] = (pre["tokens"] / pre["seconds"] / cores,
                                                   f"bench.preprocess ({bench.get('date')})")
    if (ing := bench.get("train.ingest", {}).get("result")) and ing.get("consumed_tokens_per_s"):
        flops = describe(preset("debug"))["flops_per_token"]
        out["cpu_flops_per_core"] = (ing["consumed_tokens_per_s"] * flops, f"bench.train.ingest ({bench.get('date')})")
    if (tune := bench.get("tune", {}).get("result", {}).get("asha")) and tune["fifo"]["iterations"]:
        out["asha_compute"] = (tune["asha"]["iterations"] / tune["fifo"]["iterations"],
                               f"bench.tune ({bench.get('date')})")
    for r in list_records(storage):  # later records win
        f, cfg = r.get("figures", {}), r.get("config", {})
        types = {n["type"] for n in r.get("nodes", [])}
        if r["kind"] == "preprocess" and f.get("tokens_per_s_per_cpu"):
            out["preprocess_tokens_per_s_per_core"] = (f["tokens_per_s_per_cpu"], f"run preprocess/{r['name']}")
        if r["kind"] == "train" and f.get("tokens_per_s_per_worker") and cfg.get("flops_per_token"):
            flops = f["tokens_per_s_per_worker"] * cfg["flops_per_token"]
            if cfg.get("use_gpu"):
                for t in types:
                    out[f"gpu_flops:{t}"] = (flops, f"run train/{r['name']}")
            else:
                out["cpu_flops_per_core"] = (flops / max(1.0, cfg.get("cpus_per_worker", 1)), f"run train/{r['name']}")
    return out


def _get(measured: dict, key: str) -> tuple[float, str]:
    if key in measured:
        return measured[key][0], f"measured: {measured[key][1]}"
    value, why = ASSUMED[key]
    return value, f"assumed: {why}"


def _gpu_flops(type_name: str, prices: dict, types: dict, measured: dict) -> tuple[float, str] | None:
    if f"gpu_flops:{type_name}" in measured:
        v, src = measured[f"gpu_flops:{type_name}"]
        return v * types[type_name]["gpus"], f"measured: {src}"
    gpu = prices["node_types"].get(type_name, {}).get("gpu")
    if not gpu:
        return None
    peak = next((half for frag, half, _ in PEAK_TFLOPS if frag == gpu), None)
    if peak is None:
        return None
    mfu, why = _get(measured, "gpu_mfu")
    return peak * 1e12 * mfu * types[type_name]["gpus"], f"{why} of the {gpu}'s {peak:g} TFLOPS peak"


def plan(args, storage: Storage) -> dict:
    prices, types = load_prices(), cluster_types()
    measured = _measure(storage)
    options, sources, work, tier = [], {}, "", "cpu"
    if args.preprocess_tokens:
        rate, src = _get(measured, "preprocess_tokens_per_s_per_core")
        sources["preprocess throughput"] = f"{rate:,.0f} tokens/s per core ({src})"
        work = f"preprocess {args.preprocess_tokens:,.0f} tokens"
        for name, t in types.items():
            if t["cpus"] and "gpu" not in t["tiers"]:
                options.append((name, args.preprocess_tokens / (rate * t["cpus"]), "cpu" in t["tiers"]))
    else:
        model = preset(args.train or args.preset)
        fpt = describe(model)["flops_per_token"]
        cpu_rate, cpu_src = _get(measured, "cpu_flops_per_core")
        sources["CPU training"] = f"{cpu_rate / 1e9:,.1f} GFLOP/s per core ({cpu_src})"
        if args.train:
            flops = args.tokens * fpt
            work = f"train {args.train} on {args.tokens:,.0f} tokens ({flops:.3g} FLOPs)"
            tier = "gpu"
        else:
            asha, asha_src = _get(measured, "asha_compute")
            sources["ASHA"] = f"{asha:.2f} of the trial iterations ({asha_src})"
            flops = args.sweep_trials * args.steps * args.batch_size * model.seq_len * fpt * asha
            work = (f"sweep {args.sweep_trials:,} trials x {args.steps} steps of {args.preset} "
                    f"(batch {args.batch_size}; {flops:.3g} FLOPs after early stopping)")
            tier = "spot"
        for name, t in types.items():
            if not (t["cpus"] or t["gpus"]) or "spot" in t["tiers"] and tier == "gpu" or t["gpus"] and tier == "spot":
                continue  # spot nodes for training, or GPUs for one-CPU trials: not sensible comparisons
            if t["gpus"]:
                g = _gpu_flops(name, prices, types, measured)
                if g is None:
                    continue
                sources[f"{name} training"] = f"{g[0] / 1e12:,.1f} TFLOP/s per node ({g[1]})"
                options.append((name, flops / g[0], tier in t["tiers"]))
            else:
                options.append((name, flops / (cpu_rate * t["cpus"]), tier in t["tiers"]))
    rows = []
    for name, seconds, fits in options:
        price, market = hourly_price(name, prices, types)
        hours = seconds / 3600
        rows.append({"type": name, "market": market, "fits_tier": fits, "node_hours": hours,
                     "price_per_hour": price, "cost": None if price is None else hours * price,
                     "wall_hours_1_node": hours, "max_nodes": types[name]["max_workers"],
                     "wall_hours_max_nodes": hours / types[name]["max_workers"]})
    priced = [r for r in rows if r["cost"] is not None]
    fit = [r for r in priced if r["fits_tier"]]
    best = min(fit, key=lambda r: r["cost"]) if fit else None
    return {"work": work, "options": sorted(rows, key=lambda r: (r["cost"] is None, r["cost"] or 0)),
            "recommended": best and best["type"], "why": _why(best, fit, tier) + _others(priced, fit, best, tier),
            "sources": sources,
            "currency": prices.get("currency"), "prices_as_of": prices.get("as_of")}


def _others(priced: list[dict], fit: list[dict], best: dict | None, tier: str) -> str:
    """Out-of-tier comparisons (training on CPUs; preprocessing on spot)."""
    lines = []
    for r in (r for r in priced if r not in fit and best):
        lines.append(f"\n  vs {r['type']} (not the {tier} tier): {r['cost'] / best['cost']:,.2f}x the cost per run "
                     f"and {r['node_hours'] / best['node_hours']:,.1f}x the node-hours at "
                     f"{r['price_per_hour'] / best['price_per_hour']:,.2f}x the hourly price")
    return "".join(lines)


def _why(best: dict | None, priced: list[dict], tier: str) -> str:
    if best is None:
        return "no priced node type can run this"
    lines = [f"{best['type']} is the cheapest {tier}-tier node type per run: {best['cost']:,.2f} for "
             f"{best['node_hours']:,.2f} node-hours"]
    for r in sorted((r for r in priced if r is not best), key=lambda r: r["cost"]):
        per_run = r["cost"] / best["cost"] if best["cost"] else math.inf
        per_hour = r["price_per_hour"] / best["price_per_hour"] if best["price_per_hour"] else math.inf
        lines.append(f"  vs {r['type']}: {per_run:,.2f}x the cost per run at {per_hour:,.2f}x the hourly price")
    return "\n".join(lines)


def format_plan(p: dict) -> str:
    cur = p["currency"] or ""
    lines = [f"plan: {p['work']}", "",
             f"{'node type':<14}{'market':<11}{'node-hours':>12}{'cost/run':>14}{'wall, 1 node':>14}{'wall, max':>16}"]
    for r in p["options"]:
        cost = "unpriced" if r["cost"] is None else f"{r['cost']:,.2f} {cur}"
        mark = "" if r["fits_tier"] else "  (not its tier: for comparison)"
        lines.append(f"{r['type']:<14}{r['market']:<11}{r['node_hours']:>12,.2f}{cost:>14}"
                     f"{_dur(r['wall_hours_1_node']):>14}{_dur(r['wall_hours_max_nodes']):>10} x{r['max_nodes']:<4}{mark}")
    lines += ["", f"recommended: {p['recommended']}", p["why"], "", "inputs:"]
    lines += [f"  {k}: {v}" for k, v in p["sources"].items()]
    lines.append(f"  prices: prices.yaml (as of {p['prices_as_of']})")
    return "\n".join(lines)


def _dur(hours: float) -> str:
    return f"{hours * 60:,.0f} min" if hours < 1 else f"{hours:,.1f} h" if hours < 48 else f"{hours / 24:,.1f} d"


def main(argv: list[str]) -> int:
    p = Parser(prog="python -m strata plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--preprocess-tokens", type=float, help="tokens to preprocess")
    g.add_argument("--train", metavar="PRESET", help="a model preset to train (with --tokens)")
    g.add_argument("--sweep-trials", type=int, help="trials of a sweep (with --steps)")
    p.add_argument("--tokens", type=float, help="tokens to train on")
    p.add_argument("--steps", type=int, default=40, help="steps per sweep trial (default 40)")
    p.add_argument("--preset", default="debug", help="the sweep's model preset (default debug)")
    p.add_argument("--batch-size", type=int, default=16, help="the sweep's batch size (default 16)")
    p.add_argument("--storage", help="storage root whose run records to learn from")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if a.train and not a.tokens:
        p.error("--train needs --tokens")
    try:
        result = plan(a, Storage.from_env(a.storage))
    except KeyError as e:
        p.error(f"unknown preset {e}")
    print(json.dumps(result) if a.json else format_plan(result))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
