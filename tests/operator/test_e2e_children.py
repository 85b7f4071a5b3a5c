"""What goes into the children: a pod field the Kubernetes schemas refuse never gets that far (the
CRD refuses the ModelDeployment, naming the field); a child the API still refuses (an admission
policy answering 422) sets ChildRejected with the API's message and an Event while everything
else goes on and the stable version keeps serving; and a child edited by hand is put back, with a
DriftRepaired Event naming the fields."""

from __future__ import annotations

import json

import pytest
import yaml

from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_basic import KEYS, ready_cluster, served

pytestmark = pytest.mark.timeout(240)
RUNTIME = "/apis/apps/v1/namespaces/default/deployments/scorer-runtime"
ROUTING = "/api/v1/namespaces/default/configmaps/scorer-routing"


def child_rejected(cluster: Cluster) -> dict:  # type: ignore[type-arg]
    return next((c for c in cluster.status().get("conditions", []) if c["type"] == "ChildRejected"), {})


def test_a_pod_field_the_kubernetes_schema_refuses_is_refused_at_apply(cluster: Cluster) -> None:
    ready_cluster(cluster)
    generation = cluster.md()["metadata"]["generation"]
    done = cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p",
                               '{"spec":{"runtime":{"volumes":[{"name":"models","emptyDir":"oops"}]}}}', check=False)
    assert done.returncode != 0 and "spec.runtime.volumes[0].emptyDir" in done.stderr, done.stderr
    assert cluster.md()["metadata"]["generation"] == generation  # nothing was stored


def test_a_child_the_api_refuses_is_reported_and_the_rest_goes_on(cluster: Cluster) -> None:
    pods = ready_cluster(cluster)
    before = {p.ip: served(p, KEYS[:20]) for p in pods}
    policy = "admission policy deny-unsigned-images: image registry.example/unsigned:1 is not signed"
    code, answer = cluster.emu.request("POST", "/_emulator/faults", {
        "method": "PATCH", "path": "deployments/scorer-runtime$", "code": 422, "reason": "Invalid",
        "message": policy, "times": -1})
    assert code == 201, answer
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p",
                        '{"spec":{"weights":{"v1":80,"v2":20},"runtime":{"image":"registry.example/unsigned:1"}}}')

    cond = wait_for(lambda: child_rejected(cluster) if child_rejected(cluster).get("status") == "True" else None,
                    30, "ChildRejected")
    assert "Deployment/scorer-runtime" in cond["message"] and "deny-unsigned-images" in cond["message"]
    wait_for(lambda: any(e["reason"] == "ChildRejected" and "deny-unsigned-images" in e.get("message", "")
                         for e in cluster.events()), 10, "ChildRejected event")
    # the rest of the reconcile went on: the weights were written and the status tracks them
    wait_for(lambda: cluster.configmap_weights() == {"v1": 80, "v2": 20}, 20, "weights applied")
    st = cluster.status()
    assert st["weights"] == {"v1": 80, "v2": 20} and st["observedGeneration"] == cluster.md()["metadata"]["generation"]
    assert [p.ip for p in cluster.pods()] == [p.ip for p in pods]  # the pods were not rolled
    assert all(set(served(p, KEYS[:20]).values()) <= {"v1", "v2"} for p in pods) and before
    # the policy is lifted: the operator tries again by itself, the Deployment is written, the condition clears
    assert cluster.emu.request("DELETE", "/_emulator/faults")[0] == 200
    wait_for(lambda: child_rejected(cluster).get("status") == "False", 40, "ChildRejected cleared")
    code, deployment = cluster.emu.request("GET", RUNTIME)
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example/unsigned:1"


def test_children_edited_by_hand_are_put_back_and_named(cluster: Cluster) -> None:
    pods = ready_cluster(cluster, weights={"v1": 90, "v2": 10})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 30, "weights 90/10")
    _, deployment = cluster.emu.request("GET", RUNTIME)
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]

    # someone edits the routing weights in the ConfigMap
    _, cm = cluster.emu.request("GET", ROUTING)
    config = yaml.safe_load(cm["data"]["runtime.yaml"])
    config["weights"] = {"v1": 0, "v2": 100}
    edited = json.dumps({"data": {"runtime.yaml": yaml.safe_dump(config, sort_keys=False)}})
    cluster.emu.kubectl("patch", "configmap", "scorer-routing", "--type", "merge", "-p", edited)
    wait_for(lambda: any(e["reason"] == "DriftRepaired" and "ConfigMap/scorer-routing" in e.get("message", "")
                         for e in cluster.events()), 20, "DriftRepaired of the ConfigMap")
    message = next(e["message"] for e in cluster.events() if e["reason"] == "DriftRepaired")
    assert "data[runtime.yaml].weights.v1" in message and "weights.v2" in message, message
    assert cluster.configmap_weights() == {"v1": 90, "v2": 10}
    assert cluster.status()["weights"] == {"v1": 90, "v2": 10}
    # the pods serve the repaired table (never the edited one for long)
    wait_for(lambda: all(set(served(p, KEYS[:200]).values()) == {"v1", "v2"} for p in pods), 20,
             "pods serve 90/10 again")

    # kubectl scale and an image edit on the Deployment, a selector edit on the Service
    cluster.emu.kubectl("scale", "deployment", "scorer-runtime", "--replicas", "5")
    cluster.emu.kubectl("set", "image", "deployment/scorer-runtime", "runtime=registry.example/other:9")
    cluster.emu.kubectl("patch", "service", "scorer", "--type", "merge", "-p",
                        '{"spec":{"selector":{"app.kubernetes.io/component":"nothing"}}}')

    def repaired() -> bool:
        _, dep = cluster.emu.request("GET", RUNTIME)
        _, svc = cluster.emu.request("GET", "/api/v1/namespaces/default/services/scorer")
        return (dep["spec"]["replicas"] == 2 and dep["spec"]["template"]["spec"]["containers"][0]["image"] == image
                and svc["spec"]["selector"].get("app.kubernetes.io/component") == "runtime")

    wait_for(repaired, 30, "Deployment and Service put back")
    fields = ("Deployment/scorer-runtime", "spec.replicas", "spec.template.spec.containers[0].image",
              "Service/scorer", "spec.selector")

    def named() -> str:  # the Events are posted after the writes: under load, a little later
        return " | ".join(e["message"] for e in cluster.events() if e["reason"] == "DriftRepaired")

    wait_for(lambda: all(field in named() for field in fields), 20, "DriftRepaired naming every repaired field")
    # a field the operator does not render is left alone: no repair, no event
    repairs = len([e for e in cluster.events() if e["reason"] == "DriftRepaired"])
    cluster.emu.kubectl("annotate", "service", "scorer", "team.example/owner=ml-platform")
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":80,"v2":20}}}')
    wait_for(lambda: cluster.status().get("weights") == {"v1": 80, "v2": 20}, 30, "a later reconcile")
    _, svc = cluster.emu.request("GET", "/api/v1/namespaces/default/services/scorer")
    assert svc["metadata"]["annotations"]["team.example/owner"] == "ml-platform"
    assert len([e for e in cluster.events() if e["reason"] == "DriftRepaired"]) == repairs
