"""Turn metric samples into verdicts: thresholds, comparisons with stable, inconclusive.

A provider returns, per version, a ``Sample`` of what happened in the last interval (requests,
errors, latency quantiles, custom query values). ``evaluate`` turns canary and stable samples into
one ``Analysis``: ``pass``, ``fail`` or ``inconclusive``. Too little canary traffic, or a metric
with no value, is inconclusive: it holds the step and never counts as a failure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .spec import AnalysisSpec, MetricSpec

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class Sample:
    """One version over one interval. ``None`` means the provider has no value."""

    requests: float | None = None
    errors: float | None = None
    latency: Mapping[str, float | None] = field(default_factory=dict)  # "p50" -> seconds
    custom: Mapping[str, float | None] = field(default_factory=dict)  # metric name -> value
    error: str | None = None  # why the provider could not sample (unreachable, ...)

    @property
    def error_rate(self) -> float | None:
        if self.requests is None or self.errors is None or self.requests <= 0:
            return None
        return self.errors / self.requests


@dataclass(frozen=True)
class MetricResult:
    name: str
    value: float | None
    threshold: str
    verdict: str
    message: str = ""

    def as_status(self) -> dict[str, Any]:
        value = None if self.value is None or math.isnan(self.value) else round(self.value, 6)
        out = {"name": self.name, "value": value, "threshold": self.threshold, "verdict": self.verdict}
        if self.message:
            out["message"] = self.message
        return out


@dataclass(frozen=True)
class Analysis:
    at: float
    verdict: str
    metrics: tuple[MetricResult, ...]
    canary_requests: float | None
    message: str = ""

    def failed_metric(self) -> str:
        failed = [m for m in self.metrics if m.verdict == FAIL]
        if not failed:
            return self.message or "analysis failed"
        return "; ".join(f"{m.name} = {_show(m.value)} breached {m.threshold}" for m in failed)

    def as_status(self, failures: int) -> dict[str, Any]:
        from .status import iso

        return {
            "checkedAt": iso(self.at), "verdict": self.verdict, "failures": failures,
            "canaryRequests": self.canary_requests, "message": self.message,
            "metrics": [m.as_status() for m in self.metrics],
        }


def _show(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _max_check(name: str, value: float | None, limit: float | None, label: str) -> MetricResult | None:
    if limit is None:
        return None
    if value is None:
        return MetricResult(name, None, f"{label} <= {limit:g}", INCONCLUSIVE, "no value")
    return MetricResult(name, value, f"{label} <= {limit:g}", PASS if value <= limit else FAIL)


def _evaluate_metric(metric: MetricSpec, canary: Sample, stable: Sample | None) -> list[MetricResult]:
    out: list[MetricResult] = []
    if metric.name == "error-rate":
        rate = canary.error_rate
        out.append(_max_check(metric.name, rate, metric.max, "error rate"))  # type: ignore[arg-type]
        if metric.max_error_rate_increase is not None:
            base = stable.error_rate if stable else None
            diff = None if rate is None or base is None else rate - base
            out.append(_max_check(f"{metric.name} vs stable", diff, metric.max_error_rate_increase,
                                  "canary - stable"))  # type: ignore[arg-type]
    elif metric.name.startswith("latency-"):
        q = metric.name.removeprefix("latency-")
        value = canary.latency.get(q)
        out.append(_max_check(metric.name, value, metric.max, f"{q} seconds"))  # type: ignore[arg-type]
        if metric.max_latency_ratio is not None:
            base = stable.latency.get(q) if stable else None
            ratio = None if value is None or not base else value / base
            out.append(_max_check(f"{metric.name} vs stable", ratio, metric.max_latency_ratio,
                                  "canary / stable"))  # type: ignore[arg-type]
    else:
        value = canary.custom.get(metric.name)
        if metric.max is not None:
            out.append(_max_check(metric.name, value, metric.max, "value"))  # type: ignore[arg-type]
        if metric.min is not None:
            if value is None:
                out.append(MetricResult(metric.name, None, f"value >= {metric.min:g}", INCONCLUSIVE, "no value"))
            else:
                out.append(MetricResult(metric.name, value, f"value >= {metric.min:g}",
                                        PASS if value >= metric.min else FAIL))
    return [r for r in out if r is not None]


def evaluate(spec: AnalysisSpec, canary: Sample, stable: Sample | None, now: float) -> Analysis:
    """One check. No canary request count, or fewer than minRequests: inconclusive, whatever the
    metrics say (a custom query that answers with no traffic, ``... or vector(0)``, passes nothing)."""
    if canary.error is not None:
        return Analysis(now, INCONCLUSIVE, (), None, f"no data: {canary.error}")
    results: list[MetricResult] = []
    for metric in spec.metrics:
        results.extend(_evaluate_metric(metric, canary, stable))
    requests = canary.requests
    if requests is None:
        return Analysis(now, INCONCLUSIVE, tuple(results), None,
                        "no canary request count (no series, or a pod could not be scraped): no verdict without "
                        "evidence")
    if requests < spec.min_requests:
        return Analysis(now, INCONCLUSIVE, tuple(results), requests,
                        f"only {requests:g} canary requests in the interval (minRequests {spec.min_requests})")
    verdicts = {r.verdict for r in results}
    if FAIL in verdicts:
        verdict = FAIL
    elif INCONCLUSIVE in verdicts or not results:
        verdict = INCONCLUSIVE
    else:
        verdict = PASS
    return Analysis(now, verdict, tuple(results), requests, "")
