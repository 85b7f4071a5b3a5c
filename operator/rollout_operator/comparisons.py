"""``compare: stable`` metrics: the canary's counts against stable's, judged by the sequential test
(``sequential.py``, docs/SEQUENTIAL.md) at every look.

The counts live in the status (``status.sequential.<metric>.strata``, one stratum per step) between
reconciles: each look adds the interval's counter deltas to the current step's stratum (the direct
provider), or replaces that stratum with the counts since the step started (Prometheus'
``increase()`` over the step so far). A rollout that starts again starts them afresh. The decision
maps to a verdict: ``worse`` fails at once (a rollback without waiting for failureLimit),
``not-worse`` and ``better`` pass, ``undecided`` and ``insufficient`` are inconclusive (the step
holds until the progress deadline). The test's settings are fixed in advance (its guarantee needs
it): a metric whose settings change starts its counts afresh (``settings``, a digest of them).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from .sequential import WORSE, Comparison, Counts, add_interval, compare, strata_counts
from .status import iso
from .strategy import MetricSpec

RoleCounts = Mapping[str, float | None]  # role (successes, trials; n, sum, squares) -> count


def counts_of(metric: MetricSpec, raw: RoleCounts | None, since_step: bool) -> Counts | None:
    """The ``Counts`` of one version from its per-role counts; None when a needed role has none, or
    any is not finite.
    Counts since the step started come from ``increase()``, which extrapolates each series by a
    factor of its own: successes are clamped to the trials."""
    raw = raw or {}
    if any(v is not None and not math.isfinite(v) for v in raw.values()):
        return None  # an infinite or NaN count (a value too large for its square): no usable data
    if metric.kind == "rate":
        successes, trials = raw.get("successes"), raw.get("trials")
        if successes is None or trials is None:
            return None
        return Counts(trials, min(successes, trials) if since_step else successes)
    n, total = raw.get("n"), raw.get("sum")
    if n is None or total is None:
        return None
    return Counts(n, total, raw.get("squares"))


def settings(metric: MetricSpec) -> str:
    """A digest of what the test's guarantee depends on: the test and the series it reads."""
    series = {role: [s.name, list(s.labels)] for role, s in metric.role_series().items()}
    text = json.dumps([repr(metric.test), series], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def look(metric: MetricSpec, canary: RoleCounts | None, stable: RoleCounts | None, since_step: bool, step: int,
         prior: Mapping[str, Any] | None, now: float, comparisons: int = 1) -> tuple[dict[str, Any], Comparison]:
    """One look: the step's stratum brought up to date with this sample's counts (when both
    versions have them), and the comparison over every stratum so far. Returns the status entry
    (``strata`` and the decision with its evidence) and the comparison."""
    digest = settings(metric)
    same = (prior or {}).get("settings") in (None, digest)  # changed settings: the test starts again
    strata: list[dict[str, Any]] = [dict(s) for s in (prior or {}).get("strata") or []] if same else []
    c, s = counts_of(metric, canary, since_step), counts_of(metric, stable, since_step)
    if c is not None and s is not None:
        if since_step:
            strata = [x for x in strata if x.get("step") != step]
        strata = add_interval(strata, step, c, s)
    result = compare(metric.test, *strata_counts(strata), comparisons=comparisons)
    entry = {"strata": strata, **result.as_status(), "margin": metric.margin, "settings": digest,
             "checkedAt": iso(now)}
    return entry, result


def rule(metric: MetricSpec) -> str:
    """The not-worse rule as a threshold text: what must hold to pass."""
    what = "canary/stable - 1" if metric.relative else "canary - stable"
    d = metric.margin
    bound = f"lower bound > {-d:g}" if metric.direction == "higher" else f"upper bound < {d:g}"
    return f"{what}: {bound} ({metric.confidence:g} always-valid)"


def interval_text(entry: Mapping[str, Any]) -> str:
    """``+0.012 [-0.004, +0.028]`` from a status entry (or a comparison's ``as_status``)."""
    def show(x: Any) -> str:
        return "n/a" if x is None else f"{float(x):+.4g}"

    return f"{show(entry.get('estimate'))} [{show(entry.get('lower'))}, {show(entry.get('upper'))}]"


def summary(sequential: Mapping[str, Any] | None) -> str:
    """Each compare: stable metric's decision, estimate and interval, for an Event."""
    return "; ".join(f"{name}: {e.get('decision')} {interval_text(e)}" for name, e in (sequential or {}).items())


def is_worse(comparison: Comparison) -> bool:
    return comparison.decision == WORSE
