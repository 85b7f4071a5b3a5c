"""The children's watch: an object a ModelDeployment owns that is none of its children (a user's
ConfigMap given an ownerReference so that it is garbage-collected with it) is not watched as one:
it wakes no reconcile, is not cached, and a re-list (which lists by the owner label) does not
report it deleted while unwatched. A real child stripped of its label is still watched."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import kopf
import pytest

from rollout_operator import children, main
from rollout_operator.kube import KubeClient
from rollout_operator.ports import ClusterPorts
from rollout_operator.wakeups import WakeUps
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_e2e_autoscaling import k8s_emulator, kube, owners, rendered  # noqa: F401 - the fixtures

pytestmark = pytest.mark.timeout(120)


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
