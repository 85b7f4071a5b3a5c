"""The state machine with shadow steps and ``compare: stable`` metrics, table-driven: (spec, status,
world, analysis) -> (status, events), and the runtime config a shadow step renders."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from mnn_rollout.contract.config import parse_config_text
from rollout_operator import children
from rollout_operator.analyzer import analysing, next_due
from rollout_operator.rollout import World, decide, routed_versions
from rollout_operator.spec import parse_spec
from rollout_operator.status import Phase, RolloutStatus
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Analysis, MetricResult

T0 = 1_800_000_000.0
READY = World(versions_ready={"v1": True, "v2": True}, ready_pods=2, desired_pods=2)
CONVERSION = {"name": "conversion", "compare": "stable", "margin": 0.01}


def spec(steps: list[dict[str, Any]] | None = None, failure_limit: int = 3, deadline: int = 120) -> Any:
    return parse_spec({
        "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}],
        "stable": "v1", "canary": "v2",
        "strategy": {"steps": steps or [{"shadow": 20, "pause": "10s"}, {"weight": 10, "pause": "10s"},
                                        {"weight": 50, "pause": "10s"}],
                     "analysis": {"interval": "1s", "failureLimit": failure_limit, "minRequests": 10,
                                  "metrics": [{"name": "error-rate", "max": 0.05}, CONVERSION]},
                     "scaleDownDelaySeconds": 30},
        "progressDeadlineSeconds": deadline,
    })


def at_step(step: int, weight: int = 0, shadow: int | None = None, started: float = T0, **over: Any) -> RolloutStatus:
    base = RolloutStatus(phase=Phase.PROGRESSING, stable_version="v1", canary_version="v2", canary_weight=weight,
                         weights={"v2": weight, "v1": 100 - weight}, current_step=step, total_steps=3,
                         step_text=f"{step + 1}/3", step_started_at=started, rollout_started_at=T0,
                         shadow_percent=shadow, canary_file="v2.mnn@")
    return replace(base, **over)


def compared(decision: str, at: float = T0 + 1, estimate: float = 0.0) -> Analysis:
    """A look whose compare: stable metric decided ``decision``, with its status entry."""
    verdict = {"worse": FAIL, "not-worse": PASS, "better": PASS}.get(decision, INCONCLUSIVE)
    lower, upper = estimate - 0.01, estimate + 0.01
    entry = {"strata": [{"step": 1, "canary": {"n": 500.0, "sum": 50.0}, "stable": {"n": 500.0, "sum": 50.0}}],
             "decision": decision, "estimate": estimate, "lower": lower, "upper": upper, "confidence": 0.95,
             "margin": 0.01, "message": f"canary - stable = {estimate:+.4g}", "checkedAt": "x"}
    metrics = (MetricResult("error-rate", 0.0, "error rate <= 0.05", PASS),
               MetricResult("conversion", estimate, "canary - stable: lower bound > -0.01", verdict,
                            f"{decision}: canary - stable = {estimate:+.4g}, 0.95 always-valid interval "
                            f"[{lower:+.4g}, {upper:+.4g}]", (lower, upper), immediate=verdict == FAIL))
    return Analysis(at, FAIL if verdict == FAIL else verdict if verdict == INCONCLUSIVE else PASS, metrics, 100,
                    sequential={"conversion": entry})


def shadow_look(verdict: str, at: float = T0 + 1) -> Analysis:
    return Analysis(at, verdict, (MetricResult("shadow-error-rate", 1.0 if verdict == FAIL else 0.0,
                                               "shadow error rate <= 0.05", verdict),), 150, shadow=True)


def reasons(events: list[Any]) -> list[str]:
    return [e.reason for e in events]


# -- shadow steps ----------------------------------------------------------------------------------


def test_a_shadow_step_starts_at_weight_0_with_a_shadow_once_the_canary_is_loaded() -> None:
    st, events = decide(spec(), RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}),
                        World(versions_ready={"v1": True}, ready_pods=2, desired_pods=2), None, T0)
    assert (st.current_step, st.canary_weight, st.shadow_percent) == (0, 0, None)  # not loaded: no shadow yet
    assert not analysing(spec(), st)
    st, events = decide(spec(), st, READY, None, T0 + 2)
    assert (st.canary_weight, st.weights, st.shadow_percent) == (0, {"v2": 0, "v1": 100}, 20)
    assert reasons(events) == ["StepStarted"] and "shadow of 20% of stable's requests, weight 0" in events[0].message
    assert st.step_started_at == T0 + 2 and analysing(spec(), st) and next_due(spec(), st) == 1.0
    assert st.message == "step 1/3: shadow 20%: analysing"


def test_the_runtime_config_carries_the_shadow_only_during_a_shadow_step() -> None:
    target = children.Target("scorer", "default")

    def config(status: RolloutStatus) -> dict[str, Any] | None:
        shadow = (status.canary_version, status.shadow_percent) if status.shadow_percent else None
        rendered = children.runtime_config(spec(), "scorer", status.weights, "v1", routed_versions(spec(), status),
                                           None, shadow)
        text = children.render_configmap(target, rendered)["data"]["runtime.yaml"]
        found = parse_config_text(text).shadow
        return None if found is None else found.model_dump()

    assert config(at_step(0, shadow=20)) == {"version": "v2", "percent": 20}
    st, events = decide(spec(), at_step(0, shadow=20), READY, shadow_look(PASS), T0 + 11)
    assert reasons(events) == ["StepAdvanced"] and "step 2/3: 10%" in events[0].message
    assert (st.canary_weight, st.shadow_percent) == (10, None) and config(st) is None


def test_a_canary_failing_its_shadow_step_is_rolled_back_having_served_no_user() -> None:
    st, events = decide(spec(failure_limit=2), at_step(0, shadow=20, failures=1), READY, shadow_look(FAIL), T0 + 3)
    assert st.phase == Phase.ROLLED_BACK and reasons(events) == ["RolloutAborted"]
    assert st.weights == {"v1": 100, "v2": 0} and st.canary_weight == 0 and st.shadow_percent is None
    assert events[0].message.endswith("(in a shadow step: the canary served no user)")
    assert st.abort_reason is not None and st.abort_reason.startswith("AnalysisFailed: shadow-error-rate = 1 breached")


def test_one_failed_shadow_check_under_the_failure_limit_holds_the_shadow() -> None:
    st, events = decide(spec(failure_limit=2), at_step(0, shadow=20), READY, shadow_look(FAIL), T0 + 3)
    assert st.phase == Phase.PROGRESSING and events == [] and st.failures == 1
    assert (st.canary_weight, st.shadow_percent) == (0, 20)


def test_shadow_steps_one_after_another_change_the_percent_and_keep_weight_0() -> None:
    steps = [{"shadow": 10, "pause": "5s"}, {"shadow": 50, "pause": "5s"}, {"weight": 20, "pause": "5s"}]
    st, events = decide(spec(steps), at_step(0, shadow=10), READY, shadow_look(PASS), T0 + 6)
    assert (st.current_step, st.canary_weight, st.shadow_percent) == (1, 0, 50)
    assert "step 2/3: shadow 50% (weight 0)" in events[0].message


def test_an_aborted_canary_takes_its_shadow_away() -> None:
    no_canary = parse_spec({"versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}],
                            "stable": "v1"})
    st, events = decide(no_canary, at_step(0, shadow=20), READY, None, T0 + 2)
    assert st.shadow_percent is None and "RolloutAborted" in reasons(events)


# -- compare: stable -------------------------------------------------------------------------------


@pytest.mark.parametrize(("analysis", "now", "phase", "weight", "events"), [
    # worse: rolled back at once, with failureLimit 3 and no failure before
    (compared("worse", estimate=-0.05), T0 + 2, Phase.ROLLED_BACK, 0, ["RolloutAborted"]),
    # undecided: holds, past the pause, without counting a failure
    (compared("undecided"), T0 + 30, Phase.PROGRESSING, 10, []),
    (compared("insufficient"), T0 + 30, Phase.PROGRESSING, 10, []),
    # not worse (or better), pause over: the next step
    (compared("not-worse"), T0 + 11, Phase.PROGRESSING, 50, ["StepAdvanced"]),
    (compared("better", estimate=0.03), T0 + 11, Phase.PROGRESSING, 50, ["StepAdvanced"]),
    # not worse but the pause is not over: holds
    (compared("not-worse"), T0 + 5, Phase.PROGRESSING, 10, []),
])
def test_compare_decisions_drive_the_step(analysis: Analysis, now: float, phase: Phase, weight: int,
                                         events: list[str]) -> None:
    st, emitted = decide(spec(), at_step(1, weight=10), READY, replace(analysis, at=now), now)
    assert (st.phase, st.canary_weight, reasons(emitted)) == (phase, weight, events)
    assert st.failures == (1 if phase == Phase.ROLLED_BACK else 0)
    assert st.sequential == analysis.sequential  # kept in the status between reconciles


def test_worse_names_the_estimate_and_interval_in_the_event_and_abort_reason() -> None:
    st, events = decide(spec(), at_step(1, weight=10), READY, compared("worse", estimate=-0.05), T0 + 2)
    assert events[0].message == ("canary v2 rolled back: conversion: worse: canary - stable = -0.05, 0.95 "
                                 "always-valid interval [-0.06, -0.04]")
    assert st.abort_reason == "AnalysisFailed: " + events[0].message.removeprefix("canary v2 rolled back: ")


def test_undecided_until_the_progress_deadline_fails_the_rollout() -> None:
    st, events = decide(spec(deadline=20), at_step(1, weight=10), READY, compared("undecided", at=T0 + 21), T0 + 21)
    assert st.phase == Phase.FAILED and reasons(events) == ["RolloutAborted"]
    assert "last analysis: inconclusive" in events[0].message


def test_advancing_and_promoting_say_the_evidence() -> None:
    st, events = decide(spec(), at_step(1, weight=10), READY, compared("not-worse", T0 + 11, 0.002), T0 + 11)
    assert events[0].message == "canary v2 step 3/3: 50% (conversion: not-worse +0.002 [-0.008, +0.012])"
    st, events = decide(spec(), replace(st, step_started_at=T0 + 11), READY, compared("better", T0 + 22, 0.02),
                        T0 + 22)
    assert reasons(events) == ["RolloutPromoted"]
    assert events[0].message.endswith("(conversion: better +0.02 [+0.01, +0.03])")


def test_a_restarted_rollout_starts_its_comparison_afresh() -> None:
    old = at_step(1, weight=10, sequential={"conversion": {"strata": [{"step": 1}], "decision": "undecided"}})
    edited = parse_spec({**spec().model_dump(by_alias=True, exclude_unset=True),
                         "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2-new.mnn"}]})
    st, events = decide(edited, old, READY, None, T0 + 3)
    assert "CanaryFileChanged" in reasons(events)
    assert st.sequential is None and st.current_step == 0 and st.canary_weight == 0


def test_kubectl_mnn_rollout_status_shows_the_shadow_the_estimate_and_the_interval() -> None:
    from rollout_operator.ctl import render

    entry = {"decision": "worse", "estimate": -0.132, "lower": -0.2068, "upper": -0.05715, "confidence": 0.95,
             "canary": {"n": 275.0, "mean": 0.16}, "stable": {"n": 2257.0, "mean": 0.292}}
    md = {"metadata": {"namespace": "default", "name": "scorer"}, "spec": {},
          "status": {"phase": "Progressing", "stableVersion": "v1", "canaryVersion": "v2", "canaryWeight": 0,
                     "shadowPercent": 20, "stepText": "1/3", "sequential": {"conversion": entry},
                     "experiment": {"state": "Winner", "metric": "conversion", "weights": {"v1": 50, "v3": 50},
                                    "winner": "v3", "control": "v1", "comparisons": {"v3": {**entry,
                                                                                           "decision": "better"}},
                                    "message": "v3 won on conversion"}}}
    text = render(md)
    assert "├─ canary  v2  weight 0%  shadow 20% of stable's requests  step 1/3" in text
    assert "│  worse        conversion               -0.132 [-0.2068, -0.05715] at 0.95  0.16 (n 275) vs stable " \
           "0.292 (n 2,257)" in text
    assert "├─ experiment Winner on conversion  v1:50, v3:50  winner v3" in text
    assert "│  better       v3 vs v1                 -0.132 [" in text and "│  v3 won on conversion" in text
