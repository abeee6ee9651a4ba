"""Tier 1's scaling shape: the same CPUs as one node or spread over several.

    python -m bench.scaling [--mb 50] [--workload A|B]

Two simulated clusters on 127.0.0.1 (Ray's `cluster_utils.Cluster`: real raylets, one machine): a head
that runs nothing plus one cpu-tier node of 2 CPUs, then the head plus two cpu-tier nodes of 1 CPU each.
The same preprocess run (the generated corpus of `bench.preprocess`; workload B: exact + near dedup,
whose index actors and lookups then cross nodes) runs on each, timed from its call to its return. The
last line is the throughput per CPU, two nodes / one node: 1.0 means spreading the work costs nothing.
(On one machine both shapes share its cores, so this measures what spreading costs, not what more
machines add.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def run_on(shape: list[int], paths: list[str], root: str, workload: str) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from pipelines.config import debug
    from pipelines.driver import run
    from strata.cluster import tiers
    from strata.data.storage import Storage

    temp = tempfile.mkdtemp(prefix="rays-", dir="/tmp")
    os.environ["RAY_TMPDIR"] = temp
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for cpus in shape:
            cluster.add_node(num_cpus=cpus, labels=tiers.node_labels(tiers.Tier.CPU))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        dedup = {} if workload == "B" else {"exact_dedup": False, "near_dedup": False}
        cfg = debug(f"scaling-{len(shape)}", read={"inputs": tuple(paths)}, dedup=dedup, clean={"min_chars": 1})
        t0 = time.perf_counter()
        out = run(cfg, Storage(root))
        seconds = time.perf_counter() - t0
        return {"seconds": seconds, "nodes": len(shape), "cpus": sum(shape), "tokens": out["tokens"],
                "documents": out["documents"]}
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=50, help="corpus size (default 50)")
    p.add_argument("--workload", choices=["A", "B"], default="B", help="A: tokenize only; B: dedup too (default)")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "strata-bench-scaling"))
    a = p.parse_args(argv)
    from bench.preprocess import generate

    paths = generate(os.path.join(a.workdir, f"corpus-{a.mb}mb"), a.mb)
    mb = sum(os.path.getsize(x) for x in paths) / 1e6
    results = {}
    for name, shape in (("one node of 2 CPUs", [2]), ("two nodes of 1 CPU", [1, 1])):
        root = os.path.join(a.workdir, "storage", str(len(shape)))
        shutil.rmtree(root, ignore_errors=True)
        r = results[name] = run_on(shape, paths, root, a.workload)
        print(f"{name}: {r['seconds']:.1f} s, {mb / r['seconds'] / r['cpus']:.2f} MB/s per CPU, "
              f"{r['tokens']:,} tokens, {r['documents']['kept']:,} kept", flush=True)
    one, two = results["one node of 2 CPUs"], results["two nodes of 1 CPU"]
    if one["tokens"] != two["tokens"] or one["documents"] != two["documents"]:
        print("warning: the two shapes published different data")
    print(f"ratio throughput per CPU, two nodes / one node (workload {a.workload}): {one['seconds'] / two['seconds']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
