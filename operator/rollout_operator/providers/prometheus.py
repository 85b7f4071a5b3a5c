"""The ``prometheus`` provider: PromQL against a Prometheus server.

Unreachable, erroring or empty answers give a Sample with ``error`` or ``None`` values, which the
analysis treats as inconclusive: a rollout holds, and never promotes, on missing data.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import httpx

from ..spec import MetricSpec
from ..verdicts import Sample
from .base import QUANTILES, SampleContext
from .direct import is_counter

SELECTOR = 'model="{model}",version="{version}"'
QUERIES = {
    "requests": "sum(increase(mnn_inference_requests_total{%s}[{interval}]))" % SELECTOR,
    "errors": 'sum(increase(mnn_inference_requests_total{%s,outcome!="success"}[{interval}]))' % SELECTOR,
    "latency": "histogram_quantile({q}, sum by (le) (rate(mnn_inference_duration_seconds_bucket{%s}[{interval}])))"
               % SELECTOR,
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
        """The value of an instant query with one series at time ``at``; None when it returns nothing."""
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
        result = body.get("data", {}).get("result", [])
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
        window = f"{int(max(ctx.interval_seconds, MIN_WINDOW_SECONDS))}s"
        at = time.time()  # every query of one sample at the same instant: errors never exceed requests
        out = {}
        for version in ctx.versions:
            values = dict(model=ctx.model, version=version, namespace=ctx.namespace, interval=window)
            try:
                requests = self.query(_fill(QUERIES["requests"], values), at)
                errors = self.query(_fill(QUERIES["errors"], values), at)
                latency = {name: self.query(_fill(QUERIES["latency"], {**values, "q": str(q)}), at)
                           for name, q in QUANTILES.items()}
                custom = {m.name: self.query(_fill(custom_query(m), values), at)
                          for m in ctx.metrics if m.query or m.metric}
            except PrometheusError as exc:
                out[version] = Sample(error=str(exc))
                continue
            out[version] = Sample(requests=requests if requests is not None else None,
                                  errors=errors if errors is not None else (0.0 if requests else None),
                                  latency=latency, custom=custom)
        return out


def custom_query(metric: MetricSpec) -> str:
    """The PromQL of a custom metric: its own ``query``, or one built from ``metric`` and ``labels``
    the way the direct provider reads the pods (a counter's increase, else the current value)."""
    if metric.query:
        return metric.query
    assert metric.metric is not None
    matchers = ",".join([SELECTOR] + [f'{k}="{v}"' for k, v in sorted(metric.labels.items())])
    series = f"{metric.metric}{{{matchers}}}"
    value = f"sum(increase({series}[{{interval}}]))" if is_counter(metric.metric) else f"sum({series})"
    if metric.per_request:
        value = f"({value}) / {QUERIES['requests']}"
    return value


def _fill(template: str, values: Mapping[str, str]) -> str:
    """Replace {model}, {version}, {namespace}, {interval}, {q}; other braces (PromQL) stay."""
    out = template
    for key, value in values.items():
        out = out.replace("{" + key + "}", value)
    return out
