"""The ``prometheus`` provider's shadow runs and ``compare: stable`` counts, against a real Prometheus
scraping two runtime servers at 1 s: one runs v2-breaking in v1's shadow (every run an error), the
other v2 (compared). Known traffic and feedback are sent once; every test samples the same.

``increase()`` extrapolates each series by a factor of its own (see test_prometheus_provider.py):
with >= 8 s of zero-valued samples before the traffic, a count comes out between the exact count
and 15% above it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.prometheus import MIN_WINDOW_SECONDS, PrometheusProvider
from rollout_operator.strategy import AnalysisSpec, MetricSpec
from rollout_operator.verdicts import FAIL, evaluate
from testbed.promstack import GOOD_BODY, Prometheus, require_promstack
from tests.operator.test_direct_provider_business import config
from tests.runtime_server import FEEDBACK_AUTH, RuntimeServer

pytestmark = pytest.mark.timeout(240)
WINDOW_SECONDS = 120
MAX_EXTRAPOLATION = 1.15
ROUTED = 40  # routed requests per pod: each answered by v1 and run in the shadow
# per version: (requests pinned to it on the v2 pod, feedback values 1, feedback values 0)
FEEDBACK = {"v2": (20, 4, 16), "v1": (30, 12, 18)}
CONVERSION = MetricSpec.model_validate({"name": "conversion", "compare": "stable", "margin": 0.05})


@dataclass
class Stack:
    prometheus: Prometheus
    pods: dict[str, RuntimeServer]  # by shadow version


def shadow_runs(prometheus: Prometheus, version: str) -> float | None:
    return prometheus.value(f'sum(mnn_shadow_requests_total{{model="scorer",version="{version}",'
                            f'outcome=~"compared|error"}})')


@pytest.fixture(scope="module")
def stack(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_promstack()
    workdir = tmp_path_factory.mktemp("prometheus-business")
    pods = {v: RuntimeServer(config(examples_dir, workdir / f"{v}.yaml", v), workdir / f"{v}.log")
            for v in ("v2-breaking", "v2")}
    prometheus: Prometheus | None = None
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), pods.values()))
        prometheus = Prometheus(workdir, [f"127.0.0.1:{p.port}" for p in pods.values()]).start()
        prometheus.wait_for_up(30)
        time.sleep(8)  # zero-valued samples first: bounds the extrapolation
        for pod in pods.values():
            with httpx.Client(base_url=pod.url, timeout=10) as client:
                for i in range(ROUTED):
                    assert client.post("/v2/models/scorer/infer", json=GOOD_BODY,
                                       headers={"X-User-Id": f"u{i}"}).status_code == 200
        with httpx.Client(base_url=pods["v2"].url, timeout=10) as client:
            for version, (n, ones, zeros) in FEEDBACK.items():
                ids = [client.post(f"/v2/models/scorer/versions/{version}/infer", json=GOOD_BODY).json()["id"]
                       for _ in range(n)]
                items = [{"id": i, "value": 1} for i in ids[:ones]] + [{"id": i, "value": 0}
                                                                       for i in ids[ones:ones + zeros]]
                assert client.post("/v2/models/scorer/feedback", json=items,
                                   headers=FEEDBACK_AUTH).json()["counted"] == ones + zeros
        for version in pods:
            prometheus.wait_until(lambda: shadow_runs(prometheus, version) == ROUTED, 30,  # type: ignore[union-attr]  # noqa: B023
                                  f"Prometheus scraped the {ROUTED} shadow runs of {version}")
        prometheus.wait_until(lambda: prometheus.value(  # type: ignore[union-attr]
            'sum(mnn_feedback_total{model="scorer",version="v1"})') == 30, 30, "Prometheus scraped the feedback")
        yield Stack(prometheus, pods)
    finally:
        if prometheus is not None:
            prometheus.stop()
        for pod in pods.values():
            pod.stop()


def ctx(*metrics: MetricSpec, versions: tuple[str, ...], shadow: bool = False,
        since: float | None = None) -> SampleContext:
    return SampleContext(key="uid-1", namespace="default", name="scorer", model="scorer", versions=versions,
                         interval_seconds=WINDOW_SECONDS, metrics=metrics, shadow=shadow, since=since)


def within(value: float | None, exact: float) -> bool:
    return value is not None and exact - 1e-6 <= value <= exact * MAX_EXTRAPOLATION + 1e-6


def test_a_breaking_shadow_versions_runs_are_all_errors_and_fail_the_step(stack: Stack) -> None:
    metric = MetricSpec.model_validate({"name": "shadow-error-rate", "max": 0.05})
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx(metric, versions=("v2-breaking", "v1"),
                                                                  shadow=True))
    shadow = samples["v2-breaking"].shadow
    assert shadow is not None and within(shadow.runs, ROUTED), shadow
    assert shadow.error_rate == pytest.approx(1.0)  # one series, one extrapolation factor
    assert samples["v1"].shadow is None  # the shadow series name the shadow version only
    look = evaluate(AnalysisSpec(minRequests=20, metrics=[metric]), samples["v2-breaking"], samples["v1"], 0.0,
                    shadow=True)
    assert look.verdict == FAIL and look.canary_requests == shadow.runs


def test_a_compared_shadow_gives_agreement_differences_and_both_forward_times(stack: Stack) -> None:
    metrics = [MetricSpec.model_validate(m) for m in (
        {"name": "shadow-agreement", "min": 0.0}, {"name": "shadow-mean-abs-diff", "max": 10},
        {"name": "shadow-latency-p99", "maxLatencyRatio": 1000})]
    shadow = PrometheusProvider(stack.prometheus.url).sample(ctx(*metrics, versions=("v2", "v1"), shadow=True))[
        "v2"].shadow
    assert shadow is not None and within(shadow.runs, ROUTED) and shadow.errors == 0
    assert within(shadow.rows, ROUTED) and within(shadow.diff_count, ROUTED * 32)
    assert shadow.agreement is not None and 0 <= shadow.agreement <= 1.0 + 1e-9
    assert shadow.mean_abs_diff is not None and shadow.mean_abs_diff > 0
    assert shadow.latency["p99"] is not None and shadow.latency["p99"] > 0
    assert shadow.stable_latency["p99"] is not None and shadow.stable_latency["p99"] > 0


def test_compare_counts_are_the_increase_since_the_step_started(stack: Stack) -> None:
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx(CONVERSION, versions=("v2", "v1"),
                                                                  since=time.time() - WINDOW_SECONDS))
    for version, (_, ones, zeros) in FEEDBACK.items():
        counts = samples[version].counts["conversion"]
        assert samples[version].since_step  # totals of the step so far: they replace its stratum
        assert within(counts["trials"], ones + zeros), (version, counts)
        assert within(counts["successes"], ones) and counts["successes"] <= counts["trials"]  # type: ignore[operator]
    print({v: s.counts for v, s in samples.items()})


def test_a_step_younger_than_the_shortest_window_has_no_counts_yet(stack: Stack) -> None:
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx(CONVERSION, versions=("v2", "v1"),
                                                                  since=time.time() - MIN_WINDOW_SECONDS / 2))
    for sample in samples.values():  # no window yet: no data (inconclusive), never the counts of before the step
        assert sample.counts == {} and sample.error is not None and "the step began 5 s ago" in sample.error, sample
