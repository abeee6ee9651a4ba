"""What a run costs and how well it used its hardware.

Prices per node type live in `prices.yaml` beside `cluster.yaml`. A node's type
is its `ray.io/node-group` label (the cluster launcher and KubeRay set it);
a node without one is typed by its tier: the embedded local node is `local`,
a node serving only the gpu tier `gpu-1x`, only cpu `cpu`, only spot `spot`,
none `head`.

`UsageMonitor` samples each node's CPU busy fraction (and GPU busy, where
`nvidia-smi` answers) while a run's driver works: the driver's own node in a
thread, every other node with a small actor pinned to it. Node CPU busy is
the whole node's, so on a shared node it includes other jobs' work.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import yaml

from strata.cluster import tiers

REPO = Path(__file__).resolve().parents[2]
MAX_SAMPLES = 600  # per node; older samples are thinned, so a long run keeps a compact series


def load_prices(path: str | None = None) -> dict:
    p = Path(path or os.environ.get("STRATA_PRICES") or REPO / "prices.yaml")
    if not p.exists():
        return {"currency": "USD", "as_of": None, "node_types": {"local": {"instance": "this machine", "on_demand": 0.0}}}
    return yaml.safe_load(p.read_text())


def cluster_types(path: str | None = None) -> dict:
    """cluster.yaml's node types: {name: {"cpus", "gpus", "max_workers", "market", "tiers"}}."""
    p = Path(path or REPO / "cluster.yaml")
    if not p.exists():
        return {}
    out = {}
    for name, t in yaml.safe_load(p.read_text())["available_node_types"].items():
        market = t["node_config"].get("InstanceMarketOptions", {}).get("MarketType", "on_demand")
        out[name] = {"cpus": t["resources"].get("CPU", 0), "gpus": t["resources"].get("GPU", 0),
                     "max_workers": t.get("max_workers") or 1, "market": "spot" if market == "spot" else "on_demand",
                     "tiers": sorted(tiers.tiers_of(t.get("labels") or {}))}
    return out


def node_type(labels: dict) -> str:
    if group := labels.get("ray.io/node-group"):
        return group
    served = tiers.tiers_of(labels)
    if served == set(tiers.Tier):
        return "local"
    for tier, name in ((tiers.Tier.GPU, "gpu-1x"), (tiers.Tier.CPU, "cpu"), (tiers.Tier.SPOT, "spot")):
        if tier in served:
            return name
    return "head"


def hourly_price(type_name: str, prices: dict, types: dict) -> tuple[float | None, str]:
    """(price per hour, market) of a node type; None when prices.yaml does not list it."""
    entry = prices["node_types"].get(type_name)
    market = types.get(type_name, {}).get("market", "on_demand")
    if entry is None:
        return None, market
    if market == "spot" and "spot" in entry:
        return float(entry["spot"]), "spot"
    return float(entry["on_demand"]), "on_demand"


def _gpu_busy() -> float | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout.split()
        return sum(float(v) for v in out) / len(out) / 100 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class Sampler:
    """CPU (and GPU) busy fraction of this node every `interval_s`, in a thread."""

    def __init__(self, interval_s: float = 2.0):
        import psutil

        self.psutil, self.interval_s = psutil, interval_s
        self.samples: list[list] = []
        self.stop_event = threading.Event()
        psutil.cpu_percent()  # the first call only starts the measurement
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop_event.wait(self.interval_s):
            self.samples.append([round(time.time(), 1), round(self.psutil.cpu_percent() / 100, 3), _gpu_busy()])
            if len(self.samples) > MAX_SAMPLES:
                self.samples = self.samples[::2]

    def stop(self) -> list[list]:
        self.stop_event.set()
        self.thread.join(timeout=10)
        return self.samples


class _RemoteSampler:
    def __init__(self, interval_s: float):
        self.sampler = Sampler(interval_s)

    def stop(self) -> list[list]:
        return self.sampler.stop()


def detection_bound_s() -> float | None:
    """How long the cluster takes to declare dead a node that went silent, from Ray's settings: gRPC's
    keepalive finds the connection dead (time + timeout), then the GCS's health checks fail `threshold`
    times, `period` apart. Measured (docs/reliability.md): 420 s with Ray's defaults (this gives 435),
    30-33 s with platform/ray-network.env (35). None where Ray's settings cannot be read."""
    try:
        from ray._raylet import Config

        return (Config.grpc_client_keepalive_time_ms() + Config.grpc_client_keepalive_timeout_ms()
                + Config.health_check_failure_threshold() * Config.health_check_period_ms()) / 1000
    except Exception:  # noqa: BLE001 - an internal API: without it the run still says what it lost
        return None


def _own_node() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - not connected: no node of its own to lose
        return None


class NodeWatch:
    """Says, the moment the cluster declares it dead, which node a run lost: its address and type, and how
    long into the run. A host cut off from the network looks like a slow one until then; the line names
    the host a stalled run is waiting on, and `lost` goes into the run's record."""

    def __init__(self, nodes: list[dict], interval_s: float, started: float):
        from strata.errors import log

        self.say = log("cluster").warning
        self.nodes = {n["NodeID"]: n for n in nodes}
        self.started, self.interval_s = started, interval_s
        self.own = _own_node()
        self.lost: list[dict] = []
        if bound := detection_bound_s():
            log("cluster").info(f"{len(nodes)} nodes; one that goes silent (cut off, not stopped) is declared dead "
                                f"within about {bound:.0f} s, and this run says which")
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import ray

        while not self.stop_event.wait(self.interval_s):
            try:
                dead = {n["NodeID"] for n in ray.nodes() if not n.get("Alive")}
            except Exception:  # noqa: BLE001 - the GCS itself out of reach: the run's own calls say so
                continue
            for nid in dead & set(self.nodes) - {x["node_id"] for x in self.lost}:
                n = self.nodes[nid]
                loss = {"node_id": nid, "address": n.get("NodeManagerAddress"), "type": node_type(n.get("Labels", {})),
                        "after_s": round(time.time() - self.started, 1)}
                self.lost.append(loss)
                said = f"lost node {loss['address']} ({loss['type']}, {nid[:8]}) {loss['after_s']:.0f} s into the run"
                if nid == self.own:  # this driver's host was cut off: Ray ends the driver with its node
                    self.say(f"{said}: this driver's own node: the cluster declared it dead (cut off from the "
                             "head?), so the run ends here (what it committed before stays); run it again to continue")
                else:
                    self.say(f"{said}: the cluster declared it dead; its work is retried on the nodes left")

    def stop(self) -> list[dict]:
        self.stop_event.set()
        self.thread.join(timeout=10)
        return self.lost


class UsageMonitor:
    """`with UsageMonitor() as usage:` around a run's work; then `usage.nodes(work_node_ids)`."""

    def __init__(self, interval_s: float = 2.0):
        self.interval_s = interval_s
        self.lost: list[dict] = []

    def __enter__(self) -> UsageMonitor:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.started = time.time()
        alive = [n for n in ray.nodes() if n.get("Alive")]
        self.labels = {n["NodeID"]: n.get("Labels", {}) for n in alive}
        self.resources = {n["NodeID"]: n.get("Resources", {}) for n in alive}
        self.here = ray.get_runtime_context().get_node_id()
        # One node (the embedded Ray): nothing to lose that the run would outlive.
        self.watch = NodeWatch(alive, self.interval_s, self.started) if len(alive) > 1 else None
        self.local = Sampler(self.interval_s)
        remote = ray.remote(num_cpus=0, max_restarts=0)(_RemoteSampler)
        self.remote = {
            nid: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nid, soft=False)).remote(self.interval_s)
            for nid, n in self.resources.items() if nid != self.here and (n.get("CPU") or n.get("GPU"))}
        return self

    def __exit__(self, *exc) -> None:
        import ray

        self.ended = time.time()
        self.lost = self.watch.stop() if self.watch else []
        self.series = {self.here: self.local.stop()}
        for nid, actor in self.remote.items():
            try:
                self.series[nid] = ray.get(actor.stop.remote(), timeout=30)
            except Exception:  # a node lost during the run: its samples went with it
                self.series[nid] = []
            ray.kill(actor)

    def nodes(self, work_nodes) -> list[dict]:
        """Per node that did the run's work: type, market, hours, busy fractions, cost."""
        prices, types = load_prices(), cluster_types()
        hours = (self.ended - self.started) / 3600
        out = []
        for nid in dict.fromkeys(work_nodes):
            labels = self.labels.get(nid, {})
            kind = node_type(labels)
            price, market = hourly_price(kind, prices, types)
            s = self.series.get(nid, [])
            cpu = [x[1] for x in s]
            gpu = [x[2] for x in s if x[2] is not None]
            out.append({"node_id": nid, "type": kind, "market": market, "hours": hours,
                        "price_per_hour": price, "cost": None if price is None else price * hours,
                        "cpu_busy": sum(cpu) / len(cpu) if cpu else None,
                        "gpu_busy": sum(gpu) / len(gpu) if gpu else None, "samples": s})
        return out


RAY_DAEMONS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "runtime_env", "ray_client_server")


def ray_daemon_cpu(since: dict[int, float] | None = None):
    """CPU seconds of Ray's own processes on this node (raylet, GCS, dashboard, agents): per pid now, or,
    given an earlier snapshot, the seconds used since it."""
    from strata.cluster.procs import processes

    now = {p.pid: p.cpu_s for p in processes().values()
           if any(d in p.cmdline for d in RAY_DAEMONS) and "ray::" not in p.cmdline and "default_worker" not in p.cmdline}
    if since is None:
        return now
    return round(sum(v - since.get(pid, 0.0) for pid, v in now.items()), 1)
