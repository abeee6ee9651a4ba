"""Tier labels: one definition in strata, Ray-valid, and the same in cluster.yaml."""

from pathlib import Path

import pytest
import yaml
from conftest import REPO
from ray._private.label_utils import validate_label_selector, validate_node_label_syntax

from strata.cluster import tiers


def test_selectors_are_valid_ray_syntax_and_outside_ray_prefix():
    for t in tiers.Tier:
        sel = tiers.selector(t)
        assert validate_label_selector(sel) is None
        validate_node_label_syntax(tiers.node_labels(t))
        assert all(not k.startswith("ray.io/") for k in sel)


def test_local_node_serves_every_tier_and_others_only_theirs():
    assert tiers.tiers_of(tiers.local_node_labels()) == set(tiers.Tier)
    for t in tiers.Tier:
        assert tiers.tiers_of(tiers.node_labels(t)) == {t}
    assert tiers.tiers_of({}) == set()
    assert tiers.tiers_of({tiers.label_key(tiers.Tier.GPU): "false"}) == set()


def test_unknown_tier_is_an_error():
    with pytest.raises(ValueError):
        tiers.selector("tpu")


@pytest.fixture(scope="module")
def cluster():
    return yaml.safe_load((Path(REPO) / "cluster.yaml").read_text())


def test_cluster_yaml_passes_rays_own_validation(cluster):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(cluster))


def test_cluster_yaml_labels_are_the_tiers(cluster):
    types = cluster["available_node_types"]
    served = {name: tiers.tiers_of(t.get("labels") or {}) for name, t in types.items()}
    for name, t in types.items():
        labels = t.get("labels") or {}
        validate_node_label_syntax(labels)
        ours = {k for k in labels if k.startswith(tiers.LABEL_PREFIX + "/")}
        known = {tiers.label_key(x) for x in served[name]} | {tiers.autoscale_key(x) for x in
                                                               tiers.autoscaled_tiers(labels)}
        assert ours == known, f"{name}: unknown strata labels {ours - known}"
    assert served[cluster["head_node_type"]] == set(), "the head must not serve a tier"
    for t in tiers.Tier:
        assert any(t in s for s in served.values()), f"no node type serves the {t} tier"
    for name, t in types.items():
        if tiers.Tier.GPU in served[name]:
            assert t["resources"].get("GPU", 0) >= 1, f"{name} serves the gpu tier without GPUs"
    spot_types = [t for n, t in types.items() if tiers.Tier.SPOT in served[n]]
    assert any(t["node_config"].get("InstanceMarketOptions", {}).get("MarketType") == "spot" for t in spot_types)


def test_a_tiers_nodes_and_slots_count_only_alive_nodes_that_serve_it():
    def node(alive, cpus, *ts):
        return {"NodeID": f"n{cpus}", "Alive": alive, "Labels": tiers.node_labels(*ts), "Resources": {"CPU": cpus}}

    nodes = [node(True, 8, tiers.Tier.SPOT), node(True, 6, tiers.Tier.SPOT, tiers.Tier.CPU), node(False, 16, "spot"),
             node(True, 4, tiers.Tier.CPU), {"NodeID": "head", "Alive": True, "Labels": None, "Resources": {}}]
    assert [n["NodeID"] for n in tiers.nodes_of("spot", nodes)] == ["n8", "n6"]
    assert tiers.cpus_of(tiers.Tier.SPOT, nodes) == 14 and tiers.cpus_of(tiers.Tier.CPU, nodes) == 10
    assert tiers.cpus_of(tiers.Tier.SPOT, nodes, per=4) == 3 and tiers.cpus_of("spot", nodes, per=1.0) == 14
    assert tiers.cpus_of(tiers.Tier.SPOT, nodes, per=0.25) == 56 and tiers.nodes_of(tiers.Tier.GPU, nodes) == []
