"""A spot fleet on one machine: the queue and the driver at many concurrent workers, and what losing nodes costs.

    python -m bench.tune.fleet [--nodes 4] [--per-node 25] [--configs 2000] [--config-s 1.0]
                               [--preempt-configs 512] [--preempt-per-node 4] [--kill 2] [--json]

A simulated cluster on 127.0.0.1 (ray.cluster_utils.Cluster): a head with no
CPUs (the driver and the sweep's queue) and `--nodes` spot nodes of 2 CPUs.
The configs stand for real ones by waiting `--config-s` seconds each (in
`report_every` pieces) instead of training, so that hundreds of workers fit
on 2 cores: what is measured is the sweep's machinery (Tune, the queue, the
results), not the compute. Both cases run the real driver path
(tune.driver.fit_queued, worker trials of fractional CPUs on spot nodes).

1. Concurrency: `--nodes` x `--per-node` workers over `--configs` configs.
   Printed: wall time against the ideal (configs x config-s / workers), the
   peak of workers holding configs, and the CPU the driver process and the
   queue actor used, in cores (target: driver < 1 core).
2. Preemption: `--nodes` x `--preempt-per-node` workers over
   `--preempt-configs` configs; `--kill` nodes are removed without warning
   a third of the way through. Printed: the configs run again (target <= 2%),
   how long after the loss each ran again (median, max), and that every
   config has exactly one result.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")


class WaitFit:
    """A config that takes `seconds` of wall time and no CPU; its metric is a function of its config."""

    def __init__(self, hp: dict, seconds: float, reports: int):
        self.hp, self.pause, self.step = hp, seconds / reports, 0

    def advance(self) -> tuple[float, list[float]]:
        time.sleep(self.pause)
        self.step += 1
        return abs(self.hp["lr"] - 3e-3) + self.hp["batch_size"] / 1000, [0.0]


def waiting_worker(config: dict, *, sweep, space: dict, queue: str, seconds: float) -> None:
    from tune.queued import run_worker

    run_worker(sweep=sweep, space=space, make_fit=lambda hp, state: WaitFit(hp, seconds, sweep.reports), queue=queue)


def _sweep(configs: int, workers: int, seconds: float, where: str, kill=None) -> dict:
    """Run a queued sweep of waiting configs on every spot slot; `kill()` runs in a thread meanwhile."""
    import types

    import ray

    from tune.config import SweepConfig
    from tune.driver import fit_queued, queue_name
    from tune.queued import read_results
    from tune.sweep import load_space

    spot_cpus = sum(n["Resources"].get("CPU", 0) for n in ray.nodes() if n["Alive"])
    cfg = SweepConfig(num_samples=configs, steps=2, report_every=1, scheduler="fifo", max_concurrent=workers,
                      cpus_per_trial=spot_cpus / workers)
    # What a worker reads of the config, without tune.sweep's imports (torch): a worker here is small.
    plain = types.SimpleNamespace(seed=cfg.seed, reports=cfg.reports, scheduler=cfg.scheduler, metric=cfg.metric,
                                  sign=cfg.sign, pack=cfg.pack)
    killer = threading.Thread(target=kill, args=(queue_name(where),), daemon=True) if kill else None
    if killer:
        killer.start()
    cpu, started = time.process_time(), time.perf_counter()
    _, rows, state = fit_queued(waiting_worker, cfg, load_space(cfg.space), where, workers=workers, progress=False,
                                sweep=plain, seconds=seconds)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    if killer:
        killer.join()
    # Steady state: from the moment every worker had its first config to the last config handed out, configs
    # started per second against what `workers` busy workers would start (workers / seconds).
    recs = list(read_results(where))
    first = {}
    for r in recs:
        first[r["worker"]] = min(first.get(r["worker"], r["started"]), r["started"])
    full, last = max(first.values()), max(r["started"] for r in recs)
    rate = sum(full <= r["started"] <= last for r in recs) / max(last - full, 1e-9)
    return {"configs": configs, "workers": workers, "wall_s": wall, "ideal_s": configs * seconds / workers,
            "steady_rate": rate, "steady_share": rate * seconds / workers, "steady_window_s": last - full,
            "driver_cores": cpu / wall, "queue_cores": state["cpu_s"] / wall, "peak": state["peak_running"],
            "requeued": state["requeued"], "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.tune.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--per-node", type=int, default=25, help="workers per node in the concurrency case (default 25; "
                   "a worker process takes about 134 MB, so 38 a node, 152 workers, is what 24 GB holds)")
    p.add_argument("--configs", type=int, default=2000)
    p.add_argument("--config-s", type=float, default=1.0, help="seconds each config takes")
    p.add_argument("--preempt-configs", type=int, default=512)
    p.add_argument("--preempt-per-node", type=int, default=4)
    p.add_argument("--kill", type=int, default=2, help="nodes lost in the preemption case")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)

    import ray
    from ray.cluster_utils import Cluster

    from strata.cluster import tiers
    from tune.queued import read_results

    temp = tempfile.mkdtemp(prefix="bench-fleet-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 200 << 20,
                                                            "include_dashboard": False})
    out = {}
    try:
        nodes = [cluster.add_node(num_cpus=2, labels=tiers.node_labels(tiers.Tier.SPOT), object_store_memory=100 << 20)
                 for _ in range(a.nodes)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)

        c = _sweep(a.configs, a.nodes * a.per_node, a.config_s, os.path.join(temp, "sweeps", "fleet"))
        c.pop("rows")
        out["concurrency"] = c
        print(f"{c['workers']} workers ({a.nodes} nodes x {a.per_node}), {c['configs']:,} configs of {a.config_s} s: "
              f"{c['wall_s']:.1f} s ({c['ideal_s']:.1f} s of configs per worker; starting the workers takes the "
              f"rest on 2 cores); once all were up ({c['steady_window_s']:.1f} s), {c['steady_rate']:.1f} configs "
              f"started per second, {100 * c['steady_share']:.0f}% of what {c['workers']} busy workers start; peak "
              f"{c['peak']} holding configs; driver {c['driver_cores']:.2f} cores (target < 1), queue "
              f"{c['queue_cores']:.2f} cores", flush=True)

        lost = {}

        def kill(name):
            def progress():
                try:
                    return ray.get(ray.get_actor(name).progress.remote())
                except ValueError:
                    return {}

            while progress().get("done", 0) < a.preempt_configs // 3:
                time.sleep(0.2)
            lost["at"] = time.time()
            for node in nodes[: a.kill]:
                cluster.remove_node(node, allow_graceful=False)

        where = os.path.join(temp, "sweeps", "preempt")
        r = _sweep(a.preempt_configs, a.nodes * a.preempt_per_node, a.config_s, where, kill=kill)
        recs = list(read_results(where))
        again = [x for x in recs if x["attempts"] > 1]
        delays = sorted(x["started"] - lost["at"] for x in again)
        per_index = {}
        for path in os.listdir(os.path.join(where, "results")):
            with open(os.path.join(where, "results", path)) as f:
                for line in f:
                    i = json.loads(line)["index"]
                    per_index[i] = per_index.get(i, 0) + 1
        r.pop("rows")
        r.update({"rerun": len(again), "rerun_share": len(again) / a.preempt_configs,
                  "resume_median_s": delays[len(delays) // 2] if delays else None,
                  "resume_max_s": delays[-1] if delays else None, "killed": a.kill,
                  "held_on_killed": a.kill * a.preempt_per_node,
                  "each_once": sorted(per_index) == list(range(a.preempt_configs)) and set(per_index.values()) == {1},
                  "completed": sum(x["status"] == "completed" for x in recs)})
        out["preemption"] = r
        print(f"preemption: {a.preempt_configs} configs on {r['workers']} workers ({a.nodes} nodes), {a.kill} nodes "
              f"lost at a third: {r['rerun']} configs ran again ({100 * r['rerun_share']:.1f}%, target <= 2%; the "
              f"lost nodes held at most {r['held_on_killed']}), again after {r['resume_median_s'] or 0:.2f} s median, "
              f"{r['resume_max_s'] or 0:.2f} s max; {r['completed']} completed, each config one result: "
              f"{r['each_once']}", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    if a.json:
        print(json.dumps(out))
    c, r = out["concurrency"], out["preemption"]
    print(f"fleet: driver {c['driver_cores']:.2f} cores at {c['workers']} workers (target < 1); re-run share "
          f"{100 * r['rerun_share']:.1f}% (target <= 2%)")
    return out


if __name__ == "__main__":
    main()
