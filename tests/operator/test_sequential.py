"""The sequential comparison with stable, by simulation: 2,000 seeded runs per scenario, each looked
at after every one of 40 intervals, as the operator looks. Claims that are false (worse when the
canary is at or above the margin, not-worse when it is at or below) are made at most at the
nominal rate; the power is what docs/SEQUENTIAL.md says; a fixed-horizon z-test looked at as often
fails the same check. Then the edges: no counts, n = 1, all successes, bad numbers."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from rollout_operator.sequential import (BETTER, DECISIONS, INSUFFICIENT, NOT_WORSE, UNDECIDED, WORSE, Comparison,
                                         Counts, SequentialTest, add_interval, compare, evaluate, half_width,
                                         strata_counts, winner)

RUNS, LOOKS = 2000, 40
ALPHA = 0.05
TOLERANCE = 3 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)  # three simulation standard errors at alpha
DOC = Path(__file__).resolve().parents[2] / "docs" / "SEQUENTIAL.md"

Arm = tuple[np.ndarray, np.ndarray, np.ndarray]  # cumulative (n, total, squares), each (RUNS, LOOKS)


def looks(per_look: int) -> np.ndarray:
    return np.broadcast_to(np.arange(1, LOOKS + 1, dtype=float) * per_look, (RUNS, LOOKS))


def bernoulli(per_look: int, p: float) -> Callable[[np.random.Generator], Arm]:
    """Conversions (or correct answers) out of ``per_look`` requests per interval."""
    def draw(rng: np.random.Generator) -> Arm:
        total = rng.binomial(per_look, p, (RUNS, LOOKS)).cumsum(axis=1).astype(float)
        return looks(per_look), total, np.full((RUNS, LOOKS), np.nan)  # no squares: a rate needs none
    return draw


def revenue(per_look: int, mean: float, buy: float = 0.1) -> Callable[[np.random.Generator], Arm]:
    """Revenue per request: nothing 90% of the time, else an exponential amount (skewed, unbounded:
    standard deviation ~4.4x the mean). Drawn one look at a time to stay in cache."""
    def draw(rng: np.random.Generator) -> Arm:
        buyers = rng.binomial(per_look, buy, (LOOKS, RUNS))
        sums, squares = np.zeros((LOOKS, RUNS)), np.zeros((LOOKS, RUNS))
        for k in range(LOOKS):
            x = rng.exponential(mean / buy, int(buyers[k].sum()))
            starts = np.minimum(np.concatenate([[0], buyers[k].cumsum()[:-1]]), max(len(x) - 1, 0))
            some = buyers[k] > 0
            sums[k] = np.where(some, np.add.reduceat(x, starts), 0.0)
            sq = np.square(x, out=x)
            squares[k] = np.where(some, np.add.reduceat(sq, starts), 0.0)
        return looks(per_look), sums.T.cumsum(axis=1), squares.T.cumsum(axis=1)
    return draw


@dataclass(frozen=True)
class Scenario:
    test: SequentialTest
    canary: Callable[[np.random.Generator], Arm]
    stable: Callable[[np.random.Generator], Arm]
    truth: float  # canary - stable (relative: canary / stable - 1)
    seed: int


@dataclass(frozen=True)
class Outcome:
    worse: float  # fraction of runs that ever said worse
    not_worse: float
    better: float
    median_look: float | None  # of the first worse (or not-worse, whichever is the truth), among runs reaching it
    naive_worse: float  # a one-sided fixed-horizon z-test at alpha, looked at every interval


CONVERSION = SequentialTest(kind="rate", margin=0.01)  # conversion 10%; 600 canary / 2,400 stable per look
REVENUE = SequentialTest(kind="mean", margin=0.5)  # revenue 5.0 per request; 1,000 / 4,000 per look
ACCURACY = SequentialTest(kind="mean", margin=0.01, bounds=(0.0, 1.0))  # 0/1 feedback, no squares exported
COMPLAINTS = SequentialTest(kind="rate", margin=0.005, direction="lower")  # complaint rate 5%, lower is better
RELATIVE = SequentialTest(kind="rate", margin=0.1, relative=True)  # canary may trail by 10% of stable
A_A = SequentialTest(kind="rate", margin=0.0, effect=0.01)  # margin 0: any detectable loss is "worse"


def conversion(p: float) -> tuple[Callable[[np.random.Generator], Arm], Callable[[np.random.Generator], Arm]]:
    return bernoulli(600, p), bernoulli(2400, 0.10)


def money(mean: float) -> tuple[Callable[[np.random.Generator], Arm], Callable[[np.random.Generator], Arm]]:
    return revenue(1000, mean), revenue(4000, 5.0)


SCENARIOS = {
    "conversion, canary = stable": Scenario(CONVERSION, *conversion(0.10), 0.0, 11),
    "conversion, at the margin": Scenario(CONVERSION, *conversion(0.09), -0.01, 12),
    "conversion, 1.5 x margin worse": Scenario(CONVERSION, *conversion(0.085), -0.015, 13),
    "conversion, 2 x margin worse": Scenario(CONVERSION, *conversion(0.08), -0.02, 14),
    "conversion, margin 0, canary = stable": Scenario(A_A, *conversion(0.10), 0.0, 15),
    "revenue, canary = stable": Scenario(REVENUE, *money(5.0), 0.0, 21),
    "revenue, at the margin": Scenario(REVENUE, *money(4.5), -0.5, 22),
    "revenue, 1.5 x margin worse": Scenario(REVENUE, *money(4.25), -0.75, 23),
    "revenue, 2 x margin worse": Scenario(REVENUE, *money(4.0), -1.0, 24),
    "accuracy (bounds, no squares), at the margin": Scenario(ACCURACY, bernoulli(600, 0.89), bernoulli(2400, 0.90),
                                                             -0.01, 31),
    "complaints (lower is better), at the margin": Scenario(COMPLAINTS, bernoulli(600, 0.055),
                                                            bernoulli(2400, 0.05), 0.005, 32),
    "conversion relative, at the margin": Scenario(RELATIVE, *conversion(0.09), -0.1, 33),
}

def stack(arm: Arm) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return arm[0][None], arm[1][None], arm[2][None]  # one stratum


def naive_worse(test: SequentialTest, canary: Arm, stable: Arm) -> np.ndarray:
    """What a fixed-horizon one-sided z-test at alpha says at each look: worse beyond the margin."""
    def moments(arm: Arm) -> tuple[np.ndarray, np.ndarray]:
        n, total, squares = arm
        mean = total / n
        var = mean * (1 - mean) if test.kind == "rate" or test.bounds else squares / n - mean * mean
        return mean, var / n

    (mc, vc), (ms, vs) = moments(canary), moments(stable)
    z = NormalDist().inv_cdf(1 - test.alpha)
    if test.relative:
        diff, se = mc / ms - 1, np.sqrt(vc + (mc / ms) ** 2 * vs) / ms
    else:
        diff, se = mc - ms, np.sqrt(vc + vs)
    if test.direction == "higher":
        return diff + z * se < -test.margin
    return diff - z * se > test.margin


@functools.cache
def outcome(name: str) -> Outcome:
    sc = SCENARIOS[name]
    rng = np.random.default_rng(sc.seed)
    canary, stable = sc.canary(rng), sc.stable(rng)
    codes = evaluate(sc.test, stack(canary), stack(stable)).decision
    said = {d: (codes == DECISIONS.index(d)) for d in (WORSE, NOT_WORSE, BETTER)}
    truth = said[WORSE] if bad_by(sc) > sc.test.margin else said[NOT_WORSE]
    first = truth.argmax(axis=1)[truth.any(axis=1)] + 1
    return Outcome(said[WORSE].any(axis=1).mean(), said[NOT_WORSE].any(axis=1).mean(),
                   said[BETTER].any(axis=1).mean(), float(np.median(first)) if first.size else None,
                   naive_worse(sc.test, canary, stable).any(axis=1).mean())


def bad_by(sc: Scenario) -> float:
    """How much worse than stable the canary truly is (positive: worse)."""
    return -sc.truth if sc.test.direction == "higher" else sc.truth


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_false_claims_stay_at_the_nominal_rate_when_looked_at_every_interval(name: str) -> None:
    sc, out = SCENARIOS[name], outcome(name)
    margin, bad = sc.test.margin, bad_by(sc)
    if bad <= margin + 1e-12:  # not worse beyond the margin: saying worse is a false alarm
        assert out.worse <= ALPHA + TOLERANCE, out
    if bad >= margin - 1e-12:  # at or beyond the margin: saying not-worse is a false pass
        assert out.not_worse <= ALPHA + TOLERANCE, out
    if bad >= 0:
        assert out.better <= ALPHA + TOLERANCE, out


@pytest.mark.parametrize("name", [n for n in SCENARIOS if "at the margin" in n or "margin 0" in n])
def test_a_fixed_horizon_z_test_looked_at_every_interval_raises_false_alarms(name: str) -> None:
    """The contrast: the same data, the same looks, a z-test at the same alpha. Proof that the
    false-alarm check above can fail."""
    out = outcome(name)
    assert out.naive_worse > 3 * ALPHA, out
    assert out.worse <= ALPHA + TOLERANCE, out


def documented(name: str) -> list[str]:
    """The cells of the row of docs/SEQUENTIAL.md's simulation table that starts with ``name``."""
    rows = [line for line in DOC.read_text().splitlines() if line.startswith(f"| {name} |")]
    assert len(rows) == 1, f"docs/SEQUENTIAL.md has {len(rows)} rows for {name!r}"
    return [cell.strip() for cell in rows[0].strip("|").split("|")][1:]


def percent(cell: str) -> float:
    return float(cell.rstrip("%")) / 100


def close(measured: float, doc: float) -> bool:
    """Within three simulation standard errors (and the doc's rounding to 0.1%)."""
    return abs(measured - doc) <= 3 * math.sqrt(max(doc * (1 - doc), 1e-4) / RUNS) + 0.0005


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_power_and_error_rates_are_what_the_docs_say(name: str) -> None:
    out = outcome(name)
    worse, not_worse, median, naive = documented(name)
    assert close(out.worse, percent(worse)) and close(out.not_worse, percent(not_worse)), (out, worse, not_worse)
    assert close(out.naive_worse, percent(naive)), (out, naive)
    if median != "-":
        assert out.median_look is not None and abs(out.median_look - float(median)) <= 1, (out, median)


def ramp(rng: np.random.Generator, early: int, late: int) -> Arm:
    """Per-step strata of one version: ``early`` requests per look at 12% conversion for the first
    half, then ``late`` per look at 8% (stratum 0, frozen once its step ends; stratum 1 after)."""
    half = LOOKS // 2
    first = rng.binomial(early, 0.12, (RUNS, half)).cumsum(axis=1)
    second = rng.binomial(late, 0.08, (RUNS, LOOKS - half)).cumsum(axis=1)
    steps = np.arange(1, LOOKS + 1)
    n0 = np.minimum(steps, half) * early
    n1 = np.maximum(steps - half, 0) * late
    t0 = np.concatenate([first, np.repeat(first[:, -1:], LOOKS - half, axis=1)], axis=1)
    t1 = np.concatenate([np.zeros((RUNS, half)), second], axis=1)
    n = np.stack([np.broadcast_to(n0, (RUNS, LOOKS)), np.broadcast_to(n1, (RUNS, LOOKS))]).astype(float)
    return n, np.stack([t0, t1]).astype(float), np.full(n.shape, np.nan)


def test_strata_per_step_keep_a_ramp_over_a_drifting_base_rate_honest() -> None:
    """Canary = stable all along, but conversion falls from 12% to 8% when the canary goes from 5%
    to 50% of traffic: pooled counts weigh the canary's late (low) hours more than stable's, and
    look worse; per-step strata compare like with like."""
    rng = np.random.default_rng(41)
    canary, stable = ramp(rng, 150, 1500), ramp(rng, 2850, 1500)
    def pool(arm: Arm) -> Arm:
        n, total, squares = (a.sum(axis=0, keepdims=True) for a in arm)
        return n, total, squares

    pooled = evaluate(CONVERSION, pool(canary), pool(stable))
    stratified = evaluate(CONVERSION, canary, stable)
    worse = DECISIONS.index(WORSE)
    assert (pooled.decision == worse).any(axis=1).mean() > 0.5
    assert (stratified.decision == worse).any(axis=1).mean() <= ALPHA + TOLERANCE


AB = SequentialTest(kind="rate", margin=0.0, effect=0.01)


def test_an_ab_test_splits_alpha_over_its_challengers() -> None:
    """Stable and three challengers at 25% each (750 requests per arm per look), every challenger
    compared with stable at alpha / 3: when none is better, a winner is named at most at alpha;
    when one converts 11% instead of 10%, it is found (the figure docs/SEQUENTIAL.md gives)."""
    rng = np.random.default_rng(51)
    stable = bernoulli(750, 0.10)(rng)
    same = [bernoulli(750, 0.10)(rng) for _ in range(3)]
    better_code = DECISIONS.index(BETTER)

    def ever_better(arm: Arm) -> np.ndarray:
        return (evaluate(AB, stack(arm), stack(stable), comparisons=3).decision == better_code).any(axis=1)

    false_winner = np.any([ever_better(c) for c in same], axis=0).mean()
    assert false_winner <= ALPHA + TOLERANCE
    found = ever_better(bernoulli(750, 0.11)(rng)).mean()
    assert close(found, percent(documented("A/B, one of three challengers 11% vs 10%")[0])), found


def test_winner_is_the_better_challenger_furthest_from_stable() -> None:
    def said(decision: str, lower: float, upper: float) -> Comparison:
        return Comparison(decision, (lower + upper) / 2, lower, upper, None, None, 1000, 1000, 0.98, "")

    results = {"b": said(BETTER, 0.001, 0.02), "c": said(BETTER, 0.004, 0.01), "d": said(NOT_WORSE, -0.001, 0.03)}
    assert winner(results) == "c"
    assert winner({"d": results["d"]}) is None
    assert winner({"b": said(BETTER, -0.03, -0.006), "c": said(BETTER, -0.01, -0.004)}, direction="lower") == "b"


def test_compare_says_what_the_vectorized_evaluation_says() -> None:
    rng = np.random.default_rng(61)
    canary, stable = revenue(1000, 4.6)(rng), revenue(4000, 5.0)(rng)
    ev = evaluate(REVENUE, stack(canary), stack(stable))
    for run in range(40):
        look = run % LOOKS
        got = compare(REVENUE, Counts(*(float(a[run, look]) for a in canary)),
                      Counts(*(float(a[run, look]) for a in stable)))
        assert got.decision == DECISIONS[ev.decision[run, look]]
        assert got.estimate == pytest.approx(ev.estimate[run, look])
        assert (got.lower, got.upper) == pytest.approx((ev.lower[run, look], ev.upper[run, look]))


def test_strata_given_to_compare_combine_by_inverse_variance() -> None:
    early, late = (Counts.rate(1200, 10000), Counts.rate(1150, 10000)), (Counts.rate(800, 10000), Counts.rate(820, 10000))
    both = compare(CONVERSION, [early[0], late[0]], [early[1], late[1]])
    one, two = compare(CONVERSION, early[0], early[1]), compare(CONVERSION, late[0], late[1])
    assert both.estimate is not None and one.estimate is not None and two.estimate is not None
    assert min(one.estimate, two.estimate) < both.estimate < max(one.estimate, two.estimate)
    assert both.canary_n == 20000 and both.canary_mean == pytest.approx(0.1)
    assert both.upper - both.lower < min(one.upper - one.lower, two.upper - two.lower)  # type: ignore[operator]


def test_the_mixture_is_tuned_so_the_interval_is_tightest_where_it_reaches_the_margin() -> None:
    """At the variance where the half-width equals the margin, no other mixture is narrower."""
    tau2 = CONVERSION.mixture_variance()
    target = np.array([1.0])
    lo, hi = 1e-9, 1e-3  # the variance at which the half-width is the margin, by bisection
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if half_width(target * mid, ALPHA, tau2)[0] < CONVERSION.margin else (lo, mid)
    v = target * lo
    best = half_width(v, ALPHA, tau2)[0]
    assert best == pytest.approx(CONVERSION.margin, rel=1e-6)
    for k in (0.5, 0.8, 1.25, 2.0):
        assert half_width(v, ALPHA, tau2 * k)[0] > best


NAN, INF = math.nan, math.inf
EDGES = [
    (CONVERSION, Counts.rate(0, 0), Counts.rate(0, 0), INSUFFICIENT, "the test starts at 100 each"),
    (CONVERSION, Counts.rate(1, 1), Counts.rate(0, 1), INSUFFICIENT, "1 canary and 1 stable"),
    (CONVERSION, Counts.rate(99, 99), Counts.rate(9000, 90000), INSUFFICIENT, "99 canary"),
    (CONVERSION, Counts.rate(0, 5000), Counts.rate(0, 5000), NOT_WORSE, ""),  # no conversion at all: finite
    (CONVERSION, Counts.rate(5000, 5000), Counts.rate(20000, 20000), NOT_WORSE, ""),  # all successes
    (CONVERSION, Counts.rate(0, 5000), Counts.rate(5000, 5000), WORSE, ""),
    (CONVERSION, Counts.rate(1e11, 1e12), Counts.rate(1e11, 1e12), NOT_WORSE, ""),  # huge counts
    (CONVERSION, Counts.rate(NAN, 100), Counts.rate(10, 100), INSUFFICIENT, "not finite"),
    (CONVERSION, Counts.rate(10, INF), Counts.rate(10, 100), INSUFFICIENT, "not finite"),
    (CONVERSION, Counts.rate(-1, 500), Counts.rate(10, 500), INSUFFICIENT, "not finite non-negative"),
    (CONVERSION, Counts.rate(600, 500), Counts.rate(10, 500), INSUFFICIENT, "600 successes out of 500"),
    (REVENUE, Counts(1, 5.0, 25.0), Counts(1, 5.0, 25.0), INSUFFICIENT, "the test starts at 100"),
    (REVENUE, Counts(500, 2500.0), Counts(500, 2500.0), INSUFFICIENT, "no sum of squares and no bounds"),
    (REVENUE, Counts(500, 0.0, 0.0), Counts(500, 0.0, 0.0), INSUFFICIENT, "no variation yet"),
    # squares below sum^2 / n (inconsistent, or float rounding of equal values): variance 0, no decision
    (REVENUE, Counts(500, 2500.0, 1.0), Counts(500, 2500.0, 1.0), INSUFFICIENT, "no variation yet"),
    (ACCURACY, Counts(500, 500.0), Counts(500, 500.0), NOT_WORSE, ""),  # every answer right, bounded
    (ACCURACY, Counts(500, 600.0), Counts(500, 400.0), INSUFFICIENT, "mean 1.2 is outside bounds (0.0, 1.0)"),
    (RELATIVE, Counts.rate(0, 1000), Counts.rate(0, 1000), INSUFFICIENT, "stable's mean is not above 0"),
    (RELATIVE, Counts.rate(100, 1000), Counts.rate(0, 1000), INSUFFICIENT, "stable's mean is not above 0"),
]


@pytest.mark.parametrize("test, canary, stable, decision, says", EDGES)
def test_edge_counts_give_a_decision_with_finite_numbers_and_never_raise(
        test: SequentialTest, canary: Counts, stable: Counts, decision: str, says: str) -> None:
    got = compare(test, canary, stable)
    assert got.decision == decision, got
    assert says in got.message, got.message
    status = got.as_status()
    json.dumps(status, allow_nan=False)  # raises on NaN or infinity
    if decision == INSUFFICIENT:
        assert status["estimate"] is None and status["lower"] is None and not got.may_advance
    else:
        assert status["lower"] <= status["estimate"] <= status["upper"]
        assert got.must_roll_back == (decision == WORSE) and got.may_advance == (decision != WORSE)


@pytest.mark.parametrize("fields, says", [
    ({"kind": "ratio"}, "kind: 'ratio' is not valid; valid: rate or mean"),
    ({"direction": "up"}, "direction: 'up'"),
    ({"confidence": 95}, "confidence: 95"),
    ({"margin": -0.01}, "margin: -0.01"),
    ({"margin": NAN}, "margin: nan"),
    ({"margin": 0.0}, "effect: required when margin is 0"),
    ({"effect": 0.0}, "effect: 0.0"),
    ({"min_samples": 1}, "min_samples: 1"),
    ({"bounds": (1.0, 0.0), "kind": "mean"}, "bounds: (1.0, 0.0)"),
    ({"bounds": (0.0, 1.0)}, "for kind mean only"),
])
def test_a_bad_configuration_names_the_field_and_what_is_valid(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        SequentialTest(**{"margin": 0.01, **fields})  # type: ignore[arg-type]


def test_compare_refuses_mismatched_strata_and_comparisons() -> None:
    with pytest.raises(ValueError, match="canary has 2 strata and stable 1"):
        compare(CONVERSION, [Counts.rate(1, 2)] * 2, [Counts.rate(1, 2)])
    with pytest.raises(ValueError, match="comparisons: 0"):
        compare(CONVERSION, Counts.rate(1, 2), Counts.rate(1, 2), comparisons=0)


def test_counts_accumulate_interval_deltas_and_round_trip_through_the_status() -> None:
    total = Counts(100, 250.0, 900.0) + Counts(50, 100.0, 300.0)
    assert total == Counts(150, 350.0, 1200.0)
    assert (Counts.rate(3, 10) + Counts.rate(2, 10)).squares is None
    assert Counts.from_status(json.loads(json.dumps(total.as_status()))) == total
    assert Counts.from_status(Counts.rate(3, 10).as_status()) == Counts.rate(3, 10)


def test_the_decision_is_one_of_the_documented_names() -> None:
    assert set(DECISIONS) == {INSUFFICIENT, UNDECIDED, WORSE, NOT_WORSE, BETTER}
    text = DOC.read_text()
    assert all(f"`{d}`" in text for d in DECISIONS)


def test_bonferroni_widens_each_interval() -> None:
    one = compare(AB, Counts.rate(1100, 10000), Counts.rate(1000, 10000))
    three = compare(AB, Counts.rate(1100, 10000), Counts.rate(1000, 10000), comparisons=3)
    assert three.confidence == pytest.approx(1 - ALPHA / 3)
    assert three.lower is not None and one.lower is not None and three.lower < one.lower
    assert replace(three, lower=one.lower).lower == one.lower  # a frozen dataclass, as the status copies it


def test_interval_deltas_accumulate_into_per_step_strata_that_survive_the_status() -> None:
    """What the operator keeps between reconciles: counts per step, each interval's deltas added."""
    strata: list[dict[str, object]] = []
    assert compare(CONVERSION, *strata_counts(strata)).decision == INSUFFICIENT
    for step, (c, s) in enumerate([((60, 600), (250, 2400)), ((40, 600), (240, 2400))]):
        for _ in range(10):
            strata = add_interval(strata, step, Counts.rate(*c), Counts.rate(*s))
    strata = json.loads(json.dumps(add_interval(strata, 0, Counts.rate(0, 0), Counts.rate(0, 0))))
    assert [s["step"] for s in strata] == [0, 1]
    assert strata[0]["canary"] == {"n": 6000, "sum": 600} and strata[1]["stable"] == {"n": 24000, "sum": 2400}
    canary, stable = strata_counts(strata)
    got = compare(CONVERSION, canary, stable)
    assert got.canary_n == 12000 and got.stable_n == 48000 and got.decision in (UNDECIDED, WORSE)
