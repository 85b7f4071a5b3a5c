"""A child the API refuses (422, validated against the Kubernetes schema as an API server does)
sets ChildRejected with the API's message and an Event; everything else goes on, and the stable
version keeps serving. Fixing the spec clears it."""

from __future__ import annotations

import pytest

from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_basic import KEYS, ready_cluster, served

pytestmark = pytest.mark.timeout(240)
BAD_VOLUME = {"name": "models", "emptyDir": "oops"}  # emptyDir must be an object


def test_a_child_the_api_refuses_is_reported_and_the_rest_goes_on(cluster: Cluster) -> None:
    pods = ready_cluster(cluster)
    before = {p.ip: served(p, KEYS[:20]) for p in pods}
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p",
                        '{"spec":{"weights":{"v1":80,"v2":20},"runtime":{"volumes":[{"name":"models","emptyDir":"oops"}],'
                        '"volumeMounts":[{"name":"models","mountPath":"/models"}]}}}')

    def child_rejected() -> dict:  # type: ignore[type-arg]
        return next((c for c in cluster.status().get("conditions", []) if c["type"] == "ChildRejected"), {})

    def rejected() -> dict:  # type: ignore[type-arg]
        cond = child_rejected()
        return cond if cond.get("status") == "True" else {}

    cond = wait_for(rejected, 30, "ChildRejected")
    assert "Deployment/scorer-runtime" in cond["message"] and "emptyDir" in cond["message"]
    wait_for(lambda: any(e["reason"] == "ChildRejected" and "emptyDir" in e.get("message", "")
                         for e in cluster.events()), 10, "ChildRejected event")
    # the rest of the reconcile went on: the weights were written and the status tracks them
    wait_for(lambda: cluster.configmap_weights() == {"v1": 80, "v2": 20}, 20, "weights applied")
    st = cluster.status()
    assert st["weights"] == {"v1": 80, "v2": 20} and st["observedGeneration"] == cluster.md()["metadata"]["generation"]
    assert [p.ip for p in cluster.pods()] == [p.ip for p in pods]  # the pods were not rolled
    assert all(set(served(p, KEYS[:20]).values()) <= {"v1", "v2"} for p in pods) and before
    # fixed: the condition clears and the Deployment is written
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "json", "-p",
                        '[{"op":"replace","path":"/spec/runtime/volumes","value":[{"name":"models","emptyDir":{}}]}]')
    wait_for(lambda: child_rejected().get("status") == "False", 30, "ChildRejected cleared")
