"""The ``direct`` provider: scrape every runtime pod's /metrics, no Prometheus needed.

Custom metrics name a series (``metric`` plus exact ``labels``), matched on ``model`` and
``version``: a counter's increase over the interval, or a gauge's current value, summed over pods.
``compare: stable`` metrics get each role's counter increase (``Sample.counts``); in a shadow step,
the shadow version's ``mnn_shadow_*`` counters and histograms give ``Sample.shadow``.

Counters and histogram buckets are summed across pods; the analysis interval's values are the
deltas since the previous scrape of the same pod. The first scrape of an object only sets the
baseline. Every scrape keeps the series of every metric of the analysis and the shadow series,
whichever the step is judged by, so the step after a shadow step counts only its own interval. A
pod whose process start time (``mnn_runtime_start_time_seconds``) changed restarted: its counters
began again at 0, so their current values are the interval's. A pod missed by one
scrape keeps its baseline for the next, and makes this interval's sample an error (inconclusive):
its requests went uncounted, so the interval has no request count. A pod without a baseline is
counted from its start only when its process started after the rollout's first scrape and was
never counted before; else (missed by the first scrape, or back in the pod list after leaving it)
its counters hold what came before, so it only sets its baseline and the sample is an error.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..observe import pods_http
from ..spec import MetricSpec
from ..verdicts import Sample, ShadowSample
from .base import QUANTILES, SampleContext

REQUESTS = "mnn_inference_requests_total"
BUCKETS = "mnn_inference_duration_seconds_bucket"
STARTED = "mnn_runtime_start_time_seconds"

# pod url -> series key -> value ; series key = (metric, version, label)
Snapshot = dict[str, dict[tuple[str, str, str], float]]


@dataclass(frozen=True)
class Baseline:
    """What one rollout's next look counts from."""

    since: float  # when its first scrape was taken (epoch s): a process started later counted nothing before
    pods: Snapshot  # each pod's series at its last scrape
    counted: frozenset[tuple[str, float | None]]  # (pod url, process start time) of every process counted


CUSTOM = "custom"  # series key (CUSTOM, version, metric spec name): a counter, compared across scrapes
GAUGE = "gauge"  # series key (GAUGE, version, metric spec name): a current value, summed over pods
ROLE = "role"  # series key (ROLE, version, "<metric spec name>/<role>"): a compare: stable counter
# The shadow series, labelled with the shadow version: key (name, version, outcome or le or "").
SHADOW_REQUESTS = "mnn_shadow_requests_total"
SHADOW_BUCKETS = "mnn_shadow_duration_seconds_bucket"
SHADOW_STABLE_BUCKETS = "mnn_shadow_stable_duration_seconds_bucket"
SHADOW_COUNTERS = {"mnn_shadow_rows_total": "rows", "mnn_shadow_agreeing_rows_total": "agreeing",
                   "mnn_shadow_abs_diff_sum": "diff_sum", "mnn_shadow_abs_diff_count": "diff_count"}
SHADOW_SERIES = {SHADOW_REQUESTS, SHADOW_BUCKETS, SHADOW_STABLE_BUCKETS, *SHADOW_COUNTERS}


def parse(text: str, model: str, custom: Sequence[MetricSpec] = (),
          shadow: bool = False) -> dict[tuple[str, str, str], float]:
    """The series the analysis needs from one pod's /metrics: requests, latency buckets, the
    process start time, each custom ``metric`` (its samples matching the labels summed), each
    role series of a compare: stable metric, and with ``shadow`` the shadow series."""
    wanted = [m for m in custom if m.metric]
    roles = [(f"{m.name}/{role}", series) for m in custom if m.is_compare for role, series in m.role_series().items()]
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") != model:
                continue
            if s.name == STARTED:
                out[(STARTED, "", "")] = s.value
            elif s.name == REQUESTS:
                out[(REQUESTS, s.labels["version"], s.labels["outcome"])] = s.value
            elif s.name == BUCKETS:
                out[(BUCKETS, s.labels["version"], s.labels["le"])] = s.value
            elif shadow and s.name in SHADOW_SERIES:
                label = s.labels.get("outcome") or s.labels.get("le") or ""
                out[(s.name, s.labels.get("version", ""), label)] = s.value
            for role, series in roles:
                if series.matches(s.name, s.labels):
                    role_key = (ROLE, s.labels.get("version", ""), role)
                    out[role_key] = out.get(role_key, 0.0) + s.value
            for m in wanted:
                if s.name == m.metric and all(s.labels.get(k) == v for k, v in m.labels.items()):
                    key = (CUSTOM if is_counter(s.name) else GAUGE, s.labels.get("version", ""), m.name)
                    out[key] = out.get(key, 0.0) + s.value
    return out


def is_counter(name: str) -> bool:
    """A counter by the OpenMetrics naming rules: its increase is what an interval did."""
    return name.endswith(("_total", "_sum", "_count"))


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """histogram_quantile over cumulative bucket deltas, linear inside the bucket."""
    bounds = sorted(buckets)
    if not bounds:
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound in bounds:
        count = buckets[bound]
        if count >= rank:
            if bound == float("inf"):
                return prev_bound
            if count == prev_count:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / (count - prev_count)
        prev_bound, prev_count = bound, count
    return prev_bound


def _metrics_text(url: str, timeout: float) -> str:
    """A pod's /metrics; an HTTP error status raises (httpx.HTTPStatusError) whatever its body."""
    resp = pods_http().get(url + "/metrics", timeout=timeout)
    resp.raise_for_status()
    return resp.text


class DirectProvider:
    def __init__(self, fetch: Callable[[str], str] | None = None, timeout: float = 2.0) -> None:
        self._fetch = fetch or (lambda url: _metrics_text(url, timeout))
        self._previous: dict[str, Baseline] = {}
        self._lock = threading.Lock()

    def is_online(self) -> bool:
        return True

    def _scrape(self, urls: list[str], model: str, custom: Sequence[MetricSpec]) -> tuple[Snapshot, list[str]]:
        def one(url: str) -> tuple[str, dict[tuple[str, str, str], float] | None, str | None]:
            try:
                series = parse(self._fetch(url), model, custom, shadow=True)
            except (httpx.HTTPError, ValueError) as exc:
                return url, None, f"{url}: {exc or type(exc).__name__}"
            if (STARTED, "", "") not in series:  # an empty page, a proxy's, another model's runtime
                return url, None, f"{url}: no {STARTED} of model {model} in its /metrics: not its runtime"
            return url, series, None

        snapshot: Snapshot = {}
        errors = []
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
            for url, series, err in pool.map(one, urls):
                if series is None:
                    errors.append(err or url)
                else:
                    snapshot[url] = series
        return snapshot, errors

    def sample(self, ctx: SampleContext) -> dict[str, Sample]:
        if not ctx.pod_urls:
            return {v: Sample(error="no runtime pods to scrape") for v in ctx.versions}
        # Every series any step reads, whichever this one is judged by: a series left out of one scrape
        # would have no baseline at the next, and count all its pod ever counted as one interval's.
        current, errors = self._scrape(list(ctx.pod_urls), ctx.model, ctx.tracked or ctx.metrics)
        now = time.time()
        with self._lock:
            previous = self._previous.get(ctx.key)
            # Pods missed by this scrape keep their baseline (dropped once they leave the pod list).
            kept = {url: series for url, series in (previous.pods if previous else {}).items()
                    if url in ctx.pod_urls and url not in current}
            counted = frozenset((url, series.get((STARTED, "", ""))) for url, series in current.items())
            self._previous[ctx.key] = Baseline(previous.since if previous else now, {**kept, **current},
                                               (previous.counted if previous else frozenset()) | counted)
            owner = ctx.key.split("@", 1)[0] + "@"
            for stale in [k for k in self._previous if k.startswith(owner) and k != ctx.key]:
                del self._previous[stale]  # an earlier rollout of the same object
        if previous is None:
            return {v: Sample(error="baseline taken; values from the next interval") for v in ctx.versions}
        if errors or not current:
            # A pod that did not answer served traffic nobody counted: no request count, no verdict.
            return {v: Sample(error="not every pod could be scraped: " + ("; ".join(errors) or "no pod answered"))
                    for v in ctx.versions}
        unknown = [url for url, series in current.items() if not countable(url, series, previous)]
        if unknown:
            return {v: Sample(error="no baseline of " + ", ".join(unknown) + " from before this interval (its "
                              "counters hold what came before): values from the next interval") for v in ctx.versions}
        delta: dict[tuple[str, str, str], float] = defaultdict(float)
        for url, series in current.items():
            before = previous.pods.get(url, {})
            if before.get((STARTED, "", "")) != series.get((STARTED, "", "")):
                before = {}  # a new pod, or a restarted process: everything it counted is new
            for key, value in series.items():
                if key[0] == STARTED:
                    continue
                if key[0] == GAUGE:
                    delta[key] += value  # a current value, not a count: summed over pods as it is
                    continue
                old = before.get(key, 0.0)
                delta[key] += value - old if value >= old else value  # a reset we could not see
        return {v: self._version_sample(v, delta, ctx.metrics, ctx.shadow) for v in ctx.versions}

    @staticmethod
    def _version_sample(version: str, delta: Mapping[tuple[str, str, str], float],
                        metrics: Sequence[MetricSpec] = (), shadow: bool = False) -> Sample:
        outcomes = {label: value for (metric, v, label), value in delta.items() if metric == REQUESTS and v == version}
        requests = sum(outcomes.values())
        errors = outcomes.get("client_error", 0.0) + outcomes.get("server_error", 0.0)
        buckets = {float(label): value for (metric, v, label), value in delta.items()
                   if metric == BUCKETS and v == version}
        latency = {name: quantile(q, buckets) for name, q in QUANTILES.items()}
        custom: dict[str, float | None] = {}
        for m in metrics:
            if not m.metric:
                continue
            kind = CUSTOM if is_counter(m.metric) else GAUGE
            value = delta.get((kind, version, m.name))  # None: no pod exports it for this version
            if value is not None and m.per_request:
                value = value / requests if requests else None
            custom[m.name] = value
        counts = {m.name: {role: delta.get((ROLE, version, f"{m.name}/{role}")) for role in m.role_series()}
                  for m in metrics if m.is_compare}
        return Sample(requests=requests, errors=errors, latency=latency, custom=custom, counts=counts,
                      shadow=shadow_sample(version, delta) if shadow else None)

    def forget(self, key: str) -> None:
        with self._lock:
            self._previous.pop(key, None)


def countable(url: str, series: Mapping[tuple[str, str, str], float], previous: Baseline) -> bool:
    """Whether this scrape of the pod at ``url`` gives the interval's counts: from its baseline, or,
    without one, from its start when its process started after the rollout's first scrape (a new pod
    or a restarted one) and was never counted before (a pod back in the pod list after leaving it)."""
    if url in previous.pods:
        return True  # the same process since its baseline, or one that restarted since: counted from its start
    started = series.get((STARTED, "", ""))
    return started is not None and started >= previous.since and (url, started) not in previous.counted


def shadow_sample(version: str, delta: Mapping[tuple[str, str, str], float]) -> ShadowSample:
    """The runs of ``version`` in stable's shadow over the interval, from the counter deltas."""
    outcomes = {label: v for (name, ver, label), v in delta.items() if name == SHADOW_REQUESTS and ver == version}
    counters = {field: delta.get((name, version, "")) for name, field in SHADOW_COUNTERS.items()}

    def buckets(series: str) -> dict[float, float]:
        return {float(label): v for (name, ver, label), v in delta.items() if name == series and ver == version}

    runs = outcomes.get("compared", 0.0) + outcomes.get("error", 0.0) if outcomes else None
    mine, stable = buckets(SHADOW_BUCKETS), buckets(SHADOW_STABLE_BUCKETS)
    return ShadowSample(runs=runs, errors=outcomes.get("error", 0.0) if outcomes else None, **counters,
                        latency={q: quantile(x, mine) for q, x in QUANTILES.items()},
                        stable_latency={q: quantile(x, stable) for q, x in QUANTILES.items()})
