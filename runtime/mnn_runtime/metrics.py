"""Prometheus metrics of the runtime: names, labels and the registry they live in.

Every series is labelled ``model`` and ``version``. Children are created as soon as a version is
known, so ``rate()`` sees the very first error instead of a series appearing mid-incident.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
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
        self.offloaded = Gauge(
            "mnn_version_offloaded",
            "1 when the version was unloaded while idle (it loads again on its next request), else 0.",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.memory = Gauge(
            "mnn_version_memory_bytes",
            "Resident memory loading and warming up the version added to the process that loaded it "
            "(with --workers: the supervisor, whose pages the workers share).",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.feedback = Counter(
            "mnn_feedback",
            "Feedback items counted for the version that answered the request they name.",
            ["model", "version"],
            registry=self.registry,
        )
        # Sums of feedback values: never decreasing (values are >= 0), read as counters. Gauges
        # only to keep these names (a Counter would add _total); "sum" adds every worker's, dead
        # ones included, as counters do.
        self.feedback_value = Gauge(
            "mnn_feedback_value_sum",
            "Sum of the feedback values counted per version (a conversion rate: divide by mnn_feedback_total).",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="sum",
        )
        self.feedback_squares = Gauge(
            "mnn_feedback_value_squared_sum",
            "Sum of the squared feedback values per version (the variance of a mean, for the sequential test).",
            ["model", "version"],
            registry=self.registry,
            multiprocess_mode="sum",
        )
        self.feedback_unmatched = Counter(
            "mnn_feedback_unmatched",
            "Feedback items not counted: an id this worker never answered (unknown) or answered too long ago (expired).",
            ["model", "reason"],
            registry=self.registry,
        )
        for reason in ("unknown", "expired"):
            self.feedback_unmatched.labels(model, reason)
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
        self.shadow = ShadowMetrics(model, self.registry)  # children made for the shadow version only
        self._observed: dict[tuple[str, str], tuple[Any, Any]] = {}  # see observe
        self._in_flight: dict[str, Any] = {}  # see in_flight_of
        self._feedback: dict[str, tuple[Any, Any, Any]] = {}  # see count_feedback
        self.touch(UNROUTED)

    def touch(self, version: str) -> None:
        """Create every child of a version at zero."""
        for outcome in OUTCOMES:
            self.requests.labels(self.model, version, outcome)
        self.latency.labels(self.model, version)
        self.in_flight.labels(self.model, version)
        if version != UNROUTED:
            self.feedback.labels(self.model, version)
            self.feedback_value.labels(self.model, version)
            self.feedback_squares.labels(self.model, version)

    def count_feedback(self, items: Iterable[tuple[str, float]]) -> None:
        """Feedback items (version, value), each whole in every scrape: with workers, their series are
        written holding the lock a scrape takes (``workers_metrics.feedback_writes``), once for the
        whole request. In one process a scrape and a feedback request both run on the event loop, so
        never at once."""
        rows = []
        for version, value in items:
            children = self._feedback.get(version)
            if children is None:  # looked up once, as in observe
                children = self._feedback[version] = (self.feedback.labels(self.model, version),
                                                      self.feedback_value.labels(self.model, version),
                                                      self.feedback_squares.labels(self.model, version))
            rows.append((children, value))
        if not rows:
            return
        with self._feedback_writes():
            for (trials, total, squares), value in rows:
                trials.inc()
                total.inc(value)
                squares.inc(value * value)

    def set_version_state(self, version: str, weight: int, loaded: bool, load_seconds: float | None,
                          memory_bytes: int | None = None, offloaded: bool = False) -> None:
        self.touch(version)
        self.weight.labels(self.model, version).set(weight / 100.0)
        self.loaded.labels(self.model, version).set(1 if loaded else 0)
        self.offloaded.labels(self.model, version).set(1 if offloaded else 0)
        if load_seconds is not None:
            self.load_duration.labels(self.model, version).set(load_seconds)
        self.memory.labels(self.model, version).set(memory_bytes if loaded and memory_bytes is not None else 0)

    def forget_version(self, version: str) -> None:
        """A version left the config: its weight, loaded and memory gauges drop to 0 (counters stay)."""
        self.weight.labels(self.model, version).set(0)
        self.loaded.labels(self.model, version).set(0)
        self.offloaded.labels(self.model, version).set(0)
        self.memory.labels(self.model, version).set(0)

    def in_flight_of(self, version: str) -> Any:
        """The in-flight gauge of ``version``, looked up once."""
        child = self._in_flight.get(version)
        if child is None:
            child = self._in_flight[version] = self.in_flight.labels(self.model, version)
        return child

    def observe(self, version: str, outcome: str, seconds: float) -> None:
        # the children of each (version, outcome), looked up once: labels() costs ~1.5 µs a call
        children = self._observed.get((version, outcome))
        if children is None:
            children = self._observed[(version, outcome)] = (self.requests.labels(self.model, version, outcome),
                                                             self.latency.labels(self.model, version))
        children[0].inc()
        if outcome == "success":
            children[1].observe(seconds)

    def exposition(self) -> bytes:
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry) + generate_latest(self._processes)
        from .workers_metrics import collect

        return generate_latest(collect(directory)) + generate_latest(self._processes)

    def activity(self) -> dict[str, tuple[float, float]]:
        """Per version: (requests answered, requests in flight), over every worker. A version whose
        pair has not changed and has nothing in flight was not used meanwhile."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if directory:
            from .workers_metrics import collect

            families = collect(directory).collect()
        else:
            families = self.registry.collect()
        answered: dict[str, float] = {}
        in_flight: dict[str, float] = {}
        for family in families:
            for sample in family.samples:
                version = sample.labels.get("version")
                if version is None:
                    continue
                if sample.name == "mnn_inference_requests_total":
                    answered[version] = answered.get(version, 0.0) + sample.value
                elif sample.name == "mnn_inference_in_flight_requests":
                    in_flight[version] = in_flight.get(version, 0.0) + sample.value
        return {v: (answered.get(v, 0.0), in_flight.get(v, 0.0)) for v in answered.keys() | in_flight.keys()}

    @staticmethod
    def _feedback_writes() -> contextlib.AbstractContextManager[None]:
        """The lock a request's feedback items are written under (with ``serve --workers``; none in one
        process)."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return contextlib.nullcontext()
        from .workers_metrics import feedback_writes

        return feedback_writes(directory)

    @functools.cached_property
    def _processes(self) -> CollectorRegistry:
        """Built at the first scrape (after ``serve --workers`` set the multiprocess directory)."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(ProcessTreeCollector(self.model, multi=bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))))
        return registry


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux; None elsewhere)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class ProcessTreeCollector:
    """The serving processes of this pod, summed: the process itself, or with ``serve --workers``
    (``multi``) the supervisor and every worker. prometheus_client's own process metrics describe
    one process and are not available in multiprocess mode. PSS counts each shared page once over
    the processes sharing it (the weights the workers share with the supervisor), RSS counts it in
    every process."""

    def __init__(self, model: str, multi: bool) -> None:
        self.model, self.multi = model, multi

    def _pids(self) -> list[int]:
        root = os.getppid() if self.multi else os.getpid()  # a worker answers /metrics; its parent supervises
        try:
            children = [int(p) for t in os.listdir(f"/proc/{root}/task")
                        for p in open(f"/proc/{root}/task/{t}/children").read().split()]
        except (OSError, ValueError):
            children = []
        return [root, *children] if self.multi else [root]

    def collect(self):  # type: ignore[no-untyped-def]
        pss = rss = cpu = 0.0
        count = 0
        ticks = os.sysconf("SC_CLK_TCK")
        pids = self._pids()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
                # utime + stime; the root adds what its reaped children used (cutime + cstime), so a
                # replaced worker's CPU stays in the sum and the counter never goes back. A worker that
                # exited and is not reaped yet (a zombie: no memory left) still says what it used.
                used = fields[11:15] if pid == pids[0] else fields[11:13]
                cpu += sum(int(f) for f in used) / ticks
                if fields[0] == "Z":
                    continue
                with open(f"/proc/{pid}/smaps_rollup") as fh:
                    for line in fh:
                        if line.startswith("Pss:"):
                            pss += int(line.split()[1]) * 1024
                        elif line.startswith("Rss:"):
                            rss += int(line.split()[1]) * 1024
                count += 1
            except (OSError, ValueError, IndexError):
                continue  # a worker that just exited (reaped: counted in the root's cutime from now on)
        if not count:
            return
        for name, help_, value in (
                ("mnn_runtime_memory_pss_bytes", "Proportional set size of the serving processes, summed "
                 "(shared pages counted once).", pss),
                ("mnn_runtime_memory_rss_bytes", "Resident set size of the serving processes, summed (shared "
                 "pages counted in every process).", rss),
                ("mnn_runtime_processes", "Serving processes (the supervisor and its workers, or one).", count)):
            family = GaugeMetricFamily(name, help_, labels=["model"])
            family.add_metric([self.model], value)
            yield family
        family = CounterMetricFamily("mnn_runtime_cpu_seconds", "CPU time (user + system) of the serving "
                                     "processes, summed, with that of exited workers.", labels=["model"])
        family.add_metric([self.model], cpu)
        yield family


# Outcomes of a request offered to the shadow version, and why a shadow run was an error.
SHADOW_OUTCOMES = ("compared", "error", "dropped", "skipped")
SHADOW_ERRORS = ("mismatch", "failed", "nonfinite", "not_loaded")
# 25 µs to 10 s: a forward alone, from a small scorer's to a detection model's.
FORWARD_BUCKETS = (
    0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)


class ShadowMetrics:
    """Shadow traffic (``shadow.py``), labelled with the shadow version. With workers, counters
    and the ``sum`` gauges add up over every worker (exited ones too: they never decrease) and
    the largest difference is the largest any worker saw."""

    def __init__(self, model: str, registry: CollectorRegistry) -> None:
        self.model = model
        labels = ["model", "version"]
        self.requests = Counter(
            "mnn_shadow_requests",
            "Requests offered to the shadow version, by outcome: compared, error (mnn_shadow_errors_total says why), "
            "dropped (its queue was full) or skipped (not loaded in this process at that moment).",
            [*labels, "outcome"], registry=registry,
        )
        self.errors = Counter(
            "mnn_shadow_errors",
            "Shadow runs that failed, by reason: mismatch (its inputs or outputs do not fit stable's), failed "
            "(the forward raised or gave nothing), nonfinite (NaN or infinity where stable had a number), "
            "not_loaded (the version failed to load).",
            [*labels, "reason"], registry=registry,
        )
        self.duration = Histogram(
            "mnn_shadow_duration_seconds", "Forward time of the shadow version on a shadowed request.",
            labels, buckets=FORWARD_BUCKETS, registry=registry,
        )
        self.stable_duration = Histogram(
            "mnn_shadow_stable_duration_seconds",
            "Forward time of stable on the same requests (those it ran unbatched): the baseline of "
            "mnn_shadow_duration_seconds.",
            labels, buckets=FORWARD_BUCKETS, registry=registry,
        )
        self.rows = Counter(
            "mnn_shadow_rows", "Rows of class-like outputs compared (float, last dimension > 1: one argmax per row).",
            labels, registry=registry,
        )
        self.agreeing_rows = Counter(
            "mnn_shadow_agreeing_rows", "Compared rows whose argmax over the last axis is the same in both versions.",
            labels, registry=registry,
        )
        # Never decreasing, read as counters: gauges only to keep these names (see feedback_value).
        self.diff_sum = Gauge(
            "mnn_shadow_abs_diff_sum",
            "Sum of |shadow - stable| over every output element compared (a mean: divide by "
            "mnn_shadow_abs_diff_count).",
            labels, registry=registry, multiprocess_mode="sum",
        )
        self.diff_count = Gauge(
            "mnn_shadow_abs_diff_count", "Output elements compared.",
            labels, registry=registry, multiprocess_mode="sum",
        )
        self.diff_max = Gauge(
            "mnn_shadow_abs_diff_max",
            "Largest |shadow - stable| of any output element compared since the runtime started.",
            labels, registry=registry, multiprocess_mode="max",
        )
        self._max: dict[str, float] = {}  # the largest difference this process saw, per version
        self._compared: dict[str, tuple[Any, ...]] = {}

    def touch(self, version: str) -> None:
        """Create every child of a shadow version at zero."""
        for outcome in SHADOW_OUTCOMES:
            self.requests.labels(self.model, version, outcome)
        for reason in SHADOW_ERRORS:
            self.errors.labels(self.model, version, reason)
        for family in (self.duration, self.stable_duration, self.rows, self.agreeing_rows, self.diff_sum,
                       self.diff_count, self.diff_max):
            family.labels(self.model, version)

    def count(self, version: str, outcome: str, reason: str | None = None) -> None:
        self.requests.labels(self.model, version, outcome).inc()
        if reason is not None:
            self.errors.labels(self.model, version, reason).inc()

    def compared(self, version: str, rows: int, agreeing: int, diff_sum: float, diff_count: int,
                 diff_max: float) -> None:
        children = self._compared.get(version)
        if children is None:  # looked up once: labels() costs as much as a small model's forward
            children = self._compared[version] = (
                self.requests.labels(self.model, version, "compared"), self.rows.labels(self.model, version),
                self.agreeing_rows.labels(self.model, version), self.diff_sum.labels(self.model, version),
                self.diff_count.labels(self.model, version))
        for child, amount in zip(children, (1, rows, agreeing, diff_sum, diff_count)):
            child.inc(amount)
        if diff_max > self._max.get(version, 0.0):
            self._max[version] = diff_max
            self.diff_max.labels(self.model, version).set(diff_max)

    def timed(self, version: str, seconds: float, stable_seconds: float | None) -> None:
        self.duration.labels(self.model, version).observe(seconds)
        if stable_seconds is not None:
            self.stable_duration.labels(self.model, version).observe(stable_seconds)


def outcome_of(status_code: int) -> str:
    if status_code < 400:
        return "success"
    return "client_error" if status_code < 500 else "server_error"
