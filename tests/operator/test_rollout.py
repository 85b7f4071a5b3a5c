"""The state machine, table-driven: (spec, status, world, analysis) -> (status, events)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Analysis, MetricResult
from rollout_operator.rollout import World, decide, hold_unready, mark_invalid, routed_versions
from rollout_operator.spec import parse_spec
from rollout_operator.status import Phase, RolloutStatus, condition, iso

T0 = 1_800_000_000.0


def spec(**over: Any):  # type: ignore[no-untyped-def]
    raw: dict[str, Any] = {
        "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}],
        "canary": "v2",
        "strategy": {"steps": [{"weight": 10, "pause": "10s"}, {"weight": 50, "pause": "10s"}],
                     "analysis": {"interval": "1s", "failureLimit": 2, "minRequests": 10,
                                  "metrics": [{"name": "error-rate", "max": 0.05}]},
                     "scaleDownDelaySeconds": 30},
        "progressDeadlineSeconds": 120,
    }
    raw.update(over)
    return parse_spec(raw)


READY = World(versions_ready={"v1": True, "v2": True}, ready_pods=2, desired_pods=2)
V2_LOADING = World(versions_ready={"v1": True, "v2": False}, reasons={"v2": "pod-a: loading"}, ready_pods=2,
                   desired_pods=2)


def verdict(v: str, value: float = 0.0, at: float = T0 + 1) -> Analysis:
    return Analysis(at, v, (MetricResult("error-rate", value, "error rate <= 0.05", v),), 100)


def progressing(step: int = 0, weight: int = 10, started: float = T0, **over: Any) -> RolloutStatus:
    base = RolloutStatus(phase=Phase.PROGRESSING, stable_version="v1", canary_version="v2", canary_weight=weight,
                         weights={"v2": weight, "v1": 100 - weight}, current_step=step, total_steps=2,
                         step_text=f"{step + 1}/2", step_started_at=started, rollout_started_at=T0)
    return replace(base, **over)


def reasons(events: list[Any]) -> list[str]:
    return [e.reason for e in events]


def test_a_new_canary_starts_at_zero_until_it_is_loaded_everywhere() -> None:
    st, events = decide(spec(), RolloutStatus(stable_version="v1", phase=Phase.READY,
                                              weights={"v1": 100}), V2_LOADING, None, T0)
    assert st.phase == Phase.PROGRESSING and st.canary_version == "v2"
    assert st.weights == {"v2": 0, "v1": 100} and st.current_step == 0
    assert reasons(events) == ["RolloutStarted"]
    st, _ = decide(spec(), st, V2_LOADING, None, T0 + 1)
    assert st.weights == {"v2": 0, "v1": 100}
    assert "pod-a: loading" in st.message
    st, events = decide(spec(), st, READY, None, T0 + 2)
    assert st.weights == {"v2": 10, "v1": 90} and reasons(events) == ["StepStarted"]


@pytest.mark.parametrize(
    ("status", "analysis", "now", "phase", "weights", "events"),
    [
        # pass but pause not over: hold
        (progressing(), verdict(PASS), T0 + 5, Phase.PROGRESSING, {"v2": 10, "v1": 90}, []),
        # pass and pause over: next step
        (progressing(), verdict(PASS), T0 + 11, Phase.PROGRESSING, {"v2": 50, "v1": 50}, ["StepAdvanced"]),
        # pause over but the last check was inconclusive: hold, never advance on missing data
        (progressing(), verdict(INCONCLUSIVE), T0 + 11, Phase.PROGRESSING, {"v2": 10, "v1": 90}, []),
        # one failure under failureLimit 2: hold
        (progressing(), verdict(FAIL, 0.5), T0 + 11, Phase.PROGRESSING, {"v2": 10, "v1": 90}, []),
        # second consecutive failure: roll back in the same reconcile
        (progressing(failures=1), verdict(FAIL, 0.5), T0 + 3, Phase.ROLLED_BACK, {"v1": 100, "v2": 0},
         ["RolloutAborted"]),
        # last step passes: promote
        (progressing(step=1, weight=50), verdict(PASS), T0 + 11, Phase.PROMOTING, {"v2": 100, "v1": 0},
         ["RolloutPromoted"]),
        # inconclusive past the progress deadline: fail and roll back
        (progressing(), verdict(INCONCLUSIVE), T0 + 121, Phase.FAILED, {"v1": 100, "v2": 0}, ["RolloutAborted"]),
    ],
)
def test_steps_advance_hold_or_roll_back(status: RolloutStatus, analysis: Analysis, now: float, phase: Phase,
                                         weights: dict[str, int], events: list[str]) -> None:
    st, evs = decide(spec(), status, READY, analysis, now)
    assert st.phase == phase
    assert st.weights == weights
    assert reasons(evs) == events


def test_a_pass_from_the_previous_step_never_advances_the_next_one() -> None:
    s = spec(strategy={"steps": [{"weight": 10, "pause": "1s"}, {"weight": 30, "pause": "1s"},
                                 {"weight": 60, "pause": "1s"}],
                       "analysis": {"interval": "10s", "metrics": [{"name": "error-rate", "max": 0.05}]}})
    st = progressing(step=0, weight=10, total_steps=3)
    st, _ = decide(s, st, READY, verdict(PASS, at=T0 + 2), T0 + 2)
    assert st.canary_weight == 30
    for t in (3.5, 5, 9):  # no new check yet: the pass at 10% does not carry over
        st, _ = decide(s, st, READY, None, T0 + t)
        assert st.canary_weight == 30 and st.phase == Phase.PROGRESSING
    st, _ = decide(s, st, READY, verdict(PASS, at=T0 + 12), T0 + 12)
    assert st.canary_weight == 60


def test_analysis_times_keep_sub_second_precision() -> None:
    from rollout_operator.analyzer import next_due

    st, _ = decide(spec(), progressing(), READY, verdict(PASS, at=T0 + 0.97), T0 + 0.97)
    assert next_due(spec(), st) == pytest.approx(T0 + 1.97, abs=0.002)


def test_inconclusive_checks_never_count_as_failures() -> None:
    st = progressing(failures=1)
    for i in range(20):
        st, _ = decide(spec(), st, READY, verdict(INCONCLUSIVE), T0 + i)
    assert st.phase == Phase.PROGRESSING and st.failures == 1


def test_a_canary_failing_every_request_below_min_requests_is_rolled_back_not_held() -> None:
    """Found in a chaos soak: a bad canary whose pod was killed got 4 requests in an interval, all errors,
    against minRequests 10: held as inconclusive until its progress deadline (phase Failed). 4 errors are
    40% of 10 requests whatever the rest would be: two such looks roll it back, as two failed looks do."""
    from rollout_operator.verdicts import Sample, evaluate

    st, s = progressing(), spec()
    for i in (1, 2):
        look = evaluate(s.strategy.analysis, Sample(requests=4, errors=4), Sample(requests=100, errors=0), T0 + i)
        st, events = decide(s, st, READY, look, T0 + i)
    assert st.phase == Phase.ROLLED_BACK and reasons(events) == ["RolloutAborted"], events
    assert "error-rate = 1 breached error rate <= 0.05" in events[0].message
    assert "its 4 errors alone break error rate <= 0.05 at minRequests" in st.analysis["message"]


def test_a_pass_resets_the_consecutive_failure_count() -> None:
    st, _ = decide(spec(), progressing(failures=1), READY, verdict(PASS), T0 + 1)
    assert st.failures == 0
    st, _ = decide(spec(), st, READY, verdict(FAIL, 0.9), T0 + 2)
    assert st.phase == Phase.PROGRESSING and st.failures == 1


def test_the_rollback_event_names_the_metric_value_and_threshold() -> None:
    st, events = decide(spec(), progressing(failures=1), READY, verdict(FAIL, 0.25), T0 + 3)
    assert st.phase == Phase.ROLLED_BACK
    assert "error-rate = 0.25 breached error rate <= 0.05" in events[0].message
    assert st.analysis["verdict"] == "fail" and st.analysis["failures"] == 2
    assert st.analysis["metrics"][0] == {"name": "error-rate", "value": 0.25, "threshold": "error rate <= 0.05",
                                         "verdict": "fail"}
    assert condition(st, "Progressing")["reason"] == "AnalysisFailed"  # type: ignore[index]


def test_a_rolled_back_canary_stays_loaded_and_retry_restarts_it() -> None:
    st, _ = decide(spec(), progressing(failures=1), READY, verdict(FAIL, 0.3), T0)
    assert "v2" in routed_versions(spec(), st)
    again, _ = decide(spec(), st, READY, None, T0 + 50)
    assert again.phase == Phase.ROLLED_BACK and again.weights == {"v1": 100, "v2": 0}
    retried, events = decide(spec(), st, replace(READY, action="retry"), None, T0 + 60)
    assert retried.phase == Phase.PROGRESSING and retried.weights == {"v2": 10, "v1": 90}
    assert retried.current_step == 0 and retried.failures == 0
    assert retried.abort_reason is None and retried.rolled_back_at is None  # the new attempt has not failed
    assert reasons(events) == ["RolloutRetried", "StepStarted"]


def test_after_promotion_the_old_stable_retires_after_the_delay() -> None:
    st, _ = decide(spec(), progressing(step=1, weight=50), READY, verdict(PASS), T0 + 11)
    assert st.phase == Phase.PROMOTING and st.stable_version == "v2"
    assert routed_versions(spec(), st) == ["v1", "v2"]
    st, events = decide(spec(), st, READY, None, T0 + 20)
    assert st.phase == Phase.PROMOTING and events == []
    st, events = decide(spec(), st, READY, None, T0 + 42)
    assert st.phase == Phase.SUCCEEDED and reasons(events) == ["RolloutSucceeded"]
    assert routed_versions(spec(), st) == ["v2"] and st.weights == {"v2": 100}
    st2, events = decide(spec(), st, READY, None, T0 + 100)
    assert st2 == st and events == []


def test_a_promotion_is_not_undone_by_the_stable_named_in_the_spec() -> None:
    s = spec(stable="v1")
    st, _ = decide(s, RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}), READY, None, T0)
    st = replace(st, current_step=1, canary_weight=50, weights={"v2": 50, "v1": 50},
                 analysis={"verdict": "pass", "checkedAt": iso(T0 + 10)}, step_started_at=T0)
    st, _ = decide(s, st, READY, None, T0 + 11)
    assert st.phase == Phase.PROMOTING and st.stable_version == "v2"
    for t in (12, 20, 50):
        st, _ = decide(s, st, READY, None, T0 + t)
        assert st.stable_version == "v2" and st.weights.get("v2") == 100
    assert st.phase == Phase.SUCCEEDED
    changed, _ = decide(spec(stable="v2", canary=None), st, READY, None, T0 + 60)
    assert changed.stable_version == "v2" and changed.phase == Phase.READY


def test_a_new_spec_stable_takes_over_only_once_it_is_loaded_on_every_pod() -> None:
    """The stable takes every share no other version has: a new spec.stable given it while loaded
    nowhere had the pods serve it by their fallback (the canary, mid-rollout). Found in review."""
    static = spec(canary=None, stable="v2")
    st = RolloutStatus(phase=Phase.READY, stable_version="v1", declared_stable="v1", weights={"v1": 100})
    st, _ = decide(static, st, V2_LOADING, None, T0)
    assert st.stable_version == "v1" and st.weights == {"v1": 100} and st.declared_stable == "v1"
    assert "stable stays v1 until v2 is loaded on every pod (pod-a: loading)" in st.message
    st, _ = decide(static, st, READY, None, T0 + 1)
    assert st.stable_version == "v2" and st.weights == {"v2": 100} and st.declared_stable == "v2"
    three = [{"name": "v1", "uri": "a"}, {"name": "v2", "uri": "b"}, {"name": "v3", "uri": "c"}]
    v3_loading = World(versions_ready={"v1": True, "v2": True, "v3": False}, reasons={"v3": "pod-a: loading"},
                       ready_pods=2, desired_pods=2)
    mid = spec(versions=three, stable="v3")
    st = progressing(declared_stable="v1", analysis={"verdict": "pass", "checkedAt": iso(T0 + 10)})
    st, _ = decide(mid, st, v3_loading, None, T0 + 11)  # the step passed: advance, v1 still the baseline
    assert st.stable_version == "v1" and st.weights == {"v2": 50, "v1": 50}, st.weights


def test_changing_the_canary_mid_rollout_restarts_cleanly() -> None:
    s3 = spec(versions=[{"name": "v1", "uri": "a"}, {"name": "v2", "uri": "b"}, {"name": "v3", "uri": "c"}],
              canary="v3")
    world = World(versions_ready={"v1": True, "v2": True, "v3": True}, ready_pods=2, desired_pods=2)
    st, events = decide(s3, progressing(step=1, weight=50, failures=1), world, None, T0 + 5)
    assert reasons(events)[0] == "RolloutRestarted"
    assert st.canary_version == "v3" and st.current_step == 0 and st.failures == 0 and st.step_text == "1/2"
    assert st.weights == {"v3": 10, "v1": 90}


def test_removing_the_canary_rolls_back() -> None:
    s = spec(canary=None)
    st, events = decide(s, progressing(step=1, weight=50), READY, None, T0 + 5)
    assert st.phase == Phase.READY and st.weights == {"v1": 100} and st.canary_version is None
    assert reasons(events) == ["RolloutAborted"]


@pytest.mark.parametrize(
    ("action", "phase", "weights", "event"),
    [
        ("promote", Phase.PROGRESSING, {"v2": 50, "v1": 50}, "StepAdvanced"),
        ("promote-full", Phase.PROMOTING, {"v2": 100, "v1": 0}, "RolloutPromoted"),
        ("abort", Phase.ROLLED_BACK, {"v1": 100, "v2": 0}, "RolloutAborted"),
    ],
)
def test_manual_actions(action: str, phase: Phase, weights: dict[str, int], event: str) -> None:
    st, events = decide(spec(), progressing(), replace(READY, action=action), None, T0 + 1)
    assert st.phase == phase and st.weights == weights and reasons(events) == [event]


def test_a_step_without_pause_waits_for_a_manual_promote() -> None:
    s = spec(strategy={"steps": [{"weight": 20}, {"weight": 60, "pause": "1s"}],
                       "analysis": {"interval": "1s", "metrics": [{"name": "error-rate", "max": 0.05}]}})
    st = progressing(weight=20, weights={"v2": 20, "v1": 80})
    for t in (5, 500, 5000):
        st, _ = decide(s, st, READY, verdict(PASS), T0 + t)
        assert st.phase == Phase.PAUSED and st.weights == {"v2": 20, "v1": 80}
    st, events = decide(s, st, replace(READY, action="promote"), None, T0 + 5001)
    assert st.weights == {"v2": 60, "v1": 40} and reasons(events) == ["StepAdvanced"]


def test_a_paused_canary_is_still_analysed_and_rolled_back_when_it_fails() -> None:
    """A canary held by spec.paused or by a step waiting for a manual promote still serves its
    users: it is analysed (before: never, as analysing() wanted phase Progressing) and a failing one
    is rolled back; a passing one stays paused, its weights unchanged."""
    from rollout_operator.analyzer import analysing

    manual = spec(strategy={"steps": [{"weight": 20}, {"weight": 60, "pause": "1s"}],
                            "analysis": {"interval": "1s", "failureLimit": 2,
                                         "metrics": [{"name": "error-rate", "max": 0.05}]}})
    for s, st in ((spec(paused=True), progressing()), (manual, progressing(weight=20, weights={"v2": 20, "v1": 80}))):
        st, _ = decide(s, st, READY, verdict(PASS), T0 + 5)
        held = dict(st.weights)
        assert st.phase == Phase.PAUSED and analysing(s, st)
        st, events = decide(s, st, READY, verdict(FAIL, 0.5, at=T0 + 6), T0 + 6)
        assert st.phase == Phase.PAUSED and st.weights == held and st.failures == 1 and events == []
        st, events = decide(s, st, READY, verdict(FAIL, 0.5, at=T0 + 7), T0 + 7)
        assert st.phase == Phase.ROLLED_BACK and st.weights == {"v1": 100, "v2": 0}
        assert reasons(events) == ["RolloutAborted"] and st.abort_reason.startswith("AnalysisFailed")
        assert not analysing(s, st)


def test_spec_paused_freezes_the_weights_and_the_step_clock() -> None:
    # 5 s into a 10 s step, paused for far longer than the step and the 120 s progress deadline
    st, events = decide(spec(paused=True), progressing(), READY, verdict(PASS, at=T0 + 4), T0 + 5)
    assert st.phase == Phase.PAUSED and st.weights == {"v2": 10, "v1": 90} and events == []
    for t in (100, 500):
        st, events = decide(spec(paused=True), st, READY, None, T0 + t)
        assert st.phase == Phase.PAUSED and st.paused_at == T0 + 5 and events == []
    # resumed: the step has run 5 s of its 10, so it holds; a fresh pass after 5 more seconds advances
    st, events = decide(spec(paused=False), st, READY, None, T0 + 501)
    assert st.phase == Phase.PROGRESSING and st.weights == {"v2": 10, "v1": 90} and events == []
    assert st.step_started_at == T0 + 496 and st.paused_at is None
    st, events = decide(spec(paused=False), st, READY, verdict(PASS, at=T0 + 506), T0 + 506)
    assert st.weights == {"v2": 50, "v1": 50} and reasons(events) == ["StepAdvanced"]


def test_a_firing_alert_rolls_back_at_once() -> None:
    st, events = decide(spec(), progressing(), replace(READY, alert="CanaryErrorRate"), None, T0 + 1)
    assert st.phase == Phase.ROLLED_BACK and st.weights == {"v1": 100, "v2": 0}
    assert "alert CanaryErrorRate" in events[0].message


def test_a_canary_that_never_loads_fails_at_the_progress_deadline() -> None:
    st = progressing(weight=0, weights={"v2": 0, "v1": 100})
    st, _ = decide(spec(), st, V2_LOADING, None, T0 + 60)
    assert st.phase == Phase.PROGRESSING
    st, events = decide(spec(), st, V2_LOADING, None, T0 + 121)
    assert st.phase == Phase.FAILED and "pod-a: loading" in events[0].message


def test_static_weights_hold_a_version_that_is_not_loaded_everywhere() -> None:
    s = spec(canary=None, weights={"v1": 70, "v2": 30})
    st = RolloutStatus(phase=Phase.READY, stable_version="v1", weights={"v1": 100, "v2": 0})
    held, _ = decide(s, st, V2_LOADING, None, T0)
    assert held.weights == {"v1": 100, "v2": 0} and "holding" in held.message
    applied, events = decide(s, held, READY, None, T0 + 1)
    assert applied.weights == {"v1": 70, "v2": 30} and reasons(events) == ["WeightsUpdated"]


def test_hold_unready_lets_a_not_ready_version_lose_weight_but_never_gain_it() -> None:
    world = World(versions_ready={"v1": True, "v2": False})
    assert hold_unready({"v1": 90, "v2": 10}, {"v1": 70, "v2": 30}, "v1", world) == {"v1": 90, "v2": 10}
    assert hold_unready({"v1": 50, "v2": 50}, {"v1": 70, "v2": 30}, "v1", world) == {"v1": 70, "v2": 30}


def test_first_reconcile_is_initializing_until_the_stable_version_serves() -> None:
    s = spec(canary=None)
    st, _ = decide(s, RolloutStatus(), World(), None, T0)
    assert st.phase == Phase.INITIALIZING and st.stable_version == "v1" and st.weights == {"v1": 100}
    assert condition(st, "Ready")["status"] == "False"  # type: ignore[index]
    st, _ = decide(s, st, READY, None, T0 + 1)
    assert st.phase == Phase.READY and condition(st, "Ready")["status"] == "True"  # type: ignore[index]


def test_an_invalid_spec_changes_only_phase_message_and_condition() -> None:
    st = progressing()
    bad = mark_invalid(st, "spec.weights.v1: 120 is outside 0-100", T0)
    assert bad.phase == Phase.INVALID_SPEC and bad.weights == st.weights and bad.canary_weight == st.canary_weight
    assert condition(bad, "InvalidSpec")["message"] == "spec.weights.v1: 120 is outside 0-100"  # type: ignore[index]


def test_status_round_trips_through_its_api_form() -> None:
    st, _ = decide(spec(), progressing(failures=1), READY, verdict(FAIL, 0.3), T0)
    assert RolloutStatus.from_dict(st.to_dict()) == st


# -- the canary's file: an in-place edit of uri/sha256 never inherits the old file's evidence --------

SHA_A, SHA_B = "a" * 64, "b" * 64


def versions(uri: str = "v2.mnn", sha: str | None = SHA_A) -> list[dict[str, Any]]:
    v2 = {"name": "v2", "uri": uri, **({"sha256": sha} if sha else {})}
    return [{"name": "v1", "uri": "v1.mnn"}, v2]


@pytest.mark.parametrize("edit", [{"uri": "v2-fixed.mnn"}, {"sha": SHA_B}, {"sha": None}])
def test_editing_the_canarys_file_midway_restarts_the_rollout_at_step_one_at_zero(edit: dict[str, Any]) -> None:
    before = progressing(step=1, weight=50, canary_file=f"v2.mnn@{SHA_A}", failures=1,
                         analysis=verdict(PASS, at=T0 + 9).as_status(0))
    # a pass that would otherwise promote (last step, pause over): the file it judged is gone
    st, events = decide(spec(versions=versions(**edit)), before, READY, verdict(PASS, at=T0 + 20), T0 + 20)
    assert reasons(events) == ["CanaryFileChanged", "StepStarted"]
    assert st.phase == Phase.PROGRESSING and st.current_step == 0 and st.failures == 0
    assert st.weights == {"v2": 10, "v1": 90} and st.step_started_at == T0 + 20
    assert st.canary_file == f"{edit.get('uri', 'v2.mnn')}@{edit.get('sha', SHA_A) or ''}"
    assert st.analysis == {}  # the old file's verdicts are not carried over


def test_an_unchanged_file_keeps_the_rollout_going_and_an_old_status_adopts_the_file() -> None:
    st, events = decide(spec(versions=versions()), progressing(canary_file=f"v2.mnn@{SHA_A}"), READY,
                        verdict(PASS), T0 + 11)
    assert reasons(events) == ["StepAdvanced"] and st.canary_file == f"v2.mnn@{SHA_A}"
    st, events = decide(spec(versions=versions()), progressing(), READY, verdict(PASS), T0 + 11)  # no canaryFile
    assert reasons(events) == ["StepAdvanced"] and st.canary_file == f"v2.mnn@{SHA_A}"


def test_a_fixed_file_for_a_rolled_back_canary_starts_a_new_attempt() -> None:
    rolled_back = progressing(canary_file=f"v2.mnn@{SHA_A}", phase=Phase.ROLLED_BACK, canary_weight=0,
                              weights={"v1": 100, "v2": 0})
    st, events = decide(spec(versions=versions()), rolled_back, READY, None, T0 + 50)
    assert st.phase == Phase.ROLLED_BACK and events == []  # the same file: stays rolled back until retry
    st, events = decide(spec(versions=versions(sha=SHA_B)), rolled_back, V2_LOADING, None, T0 + 50)
    assert reasons(events) == ["CanaryFileChanged"] and st.phase == Phase.PROGRESSING
    assert st.weights == {"v2": 0, "v1": 100}  # waits for the new file on every pod


# -- manual actions: applied, pending until they can apply, or ignored with the reason ---------------


def act(verb: str, world: World = READY, nonce: str = "1") -> World:
    return replace(world, action=verb, action_token=f"{verb}:{nonce}")


def test_an_applied_action_is_recorded_once_with_its_result() -> None:
    st, events = decide(spec(), progressing(), act("abort"), None, T0 + 1)
    assert st.phase == Phase.ROLLED_BACK and st.last_action == "abort:1" and st.action_result == "applied"
    assert st.pending_action is None and "ActionIgnored" not in reasons(events)


def test_promote_while_the_canary_is_loading_waits_and_applies_once_it_is_ready() -> None:
    st, events = decide(spec(), progressing(weight=0), act("promote", V2_LOADING), None, T0 + 1)
    assert st.last_action is None and st.pending_action == "promote:1: canary v2 is not loaded on every pod yet: " \
                                                          "pod-a: loading"
    assert st.current_step == 0 and events == []
    st, events = decide(spec(), st, act("promote"), None, T0 + 2)  # the caller offers it again: now it applies
    assert reasons(events) == ["StepStarted", "StepAdvanced"] and st.current_step == 1
    assert st.last_action == "promote:1" and st.action_result == "applied" and st.pending_action is None


def test_promote_full_waits_for_the_canary_to_load_and_the_old_stable_for_the_new_one() -> None:
    """promote-full on a canary not loaded everywhere gave it 100% (its pods served the stable by
    their fallback, while the status said v2); and after the scale-down delay the old stable was
    retired whether or not the new one served. Now the action waits, and so does the retirement;
    abort still applies at once."""
    st, events = decide(spec(), progressing(weight=0), act("promote-full", V2_LOADING), None, T0 + 1)
    assert st.phase == Phase.PROGRESSING and st.weights == {"v2": 0, "v1": 100} and events == []
    assert st.pending_action == "promote-full:1: canary v2 is not loaded on every pod yet: pod-a: loading"
    aborted, _ = decide(spec(), st, act("abort", V2_LOADING, nonce="2"), None, T0 + 2)
    assert aborted.phase == Phase.ROLLED_BACK and aborted.action_result == "applied"
    st, events = decide(spec(), st, act("promote-full"), None, T0 + 3)  # loaded now: applied
    assert st.phase == Phase.PROMOTING and st.weights == {"v2": 100, "v1": 0} and "RolloutPromoted" in reasons(events)
    st, events = decide(spec(), st, V2_LOADING, None, T0 + 40)  # past the delay, v2 lost on a pod meanwhile
    assert st.phase == Phase.PROMOTING and routed_versions(spec(), st) == ["v1", "v2"] and events == []
    assert "v1 retires once v2 is loaded on every pod (pod-a: loading)" in st.message
    st, events = decide(spec(), st, READY, None, T0 + 41)
    assert st.phase == Phase.SUCCEEDED and routed_versions(spec(), st) == ["v2"] and reasons(events) == ["RolloutSucceeded"]


@pytest.mark.parametrize("status, verb, says", [
    (progressing(), "retry", "nothing to retry: canary v2 is Progressing"),
    (progressing(phase=Phase.ROLLED_BACK, abort_reason="AnalysisFailed: error-rate"), "promote",
     "canary v2 was rolled back (AnalysisFailed: error-rate); retry it first"),
    (progressing(phase=Phase.ROLLED_BACK), "abort", "was rolled back"),
    (progressing(), "sideways", "'sideways' is not one of promote, promote-full, abort, retry"),
])
def test_an_action_that_cannot_apply_is_ignored_with_an_event_saying_why(status: RolloutStatus, verb: str,
                                                                         says: str) -> None:
    st, events = decide(spec(), status, act(verb), None, T0 + 1)
    assert reasons(events) == ["ActionIgnored"] and says in events[0].message
    assert st.last_action == f"{verb}:1" and st.action_result == f"ignored: {events[0].message.split(': ', 1)[1]}"
    assert st.phase == status.phase and st.weights == status.weights  # nothing else moved


def test_actions_without_a_canary_and_promote_while_paused_are_ignored() -> None:
    static = RolloutStatus(phase=Phase.READY, stable_version="v1", weights={"v1": 100})
    st, events = decide(spec(canary=None), static, act("promote"), None, T0)
    assert reasons(events) == ["ActionIgnored"] and "no rollout in progress: v1 is stable" in events[0].message
    st, events = decide(spec(paused=True), progressing(), act("promote"), None, T0 + 1)
    assert reasons(events) == ["ActionIgnored"] and "resume the rollout first" in events[0].message
    assert st.weights == {"v2": 10, "v1": 90}


def test_an_alert_still_firing_after_retry_rolls_the_new_attempt_back() -> None:
    firing = replace(READY, alert="CanaryErrorRate")
    st, _ = decide(spec(), progressing(canary_file="v2.mnn@"), firing, None, T0 + 1)
    assert st.phase == Phase.ROLLED_BACK
    st, events = decide(spec(), st, firing, None, T0 + 2)  # still firing: nothing new happens
    assert st.phase == Phase.ROLLED_BACK and events == []
    st, events = decide(spec(), st, act("retry", firing), None, T0 + 3)
    assert reasons(events) == ["RolloutRetried", "RolloutAborted"] and st.phase == Phase.ROLLED_BACK
    assert "alert CanaryErrorRate is firing" in events[1].message
    st, events = decide(spec(), st, act("retry", nonce="2"), None, T0 + 4)  # resolved: the retry proceeds
    assert reasons(events) == ["RolloutRetried", "StepStarted"] and st.phase == Phase.PROGRESSING


def test_an_alert_mark_names_the_canary_it_fired_for() -> None:
    from rollout_operator.reconcile import firing_alert

    assert firing_alert("CanaryErrorRate@2026-12-01T00:00:00Z@v2", "v2") == "CanaryErrorRate"
    assert firing_alert("CanaryErrorRate@2026-12-01T00:00:00Z@v2", "v3") is None  # an older canary's alert
    assert firing_alert("CanaryErrorRate@2026-12-01T00:00:00Z", "v3") == "CanaryErrorRate"  # no version: any
    assert firing_alert(None, "v2") is None and firing_alert("A@t@v2", None) is None
