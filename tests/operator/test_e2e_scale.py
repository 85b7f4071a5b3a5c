"""Many ModelDeployments: every one is reconciled on its own events (no thread per object), the last
created as fast as the first, and idle ones cost no API requests beyond the watches."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from testbed.cluster import MD_PATH, Cluster, wait_for

pytestmark = pytest.mark.timeout(300)
COUNT = 60  # past the 32 threads the old one-sync-daemon-per-object design starved at


def manifest(cluster: Cluster, i: int) -> dict[str, Any]:
    obj = cluster.manifest("scorer.yaml")
    obj["metadata"] = {"name": f"model-{i:03d}", "namespace": "default"}
    obj["spec"]["model"] = f"model-{i:03d}"
    obj["spec"]["runtime"] = {"replicas": 0}  # no pods: the operator's own work is what is measured
    return obj


def observed(cluster: Cluster, name: str) -> int:
    return int((cluster.md(name).get("status") or {}).get("observedGeneration") or 0)


def test_sixty_modeldeployments_are_each_reconciled_and_the_last_as_fast_as_the_first(cluster: Cluster) -> None:
    cluster.start_operator()
    names = [f"model-{i:03d}" for i in range(COUNT)]
    for i, name in enumerate(names):
        status, body = cluster.emu.request("POST", MD_PATH, manifest(cluster, i))
        assert status == 201, body
    seen: dict[str, float] = {}

    def all_reconciled() -> bool:
        with ThreadPoolExecutor(8) as pool:
            for name, gen in zip(names, pool.map(lambda n: observed(cluster, n), names)):
                if gen >= 1 and name not in seen:
                    seen[name] = time.monotonic()
        return len(seen) == COUNT

    # Creating them costs ~8 requests each (read it, six children, the status) under the client's
    # 20 requests/s limit: a burst of 60 takes ~25 s.
    wait_for(all_reconciled, 90, f"all {COUNT} ModelDeployments reconciled", interval=0.2)
    operator = cluster.operators[0]
    reconciles: list[float] = []

    def quiet() -> bool:  # the burst is over: no reconcile for 2 s
        total = sum(float(line.rsplit(" ", 1)[1]) for line in operator.metrics().splitlines()
                    if line.startswith("mnn_rollout_reconciles_total{"))
        reconciles.append(total)
        return len(reconciles) > 8 and reconciles[-9] == total

    wait_for(quiet, 60, "the operator quiet after the burst", interval=0.25)
    assert reconciles[-1] >= COUNT  # it did reconcile every object (the positive signal)

    # A spec change on the first and the last object: each is reconciled within seconds, alike.
    latency = {}
    for name in (names[0], names[-1], names[COUNT // 2]):
        started = time.monotonic()
        status, body = cluster.emu.request("PATCH", f"{MD_PATH}/{name}", {"spec": {"paused": True}},
                                           content_type="application/merge-patch+json")
        assert status == 200, body
        wait_for(lambda: observed(cluster, name) >= 2, 10, f"{name} reconciles its spec change",  # noqa: B023
                 interval=0.05)
        latency[name] = time.monotonic() - started
    assert max(latency.values()) < 3.0, latency

    # Idle: with nothing in flight (no pods to wait for), no API request but the watches and
    # kopf's peering keep-alive for a while.
    cluster.emu.reset_requests()
    time.sleep(5)
    requests = cluster.emu.requests()
    operator = [r for r in requests if r.get("userAgent", "").startswith(("mnn-rollout-operator", "kopf"))]
    calls = [r for r in operator if str((r.get("query") or {}).get("watch", "")).lower() not in ("1", "true")
             and "kopfpeerings" not in r.get("path", "")]
    assert calls == [], calls[:5]
    # it was alive and watching all along: a change right after the quiet window is reconciled at once
    status, body = cluster.emu.request("PATCH", f"{MD_PATH}/{names[1]}", {"spec": {"paused": True}},
                                       content_type="application/merge-patch+json")
    assert status == 200, body
    wait_for(lambda: observed(cluster, names[1]) >= 2, 10, "a change after the idle window reconciled")
