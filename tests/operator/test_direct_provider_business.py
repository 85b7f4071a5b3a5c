"""The ``direct`` provider's shadow runs and ``compare: stable`` counts, against real runtime servers:
one runs v2 in v1's shadow, the other v2-breaking (every shadow run a mismatch). Every check waits
for the runtime to have counted what was sent (a positive signal) before sampling."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mnn_rollout.local.net import wait_for
from rollout_operator.analyzer import Analyzer
from rollout_operator.observe import Observation, PodView
from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.direct import DirectProvider
from rollout_operator.providers.factory import ProviderFactory
from rollout_operator.spec import ModelDeploymentSpec
from rollout_operator.status import Phase, RolloutStatus, iso
from rollout_operator.strategy import AnalysisSpec, MetricSpec
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Analysis, evaluate
from testbed.promstack import GOOD_BODY
from tests.runtime.test_metrics import samples
from tests.runtime_server import FEEDBACK_AUTH, RuntimeServer

pytestmark = pytest.mark.timeout(180)


def config(examples_dir: Path, path: Path, shadow: str) -> Path:
    path.write_text(yaml.safe_dump({
        "model": "scorer", "stable": "v1", "weights": {"v1": 100},
        "versions": [{"name": v, "uri": str(examples_dir / f"{v}.mnn")} for v in ("v1", "v2", "v2-breaking")],
        "shadow": {"version": shadow, "percent": 100}}))
    return path


@pytest.fixture(scope="module")
def pods(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, RuntimeServer]]:
    workdir = tmp_path_factory.mktemp("direct-business")
    servers = {shadow: RuntimeServer(config(examples_dir, workdir / f"{shadow}.yaml", shadow), workdir / f"{shadow}.log")
               for shadow in ("v2", "v2-breaking")}
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers.values()))
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def metric(url: str, name: str, **labels: str) -> float:
    return samples(httpx.get(url + "/metrics").text).get((name, tuple(sorted({"model": "scorer", **labels}.items()))),
                                                         0.0)


def shadow_outcomes(url: str, version: str) -> float:
    return sum(metric(url, "mnn_shadow_requests_total", version=version, outcome=o) for o in ("compared", "error"))


def routed(url: str, n: int, offset: int = 0) -> list[dict[str, Any]]:
    """``n`` routed requests (all to stable v1, each run in the shadow too); their answers."""
    with httpx.Client(base_url=url, timeout=10) as client:
        return [client.post("/v2/models/scorer/infer", json=GOOD_BODY, headers={"X-User-Id": f"u{offset + i}"}).json()
                for i in range(n)]


def pinned(url: str, version: str, n: int) -> list[str]:
    """The response ids of ``n`` requests pinned to ``version``."""
    with httpx.Client(base_url=url, timeout=10) as client:
        return [client.post(f"/v2/models/scorer/versions/{version}/infer", json=GOOD_BODY).json()["id"]
                for _ in range(n)]


def feedback(url: str, items: list[tuple[str, float]]) -> None:
    resp = httpx.post(f"{url}/v2/models/scorer/feedback", json=[{"id": i, "value": v} for i, v in items],
                      headers=FEEDBACK_AUTH)
    assert resp.json() == {"counted": len(items), "unmatched": 0}


def ctx(url: str, *metrics: MetricSpec, key: str, shadow: bool = False, versions: tuple[str, ...] = ("v2", "v1")
        ) -> SampleContext:
    return SampleContext(key=key, namespace="default", name="scorer", model="scorer", versions=versions,
                         interval_seconds=10, metrics=metrics, pod_urls=(url,), shadow=shadow)


def test_a_shadow_step_sample_counts_the_runs_rows_differences_and_forward_times(
        pods: dict[str, RuntimeServer]) -> None:
    url = pods["v2"].url
    provider, context = DirectProvider(), ctx(url, key="shadow-v2", shadow=True)
    before = shadow_outcomes(url, "v2")
    provider.sample(context)  # the baseline
    answers = routed(url, 25)
    assert {a["model_version"] for a in answers} == {"v1"}  # users got stable's answers
    wait_for(lambda: shadow_outcomes(url, "v2") >= before + 25, 30, "25 shadow runs counted")
    sample = provider.sample(context)["v2"]
    shadow = sample.shadow
    assert shadow is not None and sample.requests == 0  # the canary served nobody
    assert (shadow.runs, shadow.errors, shadow.rows, shadow.diff_count) == (25, 0, 25, 25 * 32)  # 32 scores a row
    assert shadow.agreeing is not None and 0 <= shadow.agreeing <= 25
    assert shadow.diff_sum is not None and shadow.diff_sum > 0  # v2 is retrained: other scores
    assert shadow.latency["p99"] is not None and shadow.latency["p99"] > 0
    assert shadow.stable_latency["p99"] is not None and shadow.stable_latency["p99"] > 0
    spec = AnalysisSpec.model_validate({"minRequests": 20, "metrics": [
        {"name": "shadow-error-rate", "max": 0.05}, {"name": "shadow-mean-abs-diff", "max": 10}]})
    assert evaluate(spec, sample, None, now=0.0, shadow=True).verdict == PASS
    assert provider.sample(context)["v2"].shadow.runs == 0  # type: ignore[union-attr]  # nothing new since


def test_a_breaking_shadow_version_gives_a_shadow_error_rate_of_1_and_fails_the_step(
        pods: dict[str, RuntimeServer]) -> None:
    url = pods["v2-breaking"].url
    provider = DirectProvider()
    context = ctx(url, key="shadow-breaking", shadow=True, versions=("v2-breaking", "v1"))
    before = shadow_outcomes(url, "v2-breaking")
    provider.sample(context)
    routed(url, 30)
    wait_for(lambda: shadow_outcomes(url, "v2-breaking") >= before + 30, 30, "30 shadow runs counted")
    sample = provider.sample(context)["v2-breaking"]
    assert sample.shadow is not None and (sample.shadow.runs, sample.shadow.errors) == (30, 30)
    look = evaluate(AnalysisSpec.model_validate({"minRequests": 20}), sample, None, now=0.0, shadow=True)
    assert look.verdict == FAIL and look.failed_metric().startswith("shadow-error-rate = 1 breached")


def test_a_weighted_step_reads_no_shadow_series(pods: dict[str, RuntimeServer]) -> None:
    url = pods["v2"].url
    provider, context = DirectProvider(), ctx(url, key="weighted")
    provider.sample(context)
    routed(url, 3, offset=100)
    sample = provider.sample(context)
    assert sample["v1"].requests == 3 and sample["v2"].shadow is None


def test_compare_metrics_get_each_roles_counter_increase_per_version(pods: dict[str, RuntimeServer]) -> None:
    url = pods["v2"].url
    rate = MetricSpec.model_validate({"name": "conversion", "compare": "stable", "margin": 0.01})
    mean = MetricSpec.model_validate({"name": "revenue", "compare": "stable", "kind": "mean", "margin": 1})
    served = MetricSpec.model_validate({"name": "per-request", "compare": "stable", "margin": 0.01, "series": {
        "trials": 'mnn_inference_requests_total{outcome="success"}'}})
    provider, context = DirectProvider(), ctx(url, rate, mean, served, key="counts")
    provider.sample(context)
    canary, stable = pinned(url, "v2", 6), pinned(url, "v1", 10)
    feedback(url, [(i, 1.0) for i in canary[:2]] + [(i, 0.0) for i in canary[2:5]]
             + [(i, 2.0) for i in stable[:4]] + [(i, 0.5) for i in stable[4:6]])
    samples_ = provider.sample(context)
    c, s = samples_["v2"].counts, samples_["v1"].counts
    assert c["conversion"] == {"successes": 2.0, "trials": 5.0}
    assert s["conversion"] == {"successes": 9.0, "trials": 6.0}  # values above 1 are a mean's, not a rate's
    assert c["revenue"] == {"n": 5.0, "sum": 2.0, "squares": 2.0}
    assert s["revenue"] == {"n": 6.0, "sum": 9.0, "squares": 16.5}
    assert (c["per-request"]["trials"], s["per-request"]["trials"]) == (6.0, 10.0)  # answered requests
    assert not samples_["v2"].since_step  # deltas: the analysis adds them to the step's stratum


def test_the_first_look_after_a_shadow_step_counts_only_its_own_interval(pods: dict[str, RuntimeServer]) -> None:
    """A shadow step is judged by shadow metrics only, but the analyzer's scrapes keep the baseline
    of every metric of the analysis: the weighted step's first look must not take all the feedback
    the pod counted before (history at another rate) as its own interval's."""
    url = pods["v2"].url
    host, port = url.removeprefix("http://").split(":")
    spec = ModelDeploymentSpec.model_validate({
        "versions": [{"name": "v1", "uri": "file:///m/v1.mnn"}, {"name": "v2", "uri": "file:///m/v2.mnn"}],
        "stable": "v1", "canary": "v2", "strategy": {
            "steps": [{"shadow": 20, "pause": "1m"}, {"weight": 10, "pause": "1m"}],
            "analysis": {"interval": "10s", "minRequests": 1, "metrics": [
                {"name": "shadow-error-rate", "max": 0.05},
                {"name": "conversion", "compare": "stable", "margin": 0.01}]}}})
    seen = Observation([PodView("pod-a", host, int(port), True, {})])
    body = {"metadata": {"uid": "uid-after-shadow", "namespace": "default", "name": "scorer"}}
    analyzer, looked = Analyzer(ProviderFactory()), [0.0]

    def look(shadow: bool) -> Analysis:
        looked[0] += 100.0  # each look due
        status = RolloutStatus(phase=Phase.PROGRESSING, stable_version="v1", canary_version="v2",
                               canary_weight=0 if shadow else 10, shadow_percent=20 if shadow else None,
                               current_step=0 if shadow else 1, rollout_started_at=1.0, step_started_at=1.0,
                               analysis={"checkedAt": iso(looked[0] - 100.0)})
        found = analyzer(spec, status, body, seen, looked[0])
        assert found is not None
        return found

    assert "baseline" in look(True).message  # the baseline, in the shadow step
    history = pinned(url, "v1", 8)
    feedback(url, [(i, 1.0) for i in history])  # earlier outcomes, all converted
    assert "conversion" not in (look(True).sequential or {})  # the shadow step judges no compare metric
    canary, stable = pinned(url, "v2", 3), pinned(url, "v1", 4)
    feedback(url, [(canary[0], 1.0), (canary[1], 0.0), (stable[0], 0.0), (stable[1], 1.0), (stable[2], 0.0)])
    strata = (look(False).sequential or {})["conversion"]["strata"]
    assert strata == [{"step": 1, "canary": {"n": 2.0, "sum": 1.0}, "stable": {"n": 3.0, "sum": 1.0}}]  # not 9 of 11


def test_a_look_held_for_feedback_the_pods_refuse_says_so(pods: dict[str, RuntimeServer]) -> None:
    """Pods without a feedback token (an upgrade from a runtime that took feedback without one)
    count none: a compare metric on the feedback counters holds, and the look says why."""
    url = pods["v2"].url
    host, port = url.removeprefix("http://").split(":")
    spec = ModelDeploymentSpec.model_validate({
        "versions": [{"name": "v1", "uri": "file:///m/v1.mnn"}, {"name": "v2", "uri": "file:///m/v2.mnn"}],
        "stable": "v1", "canary": "v2", "strategy": {"steps": [{"weight": 10, "pause": "1m"}], "analysis": {
            "interval": "10s", "metrics": [{"name": "conversion", "compare": "stable", "margin": 0.01}]}}})
    body = {"metadata": {"uid": "uid-refused", "namespace": "default", "name": "scorer"}}
    status = RolloutStatus(phase=Phase.PROGRESSING, stable_version="v1", canary_version="v2", canary_weight=10,
                           current_step=0, rollout_started_at=1.0, step_started_at=1.0)
    analyzer = Analyzer(ProviderFactory())
    for takes, said in ((False, True), (True, False), (None, False)):  # None: a runtime that does not say
        seen = Observation([PodView("pod-a", host, int(port), True, {} if takes is None else {"feedback": takes})])
        look = analyzer(spec, status, body, seen, 100.0)
        assert look is not None and look.verdict == INCONCLUSIVE, look
        assert ("conversion read feedback, which pod-a refuses" in look.message) == said, look.message
        assert ("set spec.runtime.feedback" in look.message) == said
