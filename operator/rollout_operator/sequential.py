"""Compare a canary with stable on a rate or a mean, looking after every interval.

The operator reads the analysis after every interval and acts on the first decisive answer. A
fixed-horizon test (a z-test, Kayenta's Mann-Whitney) read that often raises false alarms far above
its level. This module keeps a confidence *sequence* for the difference canary - stable (or the
relative difference): intervals that cover the true difference at every look at once, with the
configured confidence, so acting on any look is as safe as acting on one planned look.

Method: Robbins' normal mixture boundary on the estimate with a plug-in variance, the asymptotic
confidence sequence of Waudby-Smith et al. (the two-sample mixture SPRT of Johari et al. in
interval form), mixture tuned so the interval is tightest when its half-width equals the margin.
``docs/SEQUENTIAL.md`` has the formulas, the decision rules and the simulations.

Inputs are cumulative ``Counts`` per version, optionally split into strata (one per canary step) so
that a weight change does not compare different hours' traffic in different proportions. Pure: no
I/O, no clock, numpy only. Bad counts give ``insufficient``, never an exception or a NaN.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[Any]
Kind = Literal["rate", "mean"]
Direction = Literal["higher", "lower"]

INSUFFICIENT, UNDECIDED, WORSE, NOT_WORSE, BETTER = "insufficient", "undecided", "worse", "not-worse", "better"
DECISIONS = (INSUFFICIENT, UNDECIDED, WORSE, NOT_WORSE, BETTER)  # index = the code ``evaluate`` returns


@dataclass(frozen=True)
class Counts:
    """Cumulative counts of one version: ``n`` observations (trials), their ``total`` (successes),
    and for a mean of unbounded values the sum of their squares."""

    n: float
    total: float
    squares: float | None = None

    @classmethod
    def rate(cls, successes: float, trials: float) -> Counts:
        return cls(n=trials, total=successes)

    def __add__(self, other: Counts) -> Counts:
        squares = None if self.squares is None or other.squares is None else self.squares + other.squares
        return Counts(self.n + other.n, self.total + other.total, squares)

    def as_status(self) -> dict[str, float]:
        out = {"n": self.n, "sum": self.total}
        return out if self.squares is None else {**out, "squares": self.squares}

    @classmethod
    def from_status(cls, raw: Mapping[str, Any]) -> Counts:
        squares = raw.get("squares")
        return cls(float(raw.get("n", 0.0)), float(raw.get("sum", 0.0)), None if squares is None else float(squares))


@dataclass(frozen=True)
class SequentialTest:
    """How to compare: on what, which way is better, by how much canary may trail, how sure."""

    kind: Kind = "rate"  # rate: successes / trials, each 0 or 1; mean: any value
    margin: float = 0.0  # delta: how far canary may trail stable and still be "not worse"
    confidence: float = 0.95  # of the whole sequence of intervals, across every look
    direction: Direction = "higher"  # which way is better
    relative: bool = False  # compare canary / stable - 1 instead of canary - stable (margin relative too)
    min_samples: int = 100  # per version (and per stratum) before any decision
    effect: float | None = None  # the mixture's scale: the difference the test is quickest on (default margin)
    bounds: tuple[float, float] | None = None  # mean: the values' range, a variance without squares

    def __post_init__(self) -> None:
        def bad(field: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"{field}: {value!r} is not valid; valid: {valid}")

        if self.kind not in ("rate", "mean"):
            raise bad("kind", self.kind, "rate or mean")
        if self.direction not in ("higher", "lower"):
            raise bad("direction", self.direction, "higher or lower (which way is better)")
        if not 0.5 <= self.confidence < 1:
            raise bad("confidence", self.confidence, "at least 0.5 and below 1, e.g. 0.95")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise bad("margin", self.margin, "a finite number >= 0, in the metric's units (a fraction if relative)")
        if self.effect is not None and not (math.isfinite(self.effect) and self.effect > 0):
            raise bad("effect", self.effect, "a finite number > 0")
        if self.effect is None and self.margin == 0:
            raise ValueError("effect: required when margin is 0 (the size of difference the test should detect "
                             "soonest, e.g. 0.01 for a conversion rate)")
        if not (isinstance(self.min_samples, int) and self.min_samples >= 2):
            raise bad("min_samples", self.min_samples, "an integer >= 2")
        if self.bounds is not None:
            lo, hi = self.bounds
            if self.kind == "rate" or not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                raise bad("bounds", self.bounds, "(low, high) with low < high, for kind mean only")

    @property
    def alpha(self) -> float:
        return 1.0 - self.confidence

    def mixture_variance(self, comparisons: int = 1) -> float:
        """tau^2 of the normal mixture: the interval is tightest when its half-width is ``effect``.
        Half-width at variance V is tightest at V* = tau^2 / r with r = 2 log(1/a) + log(1 + r),
        where it is sqrt(V* (1 + r)); setting that to ``effect`` gives tau^2 = effect^2 r / (1 + r)."""
        two_l = 2 * math.log(comparisons / self.alpha)
        r = two_l
        for _ in range(50):
            r = two_l + math.log1p(r)
        scale = self.effect if self.effect is not None else self.margin
        return scale * scale * r / (1 + r)


@dataclass(frozen=True)
class Evaluation:
    """Arrays of one shape: the estimate of canary - stable, the interval, the decision's code
    (an index into ``DECISIONS``); NaN where the decision is insufficient."""

    estimate: Array
    lower: Array
    upper: Array
    decision: Array


def _arm(test: SequentialTest, n: Array, total: Array, squares: Array) -> tuple[Array, Array]:
    """(mean, variance of the mean) of one version; NaN where the counts cannot give them. With
    bounds (a rate's are 0 and 1) the variance counts one more observation at each bound, as
    Agresti-Caffo do, so no count makes it 0."""
    with np.errstate(all="ignore"):
        ok = np.isfinite(n) & np.isfinite(total) & (n >= test.min_samples)
        mean = total / n
        if test.kind == "rate":
            ok &= (total >= 0) & (total <= n)
            p = (total + 1) / (n + 2)
            var = p * (1 - p)
        else:
            lo, hi = test.bounds if test.bounds is not None else (0.0, 0.0)
            extra = 0 if test.bounds is None else 2
            n2, s2, q2 = n + extra, total + lo + hi, squares + lo * lo + hi * hi
            var = np.maximum(q2 - s2 * s2 / n2, 0.0) / (n2 - 1)
            if test.bounds is not None:
                ok &= (mean >= lo) & (mean <= hi)
                centre = s2 / n2
                var = np.where(np.isfinite(squares), var, (hi - centre) * (centre - lo))  # Bhatia-Davis
            ok &= np.isfinite(var) & (var > 0)
        return np.where(ok, mean, np.nan), np.where(ok, var / n, np.nan)


def _difference(test: SequentialTest, canary: tuple[Array, Array],
                stable: tuple[Array, Array]) -> tuple[Array, Array]:
    (mc, vc), (ms, vs) = canary, stable
    with np.errstate(all="ignore"):
        if not test.relative:
            return mc - ms, vc + vs
        ratio = mc / ms  # delta method: Var(mc/ms) ~ (vc + ratio^2 vs) / ms^2
        ok = ms > 0
        return np.where(ok, ratio - 1, np.nan), np.where(ok, (vc + ratio * ratio * vs) / (ms * ms), np.nan)


def evaluate(test: SequentialTest, canary: tuple[Array, Array, Array], stable: tuple[Array, Array, Array],
             comparisons: int = 1) -> Evaluation:
    """Vectorized: each version is (n, total, squares) arrays (squares NaN where there are none) of
    one shape whose first axis is the strata; the strata are combined by inverse variance."""
    est, var = _difference(test, _arm(test, *map(_floats, canary)), _arm(test, *map(_floats, stable)))
    usable = np.isfinite(est) & np.isfinite(var) & (var > 0)
    with np.errstate(all="ignore"):
        weight = np.where(usable, 1.0 / np.where(usable, var, 1.0), 0.0)
        total_weight = weight.sum(axis=0)
        ok = total_weight > 0
        estimate = np.where(ok, (weight * np.where(usable, est, 0.0)).sum(axis=0) / total_weight, np.nan)
        variance = np.where(ok, 1.0 / total_weight, np.nan)
        half = half_width(variance, test.alpha / comparisons, test.mixture_variance(comparisons))
    lower, upper = estimate - half, estimate + half
    return Evaluation(estimate, lower, upper, _decide(test, lower, upper, ok))


def half_width(variance: Array, alpha: float, tau2: float) -> Array:
    """The normal mixture boundary: |estimate - difference| stays below this at every look with
    probability 1 - alpha, for an estimate of that variance (Robbins; Howard et al.)."""
    with np.errstate(all="ignore"):
        return np.sqrt(variance * (1 + variance / tau2) * (2 * math.log(1 / alpha) + np.log1p(tau2 / variance)))


def _decide(test: SequentialTest, lower: Array, upper: Array, ok: Array) -> Array:
    """worse beyond the margin, better than stable, not worse beyond the margin, or undecided."""
    d = test.margin
    if test.direction == "higher":
        worse, better, not_worse = upper < -d, lower > 0, lower > -d
    else:
        worse, better, not_worse = lower > d, upper < 0, upper < d
    code = np.select([~ok, worse, better, not_worse], [0, 2, 4, 3], default=1)
    return code.astype(np.int8)


def _floats(values: Any) -> Array:
    return np.asarray(values, dtype=np.float64)


@dataclass(frozen=True)
class Comparison:
    """One look: the decision and its evidence, as the status shows it."""

    decision: str
    estimate: float | None  # canary - stable (relative: canary / stable - 1)
    lower: float | None
    upper: float | None
    canary_mean: float | None
    stable_mean: float | None
    canary_n: float
    stable_n: float
    confidence: float  # of this comparison (the configured one, split over comparisons)
    message: str

    @property
    def must_roll_back(self) -> bool:
        return self.decision == WORSE

    @property
    def may_advance(self) -> bool:
        """Not worse beyond the margin (better is a stronger not-worse)."""
        return self.decision in (NOT_WORSE, BETTER)

    def as_status(self) -> dict[str, Any]:
        def show(x: float | None) -> float | None:
            return None if x is None else float(f"{x:.6g}")

        return {"decision": self.decision, "estimate": show(self.estimate), "lower": show(self.lower),
                "upper": show(self.upper), "confidence": show(self.confidence),
                "canary": {"n": self.canary_n, "mean": show(self.canary_mean)},
                "stable": {"n": self.stable_n, "mean": show(self.stable_mean)}, "message": self.message}


def compare(test: SequentialTest, canary: Counts | Sequence[Counts], stable: Counts | Sequence[Counts],
            comparisons: int = 1) -> Comparison:
    """Canary against stable at one look. Several ``Counts`` per version are strata (the same
    number for both, in the same order); ``comparisons`` splits the error rate (Bonferroni) when
    several challengers are compared with one stable."""
    cs = [canary] if isinstance(canary, Counts) else list(canary)
    ss = [stable] if isinstance(stable, Counts) else list(stable)
    if len(cs) != len(ss) or not cs:
        raise ValueError(f"canary has {len(cs)} strata and stable {len(ss)}: give the same number, at least one")
    if not (isinstance(comparisons, int) and comparisons >= 1):
        raise ValueError(f"comparisons: {comparisons!r} is not valid; valid: an integer >= 1")

    def arrays(counts: list[Counts]) -> tuple[Array, Array, Array]:
        return (_floats([c.n for c in counts]), _floats([c.total for c in counts]),
                _floats([math.nan if c.squares is None else c.squares for c in counts]))

    ev = evaluate(test, arrays(cs), arrays(ss), comparisons)
    decision = DECISIONS[int(ev.decision)]
    value = {name: _finite(float(getattr(ev, name))) for name in ("estimate", "lower", "upper")}
    nc, ns = _finite_sum([c.n for c in cs]), _finite_sum([c.n for c in ss])
    out = Comparison(decision, value["estimate"], value["lower"], value["upper"], _pooled_mean(cs), _pooled_mean(ss),
                     nc, ns, 1 - test.alpha / comparisons, "")
    message = _insufficient(test, cs, ss) if decision == INSUFFICIENT else _summary(test, out)
    return replace(out, message=message)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _finite_sum(values: list[float]) -> float:
    return float(sum(v for v in values if math.isfinite(v)))


def _pooled_mean(counts: list[Counts]) -> float | None:
    n, total = sum(c.n for c in counts), sum(c.total for c in counts)
    return total / n if math.isfinite(n) and math.isfinite(total) and n > 0 else None


def _summary(test: SequentialTest, c: Comparison) -> str:
    what = "canary/stable - 1" if test.relative else "canary - stable"
    d = test.margin
    if test.direction == "higher":
        rule = {WORSE: f"upper bound < {-d:g}", BETTER: "lower bound > 0", NOT_WORSE: f"lower bound > {-d:g}"}
    else:
        rule = {WORSE: f"lower bound > {d:g}", BETTER: "upper bound < 0", NOT_WORSE: f"upper bound < {d:g}"}
    verdict = {WORSE: "worse beyond the margin", BETTER: "better than stable",
               NOT_WORSE: "not worse beyond the margin"}
    said = f"{verdict[c.decision]} ({rule[c.decision]})" if c.decision in rule else "undecided: holding"
    return (f"{what} = {c.estimate:+.4g}, {c.confidence:.4g} always-valid interval [{c.lower:+.4g}, "
            f"{c.upper:+.4g}], {test.direction} is better: {said}")


def _insufficient(test: SequentialTest, cs: list[Counts], ss: list[Counts]) -> str:
    """Why no stratum could be compared, for the status."""
    for who, counts in (("canary", cs), ("stable", ss)):
        for c in counts:
            numbers = (c.n, c.total, 0.0 if c.squares is None else c.squares)
            if not all(math.isfinite(x) for x in numbers) or c.n < 0 or (test.kind == "rate" and c.total < 0):
                return f"{who}: counts {c.as_status()} are not finite non-negative numbers"
            if test.kind == "rate" and c.total > c.n:
                return f"{who}: {c.total:g} successes out of {c.n:g} trials"
            if test.bounds is not None and c.n > 0 and not test.bounds[0] <= c.total / c.n <= test.bounds[1]:
                return f"{who}: mean {c.total / c.n:g} is outside bounds {test.bounds}"
            if test.kind == "mean" and c.squares is None and test.bounds is None and c.n >= test.min_samples:
                return (f"{who}: no sum of squares and no bounds: the variance of a mean is unknown (export the "
                        "squares, or set bounds for values in a known range)")
    most_c, most_s = max(c.n for c in cs), max(s.n for s in ss)
    if min(most_c, most_s) < test.min_samples:
        return (f"{most_c:g} canary and {most_s:g} stable observations: the test starts at {test.min_samples} each "
                "(minSamples)")
    if test.relative:
        return "stable's mean is not above 0 (or no variation yet): no relative difference"
    return "no variation yet: every value is the same, so the variance is unknown"


def add_interval(strata: Sequence[Mapping[str, Any]], step: int, canary: Counts,
                 stable: Counts) -> list[dict[str, Any]]:
    """The strata as the status keeps them (``[{"step", "canary", "stable"}]``, in step order) with
    one interval's counter deltas added to the stratum of ``step``."""
    out = [dict(s) for s in strata]
    for s in out:
        if s.get("step") == step:
            s["canary"] = (Counts.from_status(s.get("canary", {})) + canary).as_status()
            s["stable"] = (Counts.from_status(s.get("stable", {})) + stable).as_status()
            return out
    return sorted([*out, {"step": step, "canary": canary.as_status(), "stable": stable.as_status()}],
                  key=lambda s: int(s.get("step", 0)))


def strata_counts(strata: Sequence[Mapping[str, Any]]) -> tuple[list[Counts], list[Counts]]:
    """Canary and stable ``Counts`` per stratum, for ``compare``; at least one (empty) stratum."""
    if not strata:
        return [Counts(0.0, 0.0)], [Counts(0.0, 0.0)]
    return ([Counts.from_status(s.get("canary", {})) for s in strata],
            [Counts.from_status(s.get("stable", {})) for s in strata])


def winner(results: Mapping[str, Comparison], direction: Direction = "higher") -> str | None:
    """The challenger to promote from an A/B test: among those ``better`` than stable (each compared
    with ``comparisons`` = the number of challengers), the one whose interval is furthest on the good
    side. None: keep stable."""
    better = {name: c for name, c in results.items() if c.decision == BETTER}
    if not better:
        return None
    if direction == "higher":
        return max(better, key=lambda name: better[name].lower or 0.0)
    return min(better, key=lambda name: better[name].upper or 0.0)
