"""The children's watch: an object a ModelDeployment owns that is none of its children (a user's
ConfigMap given an ownerReference so that it is garbage-collected with it) is not watched as one:
it wakes no reconcile, is not cached, and a re-list (which lists by the owner label) does not
report it deleted while unwatched. A real child stripped of its label is still watched."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import kopf
import kubernetes
import pytest
import yaml

from rollout_operator import children, main
from rollout_operator.kube import KubeClient
from rollout_operator.ports import ADOPTED, CREATED_AS, KEPT, NOT_REPAIRED, ClusterPorts
from rollout_operator.reconcile import Reconciler
from rollout_operator.spec import parse_spec
from rollout_operator.status import RolloutStatus
from rollout_operator.wakeups import WakeUps
from testbed.cluster import Cluster, wait_for
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_e2e_autoscaling import k8s_emulator, kube, owners, rendered  # noqa: F401 - the fixtures
from tests.operator.test_e2e_basic import ready_cluster
from tests.operator.test_kube_client import Scripted, make_client, scripted, status  # noqa: F401 - fixtures
from tests.operator.test_review5_routing_edit import ROUTING, rotated, table_of
from tests.operator.test_review_handedits import MirroringKube

pytestmark = pytest.mark.timeout(240)


def _event(memo: Any, body: dict[str, Any], event_type: str | None) -> None:
    """One watch event of a ConfigMap, as kopf hands it to the children's handler."""
    labels = (body.get("metadata") or {}).get("labels") or {}
    asyncio.run(main._child_changed(body=kopf.Body(body), type=event_type, labels=labels, memo=memo))


def test_an_object_a_modeldeployment_owns_that_is_no_child_is_not_watched(
        k8s_emulator: EmulatorProcess, owners: dict[str, dict[str, Any]], kube: KubeClient) -> None:  # noqa: F811
    ports = ClusterPorts(kube)
    ports.cache.sync(kube, ["default"])
    wakeups = WakeUps(SimpleNamespace(ports=ports), post=lambda *_: None, workers=1)  # type: ignore[arg-type]
    woken: list[tuple[str, str]] = []
    wakeups.wake = woken.append  # type: ignore[method-assign]
    memo = SimpleNamespace(wakeups=wakeups)
    try:
        owner = dict(children.owner_reference(owners["scorer"]))
        mine = kube.create({"apiVersion": "v1", "kind": "ConfigMap", "data": {"a": "1"}, "metadata": {
            "name": "scorer-notes", "namespace": "default", "ownerReferences": [owner]}})
        mine.setdefault("kind", "ConfigMap")
        for n in range(3):  # created, then edited by its user
            _event(memo, {**mine, "data": {"a": str(n)}}, "ADDED" if n == 0 else "MODIFIED")
        # before: cached and waking scorer at each change; the next re-list reported it deleted while
        # unwatched (kopf's log: "re-list of ConfigMap: 1 owner(s) had objects deleted while unwatched")
        assert woken == []
        assert ports.cache.live(mine) is None
        assert ports.cache.relist(kube, "ConfigMap", ["default"]) == set()

        # the routing ConfigMap, a child, stripped of its owner label by hand: still watched, wakes its owner
        routing = rendered({}, owners["scorer"])["ConfigMap"]
        assert ports.write_children([routing]) == {"ConfigMap/scorer-routing": "created"}
        stripped = kube.patch("ConfigMap", "default", "scorer-routing",
                              {"metadata": {"labels": {children.OWNER_LABEL: None}}})
        stripped.setdefault("kind", "ConfigMap")
        _event(memo, stripped, "MODIFIED")
        assert woken == [("default", "scorer")]
        assert ports.cache.live(routing) == stripped
    finally:
        wakeups.close()


@pytest.mark.parametrize("kind, name", [("ConfigMap", "scorer-routing"), ("Service", "scorer"),
                                        ("Deployment", "scorer-runtime"), ("ServiceAccount", "scorer-runtime"),
                                        ("Role", "scorer-runtime"), ("RoleBinding", "scorer-runtime"),
                                        ("PodDisruptionBudget", "scorer-runtime"),
                                        ("HorizontalPodAutoscaler", "scorer-runtime")])
def test_child_name_is_the_name_each_rendered_child_has(kind: str, name: str) -> None:
    spec = {"runtime": {"autoscaling": {"minReplicas": 1, "maxReplicas": 3, "targetCPUUtilizationPercentage": 50}}}
    assert rendered(spec)[kind]["metadata"]["name"] == name == children.child_name(kind, "scorer")


# -- the children's writes (ports.ClusterPorts.write_children) ---------------------------------------------


def test_the_apply_that_creates_a_child_is_checked_as_later_ones_are(k8s_emulator: EmulatorProcess) -> None:
    """A mutating webhook rewrites the image of every Deployment written, the first one too."""
    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}]})
    target = children.Target("mirrored", "default")
    deployment = children.render_deployment(target, spec, children.runtime_config(spec, "mirrored", {"v1": 100},
                                                                                  "v1", ["v1"]))
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(k8s_emulator.kubeconfig_path), client_configuration=cfg)
    mirroring = MirroringKube(cfg, backoff_base=0.02)
    try:
        ports = ClusterPorts(mirroring)
        ports.cache.synced = True
        (result,) = ports.write_children([deployment]).values()
        # before: "created", the image the webhook put there unseen until a second apply
        assert result.startswith(NOT_REPAIRED) and result.endswith(CREATED_AS), result
        assert "spec.template.spec.containers[0].image = 'mirror.example/" in result
        events = Reconciler._child_events(True, RolloutStatus(), RolloutStatus(), {"Deployment/mirrored-runtime":
                                                                                   result})
        assert [(e.type, e.reason) for e in events] == [("Warning", "DriftNotRepaired"), ("Normal", "ChildrenCreated")]
        assert events[1].message == "created Deployment/mirrored-runtime"
        writes = len(k8s_emulator.write_requests("deployments"))
        (again,) = ports.write_children([deployment]).values()  # said once, not applied again at once
        assert again.startswith(KEPT) and len(k8s_emulator.write_requests("deployments")) == writes
    finally:
        mirroring.close()


def _routing(owner: dict[str, Any], ports: ClusterPorts, weights: dict[str, int]) -> dict[str, Any]:
    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, {"name": "v2", "uri": "/m/v2.mnn"}]})
    target = children.Target("scorer", "default", children.owner_reference(owner))
    config = children.runtime_config(spec, "scorer", weights, "v1", ["v1", "v2"], ports.published_table(target))
    return children.render_configmap(target, config)


def test_a_routing_table_edited_while_no_operator_watched_is_said_when_found(
        k8s_emulator: EmulatorProcess, owners: dict[str, dict[str, Any]], kube: KubeClient) -> None:  # noqa: F811
    before = ClusterPorts(kube)
    assert before.write_children([_routing(owners["scorer"], before, {"v1": 90, "v2": 10})]) == {
        "ConfigMap/scorer-routing": "created"}
    # the operator stops; its table is edited, each version keeping its count of buckets (users change version)
    data, edited = rotated(kube.get("ConfigMap", "default", "scorer-routing") or {})
    kube.patch("ConfigMap", "default", "scorer-routing", {"data": data})
    restarted = ClusterPorts(kube)  # remembers nothing: the live table is all it has
    (result,) = restarted.write_children([_routing(owners["scorer"], restarted, {"v1": 90, "v2": 10})]).values()
    # before: "updated" (re-stamped), nothing said
    assert result.startswith(ADOPTED), result
    assert table_of(kube.get("ConfigMap", "default", "scorer-routing") or {}) == edited  # kept: never all-stable
    events = Reconciler._child_events(False, RolloutStatus(), RolloutStatus(), {"ConfigMap/scorer-routing": result})
    assert [(e.type, e.reason) for e in events] == [("Warning", "DriftAdopted")]
    assert "ConfigMap/scorer-routing edited while no operator watched" in events[0].message


def _away(cluster: Cluster, weights: dict[str, int] | None = None) -> tuple[str, ...]:
    """The operator stopped, its routing table edited by hand (each version keeping its count of
    buckets), with ``weights`` too, and started again: returns the edited table."""
    cluster.operators[-1].stop()
    _, cm = cluster.emu.request("GET", ROUTING)
    data, edited = rotated(cm)
    if weights is not None:
        config = yaml.safe_load(data["runtime.yaml"])
        config["weights"] = weights
        data = {"runtime.yaml": yaml.safe_dump(config, sort_keys=False)}
    cluster.emu.kubectl("patch", "configmap", "scorer-routing", "--type", "merge", "-p", json.dumps({"data": data}))
    cluster.start_operator()
    return edited


def test_a_restarted_operator_says_what_it_found_edited_in_the_routing_table(cluster: Cluster) -> None:
    ready_cluster(cluster, weights={"v1": 90, "v2": 10})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 30, "weights 90/10")
    edited = _away(cluster)
    # the table is kept as found (the operator remembers none of its own), now with a Warning saying so
    # (before: re-stamped without a word)
    wait_for(lambda: any("ConfigMap/scorer-routing edited while no operator watched" in e.get("message", "")
                         for e in cluster.events() if e["reason"] == "DriftAdopted"), 30, "DriftAdopted")
    assert table_of(cluster.emu.request("GET", ROUTING)[1]) == edited
    # the weights edited too: put back, and said as the same edit seen live is (before: put back without a word)
    _away(cluster, {"v1": 0, "v2": 100})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 30, "the weights put back")
    wait_for(lambda: any("ConfigMap/scorer-routing data[runtime.yaml].weights.v1" in e.get("message", "")
                         for e in cluster.events() if e["reason"] == "DriftRepaired"), 20, "DriftRepaired naming them")


# -- a child the cache lost with its owner label: the apply's 200 says it was there ---------------------------


@pytest.mark.parametrize("lost_by", ["re-list", "restart"])
def test_a_child_whose_owner_label_was_removed_is_repaired_not_recreated_after_a_relist(
        lost_by: str, k8s_emulator: EmulatorProcess, owners: dict[str, dict[str, Any]],  # noqa: F811
        kube: KubeClient) -> None:  # noqa: F811
    ports = ClusterPorts(kube)
    ports.cache.sync(kube, ["default"])
    objs = rendered({}, owners["scorer"])
    service = objs["Service"]
    assert ports.write_children([service]) == {"Service/scorer": "created"}
    kube.patch("Service", "default", "scorer", {"metadata": {"labels": {children.OWNER_LABEL: None}}})
    if lost_by == "re-list":  # after a watch's 410 Gone: the list, by the owner label, has it no more
        assert ports.cache.relist(kube, "Service", ["default"]) == {("default", "scorer")}
    else:
        ports = ClusterPorts(kube)
        ports.cache.sync(kube, ["default"])
    assert ports.cache.live(service) is None
    k8s_emulator.reset_requests()
    written = ports.write_children([service])
    # before: "created", and a Warning ChildrenRecreated "created Service/scorer" for a label put back
    assert written == {"Service/scorer": f"repaired: metadata.labels[{children.OWNER_LABEL}]"}
    assert [(r["method"], r["resource"]) for r in k8s_emulator.requests()] == [("PATCH", "services")]  # no read
    assert ((kube.get("Service", "default", "scorer") or {})["metadata"].get("labels") or {}).get(
        children.OWNER_LABEL) == "scorer"
    events = Reconciler._child_events(False, RolloutStatus(), RolloutStatus(), written)
    assert [(e.type, e.reason) for e in events] == [("Warning", "DriftRepaired")]
    assert f"Service/scorer metadata.labels[{children.OWNER_LABEL}]" in events[0].message
    assert ports.write_children([service]) == {"Service/scorer": "unchanged"}  # held again: no request
    # a child truly new, the cache not holding it either: still created
    assert ports.write_children([objs["ServiceAccount"]]) == {"ServiceAccount/scorer-runtime": "created"}
    kube.delete("Service", "default", "scorer")
    ports.cache.relist(kube, "Service", ["default"])
    written = ports.write_children([service])
    assert written == {"Service/scorer": "created"}
    events = Reconciler._child_events(False, RolloutStatus(), RolloutStatus(), written)
    assert [(e.type, e.reason, e.message) for e in events] == [("Warning", "ChildrenRecreated",
                                                                 "created Service/scorer")]


@pytest.mark.parametrize("script, created", [
    ([(201, {}, {"kind": "ConfigMap"})], True),
    ([(200, {}, {"kind": "ConfigMap"})], False),
    # a 503 the server may have acted on: the repeat's 200 may answer the object the first attempt created
    ([(503, {}, status(503, "ServiceUnavailable", "x")), (200, {}, {"kind": "ConfigMap"})], True),
    ([(429, {}, status(429, "TooManyRequests", "x")), (200, {}, {"kind": "ConfigMap"})], False),  # not acted on
])
def test_apply_created_says_from_the_answer_whether_the_apply_created_the_object(
        script: list[Any], created: bool, scripted: Scripted, make_client: Any) -> None:
    scripted.script = list(script)
    kube = make_client(scripted.url)
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "default"}}
    assert kube.apply_created(obj) == ({"kind": "ConfigMap"}, created)
    assert [(method, path.split("?")[0]) for _, method, path, *_ in scripted.seen] == [
        ("PATCH", "/api/v1/namespaces/default/configmaps/x")] * len(script)
    scripted.script = [(201, {}, {"kind": "ConfigMap"})]
    assert kube.apply(obj) == {"kind": "ConfigMap"}
