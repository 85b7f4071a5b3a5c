"""``evaluate``: samples and thresholds -> pass, fail or inconclusive. No verdict without evidence."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_operator.spec import AnalysisSpec
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Sample, evaluate


def spec(**fields: Any) -> AnalysisSpec:
    return AnalysisSpec.model_validate({"minRequests": 10, **fields})


STABLE = Sample(requests=1000, errors=1, latency={"p50": 0.01, "p99": 0.05})
CUSTOM = {"provider": {"type": "prometheus", "address": "http://127.0.0.1:9090"},
          "metrics": [{"name": "conversion", "query": "sum(x{version='{version}'}) or vector(0)", "max": 0.5}]}


@pytest.mark.parametrize("analysis, canary, verdict, says", [
    ({}, Sample(requests=100, errors=0), PASS, ""),
    ({}, Sample(requests=100, errors=50), FAIL, ""),
    ({}, Sample(requests=5, errors=0), INCONCLUSIVE, "only 5 canary requests"),
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
