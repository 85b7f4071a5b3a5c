"""``spec.runtime.autoscaling``: an HPA child on the runtime Deployment, which then owns its replicas.

First the server-side apply mechanics against the API emulator through the operator's own ports
(the replicas handed over when the operator lets go of them, only an owned HPA deleted), then the
whole loop with the operator process and the kubelet stand-in. There is no HPA controller here:
the tests scale the Deployment the way it would (an Update of spec.replicas by another manager)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import kubernetes
import pytest

from rollout_operator import children
from rollout_operator.kube import FIELD_MANAGER, KubeClient
from rollout_operator.ports import DELETED, HANDOVER_MANAGER, ClusterPorts
from rollout_operator.spec import parse_spec
from testbed.cluster import CRD, Cluster, wait_for
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_e2e_basic import ready_cluster

pytestmark = pytest.mark.timeout(240)
RUNTIME = "/apis/apps/v1/namespaces/default/deployments/scorer-runtime"
HPA = "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers/scorer-runtime"
MERGE = "application/merge-patch+json"
HPA_MANAGER = "horizontal-pod-autoscaler"
VERSIONS = [{"name": "v1", "uri": "/m/v1.mnn"}]
IN_FLIGHT = {"minReplicas": 1, "maxReplicas": 4, "targetInFlightPerPod": 8}


def hpa_scales(emu: EmulatorProcess, replicas: int) -> None:
    """What the HPA controller does: an Update of the Deployment's replicas under its own manager."""
    code, body = emu.request("PATCH", f"{RUNTIME}?fieldManager={HPA_MANAGER}", {"spec": {"replicas": replicas}},
                             content_type=MERGE)
    assert code == 200, body


def replicas_owners(deployment: dict[str, Any]) -> set[str]:
    return {e["manager"] for e in deployment["metadata"].get("managedFields") or []
            if "f:replicas" in (e.get("fieldsV1") or {}).get("f:spec", {})}


# -- the ports against the emulator ------------------------------------------------------------


@pytest.fixture
def k8s_emulator(k8s_emulator_factory: Callable[..., EmulatorProcess]) -> EmulatorProcess:
    """With the CRD, so the children's owners can exist: the garbage collector deletes a child
    whose owner is missing a moment after it is written, as a real one does."""
    return k8s_emulator_factory(crds=[CRD])


@pytest.fixture
def owners(k8s_emulator: EmulatorProcess) -> dict[str, dict[str, Any]]:
    """Two live ModelDeployments: ``scorer`` and ``other``."""
    made = {}
    for name in ("scorer", "other"):
        code, body = k8s_emulator.request(
            "POST", "/apis/mnnrollout.io/v1alpha1/namespaces/default/modeldeployments",
            {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment",
             "metadata": {"name": name, "namespace": "default"}, "spec": {"versions": VERSIONS}})
        assert code == 201, body
        made[name] = dict(body)
    return made


@pytest.fixture
def kube(k8s_emulator: EmulatorProcess) -> Iterator[KubeClient]:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(k8s_emulator.kubeconfig_path), client_configuration=cfg)
    client = KubeClient(cfg, backoff_base=0.02)
    yield client
    client.close()


def rendered(spec: dict[str, Any], owner: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The children of a ModelDeployment ``scorer``; ``owner`` (a live object) owns them."""
    parsed = parse_spec({"versions": VERSIONS, **spec})
    body = owner or {"apiVersion": "mnnrollout.io/v1alpha1", "metadata": {"name": "scorer", "uid": "u-1"}}
    target = children.Target("scorer", "default", children.owner_reference(body))
    config = children.runtime_config(parsed, "scorer", {"v1": 100}, "v1", ["v1"])
    return {o["kind"]: o for o in children.render_all(target, parsed, config)}


def test_server_side_apply_drops_a_field_its_only_manager_stops_applying(owners: dict[str, dict[str, Any]],
                                                                        kube: KubeClient) -> None:
    """Why the operator hands replicas over: left out of the next apply, a field only its manager
    owned is removed (a real API server then defaults a Deployment's replicas to 1)."""
    deployment = rendered({"runtime": {"replicas": 3}}, owners["scorer"])["Deployment"]
    assert kube.apply(deployment)["spec"]["replicas"] == 3
    without = rendered({"runtime": {"replicas": 3, "autoscaling": IN_FLIGHT}}, owners["scorer"])["Deployment"]
    assert kube.apply(without)["spec"]["replicas"] == 1  # removed, then defaulted


def test_switching_to_autoscaling_keeps_the_replicas_and_leaves_them_to_the_hpa(
        k8s_emulator: EmulatorProcess, owners: dict[str, dict[str, Any]], kube: KubeClient) -> None:
    ports = ClusterPorts(kube)
    fixed = rendered({"runtime": {"replicas": 3}}, owners["scorer"])
    assert ports.write_children([fixed["Deployment"]]) == {"Deployment/scorer-runtime": "created"}
    scaled = rendered({"runtime": {"replicas": 3, "autoscaling": IN_FLIGHT}}, owners["scorer"])
    written = ports.write_children([scaled["Deployment"], scaled["HorizontalPodAutoscaler"]])
    assert written == {"Deployment/scorer-runtime": "updated", "HorizontalPodAutoscaler/scorer-runtime": "created"}
    live = kube.get("Deployment", "default", "scorer-runtime")
    assert live is not None and live["spec"]["replicas"] == 3
    assert replicas_owners(live) == {HANDOVER_MANAGER}  # no longer the operator's own manager
    # the HPA scales: the operator's next write sees no drift and leaves the value alone
    hpa_scales(k8s_emulator, 5)
    assert ports.write_children([scaled["Deployment"]]) == {"Deployment/scorer-runtime": "unchanged"}
    assert ports.runtime_replicas(children.Target("scorer", "default")) == 5
    # autoscaling removed: replicas rendered again, taken back from the HPA's manager
    assert ports.write_children([fixed["Deployment"]]) == {"Deployment/scorer-runtime": "updated"}
    live = kube.get("Deployment", "default", "scorer-runtime")
    assert live is not None and live["spec"]["replicas"] == 3 and FIELD_MANAGER in replicas_owners(live)
    assert HPA_MANAGER not in replicas_owners(live)


def test_only_an_hpa_this_model_deployment_owns_is_deleted(owners: dict[str, dict[str, Any]],
                                                          kube: KubeClient) -> None:
    ports = ClusterPorts(kube)
    target = children.Target("scorer", "default")
    stubs = children.unrendered(target, parse_spec({"versions": VERSIONS}))
    uid = owners["scorer"]["metadata"]["uid"]
    assert ports.delete_children(stubs, uid) == {}  # none there
    # one of the same name that another ModelDeployment (another uid) owns stays
    kube.apply(rendered({"runtime": {"autoscaling": IN_FLIGHT}}, owners["other"])["HorizontalPodAutoscaler"])
    assert ports.delete_children(stubs, uid) == {}
    assert kube.get("HorizontalPodAutoscaler", "default", "scorer-runtime") is not None
    kube.delete("HorizontalPodAutoscaler", "default", "scorer-runtime")
    kube.apply(rendered({"runtime": {"autoscaling": IN_FLIGHT}}, owners["scorer"])["HorizontalPodAutoscaler"])
    assert ports.delete_children(stubs, uid) == {"HorizontalPodAutoscaler/scorer-runtime": DELETED}
    assert kube.get("HorizontalPodAutoscaler", "default", "scorer-runtime") is None


def test_the_emulator_validates_an_hpa_like_the_api_server(k8s_emulator: EmulatorProcess) -> None:
    hpa = rendered({"runtime": {"autoscaling": IN_FLIGHT}})["HorizontalPodAutoscaler"]
    hpa["spec"]["maxReplicas"] = "four"
    code, body = k8s_emulator.request("PATCH", f"{HPA}?fieldManager=test", hpa,
                                      content_type="application/apply-patch+yaml")
    assert code == 422 and "spec.maxReplicas" in body["message"], body


# -- the operator ------------------------------------------------------------------------------


def hpa(cluster: Cluster) -> dict[str, Any] | None:
    code, body = cluster.emu.request("GET", HPA)
    return dict(body) if code == 200 else None


def deployment(cluster: Cluster) -> dict[str, Any]:
    code, body = cluster.emu.request("GET", RUNTIME)
    assert code == 200, body
    return dict(body)


def spec_change_reconciled(cluster: Cluster, weights: dict[str, int]) -> None:
    """The positive signal that the operator reconciled after whatever came before: a weight
    change reaches the ConfigMap and the status records the new generation."""
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", json.dumps({"spec": {"weights": weights}}))
    generation = cluster.md()["metadata"]["generation"]
    wait_for(lambda: cluster.configmap_weights() == weights
             and cluster.status().get("observedGeneration") == generation, 30, f"weights {weights} reconciled")


def test_an_autoscaled_model_deployment_leaves_replicas_to_its_hpa_until_autoscaling_is_removed(
        cluster: Cluster) -> None:
    cluster.start_operator()
    cluster.apply(cluster.manifest("scorer.yaml", runtime={"replicas": 2, "autoscaling": IN_FLIGHT}))
    created = wait_for(lambda: hpa(cluster), 30, "the HPA")
    uid = cluster.md()["metadata"]["uid"]
    assert created["metadata"]["ownerReferences"][0]["uid"] == uid
    assert created["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": "scorer-runtime"}
    assert created["spec"]["metrics"][0]["pods"]["metric"]["name"] == "mnn_inference_in_flight_requests"
    assert deployment(cluster)["spec"]["replicas"] == 1  # the API's default: one pod until the HPA scales
    cluster.wait_ready(replicas=1)
    wait_for(lambda: cluster.status().get("phase") == "Ready" and cluster.condition("Ready")["status"] == "True",
             60, "phase Ready with one pod")

    hpa_scales(cluster.emu, 3)
    cluster.wait_ready(replicas=3)
    wait_for(lambda: cluster.status().get("replicas") == 3 and cluster.status().get("readyText") == "3/3", 30,
             "status counts the pods the HPA asked for")
    spec_change_reconciled(cluster, {"v1": 80, "v2": 20})
    assert deployment(cluster)["spec"]["replicas"] == 3
    assert not [e for e in cluster.events() if e["reason"] == "DriftRepaired" and "replicas" in e.get("message", "")]

    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"runtime":{"autoscaling":null}}}')
    wait_for(lambda: hpa(cluster) is None, 30, "the HPA deleted")
    wait_for(lambda: deployment(cluster)["spec"].get("replicas") == 2, 30, "spec.runtime.replicas again")
    wait_for(lambda: any(e["reason"] == "ChildrenDeleted" and "HorizontalPodAutoscaler/scorer-runtime"
                         in e.get("message", "") for e in cluster.events()), 10, "ChildrenDeleted event")
    cluster.wait_ready(replicas=2)


def test_switching_a_running_model_deployment_to_autoscaling_keeps_its_pods(cluster: Cluster) -> None:
    pods = ready_cluster(cluster)
    names = sorted(p.name for p in pods)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p",
                        '{"spec":{"runtime":{"autoscaling":{"maxReplicas":4,"targetCPUUtilizationPercentage":60}}}}')
    wait_for(lambda: hpa(cluster), 30, "the HPA")
    live = deployment(cluster)
    assert live["spec"]["replicas"] == 2 and replicas_owners(live) == {HANDOVER_MANAGER}
    spec_change_reconciled(cluster, {"v1": 90, "v2": 10})
    assert deployment(cluster)["spec"]["replicas"] == 2
    assert sorted(p.name for p in cluster.kubelet.pods("scorer-runtime", "default", include_terminating=True)) == names
    assert cluster.status()["readyText"] == "2/2"

