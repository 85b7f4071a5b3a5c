"""The routing ConfigMap's bucket table edited by hand, each version keeping its count of buckets (the
shares stay right, but users change version): the operator puts back the table it published, with a
DriftRepaired Event naming the field, also beside new weights and when a GitOps tool re-applies an old
copy; after a restart it remembers nothing and adopts the live table (never all-stable); and it never
puts its own table back over a newer one another operator instance wrote."""

from __future__ import annotations

import json
from typing import Any

import kubernetes
import pytest
import yaml

from mnn_rollout.contract.routing import decode, encode, evolve
from rollout_operator import children
from rollout_operator.kube import KubeClient
from rollout_operator.ports import REPAIRED, ClusterPorts
from rollout_operator.spec import parse_spec
from testbed.cluster import Cluster, wait_for
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_e2e_autoscaling import k8s_emulator, owners  # noqa: F401 - the fixtures
from tests.operator.test_e2e_basic import ready_cluster

pytestmark = pytest.mark.timeout(240)
ROUTING = "/api/v1/namespaces/default/configmaps/scorer-routing"
TABLE_FIELD = "data[runtime.yaml].routing.table.buckets"


def table_of(cm: dict[str, Any]) -> tuple[str, ...]:
    owners = children.published_owners(cm)
    assert owners is not None
    return owners


def rotated(cm: dict[str, Any]) -> tuple[dict[str, str], tuple[str, ...]]:
    """The ConfigMap's data with every bucket's version moved to the next bucket (same counts), and that table."""
    config = yaml.safe_load(cm["data"]["runtime.yaml"])
    owners = table_of(cm)
    owners = owners[1:] + owners[:1]
    config["routing"]["table"] = encode(owners)
    return {"runtime.yaml": yaml.safe_dump(config, sort_keys=False)}, owners


def hand_edit(cluster: Cluster) -> tuple[str, ...]:
    """``kubectl edit`` of the table (the spec-hash annotation kept); returns the edited table."""
    _, cm = cluster.emu.request("GET", ROUTING)
    data, owners = rotated(cm)
    cluster.emu.kubectl("patch", "configmap", "scorer-routing", "--type", "merge", "-p", json.dumps({"data": data}))
    return owners


def live_table(cluster: Cluster) -> tuple[str, ...]:
    return table_of(cluster.emu.request("GET", ROUTING)[1])


def repairs(cluster: Cluster) -> str:
    return " | ".join(e.get("message", "") for e in cluster.events() if e["reason"] == "DriftRepaired")


def test_a_table_edited_by_hand_is_put_back_and_named_also_beside_new_weights(cluster: Cluster) -> None:
    ready_cluster(cluster, weights={"v1": 90, "v2": 10})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 30, "weights 90/10")
    published = live_table(cluster)
    edited = hand_edit(cluster)
    moved = sum(a != b for a, b in zip(published, edited))
    assert moved > 1000  # users moved between v1 and v2, 1000 buckets of v2 all the same
    # before: adopted as the next table's base, re-stamped ("updated"), never put back, nothing said
    wait_for(lambda: live_table(cluster) == published, 30, "the published table put back")
    wait_for(lambda: f"ConfigMap/scorer-routing {TABLE_FIELD}" in repairs(cluster), 20, "DriftRepaired naming it")

    # edited again, and the weights change at once: the new table is the published one evolved
    hand_edit(cluster)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":80,"v2":20}}}')
    want = evolve(published, {"v1": 80, "v2": 20}, "v1", cluster.published_table().salt)
    wait_for(lambda: live_table(cluster) == want, 30, "80/20 evolved from the published table")


def test_an_old_copy_a_gitops_tool_applies_again_is_put_back(cluster: Cluster) -> None:
    ready_cluster(cluster, weights={"v1": 90, "v2": 10})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 30, "weights 90/10")
    _, old = cluster.emu.request("GET", ROUTING)
    for weights in ({"v1": 50, "v2": 50}, {"v1": 90, "v2": 10}):  # out and back: other users on v2
        patch = json.dumps({"spec": {"weights": weights}})
        cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", patch)
        wait_for(lambda: cluster.configmap_weights() == weights, 30, f"weights {weights}")
    published = live_table(cluster)
    assert published != table_of(old) and published.count("v2") == table_of(old).count("v2")
    # the old copy, as exported then: its annotation is the stamp of what it holds
    old["metadata"] = {k: v for k, v in old["metadata"].items()
                       if k in ("name", "namespace", "labels", "annotations", "ownerReferences")}
    assert children.stamp_holds(old)
    cluster.emu.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(old))
    # before: adopted (its stamp is an operator's), its users on v2 kept, nothing said
    wait_for(lambda: live_table(cluster) == published, 30, "the published table put back")
    wait_for(lambda: TABLE_FIELD in repairs(cluster), 20, "DriftRepaired naming it")


def test_after_a_restart_the_live_table_is_adopted_never_reset(cluster: Cluster) -> None:
    ready_cluster(cluster, weights={"v1": 90, "v2": 10})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 30, "weights 90/10")
    cluster.operators[0].stop()
    edited = hand_edit(cluster)
    _, cm = cluster.emu.request("GET", ROUTING)
    assert not children.stamp_holds(cm)  # detectable: the content no longer matches its stamp
    cluster.start_operator()
    # the restarted operator remembers no table of its own: it stamps the live one as it is
    wait_for(lambda: children.stamp_holds(cluster.emu.request("GET", ROUTING)[1]), 30, "the ConfigMap re-stamped")
    assert live_table(cluster) == edited  # not all v1's: no canary user moved again
    assert cluster.configmap_weights() == {"v1": 90, "v2": 10}


def test_another_instances_newer_table_is_adopted_never_overwritten(
        k8s_emulator: EmulatorProcess, owners: dict[str, dict[str, Any]]) -> None:  # noqa: F811 - the fixtures
    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, {"name": "v2", "uri": "/m/v2.mnn"}]})
    # a live owner: the emulator's garbage collector deletes a child whose owner is missing 0.2 s after a write
    target = children.Target("scorer", "default", children.owner_reference(owners["scorer"]))
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(k8s_emulator.kubeconfig_path), client_configuration=cfg)
    kube = KubeClient(cfg, backoff_base=0.02)

    def configmap(ports: ClusterPorts, weights: dict[str, int]) -> dict[str, Any]:
        config = children.runtime_config(spec, "scorer", weights, "v1", ["v1", "v2"], ports.published_table(target))
        return children.render_configmap(target, config)

    try:
        a, b = ClusterPorts(kube), ClusterPorts(kube)  # two operator instances (kopf peering: one active at a time)
        assert a.write_children([configmap(a, {"v1": 90, "v2": 10})]) == {"ConfigMap/scorer-routing": "created"}
        ours = table_of(kube.get("ConfigMap", "default", "scorer-routing"))
        for weights in ({"v1": 50, "v2": 50}, {"v1": 90, "v2": 10}):  # b takes over
            b.write_children([configmap(b, weights)])
        newer = table_of(kube.get("ConfigMap", "default", "scorer-routing"))
        assert newer != ours
        assert a.published_table(target) == newer  # a resumes: b's write is adopted, a's own is stale
        # b's write edited by hand: b (whose write it was) puts it back; a cannot know b's table and adopts it
        data, edited = rotated(kube.get("ConfigMap", "default", "scorer-routing"))
        kube.patch("ConfigMap", "default", "scorer-routing", {"data": data})
        assert b.published_table(target) == newer
        assert a.published_table(target) == edited
        (result,) = b.write_children([configmap(b, {"v1": 90, "v2": 10})]).values()
        assert result == f"{REPAIRED}{TABLE_FIELD}"
        assert table_of(kube.get("ConfigMap", "default", "scorer-routing")) == newer
        # the ConfigMap deleted: recreated with the table published, not all v1's
        kube.delete("ConfigMap", "default", "scorer-routing")
        last = configmap(b, {"v1": 90, "v2": 10})
        assert b.write_children([last]) == {"ConfigMap/scorer-routing": "created"}
        assert table_of(kube.get("ConfigMap", "default", "scorer-routing")) == newer
        # the ModelDeployment deleted (its children go by garbage collection): nothing of theirs is kept
        kube.delete("ConfigMap", "default", "scorer-routing")
        b.cache.forget_owner("default", "another")
        assert b.published_table(target) == newer and not b.cache.differs(last)
        b.cache.forget_owner("default", "scorer")
        assert b.published_table(target) is None and b.cache.differs(last)
    finally:
        kube.close()
