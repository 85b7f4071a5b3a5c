"""Issue 3's end-to-end paths: apply, patch weights, invalid patches, a missing model file,
operator restarts, and deletion; with real kubectl, real runtime processes and the real operator."""

from __future__ import annotations

import time
from collections import Counter

import httpx
import pytest

from mnn_rollout.contract.routing import RoutingTable
from testbed.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(240)
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
KEYS = [f"user-{i}" for i in range(5000)]


def served(pod, keys: list[str]) -> dict[str, str]:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=f"http://{pod.ip}:{pod.port}", timeout=10) as c:
        return {k: c.post("/v2/models/scorer/infer", json=BODY, headers={"X-User-Id": k}).headers["x-model-version"]
                for k in keys}


def test_apply_serves_v1_and_reports_ready_with_printer_columns(cluster: Cluster) -> None:
    cluster.start_operator()
    cluster.apply(cluster.manifest("scorer.yaml"))
    pods = cluster.wait_ready()
    assert len({p.ip for p in pods}) == 2
    wait_for(lambda: cluster.status().get("phase") == "Ready", 30, "phase Ready")
    assert cluster.condition("Ready")["status"] == "True"
    assert cluster.condition("VersionsReady")["status"] == "True"
    status = cluster.status()
    assert status["stableVersion"] == "v1" and status["weights"] == {"v1": 100, "v2": 0}
    assert status["observedGeneration"] == cluster.md()["metadata"]["generation"]
    assert {v["name"]: v["ready"] for v in status["versions"]} == {"v1": True, "v2": True}
    for pod in pods:
        assert set(served(pod, KEYS[:50]).values()) == {"v1"}
    table = cluster.emu.kubectl("get", "md").stdout
    header = table.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STABLE", "CANARY", "WEIGHT", "STEP", "READY", "AGE"]
    row = table.splitlines()[1].split()
    assert row[:3] == ["scorer", "Ready", "v1"] and "2/2" in row
    assert "ChildrenCreated" in cluster.event_reasons()
    # kopf handled every watch event above without a log line each (no --verbose); its own start is logged
    log = cluster.operators[0].log()
    assert "operator starting" in log and "Handler '" not in log, log[-2000:]


async def _route_all(url: str, keys: list[str]) -> dict[str, str]:
    import asyncio

    out: dict[str, str] = {}
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=url, timeout=20) as c:
        async def one(k: str) -> None:
            async with sem:
                r = await c.post("/v2/models/scorer/infer", json=BODY, headers={"X-User-Id": k})
                out[k] = r.headers["x-model-version"]
        await asyncio.gather(*(one(k) for k in keys))
    return out


def route_all(pod, keys: list[str]) -> dict[str, str]:  # type: ignore[no-untyped-def]
    import asyncio

    return asyncio.run(_route_all(f"http://{pod.ip}:{pod.port}", keys))


def ready_cluster(cluster: Cluster, **spec: object) -> list:  # type: ignore[type-arg]
    cluster.start_operator()
    cluster.apply(cluster.manifest("scorer.yaml", **spec))
    pods = cluster.wait_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready" and cluster.condition("VersionsReady")["status"] == "True",
             60, "phase Ready")
    return pods


def test_patched_weights_reach_every_pod_within_seconds(cluster: Cluster) -> None:
    pods = ready_cluster(cluster)
    before = cluster.published_table()
    probe = KEYS[:100]
    started = time.monotonic()
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"weights":{"v1":70,"v2":30}}}')
    table = wait_for(lambda: (t := cluster.published_table()).weights == {"v1": 70, "v2": 30} and t, 20,
                     "the ConfigMap publishes the new table")
    # the published table is the old one evolved: only stable's users moved, to the canary
    assert {(a, b) for a, b in zip(before.owners, table.owners) if a != b} == {("v1", "v2")}
    wait_for(lambda: all(served(p, probe) == {k: table.route(k) for k in probe} for p in pods), 20,
             "every pod routing by the new weights", interval=0.05)
    took = time.monotonic() - started
    print(f"kubectl patch -> every pod routes by v1:70/v2:30 in {took:.2f} s (target 2 s)")
    per_pod = [route_all(p, KEYS) for p in pods]
    for routes in per_pod:
        share = Counter(routes.values())["v2"] / len(KEYS) * 100
        assert abs(share - 30) <= 2, share
    assert per_pod[0] == per_pod[1]  # each key on the same version on every pod
    wait_for(lambda: cluster.status()["weights"] == {"v1": 70, "v2": 30}, 10, "status weights")
    assert "WeightsUpdated" in cluster.event_reasons()


def test_the_crd_schema_refuses_out_of_range_weights_where_it_is_enforced(cluster: Cluster) -> None:
    ready_cluster(cluster)
    result = cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p",
                                 '{"spec":{"weights":{"v1":120,"v2":-20}}}', check=False)
    assert result.returncode != 0 and "spec.weights.v1" in result.stderr
    assert cluster.md()["spec"]["weights"] == {"v1": 100, "v2": 0}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ('{"spec":{"weights":{"v1":120,"v2":-20}}}', "spec.weights.v1: 120 is outside 0-100"),
        ('{"spec":{"weights":{"v1":50,"v9":50}}}', "spec.weights.v9: 'v9' is not a listed version"),
        ('{"spec":{"versions":[{"name":"v1","uri":"a.mnn"},{"name":"v1","uri":"b.mnn"}]}}',
         "spec.versions: duplicate version names ['v1']"),
    ],
)
def test_an_invalid_patch_is_refused_and_traffic_stays_exactly_as_before(lenient_cluster: Cluster, patch: str,
                                                                          message: str) -> None:
    """Where the CRD schema is not enforced (older clusters, CEL off), the operator's own
    validation must catch every bad spec before anything serving changes."""
    cluster = lenient_cluster
    pods = ready_cluster(cluster, weights={"v1": 80, "v2": 20})
    wait_for(lambda: cluster.configmap_weights() == {"v1": 80, "v2": 20}, 20, "weights applied")
    before = [served(p, KEYS[:300]) for p in pods]
    routing_before = cluster.emu.request("GET", "/api/v1/namespaces/default/configmaps/scorer-routing")[1]["data"]
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", patch)
    wait_for(lambda: cluster.status().get("phase") == "InvalidSpec", 20, "phase InvalidSpec")
    cond = cluster.condition("InvalidSpec")
    assert cond["status"] == "True" and message in cond["message"]
    wait_for(lambda: any(message in e.get("message", "") for e in cluster.events() if e["reason"] == "InvalidSpec"),
             10, "InvalidSpec event")
    time.sleep(2)  # several reconciles later, nothing serving has changed
    assert cluster.emu.request("GET", "/api/v1/namespaces/default/configmaps/scorer-routing")[1]["data"] == routing_before
    assert [served(p, KEYS[:300]) for p in pods] == before
    assert all(p.ready for p in cluster.kubelet.pods("scorer-runtime", "default"))


def test_a_version_whose_file_is_missing_is_not_ready_and_gets_no_traffic(cluster: Cluster) -> None:
    pods = ready_cluster(cluster)
    obj = cluster.manifest("scorer.yaml")
    obj["spec"]["versions"].append({"name": "v3", "uri": f"file://{cluster.models}/v3-missing.mnn"})
    obj["spec"]["weights"] = {"v1": 60, "v2": 20, "v3": 20}
    cluster.apply(obj)
    cond = wait_for(lambda: (c := cluster.condition("VersionsReady"))["status"] == "False"
                    and "v3-missing.mnn' does not exist" in c["message"] and c, 60,
                    "VersionsReady False naming v3's file and why")
    assert cond["message"].startswith("v3: scorer-runtime-")
    wait_for(lambda: cluster.configmap_weights() == {"v1": 80, "v2": 20, "v3": 0}, 30, "v2 applied, v3 held at 0")
    pods = cluster.wait_ready()
    table = RoutingTable.build("scorer", {"v1": 80, "v2": 20, "v3": 0}, "v1")
    for pod in pods:
        routes = served(pod, KEYS[:300])
        assert "v3" not in routes.values()
        assert routes == {k: table.route(k) for k in KEYS[:300]}
    v3 = next(v for v in cluster.status()["versions"] if v["name"] == "v3")
    assert v3["ready"] is False and "does not exist" in v3["reason"]


def test_kubectl_scale_of_the_model_deployment_scales_its_runtime_pods(cluster: Cluster) -> None:
    """The CRD's scale subresource: `kubectl scale md` sets spec.runtime.replicas, the pods follow,
    and /scale reports the ready pods and their selector (what an HPA on the object reads)."""
    import json

    ready_cluster(cluster)
    cluster.emu.kubectl("scale", "md", "scorer", "--replicas", "3")
    assert cluster.md()["spec"]["runtime"]["replicas"] == 3
    cluster.wait_ready(replicas=3)
    wait_for(lambda: cluster.status().get("replicas") == 3, 60, "status.replicas 3")
    scale = json.loads(cluster.emu.kubectl(
        "get", "--raw", "/apis/mnnrollout.io/v1alpha1/namespaces/default/modeldeployments/scorer/scale").stdout)
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    assert scale["status"]["selector"] == "mnnrollout.io/modeldeployment=scorer,app.kubernetes.io/component=runtime"
    cluster.emu.kubectl("scale", "md", "scorer", "--replicas", "1")
    wait_for(lambda: len(cluster.pods()) == 1 and cluster.status().get("replicas") == 1, 60, "scaled down to 1")
