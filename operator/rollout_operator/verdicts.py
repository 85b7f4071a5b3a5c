"""Turn metric samples into verdicts: thresholds, comparisons with stable, inconclusive.

A provider returns, per version, a ``Sample`` of what happened in the last interval (requests,
errors, latency quantiles, custom query values, the shadow runs of a shadow step, the counts of
``compare: stable`` metrics). ``evaluate`` turns canary and stable samples into one ``Analysis``:
``pass``, ``fail`` or ``inconclusive``. Too little canary traffic (shadow runs, in a shadow step),
or a metric with no value, is inconclusive: it holds the step and never passes; it fails only when
the errors already counted break the error rate's ``max`` at minRequests whatever the rest would be. A
``compare: stable`` metric that finds the canary worse fails at once (``Analysis.immediate``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import comparisons
from .sequential import BETTER, NOT_WORSE, WORSE, Comparison
from .strategy import AnalysisSpec, MetricSpec

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class ShadowSample:
    """The canary run in stable's shadow over one interval (``mnn_shadow_*`` of its version)."""

    runs: float | None = None  # shadow runs that finished: compared or error (not dropped, not skipped)
    errors: float | None = None
    rows: float | None = None  # class-like rows compared
    agreeing: float | None = None  # of those, rows with the same argmax as stable's
    diff_sum: float | None = None  # sum of |canary - stable| over the output elements compared
    diff_count: float | None = None
    latency: Mapping[str, float | None] = field(default_factory=dict)  # "p99" -> the canary's forward, seconds
    stable_latency: Mapping[str, float | None] = field(default_factory=dict)  # stable's forward on the same requests

    @staticmethod
    def _ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b <= 0 else a / b

    @property
    def error_rate(self) -> float | None:
        return self._ratio(self.errors, self.runs)

    @property
    def agreement(self) -> float | None:
        return self._ratio(self.agreeing, self.rows)

    @property
    def mean_abs_diff(self) -> float | None:
        return self._ratio(self.diff_sum, self.diff_count)


@dataclass(frozen=True)
class Sample:
    """One version over one interval. ``None`` means the provider has no value."""

    requests: float | None = None
    errors: float | None = None
    latency: Mapping[str, float | None] = field(default_factory=dict)  # "p50" -> seconds
    custom: Mapping[str, float | None] = field(default_factory=dict)  # metric name -> value
    error: str | None = None  # why the provider could not sample (unreachable, ...)
    shadow: ShadowSample | None = None  # in a shadow step: the version's runs in stable's shadow
    # compare: stable metrics: metric name -> role -> count (the interval's, or since the step started)
    counts: Mapping[str, Mapping[str, float | None]] = field(default_factory=dict)
    since_step: bool = False  # counts are totals since the step started (replace its stratum), not deltas

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
    interval: tuple[float | None, float | None] | None = None  # compare: stable: the always-valid interval
    immediate: bool = False  # a failure that rolls back at once (compare: stable found the canary worse)

    def as_status(self) -> dict[str, Any]:
        value = None if self.value is None or math.isnan(self.value) else round(self.value, 6)
        out: dict[str, Any] = {"name": self.name, "value": value, "threshold": self.threshold, "verdict": self.verdict}
        if self.interval is not None:
            out["lower"], out["upper"] = (None if x is None else round(x, 6) for x in self.interval)
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
    sequential: dict[str, Any] | None = None  # status.sequential after this look (compare: stable metrics)
    shadow: bool = False  # judged a shadow step
    comparisons: Mapping[str, Comparison] | None = None  # an experiment's look: each challenger against stable
    # an experiment's look: the challengers whose guards (error rate, latency, custom thresholds)
    # failed; None when no challenger had the traffic to be judged on them
    breached: tuple[str, ...] | None = None

    @property
    def immediate(self) -> bool:
        """A failure that rolls back at once, whatever failureLimit says."""
        return self.verdict == FAIL and any(m.immediate for m in self.metrics if m.verdict == FAIL)

    def failed_metric(self) -> str:
        failed = [m for m in self.metrics if m.verdict == FAIL]
        if not failed:
            return self.message or "analysis failed"
        text = "; ".join(f"{m.name}: {m.message}" if m.interval is not None else
                         f"{m.name} = {_show(m.value)} breached {m.threshold}" for m in failed)
        return text + (" (in a shadow step: the canary served no user)" if self.shadow else "")

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


def _bounds(metric: MetricSpec, name: str, value: float | None, label: str) -> list[MetricResult]:
    """``max`` and ``min`` of one value."""
    out = [_max_check(name, value, metric.max, label)]
    if metric.min is not None:
        if value is None:
            out.append(MetricResult(name, None, f"{label} >= {metric.min:g}", INCONCLUSIVE, "no value"))
        else:
            out.append(MetricResult(name, value, f"{label} >= {metric.min:g}", PASS if value >= metric.min else FAIL))
    return [r for r in out if r is not None]


def _ratio_check(metric: MetricSpec, value: float | None, base: float | None) -> list[MetricResult]:
    if metric.max_latency_ratio is None:
        return []
    ratio = None if value is None or not base else value / base
    check = _max_check(f"{metric.name} vs stable", ratio, metric.max_latency_ratio, "canary / stable")
    return [check] if check is not None else []


SHADOW_LABELS = {"shadow-error-rate": "shadow error rate", "shadow-agreement": "agreeing rows",
                 "shadow-mean-abs-diff": "mean |canary - stable|"}


def _shadow_metric(metric: MetricSpec, shadow: ShadowSample) -> list[MetricResult]:
    if metric.name.startswith("shadow-latency-"):
        q = metric.name.removeprefix("shadow-latency-")
        value = shadow.latency.get(q)
        return _bounds(metric, metric.name, value, f"{q} forward seconds") + \
            _ratio_check(metric, value, shadow.stable_latency.get(q))
    value = {"shadow-error-rate": shadow.error_rate, "shadow-agreement": shadow.agreement,
             "shadow-mean-abs-diff": shadow.mean_abs_diff}[metric.name]
    return _bounds(metric, metric.name, value, SHADOW_LABELS[metric.name])


def _evaluate_metric(metric: MetricSpec, canary: Sample, stable: Sample | None) -> list[MetricResult]:
    out: list[MetricResult] = []
    if metric.is_shadow:
        return _shadow_metric(metric, canary.shadow or ShadowSample())
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
        out.extend(_ratio_check(metric, value, stable.latency.get(q) if stable else None))
    else:
        return _bounds(metric, metric.name, canary.custom.get(metric.name), "value")
    return [r for r in out if r is not None]


def guard_results(spec: AnalysisSpec, version: str, sample: Sample, stable: Sample | None) -> list[MetricResult]:
    """The threshold metrics (error rate, latency, custom: not compare: stable, not shadow) of one
    version of an experiment, each named for it."""
    return [replace(r, name=f"{r.name} ({version})") for metric in spec.metrics_for(False) if not metric.is_compare
            for r in _evaluate_metric(metric, sample, stable)]


def compare_result(metric: MetricSpec, comparison: Comparison, name: str | None = None) -> MetricResult:
    """A compare: stable metric's verdict: worse fails at once, not-worse and better pass, the rest
    (undecided, insufficient) is inconclusive."""
    verdict = FAIL if comparison.decision == WORSE else \
        PASS if comparison.decision in (NOT_WORSE, BETTER) else INCONCLUSIVE
    return MetricResult(name or metric.name, comparison.estimate, comparisons.rule(metric), verdict,
                        f"{comparison.decision}: {comparison.message}", (comparison.lower, comparison.upper),
                        immediate=verdict == FAIL)


def decisive_errors(spec: AnalysisSpec, canary: Sample, shadow: bool) -> str:
    """Below minRequests: why the errors already counted break the error rate's ``max`` even had
    the interval reached minRequests with every other request a success ("" when they do not).
    More requests could only have lowered the rate to errors / minRequests, so such a look fails
    (it counts toward failureLimit) rather than holding a canary whose every request fails."""
    name, errors = (("shadow-error-rate", canary.shadow.errors if canary.shadow else None) if shadow
                    else ("error-rate", canary.errors))
    limit = min((m.max for m in spec.metrics_for(shadow) if m.name == name and m.max is not None), default=None)
    if limit is None or errors is None or errors / spec.min_requests <= limit:
        return ""
    label = SHADOW_LABELS.get(name, "error rate")
    return (f"its {errors:g} error{'' if errors == 1 else 's'} alone break {label} <= {limit:g} at minRequests "
            f"({errors:g}/{spec.min_requests} = {errors / spec.min_requests:.4g})")


def evaluate(spec: AnalysisSpec, canary: Sample, stable: Sample | None, now: float, step: int = 0,
             shadow: bool = False, sequential: Mapping[str, Any] | None = None) -> Analysis:
    """One check of the step ``step`` (a shadow step: ``shadow``), by the metrics that judge it.
    No canary request count (shadow runs), or fewer than minRequests: inconclusive, whatever the
    threshold metrics say (a custom query that answers with no traffic, ``... or vector(0)``,
    passes nothing); it fails only when the errors counted break the error rate's ``max`` even at
    minRequests (``decisive_errors``), or by a compare: stable metric, which judges its counts
    since the rollout started. ``sequential`` is status.sequential before this look."""
    prior = dict(sequential or {})
    if canary.error is not None:
        return Analysis(now, INCONCLUSIVE, (), None, f"no data: {canary.error}", prior or None, shadow)
    results: list[MetricResult] = []
    for metric in spec.metrics_for(shadow):
        if metric.is_compare:
            base = stable.counts.get(metric.name) if stable is not None and stable.error is None else None
            prior[metric.name], comparison = comparisons.look(metric, canary.counts.get(metric.name), base,
                                                              canary.since_step, step, prior.get(metric.name), now)
            results.append(compare_result(metric, comparison))
        else:
            results.extend(_evaluate_metric(metric, canary, stable))
    kept = prior or None
    requests = (canary.shadow.runs if canary.shadow else None) if shadow else canary.requests
    what = ("shadow run", "shadow runs") if shadow else ("canary request", "canary requests")
    worse = any(r.immediate and r.verdict == FAIL for r in results)
    if requests is None or requests < spec.min_requests:
        message = (f"no {what[0]} count (no series, or a pod could not be scraped): no verdict without evidence"
                   if requests is None else
                   f"only {requests:g} {what[1]} in the interval (minRequests {spec.min_requests})")
        decisive = "" if requests is None else decisive_errors(spec, canary, shadow)
        return Analysis(now, FAIL if worse or decisive else INCONCLUSIVE, tuple(results), requests,
                        f"{message}, but {decisive}" if decisive else message, kept, shadow)
    verdicts = {r.verdict for r in results}
    if FAIL in verdicts:
        verdict = FAIL
    elif INCONCLUSIVE in verdicts or not results:
        verdict = INCONCLUSIVE
    else:
        verdict = PASS
    return Analysis(now, verdict, tuple(results), requests, "", kept, shadow)
