"""End to end: a version asking for a GPU backend these machines lack (OpenCL) still serves, on
CPU; the pods say so, the status shows both backends, and the operator emits one Warning Event
EngineFallback, not one per reconcile. A version with two threads serves from forked workers."""

from __future__ import annotations

import time

import httpx
import pytest

from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_basic import BODY, ready_cluster

pytestmark = pytest.mark.timeout(240)


def test_a_backend_the_node_lacks_serves_on_cpu_with_one_warning_event(cluster: Cluster) -> None:
    manifest = cluster.manifest("scorer.yaml")
    versions = manifest["spec"]["versions"]
    versions[1]["engine"] = {"backend": "OpenCL"}
    versions[0]["engine"] = {"threads": 2}
    manifest["spec"]["runtime"]["workers"] = 2
    manifest["spec"]["runtime"]["resources"] = {"limits": {"cpu": "4", "memory": "1Gi"}}
    cluster.start_operator()
    cluster.apply(manifest)
    pods = cluster.wait_ready()
    wait_for(lambda: any(e["reason"] == "EngineFallback" for e in cluster.events()), 60, "EngineFallback event")
    entry = next(v for v in cluster.status()["versions"] if v["name"] == "v2")
    assert (entry["requestedBackend"], entry["backend"]) == ("OpenCL", "CPU"), entry
    for pod in pods:
        with httpx.Client(base_url=f"http://{pod.ip}:{pod.port}", timeout=10) as c:
            for version, threads in (("v1", 2), ("v2", 1)):
                assert c.post(f"/v2/models/scorer/versions/{version}/infer", json=BODY).status_code == 200
                engine = c.get(f"/v2/models/scorer/versions/{version}").json()["parameters"]["engine"]
                assert (engine["backend"], engine["threads"]) == ("CPU", threads), engine
    time.sleep(3)  # several more reconciles (and status scrapes) later: still the one Event
    fallbacks = [e for e in cluster.events() if e["reason"] == "EngineFallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["type"] == "Warning", fallbacks
    assert "version v2: requested backend OpenCL, runs on CPU" in fallbacks[0]["message"]


def test_the_operator_refuses_more_threads_than_the_cpu_limit(cluster: Cluster) -> None:
    ready_cluster(cluster)
    cluster.emu.kubectl("patch", "md", "scorer", "--type", "json", "-p",
                        '[{"op": "add", "path": "/spec/versions/1/engine", "value": {"threads": 4}},'
                        ' {"op": "add", "path": "/spec/runtime/resources", "value": {"limits": {"cpu": "2"}}}]')
    wait_for(lambda: cluster.status().get("phase") == "InvalidSpec", 30, "InvalidSpec")
    assert "spec.versions.1.engine.threads: 4 (version 'v2')" in cluster.status()["message"]
    assert "runtime.resources.limits.cpu '2'" in cluster.status()["message"]
