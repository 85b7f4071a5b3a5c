"""Review of the ``prometheus`` provider in a mixed setup: one pod scraped with the labels the chart's
PodMonitor gives it (``namespace``, ``modeldeployment``), one scraped by a static config without
them, both serving the same model and versions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.prometheus import PrometheusProvider
from rollout_operator.spec import AnalysisSpec, MetricSpec
from rollout_operator.verdicts import FAIL, PASS, evaluate
from tests.operator.test_review_prometheus import Stack, scraped_pods

# per pod: version -> (good, bad). team-a's canary fails 2 of its 10 requests; the unlabelled pod serves 100 well
TRAFFIC = {"team-a": {"v2": (8, 2), "v1": (40, 0)}, "static": {"v2": (100, 0), "v1": (40, 0)}}
ANALYSIS = AnalysisSpec.model_validate({"minRequests": 10, "metrics": [{"name": "error-rate", "max": 0.05}]})
RATIO = MetricSpec(name="client-error-ratio", metric="mnn_inference_requests_total",
                   labels={"outcome": "client_error"}, perRequest=True, max=0.05)


@pytest.fixture(scope="module")
def stack(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    labels = {"team-a": {"namespace": "team-a", "modeldeployment": "scorer"}}
    with scraped_pods(examples_dir, tmp_path_factory.mktemp("prometheus-mixed"), TRAFFIC, labels) as prometheus:
        yield Stack(prometheus)

def ctx(namespace: str) -> SampleContext:
    return SampleContext(key=f"{namespace}-uid", namespace=namespace, name="scorer", model="scorer",
                         versions=("v2", "v1"), interval_seconds=120, metrics=(RATIO,))


def test_series_without_the_labels_are_not_added_to_an_object_whose_own_series_carry_them(stack: Stack) -> None:
    """Found in review: the unlabelled pod's 100 good requests counted for team-a's canary too, whose
    own 10 failed 20 %: 2 errors in 110 (1.8 %) passed an error-rate max of 5 %."""
    sample = PrometheusProvider(stack.prometheus.url).sample(ctx("team-a"))
    v2 = sample["v2"]
    assert v2.error is None, sample
    # increase() extrapolates a series younger than its window: up to ~2x here, never the other pod's 100
    assert 10 - 1e-6 <= (v2.requests or 0) <= 30, sample
    assert v2.error_rate == pytest.approx(0.2, abs=0.02), sample
    assert v2.custom["client-error-ratio"] == pytest.approx(0.2, abs=0.02), sample
    assert v2.latency["p50"] is not None, sample
    assert evaluate(ANALYSIS, v2, sample["v1"], now=0.0).verdict == FAIL


def test_an_object_none_of_whose_series_carry_the_labels_is_judged_on_the_unlabelled_ones(stack: Stack) -> None:
    """A static scrape config (no labels at all) keeps working: team-b's pods are scraped that way."""
    sample = PrometheusProvider(stack.prometheus.url).sample(ctx("team-b"))
    v2 = sample["v2"]
    assert v2.error is None, sample
    assert 100 - 1e-6 <= (v2.requests or 0) <= 300 and v2.errors == 0, sample  # the unlabelled pod's alone
    assert v2.custom["client-error-ratio"] == 0 and v2.latency["p50"] is not None, sample
    assert evaluate(ANALYSIS, v2, sample["v1"], now=0.0).verdict == PASS
