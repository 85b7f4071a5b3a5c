"""The ``prometheus`` provider: PromQL against a Prometheus server.

Unreachable, erroring or empty answers give a Sample with ``error`` or ``None`` values, which the
analysis treats as inconclusive: a rollout holds, and never promotes, on missing data. Every window
ends at the step's start (``SampleContext.since``): a step younger than ``MIN_WINDOW_SECONDS`` has no
data yet, never the traffic of the step (or the canary file) before it.

``compare: stable`` metrics read each role's ``increase()`` since the step started (the stratum's
counts so far, ``Sample.since_step``); a shadow step reads the shadow version's ``mnn_shadow_*``
series over the interval.

An object whose pods are scraped with its ``namespace`` and ``modeldeployment`` labels is read from
those series alone; series without the labels (a static scrape config) only for an object none of whose
pods carried them within the last hour (see ``scoped``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from ..spec import MetricSpec
from ..verdicts import Sample, ShadowSample
from .base import QUANTILES, SampleContext
from .direct import is_counter

# One ModelDeployment's series: its model and version, in its namespace and of its pods, as the chart's
# PodMonitor labels them (OWN); when the object's pods were not scraped with those labels within the horizon
# (a static scrape config), the series without them (SELECTOR: labelled or not). Never both, and never the
# unlabelled ones for an object whose pods carry the labels, whether or not this version or query has series
# now (a canary not loaded yet, pods down or gone): the unlabelled series are other objects' traffic then.
OWN = 'model="{model}",version="{version}",namespace="{namespace}",modeldeployment=~"{name_regex}"'
SELECTOR = 'model="{model}",version="{version}",namespace=~"{namespace}|",modeldeployment=~"{name_regex}|"'
# One answer (1) when no pod of the object was scraped with its labels within {horizon}: ``up`` carries a
# PodMonitor's target labels even while scrapes fail; every runtime exports mnn_runtime_start_time_seconds
UNLABELLED = ('absent_over_time({__name__=~"up|mnn_runtime_start_time_seconds",namespace="{namespace}",'
              'modeldeployment=~"{name_regex}"}[{horizon}])')
HORIZON_SECONDS = 3600  # how long an object's labelled pods count as there after their last scrape


def scoped(query: Callable[[str], str]) -> str:
    """``query(selector)`` over the object's own labelled series, or, when its pods were not scraped
    with the labels within the horizon, over the series without them (one PromQL expression: both
    read at the same instant, the same choice for every query of a sample)."""
    return f"(({query(OWN)}) or ({query(SELECTOR)} and on() {UNLABELLED}))"


QUERIES = {
    "requests": scoped(lambda s: "sum(increase(mnn_inference_requests_total{%s}[{interval}]))" % s),
    "errors": scoped(lambda s: 'sum(increase(mnn_inference_requests_total{%s,outcome!="success"}[{interval}]))' % s),
    "latency": scoped(lambda s: "histogram_quantile({q}, sum by (le) (rate(mnn_inference_duration_seconds_bucket"
                                "{%s}[{interval}])))" % s),
}
SHADOW_QUERIES = {
    "runs": scoped(lambda s: 'sum(increase(mnn_shadow_requests_total{%s,outcome=~"compared|error"}[{interval}]))' % s),
    "errors": scoped(lambda s: 'sum(increase(mnn_shadow_requests_total{%s,outcome="error"}[{interval}]))' % s),
    "rows": scoped(lambda s: "sum(increase(mnn_shadow_rows_total{%s}[{interval}]))" % s),
    "agreeing": scoped(lambda s: "sum(increase(mnn_shadow_agreeing_rows_total{%s}[{interval}]))" % s),
    "diff_sum": scoped(lambda s: "sum(increase(mnn_shadow_abs_diff_sum{%s}[{interval}]))" % s),
    "diff_count": scoped(lambda s: "sum(increase(mnn_shadow_abs_diff_count{%s}[{interval}]))" % s),
    "latency": scoped(lambda s: "histogram_quantile({q}, sum by (le) (rate(mnn_shadow_duration_seconds_bucket"
                                "{%s}[{interval}])))" % s),
    "stable_latency": scoped(lambda s: "histogram_quantile({q}, sum by (le) (rate("
                                       "mnn_shadow_stable_duration_seconds_bucket{%s}[{interval}])))" % s),
}
MIN_WINDOW_SECONDS = 10  # rate() needs several scrapes in its window


class PrometheusError(Exception):
    pass


class PrometheusProvider:
    def __init__(self, address: str, timeout: float = 5.0, headers: Mapping[str, str] | None = None) -> None:
        self.address = address.rstrip("/")
        self.timeout = timeout
        self.headers = dict(headers or {})
        self.http = httpx.Client(timeout=timeout, headers=self.headers)  # one pool, not a client per query

    def query(self, promql: str, at: float | None = None) -> float | None:
        """The value of an instant query with one series (or a scalar) at time ``at``; None when it
        returns nothing; PrometheusError when it returns several series (which one would be arbitrary)."""
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        try:
            resp = self.http.get(f"{self.address}/api/v1/query", params=params)
        except httpx.HTTPError as exc:
            raise PrometheusError(f"{self.address} unreachable: {exc or type(exc).__name__}") from None
        try:
            body = resp.json()
        except ValueError:
            raise PrometheusError(f"{self.address} answered {resp.status_code} without JSON") from None
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {body.get('error', resp.status_code)}")
        data = body.get("data") or {}
        result = data.get("result") or []
        if data.get("resultType") == "scalar":
            result = [{"value": result}]
        elif data.get("resultType") != "vector":
            raise PrometheusError(f"query {promql!r} gave a {data.get('resultType')}, not one value")
        if len(result) > 1:
            raise PrometheusError(f"query {promql!r} gave {len(result)} series, not one value: aggregate them "
                                  f"(sum, max, ...)")
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN (e.g. no requests for a quantile): no value

    def is_online(self) -> bool:
        try:
            return self.http.get(f"{self.address}/-/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def sample(self, ctx: SampleContext) -> dict[str, Sample]:
        at = time.time()  # every query of one sample at the same instant: errors never exceed requests
        seconds = max(ctx.interval_seconds, MIN_WINDOW_SECONDS)
        if ctx.since is not None:  # never a window reaching back before the step: its traffic judged another
            span = at - ctx.since  # weight, or another file of the canary (an edited uri restarts the step)
            if span < MIN_WINDOW_SECONDS:
                why = (f"the step began {max(span, 0.0):.0f} s ago: Prometheus needs a window of at least "
                       f"{MIN_WINDOW_SECONDS} s")
                return {version: Sample(error=why) for version in ctx.versions}
            seconds = min(seconds, span)
        window = f"{int(seconds)}s"
        horizon = f"{max(int(seconds), HORIZON_SECONDS)}s"
        out = {}
        for version in ctx.versions:
            values = dict(model=ctx.model, version=version, namespace=ctx.namespace, interval=window, horizon=horizon,
                          name_regex=ctx.name.replace(".", "\\\\."))  # a name's dots, literal in PromQL's regex
            try:
                requests = self.query(_fill(QUERIES["requests"], values), at)
                errors = self.query(_fill(QUERIES["errors"], values), at)
                latency = {name: self.query(_fill(QUERIES["latency"], {**values, "q": str(q)}), at)
                           for name, q in QUANTILES.items()}
                custom = {m.name: self.query(_fill(custom_query(m), values), at)
                          for m in ctx.metrics if m.query or m.metric}
                counts = self._counts(ctx, values, at)
                # the shadow series are labelled with the shadow version: the canary (first)
                shadow = self._shadow(ctx.metrics, values, at) if ctx.shadow and version == ctx.versions[0] else None
            except PrometheusError as exc:
                out[version] = Sample(error=str(exc))
                continue
            out[version] = Sample(requests=requests if requests is not None else None,
                                  errors=errors if errors is not None else (0.0 if requests else None),
                                  latency=latency, custom=custom, counts=counts, shadow=shadow,
                                  since_step=bool(counts))
        return out

    def _counts(self, ctx: SampleContext, values: Mapping[str, str], at: float) -> dict[str, dict[str, float | None]]:
        """Each compare: stable metric's role counts since the step started (None while the step is
        younger than a window ``increase()`` can measure)."""
        span = at - ctx.since if ctx.since is not None else 0.0
        out: dict[str, dict[str, float | None]] = {}
        for m in ctx.metrics:
            if not m.is_compare:
                continue
            if span < MIN_WINDOW_SECONDS:
                out[m.name] = {role: None for role in m.role_series()}
                continue
            at_span = {**values, "horizon": f"{max(int(span), HORIZON_SECONDS)}s"}
            out[m.name] = {role: self.query(_fill(scoped(
                lambda s: f"sum(increase({series.promql(s)}[{int(span)}s]))"), at_span), at)  # noqa: B023
                for role, series in m.role_series().items()}
        return out

    def _shadow(self, metrics: Sequence[MetricSpec], values: Mapping[str, str], at: float) -> ShadowSample:
        """The shadow runs of the interval; only the measures the step's metrics read."""
        names = {m.name for m in metrics}
        wanted = ["runs", "errors"]
        if "shadow-agreement" in names:
            wanted += ["rows", "agreeing"]
        if "shadow-mean-abs-diff" in names:
            wanted += ["diff_sum", "diff_count"]
        got = {key: self.query(_fill(SHADOW_QUERIES[key], values), at) for key in wanted}
        if got["runs"] is not None and got["errors"] is None:
            got["errors"] = 0.0
        latency: dict[str, float | None] = {}
        stable: dict[str, float | None] = {}
        for m in metrics:
            if m.name.startswith("shadow-latency-"):
                q = m.name.removeprefix("shadow-latency-")
                at_q = {**values, "q": str(QUANTILES[q])}
                latency[q] = self.query(_fill(SHADOW_QUERIES["latency"], at_q), at)
                if m.max_latency_ratio is not None:
                    stable[q] = self.query(_fill(SHADOW_QUERIES["stable_latency"], at_q), at)
        return ShadowSample(**got, latency=latency, stable_latency=stable)


def custom_query(metric: MetricSpec) -> str:
    """The PromQL of a custom metric: its own ``query``, or one built from ``metric`` and ``labels``
    the way the direct provider reads the pods (a counter's increase, else the current value)."""
    if metric.query:
        return metric.query
    assert metric.metric is not None
    name = metric.metric

    matchers = [f'{k}="{v}"' for k, v in sorted(metric.labels.items())]

    def series(selector: str) -> str:
        return f"{name}{{{','.join([selector, *matchers])}}}"

    value = scoped(lambda s: f"sum(increase({series(s)}[{{interval}}]))" if is_counter(name) else f"sum({series(s)})")
    if metric.per_request:
        value = f"({value}) / {QUERIES['requests']}"
    return value


def _fill(template: str, values: Mapping[str, str]) -> str:
    """Replace {model}, {version}, {namespace}, {interval}, {horizon}, {q}; other braces (PromQL) stay."""
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out
