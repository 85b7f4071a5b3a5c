"""A/B experiments (``spec.experiment``): a fixed split between stable and one or more challengers,
held until the sequential test of a ``compare: stable`` metric decides.

Each challenger is compared with stable at ``confidence`` split over the challengers (Bonferroni:
the chance that any challenger that is not better is called better stays below 1 - confidence).
The first look at which a challenger is ``better`` promotes the winner (``sequential.winner``: of
those better, the one whose interval lies furthest on the good side); when every challenger is
``worse``, or ``maxDuration`` passes without a winner, stable stays and takes all the traffic.
The challengers are guarded as a canary is: the analysis's threshold metrics (error rate, latency,
custom; judged once a challenger has ``minRequests`` in the interval, or on errors that break the
error rate's ``max`` even at minRequests) failing ``failureLimit`` looks
in a row, or an alert firing for a challenger, abort the experiment: stable takes all the traffic
back at once (phase RolledBack), and no challenger is promoted meanwhile.
The decision and its evidence stay in ``status.experiment`` while the spec names the experiment;
Events ``ExperimentStarted``, ``ExperimentConcluded`` and ``ExperimentAborted`` say what happened.

``decide`` is part of the pure state machine (``rollout.decide`` calls it); ``evaluate`` turns the
provider's samples into the look the state machine records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from . import comparisons
from .sequential import WORSE, Comparison, winner
from .spec import ModelDeploymentSpec
from .status import Phase, RolloutStatus, condition, iso, with_condition
from .verdicts import (FAIL, INCONCLUSIVE, PASS, Analysis, MetricResult, Sample, compare_result, decisive_errors,
                       guard_results)

if TYPE_CHECKING:
    from .rollout import Event, World

RUNNING, WINNER, NO_WINNER, ABORTED = "Running", "Winner", "NoWinner", "Aborted"


def running(status: RolloutStatus) -> bool:
    return bool(status.experiment) and (status.experiment or {}).get("state") == RUNNING


def challengers(spec: ModelDeploymentSpec, stable: str) -> list[str]:
    assert spec.experiment is not None
    return sorted(v for v in spec.experiment.weights if v != stable)


def evaluate(spec: ModelDeploymentSpec, status: RolloutStatus, samples: Mapping[str, Sample],
             now: float) -> Analysis:
    """One look: every challenger against stable on the experiment's metric, each at the
    confidence split over the challengers. ``Analysis.comparisons`` holds them by challenger."""
    assert spec.experiment is not None
    metric = spec.strategy.analysis.metric(spec.experiment.metric)
    assert metric is not None
    stable = status.stable_version or ""
    others = challengers(spec, stable)
    prior: dict[str, Any] = dict((status.experiment or {}).get("comparisons") or {})
    base = samples.get(stable)
    if base is None or base.error is not None:
        why = base.error if base is not None else "no sample"
        return Analysis(now, INCONCLUSIVE, (), None, f"no data: {why}", prior or None)
    results, found = [], {}
    for version in others:
        sample = samples.get(version)
        if sample is None or sample.error is not None:
            continue  # its counts stay as they were; judged again at the next look
        prior[version], found[version] = comparisons.look(
            metric, sample.counts.get(metric.name), base.counts.get(metric.name), sample.since_step, 0,
            prior.get(version), now, comparisons=len(others))
        results.append(compare_result(metric, found[version], f"{metric.name} {version} vs {stable}"))
    guards, breached, judged = _guards(spec, others, samples, base)
    # Promoted only once judged on its guards in this very look (never on missing data): a
    # challenger with too little traffic in the interval, or no sample of it, waits.
    guarded = any(not m.is_compare for m in spec.strategy.analysis.metrics_for(False))
    promotable = {v: c for v, c in found.items() if not guarded or v in judged}
    best = winner(promotable, metric.direction) if promotable else None
    unjudged = winner(found, metric.direction) if found and best is None else None
    lost = len(found) == len(others) and all(c.decision == WORSE for c in found.values())
    if breached:
        failed = [g for g in guards if g.verdict == FAIL]
        return Analysis(now, FAIL, (*results, *guards), None, f"{', '.join(breached)} breached a guard: " + "; ".join(
            f"{g.name} = {g.value:.4g} breached {g.threshold}" for g in failed if g.value is not None),
            prior or None, comparisons=found, breached=breached)
    verdict = PASS if best else FAIL if lost else INCONCLUSIVE
    message = f"{best} is better than {stable}" if best else \
        f"every challenger is worse than {stable}" if lost else \
        f"{unjudged} is better than {stable} but not judged on its guards in this look (fewer than " \
        "minRequests requests, or no sample): not promoted yet" if unjudged else "undecided"
    return Analysis(now, verdict, (*results, *guards), None, message, prior or None, comparisons=promotable,
                    breached=breached)


def _guards(spec: ModelDeploymentSpec, others: list[str], samples: Mapping[str, Sample], base: Sample,
            ) -> tuple[list[MetricResult], tuple[str, ...] | None, set[str]]:
    """Each challenger's threshold metrics, for those with minRequests in the interval (no verdict
    without evidence; with fewer, only an error rate its errors break even at minRequests); the
    challengers that failed one (None: none could be judged); and those judged that passed every one."""
    analysis = spec.strategy.analysis
    guards: list[MetricResult] = []
    judged, breached, passed = False, [], set()
    for version in others:
        sample = samples.get(version)
        if sample is None or sample.error is not None or sample.requests is None:
            continue
        checks = guard_results(analysis, version, sample, base)
        if sample.requests < analysis.min_requests:  # judged only on errors that break the rate at minRequests
            if not decisive_errors(analysis, sample, False):
                continue
            checks = [c for c in checks if c.name == f"error-rate ({version})" and c.verdict == FAIL]
        judged = judged or bool(checks)
        guards.extend(checks)
        if any(c.verdict == FAIL for c in checks):
            breached.append(version)
        elif checks and all(c.verdict == PASS for c in checks):
            passed.add(version)
    return guards, tuple(breached) if judged else None, passed


def decide(spec: ModelDeploymentSpec, st: RolloutStatus, world: World, analysis: Analysis | None, now: float,
           events: list[Event], pending: tuple[str, str, str] | None = None,
           written: Mapping[str, int] | None = None) -> RolloutStatus:
    """The experiment's next status: start it, give the split once every version is loaded, record
    each look, and conclude (promote the winner, or keep stable). ``pending``: the (reason,
    message, target) of an abort of this experiment decided but not recorded (a reconcile cut
    between its writes). ``written``: the weights the status this decision started from gave.
    Its duration runs only while every pod serves the split and it is not held (spec.paused, an
    invalid spec, a version not loaded on every pod): it never ends on less of it than asked."""
    from .rollout import Event, hold_unready, resumed, served_since

    exp = spec.experiment
    assert exp is not None and st.stable_version is not None
    stable, state = st.stable_version, dict(st.experiment or {})
    if state.get("key") != exp.key() or state.get("removed"):
        if stable not in exp.weights:
            return replace(st, phase=Phase.READY, message=f"experiment: stable {stable} is not one of "
                                                          f"experiment.weights ({', '.join(sorted(exp.weights))})")
        others = challengers(spec, stable)
        state = {"key": exp.key(), "metric": exp.metric, "weights": dict(exp.weights), "control": stable,
                 "state": RUNNING, "startedAt": iso(now), "comparisons": {}}
        events.append(Event("Normal", "ExperimentStarted", f"A/B test of {', '.join(others)} against {stable} on "
                                                            f"{exp.metric}: {_fmt(exp.weights)}"))
        st = replace(st, experiment=state, phase=Phase.PROGRESSING, rollout_started_at=now, step_started_at=None,
                     analysis={}, failures=0, canary_version=None, canary_file=None, canary_weight=0,
                     current_step=None, step_text="", shadow_percent=None, sequential=None, abort_reason=None,
                     step_served_at=None, paused_at=None)
    if state.get("state") != RUNNING:
        return st  # concluded: what it decided keeps serving while the spec names it
    if world.alert:  # even while a challenger still loads
        return _abort(st, state, f"alert {world.alert} is firing", now, events)
    if pending is not None:
        return _abort(st, state, pending[1], now, events)
    weights = hold_unready(exp.weights, st.weights, stable, world)
    if weights != dict(exp.weights):
        waiting = sorted(v for v in exp.weights if not world.ready(v))
        return replace(st, weights=weights, message=f"experiment: waiting for {', '.join(waiting) or 'the split'} "
                                                    "to load on every pod")
    if st.step_started_at is None:
        st = replace(st, weights=weights, step_started_at=now)  # the split is written
    st = served_since(st, written)  # its clock starts once every pod serves it
    held = spec.paused or any(not world.ready(v) for v in exp.weights)
    if held:
        st = replace(st, paused_at=st.paused_at or now)
    elif st.paused_at is not None:  # the time held does not count
        st = resumed(st, now)
    if analysis is not None:
        state["comparisons"] = analysis.sequential or state.get("comparisons") or {}
        state["checkedAt"] = iso(analysis.at)
        failures = st.failures + 1 if analysis.breached else 0 if analysis.breached is not None else st.failures
        st = replace(st, analysis=analysis.as_status(failures), experiment=state, failures=failures)
        if analysis.breached:
            if failures >= spec.strategy.analysis.failure_limit:
                return _abort(st, state, analysis.message, now, events)
            return replace(st, phase=Phase.PROGRESSING, message=f"experiment on {exp.metric}: {analysis.message} "
                                                                f"({failures}/{spec.strategy.analysis.failure_limit}"
                                                                " failed looks); no promotion meanwhile")
        if spec.paused:  # held (spec.paused, or an invalid spec): judged and guarded, never concluded
            return replace(st, phase=Phase.PROGRESSING, experiment=state,
                           message=f"experiment on {exp.metric} held: no conclusion meanwhile; " + _results(state))
        metric = spec.strategy.analysis.metric(exp.metric)
        direction = metric.direction if metric is not None else "higher"
        found = analysis.comparisons or {}
        best = winner(found, direction) if found else None
        if best is not None:
            return _promote(spec, st, state, best, found, now, events)
        if analysis.verdict == FAIL:
            return _keep_stable(st, state, "every challenger is worse than stable", now, events)
    if spec.paused:
        return replace(st, phase=Phase.PROGRESSING, experiment=state,
                       message=f"experiment on {exp.metric} held: no conclusion meanwhile; " + _results(state))
    if held:
        unready = "; ".join(f"{v}: {world.reasons.get(v, 'not loaded yet')}" for v in sorted(exp.weights)
                            if not world.ready(v))
        return replace(st, phase=Phase.PROGRESSING, experiment=state,
                       message=f"experiment on {exp.metric} held until every version is loaded on every pod "
                               f"({unready}): its duration does not run meanwhile; " + _results(state))
    if st.step_served_at is None:
        waited = now - (st.step_started_at or now)
        unserved = (condition(st, "WeightsServed") or {}).get("message", "applying")
        if waited > spec.progress_deadline_seconds:
            return _abort(st, state, f"the split was not served by every pod within {int(waited)}s: {unserved}",
                          now, events)
        return replace(st, phase=Phase.PROGRESSING, experiment=state,
                       message=f"experiment on {exp.metric}: waiting for every pod to serve {_fmt(exp.weights)} "
                               f"({unserved}); its duration runs from then")
    ran = now - st.step_served_at
    if ran >= exp.duration_seconds(spec.progress_deadline_seconds):
        return _keep_stable(st, state, f"no challenger was better within {int(ran)}s", now, events)
    return replace(st, phase=Phase.PROGRESSING, experiment=state,
                   message=f"experiment on {exp.metric}: {_fmt(exp.weights)}; " + _results(state))


def removed(st: RolloutStatus, events: list[Event]) -> RolloutStatus:
    """spec.experiment is gone: a running one is aborted (stable takes everything back); the record
    of a concluded one stays, marked so that naming it again starts it again."""
    from .rollout import Event

    if not st.experiment or st.experiment.get("removed"):
        return st
    state = {**st.experiment, "removed": True}
    st = replace(st, paused_at=None)
    if state.get("state") == RUNNING:
        state.update(state=ABORTED, endedAt=state.get("checkedAt"), message="removed from the spec")
        events.append(Event("Warning", "ExperimentAborted", f"experiment on {state.get('metric')} removed from the "
                                                            f"spec: {st.stable_version} takes all the traffic"))
    return replace(st, experiment=state)


def _promote(spec: ModelDeploymentSpec, st: RolloutStatus, state: dict[str, Any], best: str,
             found: Mapping[str, Comparison], now: float, events: list[Event]) -> RolloutStatus:
    from .rollout import Event

    old = st.stable_version
    c = found[best]
    why = (f"{best} won on {state['metric']}: {comparisons.interval_text(c.as_status())} against {old} at "
           f"{c.confidence:.4g} ({len(found)} challenger{'s' if len(found) > 1 else ''})")
    state.update(state=WINNER, winner=best, endedAt=iso(now), message=why)
    events.append(Event("Normal", "ExperimentConcluded", f"{why}: promoted"))
    events.append(Event("Normal", "RolloutPromoted", f"{best} promoted to stable (won the experiment); "
                                                      f"{', '.join(sorted(v for v in st.weights if v != best))} "
                                                      "leave the routing"))
    weights = {best: 100, **{v: 0 for v in st.weights if v != best}}
    return replace(st, phase=Phase.PROMOTING, stable_version=best, weights=weights, promoted_at=now,
                   previous_stable=old, experiment=state, step_text="done", message=f"{why}; promoted")


def _abort(st: RolloutStatus, state: dict[str, Any], why: str, now: float, events: list[Event]) -> RolloutStatus:
    """A guard failed or an alert fired: stable takes all the traffic back at once."""
    from .rollout import Event

    stable = st.stable_version or ""
    state.update(state=ABORTED, winner=None, endedAt=iso(now), message=why)
    events.append(Event("Warning", "ExperimentAborted", f"{why}: {stable} takes all the traffic back"))
    weights = {stable: 100, **{v: 0 for v in st.weights if v != stable}}
    st = replace(st, phase=Phase.ROLLED_BACK, weights=weights, experiment=state, step_text="", abort_reason=why,
                 rolled_back_at=now, message=f"experiment aborted, rolled back to {stable}: {why}")
    return with_condition(st, "Progressing", "False", "ExperimentAborted", why, now)


def _keep_stable(st: RolloutStatus, state: dict[str, Any], why: str, now: float,
                 events: list[Event]) -> RolloutStatus:
    from .rollout import Event

    stable = st.stable_version or ""
    text = f"{why}: {stable} stays stable; {_results(state)}"
    state.update(state=NO_WINNER, winner=None, endedAt=iso(now), message=text)
    events.append(Event("Normal", "ExperimentConcluded", text))
    weights = {stable: 100, **{v: 0 for v in st.weights if v != stable}}
    return replace(st, phase=Phase.READY, weights=weights, experiment=state, step_text="",
                   message=f"experiment concluded: {text}")


def _results(state: Mapping[str, Any]) -> str:
    found = state.get("comparisons") or {}
    return "; ".join(f"{v}: {e.get('decision')} {comparisons.interval_text(e)}" for v, e in sorted(found.items())) \
        or "no look yet"


def _fmt(weights: Mapping[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])))

