"""Issue 4's rollouts through real Prometheus and Alertmanager (Debian binaries on loopback):
an alert rolls the canary back at once; Prometheus going away holds the rollout, never promotes."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mnn_rollout.local.traffic import Traffic
from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_rollout import canary
from testbed.promstack import Alertmanager, Prometheus, alertmanager_factory, prometheus_factory  # noqa: F401

pytestmark = pytest.mark.timeout(300)

RULES = """groups:
- name: canary
  rules:
  - alert: CanaryErrorRate
    expr: |
      sum by (model, version) (rate(mnn_inference_requests_total{outcome!="success"}[5s]))
        / sum by (model, version) (rate(mnn_inference_requests_total[5s])) > 0.05
    for: 1s
    labels: {severity: critical}
"""


def stable_with(cluster: Cluster, version: str) -> list[Any]:
    """v1 serving alone, with the future canary already listed (loaded, weight 0), so the pods and
    Prometheus's targets stay the same through the rollout."""
    cluster.start_operator()
    obj = cluster.manifest("scorer.yaml")
    obj["spec"]["versions"] = [{"name": "v1", "uri": f"file://{cluster.models}/v1.mnn"},
                               {"name": version, "uri": f"file://{cluster.models}/{version}.mnn"}]
    obj["spec"]["weights"] = {"v1": 100, version: 0}
    cluster.apply(obj)
    pods = cluster.wait_ready()
    wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "phase Ready")
    return pods


def prometheus_analysis(prom: Prometheus, failure_limit: int) -> dict[str, Any]:
    return {"interval": "1s", "minRequests": 5, "failureLimit": failure_limit,
            "provider": {"type": "prometheus", "address": prom.url, "timeout": "2s"},
            "metrics": [{"name": "error-rate", "max": 0.05}]}


def test_a_firing_alert_rolls_the_canary_back_at_once(cluster: Cluster, tmp_path: Path,
                                                      prometheus_factory: Callable[..., Prometheus],  # noqa: F811
                                                      alertmanager_factory: Callable[..., Alertmanager]) -> None:  # noqa: F811
    pods = stable_with(cluster, "v2-breaking")
    op = cluster.operators[0]
    am = alertmanager_factory(webhook_url=f"http://127.0.0.1:{op.webhook_port}/alerts", bearer_token=cluster.token)
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    prom = prometheus_factory(scrape_targets=[f"{p.ip}:{p.port}" for p in pods], rule_files=[rules],
                              alertmanager_url=am.url)
    prom.wait_for_up(60)
    obj = canary(cluster, "v2-breaking", steps=[{"weight": 30, "pause": "1h"}])
    # The analysis would need 1,000 failed checks: only the alert can roll this canary back.
    obj["spec"]["strategy"]["analysis"] = prometheus_analysis(prom, failure_limit=1000)
    with Traffic(cluster.pods, users=500, rate=160, connections=2) as traffic:
        cluster.apply(obj)
        wait_for(lambda: cluster.status().get("canaryWeight") == 30, 60, "canary at 30%")
        started = time.monotonic()
        wait_for(lambda: cluster.status().get("phase") == "RolledBack", 90, "rolled back by the alert", interval=0.2)
        print(f"canary at 30% -> rolled back by Alertmanager in {time.monotonic() - started:.1f} s")
        back = time.monotonic()
        time.sleep(2)
        after = traffic.counts(back + 0.5)
    st = cluster.status()
    assert st["abortReason"].startswith("AlertFiring: alert CanaryErrorRate"), st["abortReason"]
    assert st["weights"] == {"v1": 100, "v2-breaking": 0}
    assert st["analysis"]["verdict"] in ("fail", "inconclusive")  # the analysis saw it too, but was not the cause
    assert cluster.md()["metadata"]["annotations"]["mnnrollout.io/alert"].startswith("CanaryErrorRate@")
    assert {v for v, _ in after} == {"v1"} and {c for _, c in after} == {200}
    assert "alert CanaryErrorRate" in next(e for e in cluster.events() if e["reason"] == "RolloutAborted")["message"]


def test_prometheus_going_away_holds_the_rollout_and_it_continues_when_back(
        cluster: Cluster, prometheus_factory: Callable[..., Prometheus]) -> None:  # noqa: F811
    pods = stable_with(cluster, "v2")
    prom = prometheus_factory(scrape_targets=[f"{p.ip}:{p.port}" for p in pods])
    prom.wait_for_up(60)
    obj = canary(cluster, "v2", steps=[{"weight": 20, "pause": "3s"}, {"weight": 50, "pause": "3s"}])
    obj["spec"]["strategy"]["analysis"] = prometheus_analysis(prom, failure_limit=2)
    with Traffic(cluster.pods, users=500, rate=160, connections=2):
        cluster.apply(obj)
        wait_for(lambda: cluster.status().get("canaryWeight") == 20, 60, "canary at 20%")
        prom.stop()
        held = time.monotonic()
        while time.monotonic() - held < 8:
            st = cluster.status()
            assert st["phase"] == "Progressing" and st["canaryWeight"] == 20, st
            time.sleep(0.3)
        # (until the step is 10 s old its checks have no window yet, whether Prometheus answers or not)
        wait_for(lambda: "unreachable" in cluster.status()["analysis"]["message"], 15, "a check that found it gone")
        st = cluster.status()
        assert st["phase"] == "Progressing" and st["canaryWeight"] == 20, st
        assert st["analysis"]["verdict"] == "inconclusive" and st.get("failures", 0) == 0, st
        prom.start()
        wait_for(lambda: cluster.status().get("phase") == "Succeeded", 120, "promoted once Prometheus is back",
                 interval=0.3)
    assert cluster.status()["weights"] == {"v2": 100}
