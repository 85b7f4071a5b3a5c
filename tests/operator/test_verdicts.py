"""``evaluate``: samples and thresholds -> pass, fail or inconclusive. No verdict without evidence."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_operator.spec import AnalysisSpec
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Sample, ShadowSample, evaluate


def spec(**fields: Any) -> AnalysisSpec:
    return AnalysisSpec.model_validate({"minRequests": 10, **fields})


STABLE = Sample(requests=1000, errors=1, latency={"p50": 0.01, "p99": 0.05})
CUSTOM = {"provider": {"type": "prometheus", "address": "http://127.0.0.1:9090"},
          "metrics": [{"name": "conversion", "query": "sum(x{version='{version}'}) or vector(0)", "max": 0.5}]}


@pytest.mark.parametrize("analysis, canary, verdict, says", [
    ({}, Sample(requests=100, errors=0), PASS, ""),
    ({}, Sample(requests=100, errors=50), FAIL, ""),
    ({}, Sample(requests=5, errors=0), INCONCLUSIVE, "only 5 canary requests"),
    # below minRequests (10), errors that break the 5% max even at 10 requests fail the look: 1 of 10 is 10%
    ({}, Sample(requests=4, errors=4), FAIL, "only 4 canary requests in the interval (minRequests 10), but its 4 "
     "errors alone break error rate <= 0.05 at minRequests (4/10 = 0.4)"),
    ({}, Sample(requests=1, errors=1), FAIL, "but its 1 error alone break"),
    ({"metrics": [{"name": "error-rate", "max": 0.2}]}, Sample(requests=4, errors=2), INCONCLUSIVE, "only 4"),
    ({"metrics": [{"name": "error-rate", "max": 0.2}]}, Sample(requests=4, errors=3), FAIL, "3/10 = 0.3"),
    ({"metrics": [{"name": "latency-p99", "max": 0.1}]}, Sample(requests=4, errors=4), INCONCLUSIVE, "only 4"),
    ({}, Sample(requests=None, errors=4), INCONCLUSIVE, "no canary request count"),
    # no request count at all: never a pass, whatever the metrics say
    ({}, Sample(requests=None, errors=0), INCONCLUSIVE, "no canary request count"),
    ({"minRequests": 0}, Sample(requests=None, errors=0), INCONCLUSIVE, "no canary request count"),
    # a custom query written `... or vector(0)` answers 0 with no traffic: held, not passed
    (CUSTOM, Sample(requests=None, custom={"conversion": 0.0}), INCONCLUSIVE, "no canary request count"),
    (CUSTOM, Sample(requests=0, custom={"conversion": 0.0}), INCONCLUSIVE, "only 0 canary requests"),
    (CUSTOM, Sample(requests=50, custom={"conversion": 0.1}), PASS, ""),
    (CUSTOM, Sample(requests=50, custom={"conversion": None}), INCONCLUSIVE, ""),
    ({}, Sample(error="prometheus unreachable"), INCONCLUSIVE, "no data: prometheus unreachable"),
])
def test_evaluate(analysis: dict[str, Any], canary: Sample, verdict: str, says: str) -> None:
    result = evaluate(spec(**analysis), canary, STABLE, now=1.0)
    assert result.verdict == verdict, result
    assert says in result.message


def test_a_shadow_step_fails_on_errors_that_break_its_rate_even_at_min_requests() -> None:
    """A shadow step counts shadow runs against minRequests (10) and judges shadow-error-rate (default
    max 0.05): 3 failed runs of 3 fail the look, 0 of 3 hold it."""
    for errors, verdict in ((3.0, FAIL), (0.0, INCONCLUSIVE)):
        canary = Sample(requests=500, errors=0, shadow=ShadowSample(runs=3, errors=errors))
        result = evaluate(spec(), canary, STABLE, now=1.0, shadow=True)
        assert result.verdict == verdict, result
        assert result.message.startswith("only 3 shadow runs in the interval (minRequests 10)"), result.message
        assert ("shadow error rate <= 0.05 at minRequests" in result.message) == (verdict == FAIL)
