"""The rollout state machine: ``decide(spec, status, world, analysis, now) -> (status, events)``.

Pure: no I/O, no clock but ``now``. kopf handlers, the local demo and the tests all drive this
one function, and it is the only writer of ``phase`` and the rollout conditions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from . import comparisons, experiment
from .verdicts import Analysis
from .spec import ModelDeploymentSpec
from .status import (Phase, RolloutStatus, condition, epoch, iso, pending_rollback, with_condition,
                     without_pending_rollback)

ACTIONS = ("promote", "promote-full", "abort", "retry")
DEADLINE = "ProgressDeadlineExceeded"  # the reason of a rollback to phase Failed


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class World:
    """What the caller observed: version readiness across pods, pods, and requests to act."""

    versions_ready: Mapping[str, bool] = field(default_factory=dict)
    reasons: Mapping[str, str] = field(default_factory=dict)
    ready_pods: int = 0
    desired_pods: int = 0
    action: str | None = None  # one of ACTIONS, already de-duplicated by the caller
    action_token: str | None = None  # the whole annotation (verb:nonce), recorded once handled
    alert: str | None = None  # an alert firing for this canary (until resolved): roll back at once

    def ready(self, version: str) -> bool:
        return bool(self.versions_ready.get(version))


def decide(
    spec: ModelDeploymentSpec,
    status: RolloutStatus,
    world: World,
    analysis: Analysis | None,
    now: float,
) -> tuple[RolloutStatus, list[Event]]:
    """The next status and the events to emit. Weights and routed versions in the returned status
    are what the children must serve."""
    events: list[Event] = []
    # A rollback decided by a reconcile that was cut before recording it (see reconcile.py): it
    # is finished below if the rollout it was for still runs; the condition goes either way.
    pending = pending_rollback(status)
    if status.phase == Phase.INVALID_SPEC:  # valid again: resume from the phase it had
        status = replace(status, phase=status.phase_before_invalid or _phase_kept_by(status))
    status = replace(status, phase_before_invalid=None)
    st = replace(_adopt_stable(spec, without_pending_rollback(status), world), total_steps=len(spec.strategy.steps))
    canary = spec.canary if spec.canary and spec.canary != st.stable_version else None
    if pending is not None and pending[2] != rollback_target(spec, canary):
        pending = None  # decided for a canary, file or experiment the spec no longer names
    outcome, why = _action_gate(spec, st, canary, world, pending)
    if outcome != APPLIED:
        world = replace(world, action=None)  # pending or ignored: the machine does not see it
    if spec.experiment is not None:
        st = experiment.decide(spec, st, world, analysis, now, events, pending, status.weights)
    elif canary is None:
        st = _no_canary(spec, experiment.removed(st, events), world, events, now)
    else:
        st = _canary(spec, experiment.removed(st, events), canary, world, analysis, now, events, pending,
                     status.weights, status.shadow_percent)
    st = _record_action(st, world, outcome, why, events)
    st = _retire(spec, st, world, now, events)
    st = _progressing(st, events, now)
    if spec.stable and spec.stable != st.declared_stable:  # held by _adopt_stable: say so
        why = world.reasons.get(spec.stable, "not loaded yet")
        st = replace(st, message=f"{st.message}; stable stays {st.stable_version} until {spec.stable} is loaded "
                                 f"on every pod ({why})")
    st = with_condition(st, "InvalidSpec", "False", "SpecValid", "the spec is valid", now)
    st = _readiness(spec, st, world, now)
    return st, events


def _phase_kept_by(status: RolloutStatus) -> Phase:
    """The phase an InvalidSpec status without ``phaseBeforeInvalid`` (written by an earlier operator,
    which did not record it) resumes from, read from what the status kept. Resumed as Initializing
    instead, a rolled-back canary went on at its step weight without a retry, an aborted experiment
    stayed Initializing, and a promotion never retired the old stable."""
    state = status.experiment or {}
    promoted = status.promoted_at is not None and status.previous_stable is not None
    retired = promoted and status.previous_stable in status.retired
    if state and not state.get("removed"):
        concluded = {experiment.ABORTED: Phase.ROLLED_BACK, experiment.NO_WINNER: Phase.READY,
                     experiment.WINNER: Phase.SUCCEEDED if retired else Phase.PROMOTING}
        return concluded.get(str(state.get("state")), Phase.INITIALIZING)
    if promoted and status.canary_version is not None and status.canary_version == status.stable_version:
        return Phase.SUCCEEDED if retired else Phase.PROMOTING
    # Rolled back, and not started again since: earlier operators left rolledBackAt behind when a
    # canary was retried or replaced, so it counts only if no rollout started after it (an alert
    # firing at the start rolls back in the same decision: the same time) and the canary has no weight.
    if (status.canary_version is not None and status.rolled_back_at is not None and status.canary_weight == 0
            and status.rolled_back_at >= (status.rollout_started_at or 0.0)):
        failed = (status.abort_reason or "").startswith(f"{DEADLINE}:")
        return Phase.FAILED if failed else Phase.ROLLED_BACK
    return Phase.INITIALIZING


# -- manual actions ----------------------------------------------------------------------------

APPLIED, PENDING, IGNORED, NONE = "applied", "pending", "ignored", ""


def _action_gate(spec: ModelDeploymentSpec, st: RolloutStatus, canary: str | None, world: World,
                 pending: tuple[str, str, str] | None = None) -> tuple[str, str]:
    """Whether the requested action applies now, waits until it can (pending), or cannot apply at
    all (ignored), and why. Judged on the status before this decision (and the rollback that
    status records as pending, which this decision finishes first)."""
    action = world.action
    if action is None:
        return NONE, ""
    if action not in ACTIONS:
        return IGNORED, f"{action!r} is not one of {', '.join(ACTIONS)}"
    if spec.experiment is not None:
        return IGNORED, "an experiment is running: actions apply to canaries; remove spec.experiment to end it"
    if canary is None:
        return IGNORED, f"no rollout in progress: {st.stable_version} is stable and spec.canary names no other version"
    if pending is not None:
        why = f"canary {canary} is being rolled back ({pending[0]}: {pending[1]})"
        return (PENDING, why) if action == "retry" else (IGNORED, why)
    started = st.canary_version == canary and st.phase in (Phase.PROGRESSING, Phase.PAUSED)
    rolled_back = st.canary_version == canary and st.phase in (Phase.ROLLED_BACK, Phase.FAILED)
    if action == "retry":
        return (APPLIED, "") if rolled_back else (IGNORED, f"nothing to retry: canary {canary} is {st.phase.value}")
    if rolled_back:
        return IGNORED, f"canary {canary} was rolled back ({st.abort_reason}); retry it first"
    if action == "promote" and spec.paused:
        return IGNORED, "spec.paused is true: resume the rollout first"
    if action in ("promote", "promote-full") and (not world.ready(canary) or (action == "promote" and not started)):
        # promote-full too: a canary not loaded everywhere never takes 100% (its pods serve the stable meanwhile)
        return PENDING, f"canary {canary} is not loaded on every pod yet: {world.reasons.get(canary, 'loading')}"
    return APPLIED, ""


def _record_action(st: RolloutStatus, world: World, outcome: str, why: str, events: list[Event]) -> RolloutStatus:
    token = world.action_token
    if outcome == NONE or token is None:
        return st
    verb = token.split(":", 1)[0]
    if outcome == PENDING:
        return replace(st, pending_action=f"{token}: {why}")
    if outcome == IGNORED:
        events.append(Event("Warning", "ActionIgnored", f"{verb}: {why}"))
        return replace(st, last_action=token, action_result=f"ignored: {why}", pending_action=None)
    return replace(st, last_action=token, action_result="applied", pending_action=None)


# -- no rollout --------------------------------------------------------------------------------


def _adopt_stable(spec: ModelDeploymentSpec, st: RolloutStatus, world: World) -> RolloutStatus:
    """The stable version lives in status (a promotion changes it); ``spec.stable`` sets it when
    first given and whenever the user changes it, never again after that. A new ``spec.stable``
    takes over only once it is loaded on every pod (the stable takes every share no other version
    has: given to a version loaded nowhere, the pods served it by their fallback, the canary); until
    then the current one stays, and ``declared_stable`` is left behind so the change is seen again."""
    names = [v.name for v in spec.versions]
    current = st.stable_version if st.stable_version in names else None
    if spec.stable and spec.stable != st.declared_stable:
        if current is None or current == spec.stable or world.ready(spec.stable):
            return _moved_stable(replace(st, declared_stable=spec.stable), spec.stable)
        return st
    return replace(st, stable_version=current or spec.stable or names[0], declared_stable=spec.stable)


def _moved_stable(st: RolloutStatus, stable: str) -> RolloutStatus:
    """``stable`` made the stable version, taking the share the old one served (mid-rollout the
    weights are kept between steps: the old stable's share stayed with it, or, removed from the
    spec, with nobody, and the routing's weights no longer summed to 100)."""
    old = st.stable_version
    if old is None or old == stable or old not in st.weights:
        return replace(st, stable_version=stable)
    weights = {k: w for k, w in st.weights.items() if k != old}
    weights[stable] = weights.get(stable, 0) + st.weights[old]
    canary = weights.get(st.canary_version, 0) if st.canary_version else st.canary_weight
    return replace(st, stable_version=stable, weights=weights, canary_weight=canary)


def unlisted_stable(spec: ModelDeploymentSpec, status: RolloutStatus, world: World) -> str | None:
    """Why the spec cannot be applied over ``status``: it no longer lists the stable version while
    that version serves requests (renamed, or removed with the default stable): its share would go
    to a version nobody chose (the canary, unanalysed, or one loaded nowhere). None when it can."""
    stable = status.stable_version
    names = [v.name for v in spec.versions]
    if not stable or stable in names or not status.weights.get(stable):
        return None
    if spec.stable and spec.stable != stable and spec.stable in names and world.ready(spec.stable):
        return None  # the version that takes over is loaded on every pod
    return (f"spec.versions: the stable version {stable!r} is not listed, and it serves {status.weights[stable]}% "
            f"of requests; list it again until another version is loaded on every pod and named in spec.stable")


def _no_canary(spec: ModelDeploymentSpec, st: RolloutStatus, world: World, events: list[Event],
               now: float) -> RolloutStatus:
    stable = st.stable_version
    assert stable is not None
    if spec.canary == stable and st.phase in (Phase.PROMOTING, Phase.SUCCEEDED):
        return st  # a finished rollout; _retire moves Promoting on to Succeeded
    aborted = bool(st.canary_version) and st.phase in (Phase.PROGRESSING, Phase.PAUSED)
    if aborted:
        events.append(Event("Warning", "RolloutAborted",
                            f"canary {st.canary_version} removed from the spec: rolled back to {stable}"))
    desired = dict(spec.weights) if spec.weights else {stable: 100}
    weights = hold_unready(desired, st.weights, stable, world)
    if st.weights and weights != st.weights and not aborted:
        events.append(Event("Normal", "WeightsUpdated", f"weights {_fmt(weights)}"))
    serving = world.ready(stable) and world.ready_pods >= world.desired_pods
    phase = Phase.READY if serving or st.phase == Phase.READY else Phase.INITIALIZING
    held = {k: v for k, v in desired.items() if weights.get(k) != v}
    message = f"serving {_fmt(weights)}" + (f"; holding {_fmt(held)} until loaded on every pod" if held else "")
    return replace(st, phase=phase, weights=weights, canary_version=None, canary_file=None, canary_weight=0,
                   current_step=None, step_text="", message=message, shadow_percent=None)


def hold_unready(desired: Mapping[str, int], current: Mapping[str, int], stable: str, world: World) -> dict[str, int]:
    """Weights to serve: a version not ready on every pod keeps the weight it has now (it may
    lose weight, never gain it); the stable version takes what is left."""
    out: dict[str, int] = {}
    for name, weight in desired.items():
        if name == stable:
            continue
        have = int(current.get(name, 0))
        out[name] = weight if world.ready(name) or weight <= have else have
    out[stable] = 100 - sum(out.values())
    return {k: v for k, v in sorted(out.items()) if v > 0 or k in desired}


# -- canary ------------------------------------------------------------------------------------


def file_of(spec: ModelDeploymentSpec, version: str) -> str:
    """What a version serves, as the rollout records it: ``uri@sha256`` (``uri@`` without a digest)."""
    v = spec.version(version)
    return f"{v.uri}@{v.sha256 or ''}"


def _canary(spec: ModelDeploymentSpec, st: RolloutStatus, canary: str, world: World,
            analysis: Analysis | None, now: float, events: list[Event],
            pending: tuple[str, str, str] | None = None, written: Mapping[str, int] | None = None,
            written_shadow: int | None = None) -> RolloutStatus:
    file = file_of(spec, canary)
    if st.canary_version == canary and st.canary_file is None:
        st = replace(st, canary_file=file)  # a status written before files were recorded: adopt
    edited = st.canary_version == canary and st.canary_file != file
    if edited:
        # The analysis so far judged another file: never promote that evidence. Start again.
        events.append(Event("Warning", "CanaryFileChanged",
                            f"canary {canary} now names {file} (was {st.canary_file}): restarting at step 1"))
        st, analysis = _start(spec, st, canary, now, events, restarted=False, announce=False), None
    elif st.canary_version != canary or (st.current_step is None and st.phase not in (Phase.ROLLED_BACK, Phase.FAILED)):
        midway = st.canary_version is not None and st.phase in (Phase.PROGRESSING, Phase.PAUSED)
        st, analysis = _start(spec, st, canary, now, events, restarted=midway), None
    elif st.phase in (Phase.ROLLED_BACK, Phase.FAILED):
        if world.action != "retry":
            return st
        events.append(Event("Normal", "RolloutRetried", f"retrying canary {canary} from the first step"))
        st, analysis = _start(spec, st, canary, now, events, restarted=False, announce=False), None
    if world.alert:
        return _rollback(st, Phase.ROLLED_BACK, "AlertFiring", f"alert {world.alert} is firing", now, events)
    if pending is not None:
        reason, detail, _ = pending
        phase = Phase.FAILED if reason == DEADLINE else Phase.ROLLED_BACK
        return _rollback(st, phase, reason, detail, now, events)
    if world.action == "abort":
        return _rollback(st, Phase.ROLLED_BACK, "ManualAbort", "aborted by a user", now, events)
    if world.action == "promote-full":
        return _promote(st, now, events, "promoted fully by a user")
    if spec.paused:
        # The step clock (pause and progress deadline) stops while paused; the analysis goes on (the
        # canary still serves its users): a failing one is rolled back.
        st = _record(spec, replace(st, phase=Phase.PAUSED, message="paused by spec.paused",
                                   paused_at=st.paused_at or now), analysis)
        return _rollback_if_failed(spec, st, analysis, now, events) or st
    if st.paused_at is not None:
        st = replace(resumed(st, now), phase=Phase.PROGRESSING)
    if not world.ready(canary):
        return _wait_for_canary(spec, st, world, now, events)
    step = _step(spec, st)
    if st.canary_weight == 0 and not st.shadow_percent and st.current_step is not None and step.shadow is not None:
        st = replace(_set_weight(st, 0, now, restart_clock=True), shadow_percent=step.shadow)
        events.append(Event("Normal", "StepStarted", f"canary {canary} ready: step {st.step_text}: shadow of "
                                                      f"{step.shadow}% of stable's requests, weight 0"))
    elif st.canary_weight == 0 and st.current_step is not None and step.weight > 0:
        st = _set_weight(st, step.weight, now, restart_clock=True)
        events.append(Event("Normal", "StepStarted", f"canary {canary} ready: step {st.step_text} at "
                                                      f"{st.canary_weight}%"))
    st = _record(spec, served_since(st, written, written_shadow), analysis)
    return _rollback_if_failed(spec, st, analysis, now, events) or _advance(spec, st, analysis, world, now, events)


def resumed(st: RolloutStatus, now: float) -> RolloutStatus:
    """``st`` held since ``paused_at``, going on at ``now``: its clocks (the write's and the serving's)
    moved on by the time held, which does not count."""
    assert st.paused_at is not None
    held = now - st.paused_at
    return replace(st, step_started_at=(st.step_started_at or now) + held, paused_at=None,
                   step_served_at=None if st.step_served_at is None else st.step_served_at + held)


def served_since(st: RolloutStatus, written: Mapping[str, int] | None, written_shadow: int | None = None,
                 ) -> RolloutStatus:
    """The step's clock started (``step_served_at``) once every ready pod routes by its weights:
    condition WeightsServed True, as the last reconcile saw the pods (its lastTransitionTime, when
    they were first seen serving them). A ConfigMap reaches the pods seconds to a minute after it is
    written: counted from the write, a step's pause and checks were partly spent on the previous
    weights. Pods that report no weights (an older runtime; Unknown) count from the write, as before.
    ``written``, ``written_shadow``: the weights and shadow percent the condition was judged against (the
    status this decision started from): a shadow step keeps the weights, and pods report the shadow (a
    condition judged for another shadow says nothing of this one; without one, nothing was ever judged)."""
    served = condition(st, "WeightsServed") or {}
    if st.step_served_at is not None or st.step_started_at is None or written is None or st.weights != written \
            or (served and st.shadow_percent != written_shadow):
        return st
    if served.get("status") == "False":
        return st
    since = epoch(served.get("lastTransitionTime")) if served.get("status") == "True" else None
    return replace(st, step_served_at=max(st.step_started_at, since or 0.0))


def _rollback_if_failed(spec: ModelDeploymentSpec, st: RolloutStatus, analysis: Analysis | None, now: float,
                        events: list[Event]) -> RolloutStatus | None:
    """The rollback a failed check calls for (at once, or after ``failureLimit`` in a row), else None."""
    if analysis is not None and analysis.verdict == "fail" and (
            analysis.immediate or st.failures >= spec.strategy.analysis.failure_limit):
        return _rollback(st, Phase.ROLLED_BACK, "AnalysisFailed", analysis.failed_metric(), now, events)
    return None


def rollback_target(spec: ModelDeploymentSpec, canary: str | None) -> str | None:
    """What a rollback decided now is for: the experiment, or the canary and its file."""
    if spec.experiment is not None:
        return f"experiment {spec.experiment.key()}"
    return f"canary {canary} {file_of(spec, canary)}" if canary else None


def _start(spec: ModelDeploymentSpec, st: RolloutStatus, canary: str, now: float, events: list[Event],
           restarted: bool, announce: bool = True) -> RolloutStatus:
    if restarted:
        events.append(Event("Normal", "RolloutRestarted",
                            f"canary changed from {st.canary_version} to {canary}: restarting at step 1"))
    elif announce:
        events.append(Event("Normal", "RolloutStarted", f"rolling out {canary} over {len(spec.strategy.steps)} "
                                                         f"steps, stable {st.stable_version}"))
    retiring = (st.previous_stable,) if st.phase == Phase.PROMOTING and st.previous_stable else ()
    retired = tuple(sorted({*st.retired, *retiring} - {canary, st.stable_version}))
    st = replace(st, canary_version=canary, canary_file=file_of(spec, canary), current_step=0, failures=0,
                 analysis={}, sequential=None, shadow_percent=None, retired=retired, paused_at=None,
                 abort_reason=None, rolled_back_at=None,
                 step_started_at=now, phase=Phase.PROGRESSING, rollout_started_at=now,
                 message=f"waiting for {canary} to load on every pod")
    return _set_weight(st, 0, now, restart_clock=True)


def _wait_for_canary(spec: ModelDeploymentSpec, st: RolloutStatus, world: World, now: float,
                     events: list[Event]) -> RolloutStatus:
    assert st.canary_version is not None
    why = world.reasons.get(st.canary_version, "not loaded yet")
    if now - (st.step_started_at or now) > spec.progress_deadline_seconds:
        return _rollback(st, Phase.FAILED, DEADLINE,
                         f"canary {st.canary_version} not ready within {spec.progress_deadline_seconds}s: {why}",
                         now, events)
    # Hold the weight it has (never raise it while it is not ready on every pod).
    return replace(st, phase=Phase.PROGRESSING, message=f"waiting for {st.canary_version}: {why}")


def _record(spec: ModelDeploymentSpec, st: RolloutStatus, analysis: Analysis | None) -> RolloutStatus:
    if analysis is None:
        return st
    failures = st.failures + 1 if analysis.verdict == "fail" else (0 if analysis.verdict == "pass" else st.failures)
    sequential = analysis.sequential if analysis.sequential is not None else st.sequential
    # what the check measured began at the one before it (the direct provider's deltas; Prometheus reads
    # one interval back, never before the step): a pass counts for a step only measured after it was served
    before = epoch(st.analysis.get("checkedAt"))
    since = before if before is not None else \
        max(analysis.at - spec.strategy.analysis.interval_seconds, st.step_started_at or 0.0)
    return replace(st, failures=failures, analysis={**analysis.as_status(failures), "windowFrom": iso(since)},
                   sequential=sequential)


def _advance(spec: ModelDeploymentSpec, st: RolloutStatus, analysis: Analysis | None, world: World,
             now: float, events: list[Event]) -> RolloutStatus:
    step = _step(spec, st)
    served = st.step_served_at
    # the progress deadline: from the write while no pod serves the step's weights, then from when every
    # pod does (counted from the write, a step whose pause fits the deadline failed when served late)
    waited = now - (served if served is not None else st.step_started_at or now)
    checked_at = epoch(st.analysis.get("checkedAt")) or 0.0
    measured_from = epoch(st.analysis.get("windowFrom"))
    if measured_from is None:  # recorded by an earlier operator
        measured_from = checked_at - spec.strategy.analysis.interval_seconds
    # Only a pass measured at this step's weight, as served by every pod, counts: never advance on the
    # previous step's, nor on a check whose interval began before the pods were seen taking the step's
    # weights (served at the write: pods that do not report them, or took them at once, as before).
    last_pass = st.analysis.get("verdict") == "pass" and served is not None and checked_at > served \
        and (measured_from >= served or served <= (st.step_started_at or 0.0))
    manual = step.pause_seconds is None
    ran = now - served if served is not None else 0.0
    if world.action == "promote" or (not manual and ran >= (step.pause_seconds or 0) and last_pass):
        return _next_step(spec, st, now, events)
    where = f"step {st.step_text}: shadow {st.shadow_percent}%" if st.shadow_percent else \
        f"step {st.step_text} at {st.canary_weight}%"
    if manual:
        return replace(st, phase=Phase.PAUSED, message=f"{where}: waiting for promote")
    unserved = "" if served is not None else (condition(st, "WeightsServed") or {}).get("message", "applying")
    if waited > spec.progress_deadline_seconds:
        verdict = st.analysis.get("verdict", "no analysis yet")
        why = f"not served by every pod: {unserved}" if unserved else f"last analysis: {verdict}"
        return _rollback(st, Phase.FAILED, DEADLINE, f"step {st.step_text} held {int(waited)}s ({why})", now, events)
    if unserved:
        return replace(st, phase=Phase.PROGRESSING,
                       message=f"{where}: waiting for every pod to serve the step's weights ({unserved}); its pause "
                               "and checks count from then")
    detail = "inconclusive: holding" if st.analysis.get("verdict") == "inconclusive" else "analysing"
    return replace(st, phase=Phase.PROGRESSING, message=f"{where}: {detail}")


def _next_step(spec: ModelDeploymentSpec, st: RolloutStatus, now: float, events: list[Event]) -> RolloutStatus:
    assert st.current_step is not None
    nxt = st.current_step + 1
    if nxt >= len(spec.strategy.steps):
        return _promote(st, now, events, f"passed all {len(spec.strategy.steps)} steps")
    step = spec.strategy.steps[nxt]
    st = replace(st, current_step=nxt, failures=0, phase=Phase.PROGRESSING, shadow_percent=step.shadow)
    st = _set_weight(st, step.weight, now, restart_clock=True)
    where = f"shadow {step.shadow}% (weight 0)" if step.shadow else f"{st.canary_weight}%"
    events.append(Event("Normal", "StepAdvanced", f"canary {st.canary_version} step {st.step_text}: {where}"
                                                   + _evidence(st)))
    return replace(st, message=f"step {st.step_text} at {where}")


def _evidence(st: RolloutStatus) -> str:
    """The compare: stable metrics' decisions, estimates and intervals, for an Event."""
    found = comparisons.summary(st.sequential)
    return f" ({found})" if found else ""


def _promote(st: RolloutStatus, now: float, events: list[Event], why: str) -> RolloutStatus:
    canary, old = st.canary_version, st.stable_version
    assert canary is not None and old is not None
    events.append(Event("Normal", "RolloutPromoted", f"{canary} promoted to stable ({why}); {old} leaves the routing"
                        + _evidence(st)))
    weights = {canary: 100, old: 0}
    return replace(st, phase=Phase.PROMOTING, stable_version=canary, canary_weight=100, weights=weights,
                   promoted_at=now, previous_stable=old, current_step=None, step_text="done", shadow_percent=None,
                   message=f"{canary} is stable; {old} is retiring")


def _rollback(st: RolloutStatus, phase: Phase, reason: str, detail: str, now: float,
              events: list[Event]) -> RolloutStatus:
    events.append(Event("Warning", "RolloutAborted", f"canary {st.canary_version} rolled back: {detail}"))
    stable = st.stable_version
    assert stable is not None
    weights = {stable: 100, **{k: 0 for k in st.weights if k != stable}}
    st = replace(st, phase=phase, canary_weight=0, weights=weights, abort_reason=f"{reason}: {detail}",
                 shadow_percent=None,
                 rolled_back_at=now, message=f"rolled back to {stable}: {detail}")
    return with_condition(st, "Progressing", "False", reason, detail, now)


def _set_weight(st: RolloutStatus, weight: int, now: float, restart_clock: bool) -> RolloutStatus:
    assert st.canary_version is not None and st.stable_version is not None
    weights = {st.canary_version: weight, st.stable_version: 100 - weight}
    step_text = f"{(st.current_step or 0) + 1}/{st.total_steps}" if st.current_step is not None else ""
    return replace(st, canary_weight=weight, weights=weights, step_text=step_text,
                   step_started_at=now if restart_clock else st.step_started_at,
                   step_served_at=None if restart_clock else st.step_served_at)


def _step(spec: ModelDeploymentSpec, st: RolloutStatus) -> Any:
    return spec.strategy.steps[min(st.current_step or 0, len(spec.strategy.steps) - 1)]


# -- after promotion, readiness ----------------------------------------------------------------


def _retire(spec: ModelDeploymentSpec, st: RolloutStatus, world: World, now: float,
            events: list[Event]) -> RolloutStatus:
    if st.phase != Phase.PROMOTING or st.promoted_at is None:
        return st
    if now - st.promoted_at < spec.strategy.scale_down_delay_seconds:
        return st
    if not world.ready(st.stable_version or ""):  # the old stable is what serves meanwhile: kept
        why = world.reasons.get(st.stable_version or "", "not loaded yet")
        return replace(st, message=f"{st.stable_version} is stable; {st.previous_stable} retires once "
                                   f"{st.stable_version} is loaded on every pod ({why})")
    # the old stable, and the other versions of an A/B test
    old = sorted({st.previous_stable or "", *(k for k, w in st.weights.items() if w == 0)} - {"", st.stable_version})
    retired = tuple(sorted({*st.retired, *old}))
    events.append(Event("Normal", "RolloutSucceeded", f"{st.stable_version} serves 100%; {', '.join(old)} unloaded"))
    weights = {st.stable_version or "": 100}
    return replace(st, phase=Phase.SUCCEEDED, retired=retired, weights=weights,
                   message=f"{st.stable_version} serves 100%")


# Condition Progressing, as Deployments and Argo Rollouts keep it: True while a rollout runs and once it
# is promoted, False once rolled back (``_rollback``, ``experiment._abort``) or aborted; each transition
# names the event that made it. Only rollbacks set it before: a retry or a new canary showed the last one.
_STARTS = ("RolloutRetried", "RolloutRestarted", "CanaryFileChanged", "RolloutStarted", "ExperimentStarted")
_DONE = ("RolloutSucceeded", "RolloutPromoted", "ExperimentConcluded")
_ABORTS = ("RolloutAborted", "ExperimentAborted")


def _progressing(st: RolloutStatus, events: list[Event], now: float) -> RolloutStatus:
    said = {e.reason: e.message for e in events}
    if st.phase in (Phase.PROGRESSING, Phase.PAUSED):
        reason = next((r for r in _STARTS if r in said), None)
        if reason is not None:
            return with_condition(st, "Progressing", "True", reason, said[reason], now)
        if (condition(st, "Progressing") or {}).get("status") != "True":  # left stale by an earlier operator
            return with_condition(st, "Progressing", "True", "RolloutProgressing", st.message, now)
        return st
    if st.phase in (Phase.ROLLED_BACK, Phase.FAILED):
        return st  # set by the rollback, with its reason
    reason = next((r for r in _DONE if r in said), None)
    if reason is not None:
        return with_condition(st, "Progressing", "True", reason, said[reason], now)
    reason = next((r for r in _ABORTS if r in said), None)
    if reason is not None:  # the canary or experiment removed from the spec while it ran
        return with_condition(st, "Progressing", "False", reason, said[reason], now)
    return st


def _readiness(spec: ModelDeploymentSpec, st: RolloutStatus, world: World, now: float) -> RolloutStatus:
    routed = routed_versions(spec, st)
    unready = [v for v in routed if not world.ready(v)]
    st = replace(st, ready_text=f"{world.ready_pods}/{world.desired_pods}", replicas=world.ready_pods)
    if unready:
        detail = "; ".join(f"{v}: {world.reasons.get(v, 'not loaded yet')}" for v in unready)
        st = with_condition(st, "VersionsReady", "False", "VersionNotReady", detail, now)
    else:
        st = with_condition(st, "VersionsReady", "True", "AllVersionsLoaded",
                            f"{', '.join(routed)} loaded on every pod", now)
    pods_ok = world.desired_pods > 0 and world.ready_pods >= world.desired_pods
    serving = world.ready(st.stable_version or "")
    if pods_ok and serving:
        return with_condition(st, "Ready", "True", "Serving", f"{world.ready_pods} pods serving {_fmt(st.weights)}",
                              now)
    why = f"{world.ready_pods}/{world.desired_pods} pods ready" if not pods_ok else \
        f"stable {st.stable_version} not loaded: {world.reasons.get(st.stable_version or '', 'loading')}"
    return with_condition(st, "Ready", "False", "NotReady", why, now)


def routed_versions(spec: ModelDeploymentSpec, st: RolloutStatus) -> list[str]:
    """Versions in the runtime config: every listed version except retired ones."""
    keep = {st.stable_version, st.canary_version}
    if spec.stable and spec.stable != st.declared_stable:  # a new spec.stable loads before it takes over
        keep.add(spec.stable)
    if experiment.running(st):
        keep |= set((st.experiment or {}).get("weights") or {})
    return [v.name for v in spec.versions if v.name not in st.retired or v.name in keep]


def _fmt(weights: Mapping[str, int]) -> str:
    return ", ".join(f"{k}:{v}" for k, v in sorted(weights.items(), key=lambda kv: -kv[1]))


def mark_invalid(status: RolloutStatus, message: str, now: float) -> RolloutStatus:
    """An invalid spec changes nothing that serves traffic: only phase, message and condition.
    The phase it replaces is kept, so a valid spec resumes the rollout where it was (a rolled-back
    canary stays rolled back, a pending rollback is still finished)."""
    before = status.phase_in_effect
    st = replace(status, phase=Phase.INVALID_SPEC, phase_before_invalid=before, message=message)
    return with_condition(st, "InvalidSpec", "True", "InvalidSpec", message, now)


def changed(a: RolloutStatus, b: RolloutStatus) -> bool:
    return a.to_dict() != b.to_dict()


__all__: Sequence[str] = ("decide", "World", "Event", "mark_invalid", "routed_versions", "hold_unready",
                         "unlisted_stable")
