"""Where training runs: GPUs of the gpu tier, or the CPU only when asked or on the embedded local Ray.

`plan()` is a pure function of the alive nodes and the flags, unit-tested
without Ray. `place()` asks the cluster: when GPU workers are wanted and none
are up (a cold cluster whose GPU node types start at zero), it asks Ray's
autoscaler for them and waits, saying what it waits for, up to `--gpu-wait-s`.
A run never falls back to the CPU silently, never has zero workers, and never
spans GPU models unless asked (DDP steps at the pace of the slowest GPU).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from strata.cluster import tiers
from strata.commands.shell import log as _logger

_log = _logger("train")

ACCELERATOR_PREFIX = "accelerator_type:"


class PlacementError(ValueError):
    """No placement satisfies the request."""


@dataclass(frozen=True)
class Plan:
    workers: int
    use_gpu: bool
    accelerator: str | None
    """The one GPU model all workers run on (None: CPU, or several models when allowed)."""
    why: str
    """The start-up line's account of the choice."""


def gpu_inventory(nodes: list[dict]) -> Counter:
    """GPUs of alive gpu-tier nodes, by model (`accelerator_type:<model>` resource; `unknown` without)."""
    inv: Counter = Counter()
    for n in tiers.nodes_of(tiers.Tier.GPU, nodes):
        if not (gpus := int(n.get("Resources", {}).get("GPU", 0))):
            continue
        models = [k[len(ACCELERATOR_PREFIX):] for k in n["Resources"] if k.startswith(ACCELERATOR_PREFIX)]
        inv[models[0] if models else "unknown"] += gpus
    return inv


def plan(nodes: list[dict], *, embedded: bool, workers: int | None = None, use_gpu: bool | None = None,
         allow_mixed: bool = False) -> Plan | None:
    """The placement, or None while the GPUs it needs are not up yet (the caller waits for them)."""
    if workers is not None and workers < 1:
        raise PlacementError(f"--workers {workers}: a run needs at least one worker")
    if use_gpu is False:
        return Plan(workers or 1, False, None, "CPU training, as asked (--no-use-gpu)")
    inv = gpu_inventory(nodes)
    if not inv:
        if embedded and use_gpu is None:
            return Plan(workers or 1, False, None, "CPU training: the embedded local Ray has no GPU")
        return None
    model, most = inv.most_common(1)[0]
    want = workers or most
    if most >= want:
        return Plan(want, True, None if model == "unknown" else model,
                    f"{want} GPU worker(s) on {model} (gpu tier: {_describe(inv)})")
    if sum(inv.values()) >= want:
        if not allow_mixed:
            raise PlacementError(f"{want} workers would span GPU models ({_describe(inv)}); DDP runs at the "
                                 "slowest one's pace: use fewer --workers, or --allow-mixed-gpus")
        return Plan(want, True, None, f"{want} GPU worker(s) across models {_describe(inv)} (--allow-mixed-gpus)")
    return None


def _describe(inv: Counter) -> str:
    return ", ".join(f"{n}x {m}" for m, n in inv.most_common())


SAY_EVERY_S = 60.0  # while waiting for GPUs, a line a minute


def max_gpus() -> int | None:
    """The most GPUs the cluster's autoscaler could bring up, by its node types (None: no autoscaler
    config, so no node comes that is not up already).

    Ray Train asks the same of the autoscaler's config before it waits for workers
    (`WorkerGroup._check_cluster_resources_and_raise_if_insufficient`); no public API says it, so this reads
    Ray's `ray._private.state`. tests/test_placement.py writes such a config and fails if the call goes, and
    tests/test_ray_internals.py pins its shape."""
    from ray._private.state import state

    most = state.get_max_resources_from_cluster_config()
    return None if most is None else int(most.get("GPU", 0))


def place(*, embedded: bool, workers: int | None, use_gpu: bool | None, allow_mixed: bool,
          wait_s: float, poll_s: float = 5.0, log=None) -> Plan:
    """`plan()` against the live cluster; asks the autoscaler for GPUs and waits for them when it can
    bring them, and fails at once when nothing can."""
    import ray

    log = log or (_log.info)
    started, asked, said = time.time(), False, time.time()
    while (p := plan(ray.nodes(), embedded=embedded, workers=workers, use_gpu=use_gpu,
                     allow_mixed=allow_mixed)) is None:
        waited = time.time() - started
        up = _describe(gpu_inventory(ray.nodes())) or "none"
        if not asked:
            most = max_gpus()
            if not most:
                raise PlacementError(
                    f"training wants {workers or 1} GPU(s) on the gpu tier and this cluster can never have "
                    f"them: {up} up, and {'no autoscaler config' if most is None else 'no node type with GPUs'} "
                    "to start more. Train on CPU with --no-use-gpu")
            _request_gpus(workers or 1)
            asked = True
            log(f"waiting for {workers or 1} GPU(s) on the gpu tier ({up} up): the autoscaler can start up to "
                f"{most}; the wait ends when they join, or fails after --gpu-wait-s {wait_s:g} s "
                "(--no-use-gpu trains on CPU instead)")
        elif waited >= wait_s:
            raise PlacementError(
                f"no {workers or 1} GPU(s) on the gpu tier after {waited:.0f} s (--gpu-wait-s {wait_s:g}); "
                f"up now: {up}. Train on CPU with --no-use-gpu")
        elif time.time() - said >= SAY_EVERY_S:
            log(f"still waiting for {workers or 1} GPU(s) on the gpu tier: {up} up ({waited:.0f} s of "
                f"--gpu-wait-s {wait_s:g})")
            said = time.time()
        time.sleep(min(poll_s, max(0.1, wait_s - waited)))
    if asked:
        _request_gpus(0)  # the GPUs are up: drop the standing request, the run's own demand keeps them
    return p


def _request_gpus(n: int) -> None:
    """Ask Ray's autoscaler for n one-GPU bundles on the gpu tier (0: withdraw the request)."""
    from ray.autoscaler.sdk import request_resources

    try:
        request_resources(bundles=[{"GPU": 1}] * n)
    except Exception as e:  # noqa: BLE001 - no autoscaler (a fixed cluster): waiting is all there is
        _log.info(f"could not ask the autoscaler for GPUs ({e}); waiting for them to appear")
