"""Prometheus metrics of the runtime: names, labels and the registry they live in.

Every series is labelled ``model`` and ``version``. Children are created as soon as a version is
known, so ``rate()`` sees the very first error instead of a series appearing mid-incident.
"""

from __future__ import annotations

import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# 0.5 ms to 10 s: covers a 16->16 scorer (µs) up to a detection model on a busy CPU.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# Rows per forward of a batched version: 1 means batching found nothing to join.
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
OUTCOMES = ("success", "client_error", "server_error")
UNROUTED = "unrouted"

CONTENT_TYPE = CONTENT_TYPE_LATEST

# `_created` series double the exposition and no query here uses them.
disable_created_metrics()


class RuntimeMetrics:
    """The runtime's metric families, in their own registry (no process-global state)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "mnn_inference_requests",
            "Inference requests by outcome (success, client_error = 4xx, server_error = 5xx).",
            ["model", "version", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "mnn_inference_duration_seconds",
            "Time from receiving an inference request to having its response, per version.",
            ["model", "version"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # multiprocess_mode applies with several workers: in-flight requests add up over the live
        # workers; state gauges show the most recent value any worker set.
        self.in_flight = Gauge(
            "mnn_inference_in_flight_requests",
            "Inference requests being served right now.",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.weight = Gauge(
            "mnn_version_traffic_weight_ratio",
            "Share of keyed traffic routed to the version (0-1) by the current routing table.",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.loaded = Gauge(
            "mnn_version_loaded",
            "1 when the version is loaded and can serve, 0 when it failed or is loading.",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.load_duration = Gauge(
            "mnn_version_load_duration_seconds",
            "How long loading and warming up the version took.",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.batch_rows = Histogram(
            "mnn_inference_batch_rows",
            "Rows per forward of a version with dynamic batching (summed over the requests batched).",
            ["model", "version"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.config_reloads = Counter(
            "mnn_config_reloads",
            "Routing config changes seen, by result (applied or rejected).",
            ["model", "result"],
            registry=self.registry,
        )
        for result in ("applied", "rejected"):
            self.config_reloads.labels(model, result)
        self.start_time = Gauge(
            "mnn_runtime_start_time_seconds",
            "When this runtime (its parent process) started (Unix time): a change means its counters "
            "restarted at 0.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.start_time.labels(model).set(time.time())
        self.touch(UNROUTED)

    def touch(self, version: str) -> None:
        """Create every child of a version at zero."""
        for outcome in OUTCOMES:
            self.requests.labels(self.model, version, outcome)
        self.latency.labels(self.model, version)
        self.in_flight.labels(self.model, version)

    def set_version_state(self, version: str, weight: int, loaded: bool, load_seconds: float | None) -> None:
        self.touch(version)
        self.weight.labels(self.model, version).set(weight / 100.0)
        self.loaded.labels(self.model, version).set(1 if loaded else 0)
        if load_seconds is not None:
            self.load_duration.labels(self.model, version).set(load_seconds)

    def forget_version(self, version: str) -> None:
        """A version left the config: its weight and loaded gauges drop to 0 (counters stay)."""
        self.weight.labels(self.model, version).set(0)
        self.loaded.labels(self.model, version).set(0)

    def observe(self, version: str, outcome: str, seconds: float) -> None:
        self.requests.labels(self.model, version, outcome).inc()
        if outcome == "success":
            self.latency.labels(self.model, version).observe(seconds)

    def exposition(self) -> bytes:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
        return generate_latest(registry)


def outcome_of(status_code: int) -> str:
    if status_code < 400:
        return "success"
    return "client_error" if status_code < 500 else "server_error"
