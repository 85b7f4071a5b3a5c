"""Children edited by hand, as a cluster's other actors edit them: a mutating webhook injects a
sidecar into the runtime Deployment (its container is another field manager's: the operator leaves
it alone, repairs nothing and says nothing), and someone strips the Deployment's ownerReference
(the operator puts it back, so deleting the ModelDeployment still collects the Deployment)."""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes
import pytest

from rollout_operator import children
from rollout_operator import ports as ports_module
from rollout_operator.kube import FIELD_MANAGER, KubeClient
from rollout_operator.ports import NOT_REPAIRED, REPAIRED, ClusterPorts
from rollout_operator.reconcile import Reconciler
from rollout_operator.spec import parse_spec
from rollout_operator.status import RolloutStatus
from testbed.cluster import Cluster, wait_for
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_e2e_basic import ready_cluster

pytestmark = pytest.mark.timeout(240)
RUNTIME = "/apis/apps/v1/namespaces/default/deployments/scorer-runtime"
SIDECAR = {"name": "proxy", "image": "registry.example/proxy:1", "command": ["sleep", "3600"]}
OWNER = (("apiVersion", "mnnrollout.io/v1alpha1"), ("kind", "ModelDeployment"), ("name", "scorer"),
         ("uid", "u-1"), ("controller", True), ("blockOwnerDeletion", True))


def rendered_deployment() -> dict[str, Any]:
    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}]})
    target = children.Target("scorer", "default", OWNER)
    config = children.runtime_config(spec, "scorer", {"v1": 100}, "v1", ["v1"])
    return children.render_deployment(target, spec, config)


def test_items_others_add_to_keyed_lists_are_not_drift_and_a_removed_owner_reference_is() -> None:
    deployment = rendered_deployment()
    live = copy.deepcopy(deployment)
    pod = live["spec"]["template"]["spec"]
    # what a sidecar injector adds: a container (first), a volume, a mount and a variable on the runtime
    pod["containers"].insert(0, {**SIDECAR, "volumeMounts": [{"name": "certs", "mountPath": "/certs"}]})
    pod["volumes"].append({"name": "certs", "emptyDir": {}})
    pod["containers"][1]["env"].append({"name": "HTTP_PROXY", "value": "http://127.0.0.1:15001"})
    pod["containers"][1]["volumeMounts"].append({"name": "certs", "mountPath": "/certs"})
    live["metadata"]["ownerReferences"].append({"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u-2"})
    assert children.drift(live, deployment) == []  # before: ["spec.template.spec.containers"], every reconcile
    # the operator's own items are still compared, wherever they are in the list
    pod["containers"][1]["image"] = "other:1"
    del pod["containers"][1]["env"][0]
    assert children.drift(live, deployment) == ["spec.template.spec.containers[0].image",
                                                "spec.template.spec.containers[0].env[0]"]
    # an ownerReference removed by hand is drift (before: not compared, never put back)
    del live["metadata"]["ownerReferences"][0]
    assert "metadata.ownerReferences[0]" in children.drift(live, deployment)


def _repairs(cluster: Cluster) -> list[str]:
    return [e.get("message", "") for e in cluster.events() if e["reason"] == "DriftRepaired"]


def test_a_sidecar_injected_into_the_deployment_is_left_alone_without_repairs_or_events(cluster: Cluster) -> None:
    ready_cluster(cluster, weights={"v1": 90, "v2": 10})
    patch = {"spec": {"template": {"spec": {"containers": [SIDECAR]}}}}
    cluster.emu.kubectl("patch", "deployment", "scorer-runtime", "--type", "strategic", "-p", json.dumps(patch))
    generation = cluster.emu.request("GET", RUNTIME)[1]["metadata"]["generation"]
    # later reconciles (new weights, polled until the pods serve them)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":80,"v2":20}}}')
    wait_for(lambda: cluster.status().get("weights") == {"v1": 80, "v2": 20}
             and cluster.condition("WeightsServed")["status"] == "True", 60, "weights 80/20 served")
    _, deployment = cluster.emu.request("GET", RUNTIME)
    assert [c["name"] for c in deployment["spec"]["template"]["spec"]["containers"]] == ["runtime", "proxy"]
    assert deployment["metadata"]["generation"] == generation  # the operator did not touch the pod template
    # before: a DriftRepaired Event "put back ... spec.template.spec.containers" on every reconcile
    # (11 in 6 s), for a container that stayed
    assert _repairs(cluster) == []


def test_an_owner_reference_removed_by_hand_is_put_back(cluster: Cluster) -> None:
    ready_cluster(cluster)
    uid = cluster.md()["metadata"]["uid"]
    cluster.emu.kubectl("patch", "deployment", "scorer-runtime", "--type", "json", "-p",
                        '[{"op":"remove","path":"/metadata/ownerReferences"}]')

    # a later reconcile too (the edit alone wakes one as well: see the test below)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":80,"v2":20}}}')

    def owners() -> list[str]:
        return [o["uid"] for o in cluster.emu.request("GET", RUNTIME)[1]["metadata"].get("ownerReferences") or []]

    # before: never put back (drift did not compare it), so deleting the ModelDeployment left the
    # Deployment and its pods running
    wait_for(lambda: owners() == [uid], 30, "the ownerReference put back")
    wait_for(lambda: any("metadata.ownerReferences" in m for m in _repairs(cluster)), 20, "DriftRepaired naming it")




SERVICE = "/api/v1/namespaces/default/services/scorer"


def test_a_child_stripped_of_its_owner_label_and_then_broken_is_repaired(cluster: Cluster) -> None:
    ready_cluster(cluster)
    cluster.emu.kubectl("label", "service", "scorer", f"{children.OWNER_LABEL}-")
    cluster.emu.kubectl("patch", "service", "scorer", "--type", "merge", "-p",
                        '{"spec":{"selector":{"app.kubernetes.io/component":"nothing"}}}')  # no endpoints

    def service() -> tuple[str | None, str | None]:
        _, svc = cluster.emu.request("GET", SERVICE)
        return svc["metadata"].get("labels", {}).get(children.OWNER_LABEL), \
            svc["spec"]["selector"].get("app.kubernetes.io/component")

    # before: never (the child watch filtered on the label, so neither edit reached the cache, which kept
    # the labelled copy the reconcile compared with), and nothing said
    wait_for(lambda: service() == ("scorer", "runtime"), 30, "the label and the selector put back")
    wait_for(lambda: any("spec.selector" in m for m in _repairs(cluster)), 20, "DriftRepaired naming the selector")


def test_removing_only_an_owner_reference_wakes_the_owner_which_puts_it_back(cluster: Cluster) -> None:
    ready_cluster(cluster)
    uid = cluster.md()["metadata"]["uid"]
    cluster.emu.kubectl("patch", "service", "scorer", "--type", "json", "-p",
                        '[{"op":"remove","path":"/metadata/ownerReferences"}]')
    # no other change: before, nothing woke the owner (wakeups.child_signature left ownerReferences out),
    # so the Service stayed unowned until some unrelated reconcile
    wait_for(lambda: [o["uid"] for o in cluster.emu.request("GET", SERVICE)[1]["metadata"].get("ownerReferences")
                      or []] == [uid], 30, "the ownerReference put back")
    wait_for(lambda: any("metadata.ownerReferences" in m for m in _repairs(cluster)), 20, "DriftRepaired naming it")


class MirroringKube(KubeClient):
    """A mutating admission webhook's doing: every Deployment written gets its images from a mirror,
    whatever the writer asked for (the API server answers with the rewritten object)."""

    def apply_created(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER, force: bool = True,
                      subresource: str | None = None) -> tuple[dict[str, Any], bool]:
        result, created = super().apply_created(obj, field_manager, force, subresource)  # apply() too
        if obj["kind"] != "Deployment":
            return result, created
        containers = copy.deepcopy(result["spec"]["template"]["spec"]["containers"])
        for c in containers:
            c["image"] = "mirror.example/" + c["image"].rsplit("/", 1)[-1]
        meta = result["metadata"]
        return self.patch("Deployment", meta["namespace"], meta["name"],
                          {"spec": {"template": {"spec": {"containers": containers}}}}), created


def test_a_repair_another_actor_undoes_is_said_once_and_not_retried_at_every_reconcile(
        k8s_emulator: EmulatorProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}]})
    target = children.Target("mirrored", "default")
    deployment = children.render_deployment(target, spec, children.runtime_config(spec, "mirrored", {"v1": 100},
                                                                                  "v1", ["v1"]))
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(k8s_emulator.kubeconfig_path), client_configuration=cfg)
    kube = MirroringKube(cfg, backoff_base=0.02)
    try:
        ports = ClusterPorts(kube)
        ports.cache.synced = True  # the watch cache, kept current here by the writes' answers
        kept = f"mirror.example/{image.rsplit('/', 1)[-1]}"
        # the webhook rewrites the image at once: the apply that creates the Deployment says so (its answer is
        # checked as later ones are); before, the next reconcile found the image "edited" and applied it again,
        # "repaired: spec.template.spec.containers[0].image", and so at every reconcile, each an apply
        (result,) = ports.write_children([deployment]).values()
        assert result.startswith(NOT_REPAIRED) and "spec.template.spec.containers[0].image" in result
        assert repr(kept) in result
        event = Reconciler._child_events(False, RolloutStatus(), RolloutStatus(), {"Deployment/mirrored-runtime":
                                                                                   result})
        assert [e.reason for e in event] == ["DriftNotRepaired", "ChildrenRecreated"]
        assert repr(kept) in event[0].message
        writes = len(k8s_emulator.write_requests("deployments"))
        for _ in range(5):  # later reconciles: nothing said, nothing written
            (again,) = ports.write_children([deployment]).values()
            assert not again.startswith((NOT_REPAIRED, REPAIRED))
        assert len(k8s_emulator.write_requests("deployments")) == writes
        # after the retry interval it is tried once more (the webhook may be gone), still saying nothing new
        monkeypatch.setattr(ports_module, "UNDONE_RETRY_SECONDS", 0.0)
        (again,) = ports.write_children([deployment]).values()
        assert not again.startswith((NOT_REPAIRED, REPAIRED))
        assert len(k8s_emulator.write_requests("deployments")) > writes
    finally:
        kube.close()
