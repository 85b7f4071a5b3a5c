"""``evaluate`` with ``compare: stable`` metrics (strata kept between looks, decision -> verdict) and
with the shadow metrics of a shadow step."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from rollout_operator.sequential import Counts, compare
from rollout_operator.status import RolloutStatus
from rollout_operator.strategy import AnalysisSpec
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Sample, ShadowSample, evaluate

CONVERSION = {"name": "conversion", "compare": "stable", "margin": 0.01}


def spec(*metrics: dict[str, Any], min_requests: int = 10) -> AnalysisSpec:
    return AnalysisSpec.model_validate({"minRequests": min_requests,
                                        "metrics": [{"name": "error-rate", "max": 0.05}, *metrics]})


def sample(successes: float, trials: float, requests: float = 100, **more: Any) -> Sample:
    return Sample(requests=requests, errors=0, counts={"conversion": {"successes": successes, "trials": trials}},
                  **more)


def result(analysis: Any, name: str = "conversion") -> Any:
    return next(m for m in analysis.metrics if m.name == name)


def test_each_look_adds_the_intervals_counts_to_the_stratum_of_its_step() -> None:
    first = evaluate(spec(CONVERSION), sample(10, 100), sample(45, 400), now=1.0, step=0)
    assert first.sequential is not None
    entry = first.sequential["conversion"]
    assert entry["strata"] == [{"step": 0, "canary": {"n": 100.0, "sum": 10.0}, "stable": {"n": 400.0, "sum": 45.0}}]
    second = evaluate(spec(CONVERSION), sample(12, 100), sample(40, 400), now=2.0, step=0, sequential=first.sequential)
    assert second.sequential["conversion"]["strata"] == [  # type: ignore[index]
        {"step": 0, "canary": {"n": 200.0, "sum": 22.0}, "stable": {"n": 800.0, "sum": 85.0}}]
    third = evaluate(spec(CONVERSION), sample(30, 300), sample(20, 200), now=3.0, step=1, sequential=second.sequential)
    strata = third.sequential["conversion"]["strata"]  # type: ignore[index]
    assert [s["step"] for s in strata] == [0, 1] and strata[1]["canary"] == {"n": 300.0, "sum": 30.0}
    expected = compare(CONVERSION_TEST, [Counts(200, 22), Counts(300, 30)], [Counts(800, 85), Counts(200, 20)])
    entry = third.sequential["conversion"]  # type: ignore[index]
    assert (entry["decision"], entry["estimate"], entry["lower"], entry["upper"]) == (
        expected.decision, float(f"{expected.estimate:.6g}"), float(f"{expected.lower:.6g}"),
        float(f"{expected.upper:.6g}"))
    assert entry["margin"] == 0.01 and entry["checkedAt"].startswith("1970-01-01T00:00:03")
    assert entry["canary"] == {"n": 500.0, "mean": 0.104} and entry["stable"]["n"] == 1000.0


CONVERSION_TEST = AnalysisSpec.model_validate({"metrics": [CONVERSION]}).metrics[0].test


def test_counts_since_the_step_started_replace_its_stratum_and_successes_are_clamped_to_trials() -> None:
    prior = {"conversion": {"strata": [{"step": 0, "canary": {"n": 50.0, "sum": 5.0}, "stable": {"n": 90.0, "sum": 9.0}},
                                       {"step": 1, "canary": {"n": 10.0, "sum": 1.0}, "stable": {"n": 10.0, "sum": 1.0}}]}}
    look = evaluate(spec(CONVERSION), sample(31.5, 30.2, since_step=True), sample(41.0, 400.7, since_step=True),
                    now=1.0, step=1, sequential=prior)
    strata = look.sequential["conversion"]["strata"]  # type: ignore[index]
    assert strata[0] == prior["conversion"]["strata"][0]  # an earlier step is kept as it was
    assert strata[1] == {"step": 1, "canary": {"n": 30.2, "sum": 30.2}, "stable": {"n": 400.7, "sum": 41.0}}


def test_a_canary_worse_beyond_the_margin_fails_at_once_even_below_min_requests() -> None:
    look = evaluate(spec(CONVERSION, min_requests=1000), sample(50, 1000), sample(300, 1000), now=1.0)
    m = result(look)
    assert look.verdict == FAIL and look.immediate
    assert m.verdict == FAIL and m.immediate and m.message.startswith("worse: canary - stable = -0.25")
    assert m.interval is not None and m.interval[1] is not None and m.interval[1] < -0.01
    assert "only 100 canary requests" in look.message  # the gate still says why nothing else could pass
    assert look.failed_metric().startswith("conversion: worse: canary - stable = -0.25, 0.95 always-valid interval [")
    status = m.as_status()
    assert status["lower"] < status["upper"] < -0.01 and status["threshold"] == \
        "canary - stable: lower bound > -0.01 (0.95 always-valid)"


def test_a_canary_not_worse_beyond_the_margin_passes() -> None:
    look = evaluate(spec(CONVERSION), sample(4000, 40000), sample(4000, 40000), now=1.0)
    assert result(look).verdict == PASS and result(look).message.startswith("not-worse:")
    assert look.verdict == PASS and not look.immediate


def test_an_undecided_or_insufficient_comparison_holds_without_counting_as_a_failure() -> None:
    undecided = evaluate(spec(CONVERSION), sample(95, 1000), sample(100, 1000), now=1.0)
    assert result(undecided).message.startswith("undecided:") and undecided.verdict == INCONCLUSIVE
    few = evaluate(spec(CONVERSION), sample(2, 20), sample(50, 500), now=1.0)
    assert result(few).verdict == INCONCLUSIVE and "the test starts at 100 each (minSamples)" in result(few).message
    assert few.verdict == INCONCLUSIVE and not few.immediate


def test_no_counts_from_a_version_keep_the_strata_as_they_were() -> None:
    prior = {"conversion": {"strata": [{"step": 0, "canary": {"n": 5.0, "sum": 1.0}, "stable": {"n": 9.0, "sum": 1.0}}]}}
    gone = Sample(requests=100, errors=0, counts={"conversion": {"successes": None, "trials": None}})
    look = evaluate(spec(CONVERSION), sample(1, 10), gone, now=1.0, sequential=prior)
    assert look.sequential["conversion"]["strata"] == prior["conversion"]["strata"]  # type: ignore[index]
    failed = evaluate(spec(CONVERSION), Sample(error="pod unreachable"), sample(1, 1), now=1.0, sequential=prior)
    assert failed.verdict == INCONCLUSIVE and failed.sequential == prior


def test_a_mean_reads_n_sum_and_squares() -> None:
    revenue = {"name": "revenue", "compare": "stable", "kind": "mean", "margin": 0.5}
    canary = Sample(requests=100, errors=0, counts={"revenue": {"n": 2000.0, "sum": 2000.0, "squares": 4000.0}})
    stable = Sample(requests=100, errors=0, counts={"revenue": {"n": 2000.0, "sum": 10000.0, "squares": 60000.0}})
    look = evaluate(spec(revenue), canary, stable, now=1.0)
    assert look.sequential["revenue"]["strata"][0]["canary"] == {"n": 2000.0, "sum": 2000.0, "squares": 4000.0}  # type: ignore[index]
    assert result(look, "revenue").verdict == FAIL  # 1.0 per request against 5.0


def test_counts_that_are_not_finite_are_no_data_and_never_reach_the_status() -> None:
    """A value too large for its square made a pod's sum of squares +Inf, and a delta of two of them
    NaN: such counts are no data (the strata stay as they were, the look holds), and the status the
    look gives is plain JSON (the API server refuses NaN and Infinity)."""
    revenue = {"name": "revenue", "compare": "stable", "kind": "mean", "margin": 0.5}
    good = {"revenue": {"strata": [{"step": 0, "canary": {"n": 200.0, "sum": 400.0, "squares": 900.0},
                                    "stable": {"n": 200.0, "sum": 410.0, "squares": 950.0}}]}}
    for bad in (math.inf, math.nan):
        canary = Sample(requests=100, errors=0, counts={"revenue": {"n": 20.0, "sum": 40.0, "squares": bad}})
        stable = Sample(requests=100, errors=0, counts={"revenue": {"n": 20.0, "sum": 41.0, "squares": 90.0}})
        look = evaluate(spec(revenue), canary, stable, now=1.0, sequential=good)
        assert look.sequential is not None and look.sequential["revenue"]["strata"] == good["revenue"]["strata"]
        json.dumps(look.sequential, allow_nan=False)
    latency = evaluate(spec({"name": "latency-p99", "max": 0.5}), Sample(requests=100, errors=0, latency={
        "p99": math.inf}), sample(1, 10), now=1.0)
    assert result(latency, "latency-p99").verdict == FAIL  # above the highest bucket: slower than any bound
    written = RolloutStatus(analysis=latency.as_status(1), sequential={"x": {"estimate": math.nan}}).to_dict()
    assert json.loads(json.dumps(written, allow_nan=False))["analysis"]["metrics"][1]["value"] is None
    assert written["sequential"] == {"x": {"estimate": None}}


# -- shadow steps ----------------------------------------------------------------------------------

SHADOWED = Sample(requests=0, errors=0, shadow=ShadowSample(
    runs=200, errors=2, rows=200, agreeing=190, diff_sum=30.0, diff_count=6400,
    latency={"p99": 0.004}, stable_latency={"p99": 0.001}))


@pytest.mark.parametrize(("metric", "value", "verdict"), [
    ({"name": "shadow-error-rate", "max": 0.05}, 0.01, PASS),
    ({"name": "shadow-error-rate", "max": 0.005}, 0.01, FAIL),
    ({"name": "shadow-agreement", "min": 0.9}, 0.95, PASS),
    ({"name": "shadow-agreement", "min": 0.98}, 0.95, FAIL),
    ({"name": "shadow-mean-abs-diff", "max": 0.01}, 30 / 6400, PASS),
    ({"name": "shadow-latency-p99", "max": 0.002}, 0.004, FAIL),
])
def test_shadow_metrics_are_read_from_the_shadow_runs(metric: dict[str, Any], value: float, verdict: str) -> None:
    look = evaluate(spec(metric, CONVERSION), SHADOWED, Sample(requests=500, errors=0), now=1.0, shadow=True)
    assert [(m.name, m.verdict) for m in look.metrics] == [(metric["name"], verdict)]  # only the shadow metrics
    assert look.metrics[0].value == pytest.approx(value) and look.verdict == verdict
    assert look.canary_requests == 200 and look.shadow


def test_a_shadow_latency_ratio_is_against_stables_forward_on_the_same_requests() -> None:
    look = evaluate(spec({"name": "shadow-latency-p99", "maxLatencyRatio": 3}), SHADOWED, None, now=1.0, shadow=True)
    assert [(m.name, m.value, m.verdict) for m in look.metrics] == [("shadow-latency-p99 vs stable", 4.0, FAIL)]
    assert look.failed_metric().endswith("(in a shadow step: the canary served no user)")


def test_a_shadow_step_without_shadow_metrics_is_judged_by_the_default_shadow_error_rate() -> None:
    broken = Sample(requests=0, errors=0, shadow=ShadowSample(runs=40, errors=40))
    look = evaluate(spec(), broken, None, now=1.0, shadow=True)
    assert [(m.name, m.value, m.threshold, m.verdict) for m in look.metrics] == [
        ("shadow-error-rate", 1.0, "shadow error rate <= 0.05", FAIL)]


def test_too_few_shadow_runs_hold_and_compare_metrics_keep_their_counts_through_a_shadow_step() -> None:
    prior = {"conversion": {"strata": [], "decision": "insufficient"}}
    few = Sample(requests=0, errors=0, shadow=ShadowSample(runs=5, errors=0))
    look = evaluate(spec(), few, None, now=1.0, shadow=True, sequential=prior)
    assert look.verdict == INCONCLUSIVE and "only 5 shadow runs in the interval (minRequests 10)" in look.message
    assert look.sequential == prior
    none = evaluate(spec(), Sample(requests=0, errors=0), None, now=1.0, shadow=True)
    assert none.verdict == INCONCLUSIVE and "no shadow run count" in none.message


def test_changed_test_settings_start_the_counts_afresh() -> None:
    first = evaluate(spec(CONVERSION), sample(10, 100), sample(45, 400), now=1.0)
    again = evaluate(spec(CONVERSION), sample(10, 100), sample(45, 400), now=2.0, sequential=first.sequential)
    assert again.sequential["conversion"]["strata"][0]["canary"]["n"] == 200.0  # type: ignore[index]
    wider = evaluate(spec({**CONVERSION, "margin": 0.02}), sample(10, 100), sample(45, 400), now=3.0,
                     sequential=again.sequential)
    entry = wider.sequential["conversion"]  # type: ignore[index]
    assert entry["strata"][0]["canary"]["n"] == 100.0 and entry["settings"] != first.sequential["conversion"][  # type: ignore[index]
        "settings"]
