"""Issue 12: version changes and pod rolls under continuous traffic through the runtime's Service
lose no request; a SIGKILLed runtime pod loses a bounded few (see testbed/zero_downtime.py)."""

from __future__ import annotations

import pytest

from testbed.cluster import Cluster
from testbed.zero_downtime import GRACEFUL, Scenario

pytestmark = pytest.mark.timeout(600)
RATE = 60.0


def test_rollout_rollback_pod_roll_and_scaling_fail_no_request_through_the_service(cluster: Cluster) -> None:
    scenario = Scenario(cluster, rate=RATE, connections=6).start()
    try:
        results = {r.name: r for r in scenario.run()}
    finally:
        scenario.stop()
    report = scenario.report()
    print(report)
    for name in GRACEFUL:
        r = results[name]
        assert r.total >= RATE * r.seconds * 0.5, f"{name}: too little traffic to tell\n{report}"
        assert r.failed == 0, f"{name}: failed requests\n{report}"
    # The traffic went through the Service to every pod it had, not to one address.
    assert len(cluster.kubelet.services.connections) >= 3, cluster.kubelet.services.connections
    # A SIGKILL is not graceful: what the killed pod held, and what reached it before the Service
    # dropped it, fail; the readiness probe (0.2 s here) and the proxy's delay (0.3 s) bound that.
    kill = results["sigkill"]
    assert scenario.killed_connections >= 1, "the killed pod served none of the traffic"
    assert kill.total >= RATE * kill.seconds * 0.5, report
    assert kill.failed <= RATE * 2, f"sigkill: more failures than 2 s of traffic\n{report}"
