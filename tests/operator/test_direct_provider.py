"""The ``direct`` metric provider against real runtime servers: exact deltas, sums across pods,
restarts, unreachable pods; ``quantile()`` against hand-computed values; ``evaluate`` on its samples.

Two runtime servers are shared by the module: every test uses a fresh DirectProvider (its own
baseline), so traffic sent by other tests never leaks into a test's deltas.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mnn_rollout.local.net import free_port
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, evaluate
from rollout_operator.providers.base import SampleContext
from rollout_operator.providers.direct import DirectProvider, quantile
from rollout_operator.spec import AnalysisSpec
from testbed.promstack import send, write_runtime_config
from tests.runtime_server import RuntimeServer

VERSIONS = ("v2", "v1", "v2-breaking")  # canary first, then stable (and a version that always fails)


@pytest.fixture(scope="module")
def pods(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RuntimeServer]]:
    workdir = tmp_path_factory.mktemp("direct-provider")
    config = write_runtime_config(examples_dir, workdir / "runtime.yaml")
    servers = [RuntimeServer(config, workdir / f"pod-{i}.log") for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), servers))
        yield servers
    finally:
        for server in servers:
            server.stop()


def ctx(*urls: str, key: str = "uid-1", versions: tuple[str, ...] = VERSIONS) -> SampleContext:
    return SampleContext(key=key, namespace="default", name="scorer", model="scorer", versions=versions,
                         interval_seconds=10, metrics=(), pod_urls=urls)


def counts(samples: dict, version: str) -> tuple[float | None, float | None]:
    return samples[version].requests, samples[version].errors


def test_the_first_sample_only_takes_a_baseline_and_says_so(pods: list[RuntimeServer]) -> None:
    samples = DirectProvider().sample(ctx(pods[0].url))
    assert set(samples) == set(VERSIONS)
    for sample in samples.values():
        assert sample.error is not None and "baseline" in sample.error
        assert sample.requests is None


def test_the_second_sample_has_exactly_the_requests_and_errors_sent_to_each_version(
        pods: list[RuntimeServer]) -> None:
    provider, url = DirectProvider(), pods[0].url
    provider.sample(ctx(url))
    assert send(url, "v1", good=12, bad=0) == {200: 12}
    assert send(url, "v2", good=7, bad=3) == {200: 7, 400: 3}
    assert send(url, "v2-breaking", good=4) == {400: 4}  # v1-shaped requests: 400 from the breaking model
    samples = provider.sample(ctx(url))
    assert all(s.error is None for s in samples.values())
    assert counts(samples, "v1") == (12, 0)
    assert counts(samples, "v2") == (10, 3)
    assert counts(samples, "v2-breaking") == (4, 4)
    # and a third sample with no traffic in between counts nothing
    samples = provider.sample(ctx(url))
    assert {v: counts(samples, v) for v in VERSIONS} == {v: (0, 0) for v in VERSIONS}


def test_counts_are_summed_across_two_pods(pods: list[RuntimeServer]) -> None:
    provider, urls = DirectProvider(), [p.url for p in pods]
    provider.sample(ctx(*urls))
    send(urls[0], "v2", good=5, bad=1)
    send(urls[1], "v2", good=8, bad=2)
    send(urls[1], "v1", good=6)
    samples = provider.sample(ctx(*urls))
    assert counts(samples, "v2") == (16, 3)
    assert counts(samples, "v1") == (6, 0)
    assert counts(samples, "v2-breaking") == (0, 0)


def test_latency_quantiles_are_plausible_ordered_and_absent_without_successes(pods: list[RuntimeServer]) -> None:
    provider, urls = DirectProvider(), [p.url for p in pods]
    provider.sample(ctx(*urls))
    for url in urls:
        send(url, "v1", good=25)
        send(url, "v2-breaking", good=5)  # failures are not timed: no latency for this version
    samples = provider.sample(ctx(*urls))
    latency = samples["v1"].latency
    assert set(latency) == {"p50", "p95", "p99"}
    assert all(value is not None and 0 < value < 1.0 for value in latency.values()), latency
    assert latency["p50"] <= latency["p95"] <= latency["p99"]
    assert samples["v2-breaking"].latency == {"p50": None, "p95": None, "p99": None}
    assert samples["v2"].latency == {"p50": None, "p95": None, "p99": None}  # no requests at all


def test_a_restarted_pod_is_a_counter_reset_and_never_gives_negative_deltas(pods: list[RuntimeServer]) -> None:
    provider, urls = DirectProvider(), [p.url for p in pods]
    send(urls[0], "v2", good=10, bad=4)  # counters well above what follows the restart
    provider.sample(ctx(*urls))
    port = pods[0].port
    pods[0].stop()
    pods[0].start()
    assert pods[0].port == port  # RuntimeServer keeps the port chosen at construction
    send(urls[0], "v2", good=3, bad=1)
    send(urls[1], "v2", good=2)
    samples = provider.sample(ctx(*urls))
    assert counts(samples, "v2") == (6, 1)
    for sample in samples.values():
        assert sample.requests is not None and sample.requests >= 0
        assert sample.errors is not None and sample.errors >= 0
    assert samples["v2"].latency["p50"] is not None and samples["v2"].latency["p50"] > 0


def test_an_unreachable_pod_makes_the_sample_inconclusive_naming_it(pods: list[RuntimeServer]) -> None:
    provider = DirectProvider(timeout=1.0)
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    urls = [pods[0].url, gone]
    provider.sample(ctx(*urls))
    send(pods[0].url, "v2", good=40)
    samples = provider.sample(ctx(*urls))
    # the requests the missing pod served went uncounted: no request count, so no verdict
    assert samples["v2"].error is not None and gone in samples["v2"].error and samples["v2"].requests is None
    analysis = evaluate(AnalysisSpec(minRequests=1), samples["v2"], samples["v1"], now=0.0)
    assert analysis.verdict == INCONCLUSIVE
    # the pod that answered is counted again once every pod answers
    send(pods[0].url, "v2", good=4, bad=2)
    assert counts(provider.sample(ctx(pods[0].url)), "v2") == (6, 2)


def test_all_pods_unreachable_gives_an_error_sample_naming_them(pods: list[RuntimeServer]) -> None:
    provider = DirectProvider(timeout=1.0)
    gone = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    provider.sample(ctx(pods[0].url))  # a baseline exists: the error is not the baseline message
    samples = provider.sample(ctx(*gone))
    for sample in samples.values():
        assert sample.error is not None and gone[0] in sample.error and gone[1] in sample.error
        assert sample.requests is None
    analysis = evaluate(AnalysisSpec(), samples["v2"], samples["v1"], now=0.0)
    assert analysis.verdict == INCONCLUSIVE and analysis.message.startswith("no data:")


def test_no_pods_at_all_gives_an_error_sample() -> None:
    samples = DirectProvider().sample(ctx())
    assert all(s.error == "no runtime pods to scrape" for s in samples.values())


def test_each_object_keeps_its_own_baseline_and_forget_drops_it(pods: list[RuntimeServer]) -> None:
    provider, url = DirectProvider(), pods[1].url
    provider.sample(ctx(url, key="a"))
    send(url, "v1", good=3)
    provider.sample(ctx(url, key="b"))  # b's baseline already includes those 3
    send(url, "v1", good=2)
    assert counts(provider.sample(ctx(url, key="a")), "v1") == (5, 0)
    assert counts(provider.sample(ctx(url, key="b")), "v1") == (2, 0)
    provider.forget("a")
    assert provider.sample(ctx(url, key="a"))["v1"].error is not None  # a baseline again


def test_evaluate_on_direct_samples_passes_fails_and_holds_as_the_spec_says(pods: list[RuntimeServer]) -> None:
    provider, url = DirectProvider(), pods[1].url
    provider.sample(ctx(url))
    send(url, "v1", good=40)
    send(url, "v2", good=38, bad=2)  # 5 % errors
    send(url, "v2-breaking", good=20)  # 100 % errors
    s = provider.sample(ctx(url))

    def spec(**analysis: object) -> AnalysisSpec:
        return AnalysisSpec.model_validate(analysis)

    lenient = spec(minRequests=20, metrics=[{"name": "error-rate", "max": 0.1}])
    assert evaluate(lenient, s["v2"], s["v1"], 0).verdict == PASS
    strict = spec(minRequests=20, metrics=[{"name": "error-rate", "max": 0.01}])
    result = evaluate(strict, s["v2"], s["v1"], 0)
    assert result.verdict == FAIL and "error-rate = 0.05 breached error rate <= 0.01" in result.failed_metric()
    assert evaluate(lenient, s["v2-breaking"], s["v1"], 0).verdict == FAIL
    # too little canary traffic holds, whatever the metrics say (0.05 is over the max, but its 2 errors
    # would be 2/41 = 0.0488 at minRequests, within it)
    held = evaluate(spec(minRequests=41, metrics=[{"name": "error-rate", "max": 0.049}]), s["v2"], s["v1"], 0)
    assert held.verdict == INCONCLUSIVE and "only 40 canary requests" in held.message
    assert [m.verdict for m in held.metrics] == [FAIL]
    # ... unless its errors alone break the max even at minRequests: 2/41 = 0.0488 > 0.01
    failed = evaluate(spec(minRequests=41, metrics=[{"name": "error-rate", "max": 0.01}]), s["v2"], s["v1"], 0)
    assert failed.verdict == FAIL and "its 2 errors alone break error rate <= 0.01 at minRequests" in failed.message
    # compared with stable: 0.05 - 0.0 against an allowed increase
    increase = spec(minRequests=1, metrics=[{"name": "error-rate", "max": 1, "maxErrorRateIncrease": 0.01}])
    assert evaluate(increase, s["v2"], s["v1"], 0).verdict == FAIL
    increase = spec(minRequests=1, metrics=[{"name": "error-rate", "max": 1, "maxErrorRateIncrease": 0.06}])
    assert evaluate(increase, s["v2"], s["v1"], 0).verdict == PASS
    # latency: v2 (int8) against v1 (fp32), same architecture: far within a 100x ratio and 1 s
    ratio = spec(minRequests=1, metrics=[{"name": "latency-p99", "max": 1.0, "maxLatencyRatio": 100}])
    result = evaluate(ratio, s["v2"], s["v1"], 0)
    assert result.verdict == PASS, result
    assert [m.name for m in result.metrics] == ["latency-p99", "latency-p99 vs stable"]
    # no successes on the canary: no latency, the latency metric cannot pass
    assert evaluate(ratio, s["v2-breaking"], s["v1"], 0).verdict == INCONCLUSIVE


# -- quantile(): histogram_quantile over cumulative bucket counts --------------------------------

BUCKETS = {0.1: 10.0, 0.2: 30.0, 0.5: 40.0, math.inf: 40.0}


@pytest.mark.parametrize(("q", "expected"), [
    (0.25, 0.1),            # rank 10: exactly the top of the first bucket
    (0.5, 0.15),            # rank 20: 0.1 + 0.1 * (20 - 10) / (30 - 10)
    (0.95, 0.44),           # rank 38: 0.2 + 0.3 * (38 - 30) / (40 - 30)
    (0.1, 0.04),            # rank 4: first bucket, lower bound 0: 0.1 * 4 / 10
    (1.0, 0.5),             # rank 40: the last finite bucket's top
])
def test_quantile_interpolates_linearly_inside_the_bucket_holding_the_rank(q: float, expected: float) -> None:
    assert quantile(q, BUCKETS) == pytest.approx(expected)


def test_quantile_in_the_infinite_bucket_is_the_highest_finite_bound() -> None:
    assert quantile(0.9, {0.1: 5.0, 0.25: 6.0, math.inf: 10.0}) == 0.25


def test_quantile_of_no_observations_is_none() -> None:
    assert quantile(0.5, {}) is None
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None


def test_quantile_skips_empty_buckets_to_the_one_holding_the_rank() -> None:
    # nothing between 0.1 and 0.25: the rank 2 of 4 lies in (0.25, 0.5]
    assert quantile(0.5, {0.1: 1.0, 0.25: 1.0, 0.5: 4.0, math.inf: 4.0}) == pytest.approx(0.25 + 0.25 / 3)


# -- regressions: a missed scrape must not count a pod's whole history; restarts by start time ----


def test_a_pod_missed_by_one_scrape_is_not_counted_with_its_whole_history(pods: list[RuntimeServer]) -> None:
    import httpx

    blip: set[str] = set()

    def fetch(url: str) -> str:
        if url in blip:
            raise httpx.ConnectTimeout("network blip")
        return httpx.get(url + "/metrics", timeout=2).text

    provider, urls = DirectProvider(fetch=fetch), [p.url for p in pods]
    send(urls[0], "v2", good=5, bad=5)  # history: errors long before this rollout's interval
    provider.sample(ctx(*urls))
    blip.add(urls[0])
    missed = provider.sample(ctx(*urls))["v2"]  # pods[1] answered, pods[0] did not: no verdict
    assert missed.error is not None and urls[0] in missed.error and missed.requests is None
    blip.clear()
    send(urls[0], "v2", good=2)
    assert counts(provider.sample(ctx(*urls)), "v2") == (2, 0)
    # and when every pod is missed once, all keep their baselines
    blip.update(urls)
    assert provider.sample(ctx(*urls))["v2"].error is not None
    blip.clear()
    send(urls[0], "v2", good=1, bad=1)
    assert counts(provider.sample(ctx(*urls)), "v2") == (2, 1)


def test_a_restarted_pod_that_served_more_than_before_is_counted_in_full(pods: list[RuntimeServer]) -> None:
    import httpx

    from rollout_operator.providers.direct import REQUESTS, parse

    provider, url = DirectProvider(), pods[1].url
    send(url, "v1", good=2)
    provider.sample(ctx(url))
    before = parse(httpx.get(url + "/metrics").text, "scorer")[(REQUESTS, "v1", "success")]
    pods[1].stop()
    pods[1].start()
    served = int(before) + 3  # the restarted pod's counter ends above its old value
    send(url, "v1", good=served)
    assert counts(provider.sample(ctx(url)), "v1") == (served, 0)


def test_a_new_rollout_of_the_same_object_takes_a_fresh_baseline(pods: list[RuntimeServer]) -> None:
    from dataclasses import replace

    provider, url = DirectProvider(), pods[0].url
    first = replace(ctx(url), key="uid-1@100.0")
    provider.sample(first)
    send(url, "v2", bad=4)  # failures of the first rollout, after its last check
    retried = replace(ctx(url), key="uid-1@200.0")
    assert provider.sample(retried)["v2"].error is not None  # a baseline, not the old failures
    send(url, "v2", good=3)
    assert counts(provider.sample(retried), "v2") == (3, 0)
    assert list(provider._previous) == ["uid-1@200.0"]


# -- custom metrics: a series the pods export, by name and label matchers ------------------------


def test_a_custom_counter_is_its_increase_summed_over_pods_and_per_request_divides_by_requests(
        pods: list[RuntimeServer]) -> None:
    from rollout_operator.spec import MetricSpec

    metrics = (MetricSpec(name="client-errors", metric="mnn_inference_requests_total",
                          labels={"outcome": "client_error"}, max=5),
               MetricSpec(name="client-error-ratio", metric="mnn_inference_requests_total",
                          labels={"outcome": "client_error"}, perRequest=True, max=0.1),
               MetricSpec(name="absent", metric="mnn_no_such_series_total", max=1))
    urls = [p.url for p in pods]
    provider = DirectProvider()
    context = SampleContext(key="uid-custom", namespace="default", name="scorer", model="scorer",
                            versions=VERSIONS, interval_seconds=10, metrics=metrics, pod_urls=tuple(urls))
    provider.sample(context)
    send(urls[0], "v2", good=6, bad=2)
    send(urls[1], "v2", good=3, bad=1)
    samples = provider.sample(context)
    assert samples["v2"].custom["client-errors"] == 3
    assert samples["v2"].custom["client-error-ratio"] == pytest.approx(3 / 12)
    assert samples["v2"].custom["absent"] is None  # no pod exports it: no value, never a pass
    assert samples["v1"].custom["client-error-ratio"] is None  # no v1 requests: nothing to divide by
    analysis = evaluate(AnalysisSpec(minRequests=1, metrics=list(metrics[:2])), samples["v2"], samples["v1"], now=0.0)
    assert analysis.verdict == FAIL and {m.name: m.verdict for m in analysis.metrics} == {
        "client-errors": PASS, "client-error-ratio": FAIL}


def test_a_custom_gauge_is_its_current_value_summed_over_pods(pods: list[RuntimeServer]) -> None:
    from rollout_operator.spec import MetricSpec

    loaded = MetricSpec(name="pods-with-v2", metric="mnn_version_loaded", min=2)
    context = SampleContext(key="uid-gauge", namespace="default", name="scorer", model="scorer",
                            versions=VERSIONS, interval_seconds=10, metrics=(loaded,),
                            pod_urls=tuple(p.url for p in pods))
    provider = DirectProvider()
    provider.sample(context)
    samples = provider.sample(context)
    assert samples["v2"].custom["pods-with-v2"] == 2  # loaded (1) on each of the two pods
