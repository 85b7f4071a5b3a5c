"""Review of the ``prometheus`` provider against a real Prometheus scraping two runtime servers that
serve the same model and versions for two ModelDeployments named alike in two namespaces: each
pod's series carry its ``namespace`` and ``modeldeployment``, as the chart's PodMonitor labels them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.prometheus import PrometheusProvider
from rollout_operator.spec import AnalysisSpec, MetricSpec
from rollout_operator.verdicts import FAIL, PASS, evaluate
from testbed.promstack import Prometheus, require_promstack, send, write_runtime_config
from tests.runtime_server import RuntimeServer

# per namespace: version -> (good, bad). team-a's canary fails 2 of its 10 requests; team-b's serves 100 well
TRAFFIC = {"team-a": {"v2": (8, 2), "v1": (40, 0)}, "team-b": {"v2": (100, 0), "v1": (40, 0)}}
ANALYSIS = AnalysisSpec.model_validate({"minRequests": 10, "metrics": [{"name": "error-rate", "max": 0.05}]})


@dataclass
class Stack:
    prometheus: Prometheus


Traffic = dict[str, dict[str, tuple[int, int]]]


@contextlib.contextmanager
def scraped_pods(examples_dir: Path, workdir: Path, traffic: Traffic,
                 labels: dict[str, dict[str, str]]) -> Iterator[Prometheus]:
    """One runtime server per key of ``traffic`` (version -> (good, bad) requests sent to it), all
    scraped by one real Prometheus, each with the target labels ``labels`` gives its key (none when
    absent); yields once Prometheus has every v2 request."""
    require_promstack()
    config = write_runtime_config(examples_dir, workdir / "runtime.yaml", versions=("v1", "v2"))
    pods = {name: RuntimeServer(config, workdir / f"{name}.log") for name in traffic}
    prometheus: Prometheus | None = None
    try:
        for pod in pods.values():
            pod.start()
        prometheus = Prometheus(workdir, [f"127.0.0.1:{pod.port}" for pod in pods.values()],
                                target_labels={f"127.0.0.1:{pods[name].port}": extra
                                               for name, extra in labels.items()}).start()
        prometheus.wait_for_up(30)
        for name, served in traffic.items():
            for version, (good, bad) in served.items():
                send(pods[name].url, version, good=good, bad=bad)
        total = sum(sum(served["v2"]) for served in traffic.values())
        promql = 'sum(mnn_inference_requests_total{model="scorer",version="v2"})'
        prometheus.wait_until(lambda: prometheus.value(promql) == total, 15,  # type: ignore[union-attr]
                              f"Prometheus scraped all {total} v2 requests")
        yield prometheus
    finally:
        if prometheus is not None:
            prometheus.stop()
        for pod in pods.values():
            pod.stop()


@pytest.fixture(scope="module")
def stack(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    labels = {ns: {"namespace": ns, "modeldeployment": "scorer"} for ns in TRAFFIC}
    with scraped_pods(examples_dir, tmp_path_factory.mktemp("prometheus-namespaces"), TRAFFIC, labels) as prometheus:
        yield Stack(prometheus)

def ctx(namespace: str, metrics: tuple[MetricSpec, ...] = ()) -> SampleContext:
    return SampleContext(key=f"{namespace}-uid", namespace=namespace, name="scorer", model="scorer",
                         versions=("v2", "v1"), interval_seconds=120, metrics=metrics)


def test_a_canary_is_judged_on_its_own_namespace_never_on_a_namesake_in_another(stack: Stack) -> None:
    """Found in review: the built-in queries matched model and version only, so team-a's canary was
    judged on team-b's traffic too: 2 errors in 110 requests (1.8 %) passed an error-rate max of 5 %
    where its own 10 requests failed 20 %, and team-b's 100 requests met team-a's minRequests."""
    provider = PrometheusProvider(stack.prometheus.url)
    for namespace, traffic in TRAFFIC.items():
        sample = provider.sample(ctx(namespace))
        good, bad = traffic["v2"]
        assert sample["v2"].error is None, sample
        # increase() extrapolates a series younger than its window: up to ~2x here, never the other's 100
        assert good + bad - 1e-6 <= (sample["v2"].requests or 0) <= (good + bad) * 3, (namespace, sample)
        assert sample["v2"].error_rate == pytest.approx(bad / (good + bad), abs=0.02), (namespace, sample)
        verdict = evaluate(ANALYSIS, sample["v2"], sample["v1"], now=0.0).verdict
        assert verdict == (FAIL if bad else PASS), (namespace, sample)


def test_a_custom_query_answering_several_series_is_no_data_and_a_scalar_is_its_value(stack: Stack) -> None:
    """Found in review: a query meant to give one value that gave one series per pod (no sum) was read
    as its first series, whichever Prometheus listed first: one pod's 0 errors passed while the
    other's failed. A ``scalar(...)`` answer raised TypeError out of the provider."""
    per_pod = MetricSpec(name="client-errors", max=0, query='increase(mnn_inference_requests_total{model="{model}",'
                                                             'version="{version}",outcome="client_error"}[{interval}])')
    provider = PrometheusProvider(stack.prometheus.url)
    sample = provider.sample(ctx("team-a", (per_pod,)))["v2"]
    assert sample.error is not None and "2 series" in sample.error and "client_error" in sample.error, sample
    scalar = MetricSpec(name="pods", min=1, query='scalar(count(mnn_version_loaded{model="{model}",'
                                                  'version="{version}",namespace="{namespace}"}))')
    assert provider.sample(ctx("team-a", (scalar,)))["v2"].custom == {"pods": 1.0}
