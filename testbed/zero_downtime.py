"""Version changes and pod rolls under continuous traffic through the runtime's Service: what each
event costs in failed requests. One scenario for the e2e test (``tests/operator/
test_e2e_zero_downtime.py``: zero failed requests, a SIGKILL's failures bounded) and the benchmark
(``bench/zero_downtime.py``: the table in bench/RESULTS.md).

The traffic goes to the Service's address of the kubelet stand-in (``kubelet_services``: ready,
not deleted pods only, a few hundred ms behind the API, connections kept with their pod), on
kept-alive connections, as an application in the cluster would send it. Events, in order, on
one ModelDeployment ``scorer`` (v1 stable, 2 replicas):

- ``rollout``: add v2 as canary, every step (20%, 50%), promote, retire v1;
- ``rollback``: a slow canary (v2-slow) rolled back by the latency analysis;
- ``image``: a new runtime image: every pod rolls (maxSurge 1, maxUnavailable 0, preStop, drain);
- ``scale-up`` / ``scale-down``: ``kubectl scale md scorer --replicas 3``, then back to 2;
- ``sigkill``: the main process of one runtime pod is SIGKILLed (not graceful: failures expected,
  bounded, reported).

An event's requests are those sent from its start until one second after it completed.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mnn_rollout.local.traffic import Traffic
from testbed.cluster import Cluster, wait_for

GRACEFUL = ("rollout", "rollback", "image", "scale-up", "scale-down")
EVENTS = (*GRACEFUL, "sigkill")
SETTLE = 1.0  # seconds of traffic after an event completed that still count as its own


@dataclass
class EventResult:
    name: str
    seconds: float  # from its start until it completed
    total: int
    failed: int
    statuses: Counter[int] = field(default_factory=Counter)  # of the failed requests (0: no answer)

    def line(self) -> str:
        detail = ", ".join(f"{'no answer' if s == 0 else s}: {n}" for s, n in sorted(self.statuses.items()))
        return (f"{self.name:<11} {self.failed:>6} / {self.total:<7} failed  ({self.seconds:5.1f} s)"
                + (f"  [{detail}]" if detail else ""))


class Scenario:
    """Runs ``events`` on ``cluster`` (operator started here) under ``rate`` requests/s on
    ``connections`` kept-alive connections to the Service."""

    def __init__(self, cluster: Cluster, rate: float = 100.0, connections: int = 8, timeout: float = 120.0) -> None:
        self.cluster, self.rate, self.connections, self.timeout = cluster, rate, connections, timeout
        self.results: list[EventResult] = []
        self.traffic: Traffic | None = None
        self.killed_connections = 0  # the traffic's connections to the SIGKILLed pod

    # --- the events -------------------------------------------------------------------------------

    def _spec(self, **spec: Any) -> dict[str, Any]:
        models = self.cluster.models
        return {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "scorer"},
                "spec": {"model": "scorer", "versions": [{"name": "v1", "uri": f"file://{models}/v1.mnn"}],
                         "runtime": {"replicas": 2}, **spec}}

    def _canary(self, version: str, metrics: list[dict[str, Any]], stable: str) -> dict[str, Any]:
        models = self.cluster.models
        runtime = dict(self._applied["spec"]["runtime"])
        return self._spec(
            versions=[{"name": stable, "uri": f"file://{models}/{stable}.mnn"},
                      {"name": version, "uri": f"file://{models}/{version}.mnn"}],
            stable=stable, canary=version, runtime=runtime,
            strategy={"steps": [{"weight": 20, "pause": "2s"}, {"weight": 50, "pause": "2s"}],
                      "analysis": {"interval": "1s", "minRequests": 5, "failureLimit": 2, "metrics": metrics},
                      "scaleDownDelaySeconds": 2},
            progressDeadlineSeconds=90)

    def rollout(self) -> None:
        c = self.cluster
        self._applied = self._canary("v2", [{"name": "error-rate", "max": 0.05}], "v1")
        c.apply(self._applied)
        seen: set[Any] = set()

        def promoted() -> bool:
            st = c.status()
            seen.add(st.get("canaryWeight"))
            return st.get("phase") == "Succeeded" and st.get("retiredVersions") == ["v1"]

        wait_for(promoted, self.timeout, "v2 promoted and v1 retired", interval=0.2)
        assert {20, 50} <= seen, f"steps seen: {seen}"
        wait_for(lambda: set(c.configmap_weights()) == {"v2"}, 30, "v1 gone from the routing ConfigMap")

    def rollback(self) -> None:
        c = self.cluster
        self._applied = self._canary("v2-slow", [{"name": "error-rate", "max": 0.05},
                                                 {"name": "latency-p50", "maxLatencyRatio": 3}], "v2")
        c.apply(self._applied)
        wait_for(lambda: c.status().get("phase") == "RolledBack", self.timeout, "v2-slow rolled back", interval=0.2)
        wait_for(lambda: c.configmap_weights().get("v2") == 100, 30, "v2 at 100% again")

    def _roll(self, change: Callable[[], None], replicas: int) -> None:
        kubelet = self.cluster.kubelet
        before = kubelet.template_hash("scorer-runtime")
        change()
        wait_for(lambda: kubelet.template_hash("scorer-runtime") != before, 30, "the new pod template")
        kubelet.wait_ready("scorer-runtime", "default", replicas=replicas, timeout=self.timeout)

    def image(self) -> None:
        spec = dict(self._applied)
        spec["spec"] = {**spec["spec"], "runtime": {**spec["spec"]["runtime"], "image": "mnn-rollout:zero-downtime"}}
        self._applied = spec
        self._roll(lambda: self.cluster.apply(spec), replicas=2)

    def _scale(self, replicas: int) -> None:
        c = self.cluster
        c.emu.kubectl("scale", "modeldeployment/scorer", f"--replicas={replicas}")
        c.kubelet.wait_ready("scorer-runtime", "default", replicas=replicas, timeout=self.timeout)
        wait_for(lambda: c.status().get("replicas") == replicas, 30, f"status.replicas {replicas}")
        self._applied["spec"]["runtime"]["replicas"] = replicas

    def scale_up(self) -> None:
        self._scale(3)

    def scale_down(self) -> None:
        self._scale(2)

    def sigkill(self) -> None:
        kubelet = self.cluster.kubelet
        # the pod holding the most of the traffic's connections: the worst case
        pod = max(kubelet.pods("scorer-runtime", "default"), key=lambda p: kubelet.services.open[(p.ip, p.port)])
        self.killed_connections = kubelet.services.open[(pod.ip, pod.port)]
        kubelet.kill(pod.name, signal.SIGKILL)
        wait_for(lambda: any(p.name == pod.name and p.restarts >= 1 and p.ready
                             for p in kubelet.pods("scorer-runtime", "default")), self.timeout,
                 "the killed pod restarted and ready")
        wait_for(lambda: len(kubelet.service_endpoints("scorer") or ()) == 2, 30, "both pods as endpoints again")

    # --- running ----------------------------------------------------------------------------------

    def start(self) -> Scenario:
        c = self.cluster
        if not c.operators:
            c.start_operator()
        self._applied = self._spec()
        c.apply(self._applied)
        c.wait_ready()
        wait_for(lambda: c.status().get("phase") == "Ready", 60, "phase Ready")
        url = c.kubelet.service_url("scorer")
        wait_for(lambda: len(c.kubelet.service_endpoints("scorer") or ()) == 2, 30, "both pods behind the Service")
        self.traffic = Traffic(url, users=1000, rate=self.rate, connections=self.connections,
                               max_seconds=1800, timeout=10.0).start()
        wait_for(lambda: len(self.traffic.samples()) >= 20, 30, "traffic flowing")  # type: ignore[union-attr]
        return self

    def run(self, events: Sequence[str] = EVENTS) -> list[EventResult]:
        assert self.traffic is not None, "start() first"
        for name in events:
            started = time.monotonic()
            getattr(self, name.replace("-", "_"))()
            done = time.monotonic()
            time.sleep(SETTLE)
            samples = [s for s in self.traffic.samples(started) if started <= s.sent <= done + SETTLE]
            failed = [s for s in samples if not s.ok]
            self.results.append(EventResult(name, done - started, len(samples), len(failed),
                                            Counter(s.status for s in failed)))
            if self.traffic.error is not None:
                raise AssertionError(f"the traffic generator failed: {self.traffic.error!r}")
        return self.results

    def stop(self) -> None:
        if self.traffic is not None:
            self.traffic.stop()

    def report(self) -> str:
        lines = ["event       failed / total", *(r.line() for r in self.results)]
        if any(r.name == "sigkill" for r in self.results):
            lines.append(f"(the SIGKILLed pod held {self.killed_connections} of the {self.connections} connections)")
        return "\n".join(lines)
