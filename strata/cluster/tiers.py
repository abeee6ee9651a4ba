"""The tiers are node labels, defined here once.

A node serves a tier when it carries that tier's label with value "true". Code
asks for a tier (`selector(Tier.CPU)`), never for an instance type. One label per
tier (rather than one `tier` key with several values) lets the embedded local
node serve every tier at once, so the same selectors work on a laptop.
"""

from __future__ import annotations

import enum

LABEL_PREFIX = "strata.io"  # our own prefix: `ray.io/` is reserved for Ray.
LABEL_VALUE = "true"


class Tier(enum.StrEnum):
    CPU = "cpu"  # preprocessing: Ray Data map work
    GPU = "gpu"  # training: TorchTrainer workers
    SPOT = "spot"  # sweeps: Ray Tune trials on preemptible CPU nodes


def label_key(tier: Tier | str) -> str:
    """The node label key that marks a node as serving `tier`."""
    return f"{LABEL_PREFIX}/{Tier(tier).value}"


def selector(tier: Tier | str) -> dict[str, str]:
    """The `label_selector` that places work on nodes of `tier`."""
    return {label_key(tier): LABEL_VALUE}


def node_labels(*tiers: Tier | str) -> dict[str, str]:
    """Labels for a node that serves `tiers` (as `ray start --labels` or cluster.yaml)."""
    return {label_key(t): LABEL_VALUE for t in tiers}


def local_node_labels() -> dict[str, str]:
    """Labels of the embedded local node: it satisfies every tier's selector."""
    return node_labels(*Tier)


def tiers_of(labels: dict[str, str]) -> set[Tier]:
    """Which tiers a node with `labels` serves."""
    return {t for t in Tier if labels.get(label_key(t)) == LABEL_VALUE}


def autoscale_key(tier: Tier | str) -> str:
    """The label by which a node (the head of an autoscaling cluster) announces that the autoscaler starts
    nodes of `tier` on demand: every worker type of cluster.yaml starts at zero, so a cold cluster has no
    node of the tier yet, and a job that needs one must still be let through (strata.commands.submit)."""
    return f"{LABEL_PREFIX}/autoscales-{Tier(tier).value}"


def autoscale_labels(*tiers: Tier | str) -> dict[str, str]:
    return {autoscale_key(t): LABEL_VALUE for t in tiers}


def autoscaled_tiers(labels: dict[str, str]) -> set[Tier]:
    """Which tiers a node with `labels` announces as started on demand."""
    return {t for t in Tier if labels.get(autoscale_key(t)) == LABEL_VALUE}


def nodes_of(tier: Tier | str, nodes: list[dict]) -> list[dict]:
    """The alive nodes of `nodes` (as `ray.nodes()` gives them) that serve `tier`."""
    return [n for n in nodes if n.get("Alive") and Tier(tier) in tiers_of(n.get("Labels") or {})]


def cpus_of(tier: Tier | str, nodes: list[dict], per: float | None = None) -> float | int:
    """CPUs of the alive nodes of `tier`; with `per`, how many whole slots of `per` CPUs they hold (a slot
    does not span nodes)."""
    cpus = [n.get("Resources", {}).get("CPU", 0) for n in nodes_of(tier, nodes)]
    return sum(cpus) if per is None else sum(int(c // per) for c in cpus)


def format_labels(labels: dict[str, str]) -> str:
    """`k=v,k=v`, the syntax of `ray start --labels`."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
