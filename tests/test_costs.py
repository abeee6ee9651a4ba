"""Run records with cost and utilization, reports, and the planner."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from strata.accounting.cost import cluster_types, hourly_price, load_prices, node_type
from strata.cluster import tiers
from strata.data.storage import Storage


def test_prices_cover_every_node_type_of_cluster_yaml():
    prices, types = load_prices(), cluster_types()
    assert set(prices["node_types"]) == set(types) | {"local"}
    for name, t in types.items():
        price, market = hourly_price(name, prices, types)
        assert price is not None and price >= 0
        assert market == t["market"]
        if t["gpus"]:
            assert prices["node_types"][name]["gpu"], f"{name}: the planner needs its GPU model"
    assert hourly_price("spot", prices, types) == (prices["node_types"]["spot"]["spot"], "spot")
    assert hourly_price("spot-fallback", prices, types)[1] == "on_demand"
    assert node_type({"ray.io/node-group": "gpu-8x"}) == "gpu-8x"
    assert node_type(tiers.local_node_labels()) == "local"
    assert [node_type(tiers.node_labels(t)) for t in tiers.Tier] == ["cpu", "gpu-1x", "spot"]
    assert node_type({}) == "head"


def _check_record(record: dict, kind: str):
    assert record["kind"] == kind and record["code_version"] and record["libraries"]["ray"]
    assert record["ended_at"] > record["work_started_at"] >= record["started_at"] and record["config"]
    assert record["nodes"] and all(n["type"] == "local" for n in record["nodes"])
    hours = (record["ended_at"] - record["work_started_at"]) / 3600  # the nodes' time is the work's
    assert record["node_hours"] == pytest.approx(hours * len(record["nodes"]))
    assert record["cost"] == pytest.approx(3.6 * record["node_hours"]) and record["currency"] == "EUR"
    busy = record["utilization"]["cpu_busy"]
    assert busy is not None and 0 <= busy <= 1
    assert record["nodes"][0]["samples"], "the sampler took no samples"


@pytest.mark.slow("a training run and a sweep, each a command")
def test_train_and_sweep_runs_write_priced_records_and_reports(local_ray, dataset, priced, sweep_space):
    from strata.accounting.records import find_record, list_records
    from train.__main__ import main as train_main
    from tune.config import SweepConfig
    from tune.driver import run as sweep

    storage = Storage.from_env()
    out = train_main(["--dataset", dataset["ref"], "--max-steps", "30", "--log-every", "5", "--run", "costed",
                      "--json"])
    record = find_record(storage, "train/costed")
    _check_record(record, "train")
    assert out["cost"] == pytest.approx(record["cost"])
    assert record["figures"]["tokens_per_s"] == pytest.approx(out["tokens_per_s"])
    with open(os.path.join(out["path"], "record.json")) as f:
        assert json.load(f) == record  # beside the outputs, and in records/
    sweep(SweepConfig(num_samples=2, steps=4, report_every=2, max_rows=32, eval_rows=8, scheduler="fifo",
                      space=sweep_space),
          dataset=dataset["ref"], model_preset="debug", sweep_name="costed-sweep", storage=storage)
    _check_record(find_record(storage, "costed-sweep"), "sweep")
    assert {"train", "sweep"} <= {r["kind"] for r in list_records(storage)}

    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    runs = subprocess.run([sys.executable, "-m", "strata", "runs"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert runs.returncode == 0, runs.stderr
    row = next(line for line in runs.stdout.splitlines() if " costed " in line)
    assert f"{record['cost']:.4f} EUR" in row and "30 steps" in row
    rep = subprocess.run([sys.executable, "-m", "strata", "report", "costed"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert f"{record['cost']:.4f} EUR" in rep.stdout and "CPU busy" in rep.stdout
    page = rep.stdout.strip().splitlines()[-1].split(None, 1)[1]  # "  report   PATH"
    with open(page) as f:
        text = f.read()
    for title in ("Loss", "Throughput over time", "Utilization", "Cost by node type"):
        assert f"<h2>{title}</h2>" in text, title
    assert text.count("data:image/png;base64,") == 4
    missing = subprocess.run([sys.executable, "-m", "strata", "report", "no-such-run"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "no run named 'no-such-run'" in missing.stderr

    # The planner learns CPU training throughput from that run (priced with the real prices.yaml).
    env.pop("STRATA_PRICES")
    plan = subprocess.run([sys.executable, "-m", "strata", "plan", "--train", "gpt2-124m", "--tokens", "1e9",
                           "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr
    p = json.loads(plan.stdout)
    assert p["sources"]["CPU training"].endswith("(measured: run train/costed)")
    assert "gpu-1x training" in p["sources"] and "assumed" in p["sources"]["gpu-1x training"]


def test_the_planner_prices_per_run_and_says_what_it_assumed(tmp_path):
    from train.plan import main

    env = {**os.environ, "STRATA_STORAGE": str(tmp_path)}  # no run records: assumptions or bench results
    out = subprocess.run([sys.executable, "-m", "strata", "plan", "--sweep-trials", "50000", "--steps", "40",
                          "--json"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    p = json.loads(out.stdout)
    prices, types = load_prices(), cluster_types()
    for o in p["options"]:
        assert o["cost"] == pytest.approx(o["node_hours"] * hourly_price(o["type"], prices, types)[0])
        assert o["wall_hours_max_nodes"] == pytest.approx(o["node_hours"] / o["max_nodes"])
    spot = [o for o in p["options"] if o["fits_tier"]]
    assert p["recommended"] == min(spot, key=lambda o: o["cost"])["type"] == "spot"
    assert all(not types[o["type"]]["gpus"] for o in p["options"])  # GPUs are no place for 1-CPU trials
    assert all(("measured" in v or "assumed" in v) for k, v in p["sources"].items() if k != "prices")
    with pytest.raises(SystemExit):
        main(["--train", "gpt2-124m"])  # no --tokens
