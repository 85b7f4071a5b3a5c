"""Issue 14's shadow step end to end (the API emulator, the kubelet stand-in, two real runtime pods,
the real operator): a breaking canary is judged in stable's shadow and rolled back having served
no user request, neither as the client saw it nor as the pods counted it."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import yaml

from mnn_rollout.local.traffic import Traffic
from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_rollout import canary, phase, start_stable
from tests.runtime.test_metrics import samples

pytestmark = pytest.mark.timeout(300)


def routing_config(cluster: Cluster) -> dict[str, Any]:
    status, body = cluster.emu.request("GET", "/api/v1/namespaces/default/configmaps/scorer-routing")
    assert status == 200, body
    return dict(yaml.safe_load(body["data"]["runtime.yaml"]))


def pod_counts(pod: Any, version: str) -> tuple[float, float]:
    """(requests served, shadow runs that were errors) of ``version`` on one pod."""
    found = samples(httpx.get(f"http://{pod.ip}:{pod.port}/metrics", timeout=5).text)

    def get(name: str, **labels: str) -> float:
        return found.get((name, tuple(sorted({"model": "scorer", "version": version, **labels}.items()))), 0.0)

    served = sum(get("mnn_inference_requests_total", outcome=o) for o in ("success", "client_error", "server_error"))
    return served, get("mnn_shadow_requests_total", outcome="error")


def test_a_canary_breaking_in_its_shadow_step_is_rolled_back_having_served_no_user(cluster: Cluster) -> None:
    start_stable(cluster)
    steps = [{"shadow": 50, "pause": "30s"}, {"weight": 20, "pause": "2s"}]
    metrics = [{"name": "error-rate", "max": 0.05}, {"name": "shadow-error-rate", "max": 0.05}]
    with Traffic(cluster.pods, users=500, rate=120, connections=2) as traffic:
        cluster.apply(canary(cluster, "v2-breaking", steps=steps, metrics=metrics))
        wait_for(lambda: cluster.status().get("shadowPercent") == 50, 90, "the shadow step started", interval=0.2)
        assert routing_config(cluster)["shadow"] == {"version": "v2-breaking", "percent": 50}
        assert cluster.status()["canaryWeight"] == 0
        wait_for(lambda: phase(cluster) == "RolledBack", 90, "phase RolledBack", interval=0.2)
        rolled_back = time.monotonic()
        wait_for(lambda: traffic.counts(rolled_back + 0.5), 10, "traffic after the rollback")
        after = traffic.counts(rolled_back + 0.5)
    st = cluster.status()
    assert st["weights"] == {"v1": 100, "v2-breaking": 0} and st["canaryWeight"] == 0
    assert "shadowPercent" not in st and "shadow" not in routing_config(cluster)
    assert st["abortReason"].startswith("AnalysisFailed: shadow-error-rate = 1 breached shadow error rate <= 0.05")
    event = next(e for e in cluster.events() if e["reason"] == "RolloutAborted")
    assert event["message"].endswith("(in a shadow step: the canary served no user)")
    started = next(e for e in cluster.events() if e["reason"] == "StepStarted")
    assert "shadow of 50% of stable's requests, weight 0" in started["message"]
    # no user request reached v2-breaking: the client saw only v1 answer, all of them successes ...
    assert set(traffic.totals) == {"v1"} and traffic.totals["v1"][1] == 0
    assert {v for v, _ in after} == {"v1"}
    # ... and the pods served it nothing, while its shadow runs failed there (the evidence)
    counts = [pod_counts(pod, "v2-breaking") for pod in cluster.pods()]
    assert [served for served, _ in counts] == [0.0] * len(counts)
    assert sum(errors for _, errors in counts) >= 2 * 5  # two failed checks of minRequests 5 runs each
