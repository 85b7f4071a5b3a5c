"""Issue 4's end-to-end rollouts with the direct provider: promote, roll back on errors and on
latency, hold on too little traffic, survive an operator restart, and manual actions."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest

from mnn_rollout.local.traffic import Traffic
from testbed.cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(300)


def canary(cluster: Cluster, version: str = "v2", steps: list[dict[str, Any]] | None = None,
           metrics: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    obj = cluster.manifest("scorer-canary.yaml")
    obj["spec"]["versions"] = [{"name": "v1", "uri": f"file://{cluster.models}/v1.mnn"},
                               {"name": version, "uri": f"file://{cluster.models}/{version}.mnn"}]
    obj["spec"]["canary"] = version
    obj["spec"]["strategy"] = {
        "steps": steps or [{"weight": 20, "pause": "2s"}, {"weight": 50, "pause": "2s"}],
        "analysis": {"interval": "1s", "minRequests": 5, "failureLimit": 2,
                     "metrics": metrics or [{"name": "error-rate", "max": 0.05}]},
        "scaleDownDelaySeconds": 2,
    }
    obj["spec"]["progressDeadlineSeconds"] = 60
    obj["spec"].update(spec)
    return obj


def start_stable(cluster: Cluster) -> None:
    """v1 serving alone, as before any rollout."""
    cluster.start_operator()
    cluster.apply(cluster.manifest("scorer.yaml"))
    cluster.wait_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "phase Ready")


def phase(cluster: Cluster) -> str:
    return str(cluster.status().get("phase"))


def test_a_healthy_canary_is_promoted_through_every_step(cluster: Cluster) -> None:
    start_stable(cluster)
    with Traffic(cluster.pods, users=500, rate=120, connections=2) as traffic:
        cluster.apply(canary(cluster))
        seen_weights = set()

        def done() -> bool:
            st = cluster.status()
            seen_weights.add(st.get("canaryWeight"))
            return st.get("phase") == "Succeeded"

        wait_for(done, 150, "phase Succeeded", interval=0.2)
        after = time.monotonic()
        time.sleep(1.5)
        recent = traffic.counts(after)
    st = cluster.status()
    assert st["stableVersion"] == "v2" and st["weights"] == {"v2": 100}
    assert st["retiredVersions"] == ["v1"]
    assert {20, 50} <= seen_weights
    assert st["analysis"]["verdict"] == "pass"
    assert all(m["verdict"] == "pass" for m in st["analysis"]["metrics"])
    reasons = cluster.event_reasons()
    for reason in ("RolloutStarted", "StepStarted", "StepAdvanced", "RolloutPromoted", "RolloutSucceeded"):
        assert reason in reasons, reasons
    assert "RolloutAborted" not in reasons
    assert {v for v, _ in recent} == {"v2"} and {c for _, c in recent} == {200}
    assert 'mnn_rollout_promotions_total{name="scorer",namespace="default",reason="steps"} 1.0' in \
        cluster.operators[0].metrics()

    def served() -> dict[str, object]:
        return next((c for c in cluster.status().get("conditions", []) if c["type"] == "WeightsServed"), {})

    # the runtime pods report the weights they route by: the status says once they all serve v2 alone
    wait_for(lambda: served().get("status") == "True", 15, "WeightsServed True")
    assert served()["message"] == "every pod serves v2:100"


def test_a_breaking_canary_is_rolled_back_and_users_stay_on_v1(cluster: Cluster) -> None:
    start_stable(cluster)
    with Traffic(cluster.pods, users=500, rate=120, connections=2) as traffic:
        cluster.apply(canary(cluster, "v2-breaking"))
        wait_for(lambda: phase(cluster) == "RolledBack", 90, "phase RolledBack", interval=0.2)
        rolled_back = time.monotonic()
        time.sleep(2)
        after = traffic.counts(rolled_back + 0.5)
    st = cluster.status()
    assert st["weights"] == {"v1": 100, "v2-breaking": 0} and st["canaryWeight"] == 0
    assert st["abortReason"].startswith("AnalysisFailed")
    failed = [m for m in st["analysis"]["metrics"] if m["verdict"] == "fail"]
    assert failed and failed[0]["name"] == "error-rate" and failed[0]["value"] > 0.05
    event = next(e for e in cluster.events() if e["reason"] == "RolloutAborted")
    assert "error-rate" in event["message"] and "breached" in event["message"] and "0.05" in event["message"]
    assert {v for v, _ in after} == {"v1"} and {c for _, c in after} == {200}
    assert "v2-breaking" in [v["name"] for v in st["versions"]]  # still loaded: retry is instant


def test_a_slow_canary_is_rolled_back_on_latency(cluster: Cluster) -> None:
    start_stable(cluster)
    with Traffic(cluster.pods, users=500, rate=120, connections=2):
        cluster.apply(canary(cluster, "v2-slow", metrics=[{"name": "error-rate", "max": 0.05},
                                                          {"name": "latency-p50", "maxLatencyRatio": 3}]))
        wait_for(lambda: phase(cluster) == "RolledBack", 90, "phase RolledBack", interval=0.2)
    st = cluster.status()
    failed = [m for m in st["analysis"]["metrics"] if m["verdict"] == "fail"]
    assert [m["name"] for m in failed] == ["latency-p50 vs stable"], st["analysis"]
    assert failed[0]["value"] > 3


def test_too_little_traffic_holds_the_step_until_the_progress_deadline(cluster: Cluster) -> None:
    start_stable(cluster)
    cluster.apply(canary(cluster, progressDeadlineSeconds=12))
    wait_for(lambda: cluster.status().get("canaryWeight") == 20, 60, "first step")
    held_from = time.monotonic()
    while time.monotonic() - held_from < 6:
        st = cluster.status()
        assert st["phase"] == "Progressing" and st["canaryWeight"] == 20, st
        assert st.get("failures", 0) == 0
        time.sleep(0.3)
    assert cluster.status()["analysis"]["verdict"] == "inconclusive"
    wait_for(lambda: phase(cluster) == "Failed", 30, "phase Failed at the deadline")
    st = cluster.status()
    assert st["abortReason"].startswith("ProgressDeadlineExceeded") and st["weights"]["v1"] == 100


def test_an_operator_restarted_mid_rollout_resumes_at_the_same_step(cluster: Cluster) -> None:
    start_stable(cluster)
    with Traffic(cluster.pods, users=500, rate=120, connections=2):
        cluster.apply(canary(cluster, steps=[{"weight": 30}, {"weight": 60, "pause": "1s"}]))
        wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 30, 60,
                 "waiting for promote at step 1")
        # kopf posts Events from a queue of its own, after the status: the kill must not come first
        wait_for(lambda: "RolloutStarted" in cluster.event_reasons(), 30, "the RolloutStarted Event posted")
        before = cluster.status()
        cluster.operators[0].kill(signal.SIGKILL)
        new = cluster.start_operator()  # it may wait for the dead replica's peering keep-alive to expire

        def reconciled() -> bool:  # the new replica has looked at the object
            return any(line.startswith('mnn_rollout_reconciles_total{outcome="ok"}') and
                       float(line.rsplit(" ", 1)[1]) > 0 for line in new.metrics().splitlines())

        wait_for(reconciled, 60, "the new replica reconciles")
        st = cluster.status()
        assert (st["phase"], st["currentStep"], st["weights"]) == (before["phase"], before["currentStep"],
                                                                  before["weights"])
        assert cluster.configmap_weights() == {"v1": 70, "v2": 30}
        assert cluster.event_reasons().count("RolloutStarted") == 1
        # and it drives the rollout on from there
        annotate(cluster, "promote")
        wait_for(lambda: cluster.status()["canaryWeight"] == 60, 20, "promote -> step 2 by the new replica")


def annotate(cluster: Cluster, action: str) -> None:
    cluster.emu.kubectl("annotate", "md", "scorer", "--overwrite", f"mnnrollout.io/action={action}:{time.time()}")


def test_manual_promote_abort_retry_pause_and_resume(cluster: Cluster) -> None:
    start_stable(cluster)
    with Traffic(cluster.pods, users=500, rate=120, connections=2):
        cluster.apply(canary(cluster, steps=[{"weight": 10}, {"weight": 40}, {"weight": 70}]))
        wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 10, 60, "step 1 waits")
        annotate(cluster, "promote")
        wait_for(lambda: cluster.status()["canaryWeight"] == 40, 20, "promote -> step 2")
        assert cluster.configmap_weights() == {"v1": 60, "v2": 40}
        annotate(cluster, "abort")
        wait_for(lambda: phase(cluster) == "RolledBack", 20, "abort")
        assert cluster.configmap_weights() == {"v1": 100, "v2": 0}
        assert cluster.status()["abortReason"].startswith("ManualAbort")
        annotate(cluster, "retry")
        wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 10, 20, "retry -> step 1")
        cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"paused":true}}')
        wait_for(lambda: "paused by spec.paused" in cluster.status()["message"], 20, "paused")
        annotate(cluster, "promote")  # paused: refused with the reason, the weight stays
        wait_for(lambda: "spec.paused is true" in (cluster.status().get("actionResult") or ""), 20, "promote ignored")
        assert cluster.status()["canaryWeight"] == 10 and "ActionIgnored" in cluster.event_reasons()
        cluster.emu.kubectl("patch", "md", "scorer", "--type", "merge", "-p", '{"spec":{"paused":false}}')
        annotate(cluster, "promote-full")
        wait_for(lambda: phase(cluster) in ("Promoting", "Succeeded"), 20, "promote-full")
        assert cluster.configmap_weights()["v2"] == 100
    reasons = cluster.event_reasons()
    for reason in ("StepAdvanced", "RolloutAborted", "RolloutRetried", "RolloutPromoted"):
        assert reason in reasons
