"""The ``prometheus`` metric provider against a real Prometheus scraping two runtime servers at 1 s.

The module sends one known batch of traffic and then samples with a 120 s window, so every test
sees the same increase. ``increase()`` extrapolates: over a window [t-120s, t] it scales the
difference between the first and last samples in the window by (sampled span + gap to the window
ends) / sampled span. The counters start at 0 (children exist from start-up), and Prometheus never
extrapolates a counter below zero, so the result is at least the exact count and at most about
(span + 1.1 scrape interval) / span of it: with >= 8 s of 1 s scrapes, under +15 %.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Sample, evaluate
from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.factory import ProviderFactory
from rollout_operator.providers.prometheus import PrometheusProvider
from rollout_operator.spec import AnalysisSpec, MetricSpec, ProviderSpec
from testbed.promstack import Prometheus, require_promstack, send, write_runtime_config
from tests.runtime_server import RuntimeServer

WINDOW_SECONDS = 120  # every test of the module runs well within it after the traffic
MAX_EXTRAPOLATION = 1.15
# per pod: version -> (good, bad); v2-breaking answers 400 to every (v1-shaped) request
TRAFFIC = {"v1": (30, 0), "v2": (20, 5), "v2-breaking": (10, 0)}
SERVER_ERRORS = ('sum(increase(mnn_inference_requests_total{model="{model}",version="{version}",'
                 'outcome="server_error"}[{interval}]))')


@dataclass
class Stack:
    prometheus: Prometheus
    pods: list[RuntimeServer]
    expected: dict[str, tuple[int, int]]  # version -> (requests, errors) over both pods
    scraped_at: float  # when Prometheus had scraped every request sent (none came after)


@pytest.fixture(scope="module")
def stack(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_promstack()
    workdir = tmp_path_factory.mktemp("prometheus-provider")
    config = write_runtime_config(examples_dir, workdir / "runtime.yaml")
    pods = [RuntimeServer(config, workdir / f"pod-{i}.log") for i in range(2)]
    prometheus: Prometheus | None = None
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), pods))
        prometheus = Prometheus(workdir, [f"127.0.0.1:{p.port}" for p in pods]).start()
        waited = prometheus.wait_for_up(30)
        print(f"targets up {waited:.1f} s after Prometheus was ready")
        time.sleep(8)  # >= 8 s of zero-valued samples before the traffic: bounds the extrapolation
        expected = {}
        for version, (good, bad) in TRAFFIC.items():
            for pod in pods:
                send(pod.url, version, good=good, bad=bad)
            errors = good + bad if version == "v2-breaking" else bad
            expected[version] = (2 * (good + bad), 2 * errors)
        for version, (requests, _) in expected.items():
            promql = f'sum(mnn_inference_requests_total{{model="scorer",version="{version}"}})'
            prometheus.wait_until(lambda: prometheus.value(promql) == requests, 15,  # noqa: B023
                                  f"Prometheus scraped all {requests} {version} requests")
        yield Stack(prometheus, pods, expected, time.time())
    finally:
        if prometheus is not None:
            prometheus.stop()
        for pod in pods:
            pod.stop()


PROVIDER = {"type": "prometheus", "address": "http://127.0.0.1:9090"}


def ctx(model: str = "scorer", versions: tuple[str, ...] = ("v2", "v1", "v2-breaking"),
        metrics: tuple[MetricSpec, ...] = (), since: float | None = None) -> SampleContext:
    return SampleContext(key="uid-1", namespace="default", name="scorer", model=model, versions=versions,
                         interval_seconds=WINDOW_SECONDS, metrics=metrics, since=since)


def test_a_step_is_judged_on_its_own_traffic_never_on_what_came_before_it(stack: Stack) -> None:
    """The window ends at the step's start (``since``): a step that began after the traffic sees
    none of it, and one too young for a window sees no data (inconclusive). Before, every window
    was the whole interval: a canary file edited in place (the step restarted at once) passed on
    the old file's traffic and was promoted."""
    provider = PrometheusProvider(stack.prometheus.url)
    young = provider.sample(ctx(since=time.time() - 3))
    for sample in young.values():
        assert sample.error is not None and "the step began 3 s ago" in sample.error, sample
    assert evaluate(AnalysisSpec(), young["v2"], young["v1"], now=0.0).verdict == INCONCLUSIVE
    since = stack.scraped_at + 1.0  # after the last request was scraped
    time.sleep(max(0.0, since + 11 - time.time()))
    after = provider.sample(ctx(since=since))
    for version in stack.expected:
        assert after[version].error is None and after[version].requests == 0, (version, after[version])
    whole = provider.sample(ctx())  # the same minute, no step start given: the whole interval
    assert whole["v2"].requests is not None and whole["v2"].requests >= stack.expected["v2"][0] - 1e-6


def test_requests_and_errors_per_version_match_the_traffic_sent_within_the_extrapolation(stack: Stack) -> None:
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx())
    for version, (requests, errors) in stack.expected.items():
        sample = samples[version]
        assert sample.error is None, sample.error
        assert requests - 1e-6 <= sample.requests <= requests * MAX_EXTRAPOLATION, (version, sample)
        assert errors - 1e-6 <= sample.errors <= errors * MAX_EXTRAPOLATION + 1e-6, (version, sample)
        # each series is extrapolated by its own factor (the two pods are scraped at different
        # offsets), so the error rate is close to, not exactly, what was sent
        assert sample.error_rate == pytest.approx(errors / requests, rel=0.05)
        print(f"{version}: sent {requests} requests / {errors} errors, increase() gave "
              f"{sample.requests:.2f} / {sample.errors:.2f}")


def test_latency_quantiles_are_present_plausible_and_ordered(stack: Stack) -> None:
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx())
    for version in ("v1", "v2"):
        latency = samples[version].latency
        assert set(latency) == {"p50", "p95", "p99"}
        assert all(v is not None and 0 < v < 1.0 for v in latency.values()), (version, latency)
        assert latency["p50"] <= latency["p95"] <= latency["p99"]
    # failures are not timed: histogram_quantile over no observations is NaN, reported as None
    assert samples["v2-breaking"].latency == {"p50": None, "p95": None, "p99": None}


def test_a_custom_metric_query_gets_model_version_and_interval_filled_in(stack: Stack) -> None:
    metrics = (MetricSpec(name="server-errors", query=SERVER_ERRORS, max=0),
               MetricSpec(name="pods-loaded", query='sum(mnn_version_loaded{model="{model}",version="{version}"})',
                          min=2),
               MetricSpec(name="targets", query='count(count_over_time(up{job="mnn-runtime"}[{interval}]))', max=10))
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx(metrics=metrics))
    assert samples["v2"].custom == {"server-errors": 0.0, "pods-loaded": 2.0, "targets": 2.0}
    assert samples["v1"].custom["pods-loaded"] == 2.0
    spec = AnalysisSpec.model_validate({"minRequests": 10, "provider": PROVIDER, "metrics": [
        {"name": "error-rate", "max": 0.25}, {"name": "server-errors", "query": SERVER_ERRORS, "max": 0},
        {"name": "pods-loaded", "query": "x", "min": 2}]})
    analysis = evaluate(spec, samples["v2"], samples["v1"], now=0.0)
    assert analysis.verdict == PASS, analysis
    assert [m.verdict for m in analysis.metrics] == [PASS, PASS, PASS]


def test_a_custom_metric_named_by_series_and_labels_reads_like_the_direct_provider(stack: Stack) -> None:
    metrics = (MetricSpec(name="pods-loaded", metric="mnn_version_loaded", min=2),
               MetricSpec(name="client-errors", metric="mnn_inference_requests_total",
                          labels={"outcome": "client_error"}, max=0),
               MetricSpec(name="client-error-ratio", metric="mnn_inference_requests_total",
                          labels={"outcome": "client_error"}, perRequest=True, max=0.5))
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx(metrics=metrics))
    assert samples["v2"].custom["pods-loaded"] == 2.0  # a gauge: its current value, summed over the pods
    good, bad = TRAFFIC["v2"]
    assert samples["v2"].custom["client-errors"] == pytest.approx(2 * bad, rel=0.35)  # increase(), extrapolated
    assert samples["v2"].custom["client-error-ratio"] == pytest.approx(bad / (good + bad), rel=0.05)
    assert samples["v2-breaking"].custom["client-error-ratio"] == pytest.approx(1.0)


def test_evaluate_on_prometheus_samples_fails_breaches_and_holds_on_too_few_requests(stack: Stack) -> None:
    s = PrometheusProvider(stack.prometheus.url).sample(ctx())

    def spec(**analysis: object) -> AnalysisSpec:
        return AnalysisSpec.model_validate(analysis)

    assert evaluate(spec(minRequests=10, metrics=[{"name": "error-rate", "max": 0.1}]),
                    s["v2"], s["v1"], 0).verdict == FAIL  # 20 % errors
    assert evaluate(spec(minRequests=10, metrics=[{"name": "error-rate", "max": 1, "maxErrorRateIncrease": 0.1}]),
                    s["v2"], s["v1"], 0).verdict == FAIL  # 0.2 - 0.0 > 0.1
    assert evaluate(spec(minRequests=10, metrics=[{"name": "latency-p95", "max": 1.0, "maxLatencyRatio": 50}]),
                    s["v2"], s["v1"], 0).verdict == PASS
    held = evaluate(spec(minRequests=1000, metrics=[{"name": "error-rate", "max": 0.1}]), s["v2"], s["v1"], 0)
    assert held.verdict == INCONCLUSIVE and "minRequests 1000" in held.message


def test_a_query_returning_nothing_gives_none_values_and_an_inconclusive_verdict(stack: Stack) -> None:
    metrics = (MetricSpec(name="server-errors", query=SERVER_ERRORS, max=0),)
    samples = PrometheusProvider(stack.prometheus.url).sample(ctx(model="no-such-model", metrics=metrics))
    sample = samples["v2"]
    assert sample.error is None
    assert sample.requests is None and sample.errors is None
    assert sample.latency == {"p50": None, "p95": None, "p99": None}
    assert sample.custom == {"server-errors": None}
    spec = AnalysisSpec.model_validate({"minRequests": 0, "provider": PROVIDER, "metrics": [
        {"name": "error-rate", "max": 0.01}, {"name": "latency-p99", "max": 1},
        {"name": "server-errors", "query": SERVER_ERRORS, "max": 0}]})
    analysis = evaluate(spec, sample, samples["v1"], now=0.0)
    assert analysis.verdict == INCONCLUSIVE
    assert {m.verdict for m in analysis.metrics} == {INCONCLUSIVE}


def test_a_bad_query_gives_an_error_sample_naming_the_query(stack: Stack) -> None:
    broken = 'sum(rate(mnn_inference_requests_total{model="{model}"}[{interval}]'  # unbalanced
    samples = PrometheusProvider(stack.prometheus.url).sample(
        ctx(metrics=(MetricSpec(name="broken", query=broken, max=1),)))
    for sample in samples.values():
        assert sample.error is not None
        assert 'sum(rate(mnn_inference_requests_total{model="scorer"}[120s]' in sample.error
        assert "parse error" in sample.error
    analysis = evaluate(AnalysisSpec(), samples["v2"], samples["v1"], now=0.0)
    assert analysis.verdict == INCONCLUSIVE and "parse error" in analysis.message


def test_prometheus_stopped_gives_error_samples_and_inconclusive_then_recovers_when_started(stack: Stack) -> None:
    provider = PrometheusProvider(stack.prometheus.url, timeout=2.0)
    assert provider.is_online()
    stack.prometheus.stop()
    try:
        assert not provider.is_online()
        samples = provider.sample(ctx())
        for sample in samples.values():
            assert sample.error is not None and "unreachable" in sample.error and stack.prometheus.url in sample.error
        analysis = evaluate(AnalysisSpec(), samples["v2"], samples["v1"], now=0.0)
        assert analysis.verdict == INCONCLUSIVE
        assert analysis.message.startswith("no data:") and "unreachable" in analysis.message
    finally:
        stack.prometheus.start()
    assert provider.is_online()
    # same port and storage: the data from before the stop is still there
    requests, _ = stack.expected["v2"]

    def recovered() -> Sample | None:
        sample = provider.sample(ctx())["v2"]
        return sample if sample.error is None and (sample.requests or 0) >= requests - 1e-6 else None

    stack.prometheus.wait_until(recovered, 15, "a full sample after the restart")


# -- the Authorization header from the factory's secret reader -----------------------------------


class RecordingPrometheus:
    """A stand-in for Prometheus behind an auth proxy: records headers, wants a bearer token."""

    def __init__(self, token: str) -> None:
        self.seen: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                outer.seen.append({"path": self.path, "authorization": self.headers.get("Authorization")})
                if self.headers.get("Authorization") != f"Bearer {token}":
                    code, body = 401, b"unauthorized"
                elif self.path.startswith("/api/v1/query"):
                    code, body = 200, json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
                        {"metric": {}, "value": [time.time(), "7"]}]}}).encode()
                else:
                    code, body = 200, b"Prometheus Server is Ready.\n"
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RecordingPrometheus:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_factory_sends_the_authorization_header_its_secret_reader_returns() -> None:
    reads: list[tuple[str, str]] = []

    def read_secret(namespace: str, name: str) -> str | None:
        reads.append((namespace, name))
        return "Bearer s3cret" if (namespace, name) == ("team-a", "prom-auth") else None

    with RecordingPrometheus("s3cret") as server:
        factory = ProviderFactory(read_secret)
        spec = ProviderSpec.model_validate({"type": "prometheus", "address": server.url,
                                            "secretRef": {"name": "prom-auth"}})
        provider = factory.get(spec, "team-a")
        assert factory.get(spec, "team-a") is provider and reads == [("team-a", "prom-auth")]  # cached
        samples = provider.sample(ctx(versions=("v2",)))
        assert samples["v2"] == Sample(requests=7.0, errors=7.0, latency={"p50": 7.0, "p95": 7.0, "p99": 7.0})
        queries = [r for r in server.seen if r["path"].startswith("/api/v1/query")]
        assert len(queries) == 5 and {r["authorization"] for r in queries} == {"Bearer s3cret"}

        # without a secretRef no header is sent, and the proxy's 401 is an error sample, not a crash
        server.seen.clear()
        plain = factory.get(ProviderSpec.model_validate({"type": "prometheus", "address": server.url}), "team-a")
        sample = plain.sample(ctx(versions=("v2",)))["v2"]
        assert sample.error is not None and "without JSON" in sample.error and "401" in sample.error
        assert {r["authorization"] for r in server.seen} == {None}
