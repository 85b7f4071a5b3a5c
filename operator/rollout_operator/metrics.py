"""The operator's own Prometheus metrics."""

from __future__ import annotations

import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from .status import Phase


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.reconciles = Counter("mnn_rollout_reconciles", "Reconciles by outcome (ok, invalid_spec, error).",
                                  ["outcome"], registry=r)
        self.reconcile_duration = Histogram(
            "mnn_rollout_reconcile_duration_seconds", "Time one reconcile took.", registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.phase = Gauge("mnn_rollout_phase", "1 for the current phase of each ModelDeployment.",
                           ["namespace", "name", "phase"], registry=r)
        self.weight = Gauge("mnn_rollout_version_weight_percent", "Traffic weight the operator routes to a version.",
                            ["namespace", "name", "version"], registry=r)
        self.canary_weight = Gauge("mnn_rollout_canary_weight_percent", "Traffic weight of the canary.",
                                   ["namespace", "name"], registry=r)
        self.verdicts = Counter("mnn_rollout_analysis_verdicts", "Analysis results by metric and verdict.",
                                ["namespace", "name", "metric", "verdict"], registry=r)
        self.rollbacks = Counter("mnn_rollout_rollbacks", "Canaries rolled back, by reason.",
                                 ["namespace", "name", "reason"], registry=r)
        self.promotions = Counter("mnn_rollout_promotions", "Canaries promoted, by reason.",
                                  ["namespace", "name", "reason"], registry=r)
        self.step_seconds = Histogram("mnn_rollout_step_duration_seconds", "Time a canary spent on one step.",
                                      ["namespace", "name"], registry=r,
                                      buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
        self.analysis_lateness = Histogram(
            "mnn_rollout_analysis_lateness_seconds", "How long after its due time an analysis ran.", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10))
        for outcome in ("ok", "invalid_spec", "error"):
            self.reconciles.labels(outcome)
        self._lock = threading.Lock()
        self._weights: dict[tuple[str, str], set[str]] = {}

    def set_state(self, namespace: str, name: str, phase: Phase, weights: Mapping[str, int], canary_weight: int) -> None:
        with self._lock:
            for p in Phase:
                self.phase.labels(namespace, name, p.value).set(1 if p == phase else 0)
            old = self._weights.get((namespace, name), set())
            for version in old - set(weights):
                self.weight.remove(namespace, name, version)
            for version, w in weights.items():
                self.weight.labels(namespace, name, version).set(w)
            self._weights[(namespace, name)] = set(weights)
            self.canary_weight.labels(namespace, name).set(canary_weight)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            children: list[tuple[Gauge, tuple[str, ...]]] = [(self.phase, (namespace, name, p.value)) for p in Phase]
            children += [(self.weight, (namespace, name, v)) for v in self._weights.pop((namespace, name), set())]
            children.append((self.canary_weight, (namespace, name)))
            for gauge, labels in children:
                try:
                    gauge.remove(*labels)
                except KeyError:
                    pass

    def serve(self, port: int, addr: str) -> None:
        start_http_server(port, addr=addr, registry=self.registry)
