"""The rollout strategy of a ModelDeployment spec: steps (weighted or shadow), the analysis and its
metrics (thresholds, comparisons with stable by a sequential test), and A/B experiments.

Part of the spec (``spec.py`` re-exports these); every message names the field, the value and what
would be valid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .sequential import SequentialTest

DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h))+$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
# a series with optional exact label matchers: name or name{label="value",...}
SERIES = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{((?:\s*[a-zA-Z_][a-zA-Z0-9_]*\s*=\s*"[^"]*"\s*,?)*)\})?$')
MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"')
# Read in shadow steps only (the canary serves no user there): from the runtime's mnn_shadow_* series.
SHADOW_METRICS = ("shadow-error-rate", "shadow-agreement", "shadow-mean-abs-diff", "shadow-latency-p50",
                  "shadow-latency-p95", "shadow-latency-p99")
BUILTIN_METRICS = ("error-rate", "latency-p50", "latency-p95", "latency-p99", *SHADOW_METRICS)
# The series of each role of a compare: stable metric, by kind: the runtime's feedback counters.
ROLE_SERIES = {
    "rate": {"successes": "mnn_feedback_value_sum", "trials": "mnn_feedback_total"},
    "mean": {"n": "mnn_feedback_total", "sum": "mnn_feedback_value_sum", "squares": "mnn_feedback_value_squared_sum"},
}
# Fields of a compare: stable metric only (their names in the spec).
COMPARE_FIELDS = {"kind": "kind", "direction": "direction", "margin": "margin", "relative": "relative",
                  "confidence": "confidence", "effect": "effect", "min_samples": "minSamples", "bounds": "bounds",
                  "series": "series"}


def parse_duration(text: str) -> float:
    """'1h30m' -> 5400.0 seconds; raises ValueError naming the text."""
    if not isinstance(text, str) or not DURATION.match(text):
        raise ValueError(f"{text!r} is not a duration; valid: e.g. 500ms, 30s, 5m, 1h30m")
    return sum(float(n) * _UNIT[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


class SpecModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


class Step(SpecModel):
    """A canary weight held for a pause, or a shadow step: weight 0, and ``shadow`` percent of
    stable's requests also run on the canary (users get stable's answers)."""

    weight: int = Field(default=0, ge=0, le=100)
    shadow: int | None = Field(default=None, ge=1, le=100)
    pause: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _weight_or_shadow(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "weight" not in raw and raw.get("shadow") is None:
            raise ValueError("weight: required (the canary's percent of traffic), or shadow (the percent of "
                             "stable's requests also run on the canary, which keeps weight 0)")
        return raw

    @model_validator(mode="after")
    def _shadow_keeps_weight_zero(self) -> Step:
        if self.shadow is not None and self.weight:
            raise ValueError(f"weight: {self.weight} in a shadow step; a shadow step keeps the canary at weight 0: "
                             "give either weight or shadow")
        return self

    @field_validator("pause")
    @classmethod
    def _pause(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @property
    def pause_seconds(self) -> float | None:
        return None if self.pause is None else parse_duration(self.pause)


class ProviderSpec(SpecModel):
    type: Literal["direct", "prometheus"] = "direct"
    address: str | None = None
    timeout: str = "5s"
    secret_ref: dict[str, str] | None = Field(default=None, alias="secretRef")

    @model_validator(mode="after")
    def _address(self) -> ProviderSpec:
        parse_duration(self.timeout)
        if self.type == "prometheus" and not self.address:
            raise ValueError("address: required when provider type is prometheus (e.g. http://prometheus:9090)")
        return self


@dataclass(frozen=True)
class Series:
    """A series name with exact label matchers (matched on model and version besides)."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str, labels: dict[str, str] | None = None) -> Series:
        found = SERIES.match(text.strip())
        if not found:
            raise ValueError(f'{text!r} is not a series; valid: a metric name, optionally with exact label '
                             'matchers, e.g. mnn_feedback_total or mnn_feedback_total{kind="click"}')
        own = dict(MATCHER.findall(found.group(2) or ""))
        return cls(found.group(1), tuple(sorted({**(labels or {}), **own}.items())))

    def matches(self, name: str, labels: dict[str, str]) -> bool:
        return name == self.name and all(labels.get(k) == v for k, v in self.labels)

    def promql(self, selector: str) -> str:
        """``name{selector,label="value",...}``: ``selector`` holds the model and version matchers."""
        matchers = [selector, *(f'{k}="{v}"' for k, v in self.labels)]
        return f"{self.name}{{{','.join(matchers)}}}"


class MetricSpec(SpecModel):
    name: str
    max: float | None = None
    min: float | None = None
    max_error_rate_increase: float | None = Field(default=None, alias="maxErrorRateIncrease", ge=0)
    max_latency_ratio: float | None = Field(default=None, alias="maxLatencyRatio", ge=0)
    query: str | None = None  # PromQL (prometheus provider)
    metric: str | None = None  # a series on the runtime pods' /metrics (either provider)
    labels: dict[str, str] = Field(default_factory=dict)  # more exact label matchers for ``metric`` (or series)
    per_request: bool = Field(default=False, alias="perRequest")
    # compare: stable -- a sequential test of canary against stable on counters per version
    compare: Literal["stable"] | None = None
    kind: Literal["rate", "mean"] = "rate"  # rate: successes / trials (each 0 or 1); mean: any value
    direction: Literal["higher", "lower"] = "higher"  # which way is better
    margin: float = 0.0  # how far the canary may trail stable and still pass (a fraction with relative)
    relative: bool = False  # compare canary / stable - 1 instead of canary - stable
    confidence: float = 0.95  # of the whole sequence of looks
    effect: float | None = None  # the difference the test is quickest on (default the margin)
    min_samples: int = Field(default=100, alias="minSamples")  # per version and step before any decision
    bounds: list[float] | None = None  # kind mean: the values' range [low, high]
    series: dict[str, str] = Field(default_factory=dict)  # role -> series, over ROLE_SERIES' defaults

    @model_validator(mode="after")
    def _shape(self) -> MetricSpec:
        if self.compare is not None:
            return self._compare_shape()
        extra = sorted(COMPARE_FIELDS[f] for f in self.model_fields_set & set(COMPARE_FIELDS))
        if extra:
            raise ValueError(f"metric {self.name!r}: {', '.join(extra)} apply only with compare: stable")
        if self.name not in BUILTIN_METRICS and not self.query and not self.metric:
            raise ValueError(
                f"metric {self.name!r} is not built in ({', '.join(BUILTIN_METRICS)}) and has neither query "
                "(PromQL) nor metric (a series the runtime pods export), nor compare: stable"
            )
        if self.query and self.metric:
            raise ValueError(f"metric {self.name!r}: set either query (PromQL) or metric (a series name), not both")
        if self.metric is not None and not METRIC_NAME.match(self.metric):
            raise ValueError(f"metric {self.name!r}: {self.metric!r} is not a Prometheus metric name")
        if self.name in BUILTIN_METRICS and (self.query or self.metric):
            raise ValueError(f"metric {self.name!r} is built in: it takes no query or metric; give a custom name")
        if self.max is None and self.min is None and self.max_error_rate_increase is None \
                and self.max_latency_ratio is None:
            raise ValueError(f"metric {self.name!r} needs a threshold: max, min, maxErrorRateIncrease "
                             "or maxLatencyRatio (or compare: stable)")
        if self.max_error_rate_increase is not None and self.name != "error-rate":
            raise ValueError(f"maxErrorRateIncrease applies to error-rate, not {self.name!r}")
        if self.max_latency_ratio is not None and not self.name.startswith(("latency-", "shadow-latency-")):
            raise ValueError(f"maxLatencyRatio applies to latency-p50/p95/p99 and shadow-latency-p50/p95/p99, "
                             f"not {self.name!r}")
        return self

    def _compare_shape(self) -> MetricSpec:
        if self.name in BUILTIN_METRICS:
            raise ValueError(f"metric {self.name!r} is built in; a compare: stable metric needs a name of its own "
                             "(e.g. conversion)")
        given = [alias for field, alias in (("max", "max"), ("min", "min"), ("query", "query"), ("metric", "metric"),
                                            ("max_error_rate_increase", "maxErrorRateIncrease"),
                                            ("max_latency_ratio", "maxLatencyRatio"), ("per_request", "perRequest"))
                 if field in self.model_fields_set]
        if given:
            raise ValueError(f"metric {self.name!r}: {', '.join(given)} do not apply with compare: stable (it compares "
                             "counters per version: see kind and series)")
        roles = ROLE_SERIES[self.kind]
        for role, text in self.series.items():
            if role not in roles:
                raise ValueError(f"series.{role}: not a role of kind {self.kind}; valid: {', '.join(roles)}")
            try:
                Series.parse(text)
            except ValueError as exc:
                raise ValueError(f"series.{role}: {exc}") from None
        if self.bounds is not None and len(self.bounds) != 2:
            raise ValueError(f"bounds: {self.bounds!r} is not valid; valid: [low, high], for kind mean only")
        try:
            self.test  # noqa: B018 - SequentialTest checks the statistics' fields
        except ValueError as exc:
            text = str(exc)
            for field, alias in COMPARE_FIELDS.items():
                if text.startswith(f"{field}:"):
                    text = alias + text[len(field):]
            raise ValueError(text) from None
        return self

    @property
    def is_shadow(self) -> bool:
        return self.name in SHADOW_METRICS

    @property
    def is_compare(self) -> bool:
        return self.compare is not None

    @property
    def test(self) -> SequentialTest:
        """The sequential test a compare: stable metric runs."""
        bounds = None if self.bounds is None else (float(self.bounds[0]), float(self.bounds[1]))
        return SequentialTest(kind=self.kind, margin=self.margin, confidence=self.confidence, direction=self.direction,
                              relative=self.relative, min_samples=self.min_samples, effect=self.effect, bounds=bounds)

    def role_series(self) -> dict[str, Series]:
        """The series of each role (defaults: the runtime's feedback counters), with ``labels``."""
        return {role: Series.parse(self.series.get(role, default), self.labels)
                for role, default in ROLE_SERIES[self.kind].items()}


DEFAULT_SHADOW_METRIC = MetricSpec(name="shadow-error-rate", max=0.05)


class AnalysisSpec(SpecModel):
    interval: str = "10s"
    min_requests: int = Field(default=20, ge=0, alias="minRequests")
    failure_limit: int = Field(default=2, ge=1, alias="failureLimit")
    provider: ProviderSpec = Field(default_factory=ProviderSpec)
    metrics: list[MetricSpec] = Field(default_factory=lambda: [MetricSpec(name="error-rate", max=0.05)])

    @model_validator(mode="after")
    def _metrics(self) -> AnalysisSpec:
        names = [m.name for m in self.metrics]
        for i, m in enumerate(self.metrics):
            if m.query and self.provider.type == "direct":
                raise ValueError(
                    f"metrics.{i}.query: {m.query!r} is PromQL, which the direct provider cannot run; set "
                    "provider.type: prometheus, or name a series the pods export with metric (and labels)")
            if m.is_compare and m.name in names[:i]:
                raise ValueError(f"metrics.{i}.name: {m.name!r} is used by another metric; a compare: stable metric "
                                 "needs a name of its own (its test is kept under it in status.sequential)")
        return self

    @field_validator("interval")
    @classmethod
    def _interval(cls, value: str) -> str:
        if parse_duration(value) < 1:
            raise ValueError(f"interval {value!r} is below the minimum of 1s")
        return value

    @property
    def interval_seconds(self) -> float:
        return parse_duration(self.interval)

    def metrics_for(self, shadow: bool) -> list[MetricSpec]:
        """The metrics a step is judged by: a shadow step by the shadow metrics (default
        shadow-error-rate <= 0.05), a weighted step by all the others."""
        if shadow:
            return [m for m in self.metrics if m.is_shadow] or [DEFAULT_SHADOW_METRIC]
        return [m for m in self.metrics if not m.is_shadow]

    def metric(self, name: str) -> MetricSpec | None:
        return next((m for m in self.metrics if m.name == name), None)


class StrategySpec(SpecModel):
    steps: list[Step] = Field(
        default_factory=lambda: [Step(weight=10, pause="30s"), Step(weight=50, pause="30s")], min_length=1,
        max_length=50,
    )
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)
    scale_down_delay_seconds: float = Field(default=30, ge=0, alias="scaleDownDelaySeconds")

    @model_validator(mode="after")
    def _shadow_steps_first(self) -> StrategySpec:
        weighted = [i for i, s in enumerate(self.steps) if s.shadow is None]
        for i, step in enumerate(self.steps):
            if step.shadow is not None and weighted and weighted[0] < i:
                raise ValueError(f"steps.{i}.shadow: a shadow step after step {weighted[0]} gave the canary weight; "
                                 "shadow steps come first (before any user is served by the canary)")
        metrics = self.analysis.metrics
        shadow = [m.name for m in metrics if m.is_shadow]
        if shadow and len(weighted) == len(self.steps):
            raise ValueError(f"analysis.metrics: {', '.join(shadow)} are read in shadow steps only, and no step "
                             "is one; add a step such as {shadow: 20, pause: 2m}, or remove them")
        if shadow and weighted and len(shadow) == len(metrics):
            raise ValueError(f"analysis.metrics: only shadow metrics ({', '.join(shadow)}), but steps "
                             f"{', '.join(str(i) for i in weighted)} give the canary weight and would have nothing to "
                             "judge them; add one for them (e.g. {name: error-rate, max: 0.05})")
        return self


class ExperimentSpec(SpecModel):
    """An A/B test: a fixed split between stable (the control) and one or more challengers, held
    until the sequential test of ``metric`` finds a challenger better than stable (it is promoted)
    or ``maxDuration`` passes (stable stays)."""

    weights: dict[str, int]  # percent per version, every one above 0, summing to 100; stable among them
    metric: str  # the name of a compare: stable metric in strategy.analysis.metrics
    max_duration: str | None = Field(default=None, alias="maxDuration")  # default progressDeadlineSeconds

    @field_validator("max_duration")
    @classmethod
    def _duration(cls, value: str | None) -> str | None:
        if value is not None and parse_duration(value) < 1:
            raise ValueError(f"maxDuration {value!r} is below the minimum of 1s")
        return value

    def duration_seconds(self, default: float) -> float:
        return default if self.max_duration is None else parse_duration(self.max_duration)

    def key(self) -> str:
        """What identifies one experiment: a change of split or metric starts another."""
        return f"{self.metric}:" + ",".join(f"{k}={v}" for k, v in sorted(self.weights.items()))

    def check(self, stable: str, analysis: AnalysisSpec) -> None:
        """Cross-field rules (versions are checked by the caller): stable is the control, every
        challenger takes traffic, the metric is a compare: stable one."""
        if self.weights.get(stable, 0) <= 0:
            raise ValueError(f"experiment.weights: {dict(self.weights)} gives stable {stable!r} no traffic; stable is "
                             "the control every challenger is compared with: give it a weight above 0")
        zero = sorted(k for k, v in self.weights.items() if v <= 0)
        if zero:
            raise ValueError(f"experiment.weights: {', '.join(zero)} at 0; every version of an experiment takes "
                             "traffic")
        if len(self.weights) < 2:
            raise ValueError(f"experiment.weights: {dict(self.weights)} has no challenger besides stable {stable!r}")
        metric = analysis.metric(self.metric)
        compares = [m.name for m in analysis.metrics if m.is_compare]
        if metric is None or not metric.is_compare:
            raise ValueError(f"experiment.metric: {self.metric!r} is not a compare: stable metric of "
                             f"strategy.analysis.metrics; valid: {compares or 'none defined'}")

