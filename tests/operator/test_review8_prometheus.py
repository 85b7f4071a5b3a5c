"""Review of the ``prometheus`` provider in a mixed setup, against a real Prometheus: team-a's pods are
scraped with the labels the chart's PodMonitor gives them (``namespace``, ``modeldeployment``), a static
scrape config scrapes another pod of the same model and versions without them (team-b's). The unlabelled
series are read only for an object none of whose pods were scraped with its labels: never for team-a,
whether or not its own series of a version are there right now (a canary not loaded yet, pods down)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.prometheus import PrometheusProvider
from rollout_operator.spec import AnalysisSpec, MetricSpec
from rollout_operator.verdicts import INCONCLUSIVE, PASS, evaluate
from testbed.promstack import Prometheus, require_promstack, send, write_runtime_config
from tests.runtime_server import RuntimeServer

ANALYSIS = AnalysisSpec.model_validate({"minRequests": 10, "metrics": [{"name": "error-rate", "max": 0.05}]})
RATIO = MetricSpec(name="client-error-ratio", metric="mnn_inference_requests_total",
                   labels={"outcome": "client_error"}, perRequest=True, max=0.05)
CONVERSION = MetricSpec.model_validate({"name": "conversion", "compare": "stable", "margin": 0.05})
TEAM_A = {"namespace": "team-a", "modeldeployment": "scorer"}
TEAM_C = {"namespace": "team-c", "modeldeployment": "scorer"}
TEAM_D = {"namespace": "team-d", "modeldeployment": "ranker"}
DEADLINE = 60.0  # generous: a loaded 2-core machine


@dataclass
class Stack:
    prometheus: Prometheus
    pods: dict[str, RuntimeServer]

    def target(self, pod: str) -> str:
        return f"127.0.0.1:{self.pods[pod].port}"

    def scraped(self, promql: str, want: float, what: str) -> None:
        self.prometheus.wait_until(lambda: self.prometheus.value(promql) == want, DEADLINE, what)


@pytest.fixture(scope="module")
def stack(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Pods: team-a's (labelled; loads v1 only: its canary v2 is not loaded yet), team-c's (labelled, v1
    and v2, stopped by a test), the static one (no labels, v1 and v2: team-b's), team-d's (model ranker;
    unlabelled until a test relabels it)."""
    require_promstack()
    workdir = tmp_path_factory.mktemp("prometheus-mixed-presence")
    configs = {"v1": write_runtime_config(examples_dir, workdir / "v1.yaml", versions=("v1",)),
               "both": write_runtime_config(examples_dir, workdir / "both.yaml", versions=("v1", "v2")),
               "ranker": write_runtime_config(examples_dir, workdir / "ranker.yaml", model="ranker",
                                              versions=("v1", "v2"))}
    kinds = {"team-a": "v1", "team-c": "both", "static": "both", "team-d": "ranker"}
    pods = {name: RuntimeServer(configs[kind], workdir / f"{name}.log") for name, kind in kinds.items()}
    prometheus: Prometheus | None = None
    try:
        for pod in pods.values():
            pod.start()
        labels = {"team-a": TEAM_A, "team-c": TEAM_C}
        prometheus = Prometheus(workdir, [f"127.0.0.1:{pod.port}" for pod in pods.values()],
                                target_labels={f"127.0.0.1:{pods[n].port}": x for n, x in labels.items()}).start()
        prometheus.wait_for_up(DEADLINE)
        send(pods["team-a"].url, "v1", good=40)
        send(pods["team-c"].url, "v2", good=8, bad=2)
        send(pods["static"].url, "v2", good=100)
        send(pods["static"].url, "v1", good=40)
        built = Stack(prometheus, pods)
        built.scraped('sum(mnn_inference_requests_total{model="scorer",version="v2"})', 110, "110 v2 requests")
        built.scraped('sum(mnn_inference_requests_total{model="scorer",version="v1"})', 80, "80 v1 requests")
        yield built
    finally:
        if prometheus is not None:
            prometheus.stop()
        for pod in pods.values():
            pod.stop()


def ctx(namespace: str, name: str = "scorer", model: str = "scorer", interval: int = 120,
        since: float | None = None, metrics: tuple[MetricSpec, ...] = (RATIO,)) -> SampleContext:
    return SampleContext(key=f"{namespace}-uid", namespace=namespace, name=name, model=model,
                         versions=("v2", "v1"), interval_seconds=interval, metrics=metrics, since=since)


def test_a_version_the_labelled_pods_do_not_serve_is_no_data_never_the_unlabelled_pods_traffic(stack: Stack) -> None:
    """Found in review: whether an object's series carry its labels was asked per version, so team-a's
    canary v2, not loaded by its pods (no v2 series of its own), was judged on the static pod's 100 good v2
    requests (team-b's), and passed. Now it has no data: inconclusive, never promoted."""
    provider = PrometheusProvider(stack.prometheus.url)
    a = provider.sample(ctx("team-a", metrics=(RATIO, CONVERSION), since=time.time() - 100))
    v2, v1 = a["v2"], a["v1"]
    assert v2.error is None and v2.requests is None and v2.errors is None, a
    assert v2.latency == {"p50": None, "p95": None, "p99": None}, a  # no _bucket of the static pod's either
    assert v2.custom == {"client-error-ratio": None}, a
    assert v2.counts["conversion"] and set(v2.counts["conversion"].values()) == {None}, a
    assert 40 - 1e-6 <= (v1.requests or 0) <= 120, a  # its own 40 (extrapolated), never the static pod's too
    assert evaluate(ANALYSIS, v2, v1, now=0.0).verdict == INCONCLUSIVE
    # the object without labelled pods still reads the static pod's series: its 100, not team-c's 10
    b = provider.sample(ctx("team-b"))
    assert b["v2"].error is None and 100 - 1e-6 <= (b["v2"].requests or 0) <= 300 and b["v2"].errors == 0, b
    assert b["v2"].latency["p50"] is not None and evaluate(ANALYSIS, b["v2"], b["v1"], now=0.0).verdict == PASS


def test_labelled_pods_gone_down_are_no_data_never_the_unlabelled_pods_traffic(stack: Stack) -> None:
    """Found in review: once team-c's labelled pod stopped answering scrapes its series went stale, and a
    window after its last scrape read the static pod's traffic as team-c's: 100 good requests passed the
    canary whose own failed 20 %. Now the pod's ``up`` (0, with its labels) keeps it labelled: no data."""
    pods = stack.pods
    pods["team-c"].stop()
    stack.scraped('up{namespace="team-c"}', 0, "team-c's pod seen down")
    stack.prometheus.wait_until(
        lambda: not stack.prometheus.query('mnn_inference_requests_total{namespace="team-c"}'), DEADLINE,
        "team-c's series stale")
    since = time.time()  # the window starts up to 1 s later (whole seconds): the traffic comes 2 s after
    stack.prometheus.wait_until(lambda: time.time() - since > 2, DEADLINE, "2 s into the step")
    send(pods["static"].url, "v2", good=100)  # team-b's traffic in team-c's window
    stack.scraped('sum(mnn_inference_requests_total{model="scorer",version="v2",namespace=""})', 200,
                  "the static pod's 200 v2 requests")
    stack.prometheus.wait_until(lambda: time.time() - since > 12, DEADLINE, "a 12 s window")
    sample = PrometheusProvider(stack.prometheus.url).sample(ctx("team-c", since=since))
    v2 = sample["v2"]
    assert v2.error is None and v2.requests is None and v2.custom == {"client-error-ratio": None}, sample
    assert v2.latency["p50"] is None and evaluate(ANALYSIS, v2, sample["v1"], now=0.0).verdict == INCONCLUSIVE


def test_series_labelled_midway_are_read_alone_never_with_the_unlabelled_ones_of_the_window(stack: Stack) -> None:
    """team-d's pod, scraped without labels, serves 10 failing requests; then its scrape config gives it
    team-d's labels (as a pod restarted under the PodMonitor) and it serves 10 good ones. A window over
    both counts the labelled series alone: 10 requests, no errors, never 20 with 10 errors."""
    prometheus, pod = stack.prometheus, stack.pods["team-d"]
    since = time.time()  # the window starts up to 1 s later (whole seconds): the traffic comes 2 s after
    prometheus.wait_until(lambda: time.time() - since > 2, DEADLINE, "2 s into the step")
    send(pod.url, "v2", bad=10, model="ranker")
    stack.scraped('sum(mnn_inference_requests_total{model="ranker",version="v2",namespace=""})', 10,
                  "10 unlabelled v2 requests")
    prometheus.target_labels[stack.target("team-d")] = TEAM_D
    prometheus.write_config()
    prometheus.reload()
    stack.scraped('sum(mnn_inference_requests_total{model="ranker",version="v2",namespace="team-d"})', 10,
                  "the same counters, now labelled")
    relabelled = time.time()
    send(pod.url, "v2", good=10, model="ranker")
    stack.scraped('sum(mnn_inference_requests_total{model="ranker",version="v2",namespace="team-d"})', 20,
                  "10 more, labelled")
    prometheus.wait_until(lambda: time.time() - relabelled > 10, DEADLINE, "10 s of labelled series")
    sample = PrometheusProvider(prometheus.url).sample(ctx("team-d", name="ranker", model="ranker", since=since))
    v2 = sample["v2"]
    assert v2.error is None and v2.errors == 0 and v2.custom == {"client-error-ratio": 0}, sample
    assert 10 - 1e-6 <= (v2.requests or 0) < 16, sample  # the labelled 10 (a little extrapolation), never 20
