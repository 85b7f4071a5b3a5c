"""Operator lifecycle: idempotent reconciles, conflicts, deleted children, restarts, deletion, HA."""

from __future__ import annotations

import signal
import time

import pytest

from testbed.cluster import MD_PATH, Cluster, wait_for
from tests.operator.test_e2e_basic import ready_cluster, served

pytestmark = pytest.mark.timeout(240)
OWNED = {"configmaps", "deployments", "services", "serviceaccounts", "roles", "rolebindings", "poddisruptionbudgets",
         "horizontalpodautoscalers", "modeldeployments"}
KEYS = [f"user-{i}" for i in range(200)]
# The API paths of the children of the ModelDeployment "scorer" in "default" (without autoscaling's HPA)
CHILDREN = {
    "configmaps": "/api/v1/namespaces/default/configmaps/scorer-routing",
    "services": "/api/v1/namespaces/default/services/scorer",
    "deployments": "/apis/apps/v1/namespaces/default/deployments/scorer-runtime",
    "serviceaccounts": "/api/v1/namespaces/default/serviceaccounts/scorer-runtime",
    "roles": "/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles/scorer-runtime",
    "rolebindings": "/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings/scorer-runtime",
    "poddisruptionbudgets": "/apis/policy/v1/namespaces/default/poddisruptionbudgets/scorer-runtime",
}


def operator_writes(cluster: Cluster) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in cluster.emu.write_requests()
            if r.get("resource") in OWNED and "mnn-rollout-operator" in (r.get("userAgent") or "")
            or r.get("resource") in OWNED and (r.get("userAgent") or "").startswith("kopf")]


def reconciles(cluster: Cluster, index: int = 0) -> float:
    """The operator's reconcile counter (every outcome): the signal that it looked."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in cluster.operators[index].metrics().splitlines()
               if line.startswith("mnn_rollout_reconciles_total{"))


def test_reconciling_an_unchanged_object_makes_no_writes(cluster: Cluster) -> None:
    ready_cluster(cluster)
    wait_for(lambda: cluster.status().get("phase") == "Ready" and cluster.condition("VersionsReady")["status"] == "True",
             30, "settled")
    # a new operator reconciles every object it finds: an unchanged one, with no write
    cluster.operators[0].stop()
    cluster.emu.reset_requests()
    cluster.start_operator()
    wait_for(lambda: reconciles(cluster, 1) > 0, 60, "the new operator reconciled the object")
    time.sleep(0.5)  # any write of that reconcile has reached the emulator
    # (kopf itself may record its bookkeeping on the object: not the reconcile's)
    assert [w for w in operator_writes(cluster) if "mnn-rollout-operator" in (w.get("userAgent") or "")] == []
    assert any(r.get("resource") == "modeldeployments" and r["method"] == "GET"
               and "mnn-rollout-operator" in (r.get("userAgent") or "") for r in cluster.emu.requests())


def test_a_409_conflict_on_a_child_write_is_retried(cluster: Cluster) -> None:
    ready_cluster(cluster)
    cluster.emu.inject_fault(code=409, method="PUT", path="configmaps/scorer-routing", times=2,
                             reason="Conflict", message="the object has been modified")
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":50,"v2":50}}}')
    wait_for(lambda: cluster.configmap_weights() == {"v1": 50, "v2": 50}, 30, "weights written despite 409s")
    wait_for(lambda: cluster.status()["weights"] == {"v1": 50, "v2": 50}, 10, "status weights")


def test_a_deleted_child_is_recreated(cluster: Cluster) -> None:
    ready_cluster(cluster)
    cluster.emu.kubectl("delete", "configmap", "scorer-routing")
    cluster.emu.kubectl("delete", "service", "scorer")
    wait_for(lambda: cluster.emu.request("GET", "/api/v1/namespaces/default/configmaps/scorer-routing")[0] == 200
             and cluster.emu.request("GET", "/api/v1/namespaces/default/services/scorer")[0] == 200, 20,
             "children recreated")
    wait_for(lambda: "ChildrenRecreated" in cluster.event_reasons(), 10, "ChildrenRecreated event")


def test_an_operator_killed_mid_way_resumes_without_duplicates_or_lost_status(cluster: Cluster) -> None:
    pods = ready_cluster(cluster, weights={"v1": 60, "v2": 40})
    wait_for(lambda: cluster.status()["weights"] == {"v1": 60, "v2": 40}, 20, "weights applied")
    before = cluster.status()
    routes = [served(p, KEYS) for p in pods]
    cluster.operators[0].kill(signal.SIGKILL)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":30,"v2":70}}}')
    assert [served(p, KEYS) for p in pods] == routes  # the pods serve on without an operator
    cluster.start_operator()  # it may wait for the dead replica's peering keep-alive (15 s) to expire
    wait_for(lambda: cluster.configmap_weights() == {"v1": 30, "v2": 70}, 60, "new operator applies the change")
    status = cluster.status()
    assert status["stableVersion"] == before["stableVersion"]
    assert [c["type"] for c in status["conditions"]] == [c["type"] for c in before["conditions"]]
    for plural, prefix in (("configmaps", "/api/v1"), ("services", "/api/v1"), ("deployments", "/apis/apps/v1")):
        items = cluster.emu.request("GET", f"{prefix}/namespaces/default/{plural}")[1]["items"]
        names = [i["metadata"]["name"] for i in items if i["metadata"]["name"].startswith("scorer")]
        assert len(names) == len(set(names)) == 1, names


def test_delete_removes_the_finalizer_and_garbage_collects_every_child(cluster: Cluster) -> None:
    ready_cluster(cluster)
    hpa = "/apis/autoscaling/v2/namespaces/default/horizontalpodautoscalers/scorer-runtime"
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p",
                        '{"spec":{"runtime":{"autoscaling":{"minReplicas":2,"maxReplicas":4,"targetInFlightPerPod":8}}}}')
    wait_for(lambda: cluster.emu.request("GET", hpa)[0] == 200, 30, "the HPA (spec.runtime.autoscaling)")
    md = cluster.md()
    # kopf holds a finalizer while its per-object daemon runs; deletion must remove it.
    assert md["metadata"].get("finalizers") == ["mnnrollout.io/finalizer"]
    uid = md["metadata"]["uid"]
    children = {**CHILDREN, "horizontalpodautoscalers": hpa}
    for path in children.values():
        owners = cluster.emu.request("GET", path)[1]["metadata"]["ownerReferences"]
        assert owners == [{"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "name": "scorer",
                           "uid": uid, "controller": True, "blockOwnerDeletion": True}]
    role = cluster.emu.request("GET", children["roles"])[1]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["scorer-routing"],
                              "verbs": ["get", "watch"]}]
    cluster.emu.kubectl("delete", "md", "scorer", "--timeout=30s")
    assert cluster.emu.request("GET", f"{MD_PATH}/scorer")[0] == 404
    for path in children.values():
        wait_for(lambda p=path: cluster.emu.request("GET", p)[0] == 404, 20, f"{path} collected")
    wait_for(lambda: cluster.kubelet.pods("scorer-runtime", "default", include_terminating=True) == [], 30,
             "runtime processes ended")


def test_two_replicas_with_peering_only_one_acts_and_the_other_takes_over(cluster: Cluster) -> None:
    high = cluster.start_operator("--priority", "200")
    low = cluster.start_operator("--priority", "100")
    cluster.apply(cluster.manifest("scorer.yaml"))
    cluster.wait_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "phase Ready")
    # a change the active replica applies: the positive signal that the standby had its chance
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":80,"v2":20}}}')
    wait_for(lambda: cluster.configmap_weights() == {"v1": 80, "v2": 20}, 30, "the active replica applies it")
    assert "mnn_rollout_reconciles_total{outcome=\"ok\"} 0.0" in low.metrics()  # it never acted
    assert "mnn_rollout_reconciles_total{outcome=\"ok\"} 0.0" not in high.metrics()
    high.kill(signal.SIGTERM)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":90,"v2":10}}}')
    wait_for(lambda: cluster.configmap_weights() == {"v1": 90, "v2": 10}, 60, "the standby replica took over")


def test_a_standby_that_takes_over_forgets_the_pods_deleted_while_it_stood_by(cluster: Cluster) -> None:
    """A standby's watches are paused: the pods deleted meanwhile never reach it as events, and
    its re-list on taking over reports none. It must not scrape them (an analysis that cannot
    scrape every pod is inconclusive: the canary would hold until its deadline)."""
    from mnn_rollout.local.traffic import Traffic
    from tests.operator.test_e2e_rollout import canary

    high = cluster.start_operator("--priority", "200", "--peering-lifetime", "5")
    cluster.apply(cluster.manifest("scorer.yaml"))
    old = {p.name for p in cluster.wait_ready()}
    wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "phase Ready")
    low = cluster.start_operator("--priority", "100", "--peering-lifetime", "5")
    wait_for(lambda: "watch cache synced" in low.log(), 30, "the standby lists the pods at its start")
    gone = sorted(old)[0]
    cluster.emu.kubectl("delete", "pod", gone, "--wait=false")
    wait_for(lambda: len({p.name for p in cluster.pods()} - old) == 1 and len(cluster.pods()) == 2, 90,
             "a replacement pod ready")
    # gone from the API, not only terminating (its preStop and drain take seconds), before the
    # standby takes over: only then did it vanish while the standby was not watching
    wait_for(lambda: cluster.emu.request("GET", f"/api/v1/namespaces/default/pods/{gone}")[0] == 404, 60,
             f"pod {gone} gone from the API")
    high.kill(signal.SIGKILL)
    with Traffic(cluster.pods, users=500, rate=120, connections=2):
        cluster.apply(canary(cluster, steps=[{"weight": 30, "pause": "2s"}]))
        wait_for(lambda: cluster.status().get("phase") == "Succeeded", 120, "the standby promotes the canary")
    assert "re-list of Pod: 1 owner(s) had objects deleted while unwatched" in low.log()


def test_operator_metrics_report_reconciles_phase_and_weights(cluster: Cluster) -> None:
    ready_cluster(cluster, weights={"v1": 75, "v2": 25})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 75, "v2": 25}, 20, "weights applied")
    text = wait_for(lambda: (t := cluster.operators[0].metrics()) and
                    'mnn_rollout_version_weight_percent{name="scorer",namespace="default",version="v2"} 25.0' in t
                    and t, 10, "weight metric")
    assert 'mnn_rollout_phase{name="scorer",namespace="default",phase="Ready"} 1.0' in text
    assert 'mnn_rollout_phase{name="scorer",namespace="default",phase="Progressing"} 0.0' in text
    assert "mnn_rollout_reconcile_duration_seconds_count" in text
