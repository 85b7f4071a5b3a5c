"""
``kubectl delete md NAME --cascade=foreground|orphan`` with the emulator's garbage collector (see
test_review9_emulator.py), a real operator and a ModelDeployment with children: foreground ends with the
object and every child gone and the operator's finalizer released; orphan leaves every child without its
ownerReference to the ModelDeployment.
"""
from __future__ import annotations

import pytest

from testbed.cluster import MD_PATH, Cluster, wait_for
from tests.k8s.helpers import watch
from tests.k8s.kubelet_fixtures import kubelet_factory  # noqa: F401
from tests.operator.conftest import cluster  # noqa: F401
from tests.operator.test_e2e_basic import ready_cluster
from tests.operator.test_e2e_lifecycle import CHILDREN

pytestmark = pytest.mark.timeout(300)
DANGLING = {"apiVersion": "v1", "kind": "ConfigMap", "name": "ghost", "uid": "00000000-0000-0000-0000-000000000000"}


def gc_ran(cluster: Cluster, name: str) -> None:
    """A positive signal that the collector has looked at what was written before: a dependent of an
    owner that never existed, written now, is collected."""
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "ownerReferences": [DANGLING]}}
    assert cluster.emu.request("POST", "/api/v1/namespaces/default/configmaps", body)[0] == 201
    wait_for(lambda: cluster.emu.request("GET", f"/api/v1/namespaces/default/configmaps/{name}")[0] == 404, 20,
             "the collector ran")


def events_since(cluster: Cluster, path: str, rv: str, name: str) -> list[tuple[int, str, dict]]:
    """(resourceVersion, type, object) of the watch events of the object at ``path`` after ``rv``."""
    _, events = watch(cluster.emu, path.rsplit("/", 1)[0], {"resourceVersion": rv, "timeoutSeconds": "1",
                                                            "fieldSelector": f"metadata.name={name}"})
    return [(int(e["object"]["metadata"]["resourceVersion"]), e["type"], e["object"]) for e in events]


def test_kubectl_delete_cascade_foreground_removes_the_children_first_then_the_object(
        cluster: Cluster) -> None:  # noqa: F811
    ready_cluster(cluster)
    md = cluster.md()
    assert md["metadata"]["finalizers"] == ["mnnrollout.io/finalizer"]
    rv = md["metadata"]["resourceVersion"]
    cluster.emu.kubectl("delete", "md", "scorer", "--cascade=foreground", "--timeout=90s", timeout=120)
    assert cluster.emu.request("GET", f"{MD_PATH}/scorer")[0] == 404
    own = events_since(cluster, f"{MD_PATH}/scorer", rv, "scorer")
    assert any("foregroundDeletion" in (o["metadata"].get("finalizers") or []) for _, t, o in own if t == "MODIFIED")
    md_gone = next(v for v, t, _ in own if t == "DELETED")
    for path in CHILDREN.values():  # every child blocks its owner's deletion: gone before it
        assert cluster.emu.request("GET", path)[0] == 404, path
        child_gone = [v for v, t, _ in events_since(cluster, path, rv, path.rsplit("/", 1)[1]) if t == "DELETED"]
        assert child_gone and max(child_gone) < md_gone, (path, child_gone, md_gone)
    wait_for(lambda: cluster.kubelet.pods("scorer-runtime", "default", include_terminating=True) == [], 60,
             "runtime processes ended")
    gc_ran(cluster, "signal-foreground")
    for path in CHILDREN.values():  # and none was made again for the deleted object
        assert cluster.emu.request("GET", path)[0] == 404, path


def test_kubectl_delete_cascade_orphan_leaves_the_children_without_the_owner_reference(
        cluster: Cluster) -> None:  # noqa: F811
    ready_cluster(cluster)
    md = cluster.md()
    uid, rv = md["metadata"]["uid"], md["metadata"]["resourceVersion"]
    cluster.emu.kubectl("delete", "md", "scorer", "--cascade=orphan", "--timeout=90s", timeout=120)
    assert cluster.emu.request("GET", f"{MD_PATH}/scorer")[0] == 404
    own = events_since(cluster, f"{MD_PATH}/scorer", rv, "scorer")
    assert any("orphan" in (o["metadata"].get("finalizers") or []) for _, t, o in own if t == "MODIFIED")
    md_gone = next(v for v, t, _ in own if t == "DELETED")
    gc_ran(cluster, "signal-orphan")
    for path in CHILDREN.values():
        status, child = cluster.emu.request("GET", path)
        assert status == 200, path
        assert uid not in [r.get("uid") for r in child["metadata"].get("ownerReferences") or []], (path, child)
        freed = [v for v, t, o in events_since(cluster, path, rv, path.rsplit("/", 1)[1])
                 if t == "MODIFIED" and uid not in [r.get("uid") for r in o["metadata"].get("ownerReferences") or []]]
        assert freed and min(freed) < md_gone, (path, freed, md_gone)  # orphaned before the owner went
