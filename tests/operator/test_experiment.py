"""A/B experiments: the looks (each challenger against stable, Bonferroni over the challengers) and
the state machine (start, split once loaded, promote the winner, keep stable without one)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rollout_operator import experiment
from rollout_operator.analyzer import analysing, next_due
from rollout_operator.rollout import World, decide, routed_versions
from rollout_operator.spec import parse_spec
from rollout_operator.status import Phase, RolloutStatus
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Sample

T0 = 1_800_000_000.0
VERSIONS = ("v1", "v2", "v3")
ALL_READY = World(versions_ready={v: True for v in VERSIONS}, ready_pods=2, desired_pods=2)


def spec(weights: dict[str, int] | None = None, **more: Any) -> Any:
    return parse_spec({
        "versions": [{"name": v, "uri": f"{v}.mnn"} for v in VERSIONS], "stable": "v1",
        "experiment": {"weights": weights or {"v1": 34, "v2": 33, "v3": 33}, "metric": "conversion", **more},
        "strategy": {"analysis": {"interval": "5s", "metrics": [
            {"name": "conversion", "compare": "stable", "margin": 0, "effect": 0.01}]}, "scaleDownDelaySeconds": 30},
        "progressDeadlineSeconds": 3600,
    })


def rates(**conversions: tuple[int, int]) -> dict[str, Sample]:
    """version=(successes, trials) -> a sample per version."""
    return {v: Sample(requests=0, errors=0, counts={"conversion": {"successes": float(s), "trials": float(n)}})
            for v, (s, n) in conversions.items()}


def running(now: float = T0) -> RolloutStatus:
    """Started, every version loaded, the split served from ``now``."""
    st, _ = decide(spec(), RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}), ALL_READY,
                   None, now)
    return st


def reasons(events: list[Any]) -> list[str]:
    return [e.reason for e in events]


def test_each_challenger_is_compared_with_stable_at_the_split_confidence() -> None:
    st = running()
    look = experiment.evaluate(spec(), st, rates(v1=(1000, 10000), v2=(1000, 10000), v3=(1000, 10000)), T0 + 5)
    assert [m.name for m in look.metrics] == ["conversion v2 vs v1", "conversion v3 vs v1"]
    assert look.comparisons is not None and set(look.comparisons) == {"v2", "v3"}
    assert all(c.confidence == 1 - 0.05 / 2 for c in look.comparisons.values())
    assert look.sequential is not None and look.sequential["v2"]["strata"][0]["canary"] == {"n": 10000.0,
                                                                                            "sum": 1000.0}
    assert look.verdict == INCONCLUSIVE  # equal: neither better nor worse, with margin 0
    # the counts are kept: the next look adds to them
    st = replace(st, experiment={**(st.experiment or {}), "comparisons": look.sequential})
    again = experiment.evaluate(spec(), st, rates(v1=(10, 100), v2=(10, 100), v3=(10, 100)), T0 + 10)
    assert again.sequential["v2"]["strata"][0]["canary"] == {"n": 10100.0, "sum": 1010.0}  # type: ignore[index]


def test_the_winner_is_the_better_challenger_whose_interval_lies_furthest_up() -> None:
    look = experiment.evaluate(spec(), running(), rates(v1=(1000, 10000), v2=(1300, 10000), v3=(1600, 10000)),
                               T0 + 5)
    assert look.comparisons is not None
    assert {v: c.decision for v, c in look.comparisons.items()} == {"v2": "better", "v3": "better"}
    assert look.verdict == PASS and look.message == "v3 is better than v1"


def test_every_challenger_worse_is_a_failed_look_and_a_missing_stable_is_no_look() -> None:
    look = experiment.evaluate(spec(), running(), rates(v1=(3000, 10000), v2=(1000, 10000), v3=(1200, 10000)),
                               T0 + 5)
    assert look.verdict == FAIL and look.message == "every challenger is worse than v1"
    none = experiment.evaluate(spec(), running(), {"v2": Sample(requests=1, errors=0)}, T0 + 5)
    assert none.verdict == INCONCLUSIVE and none.message == "no data: no sample"


def test_an_experiment_starts_once_every_version_is_loaded_and_analyses_the_split() -> None:
    loading = World(versions_ready={"v1": True, "v2": True, "v3": False}, ready_pods=2, desired_pods=2)
    st, events = decide(spec(), RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}),
                        loading, None, T0)
    assert reasons(events) == ["ExperimentStarted"]
    assert events[0].message == "A/B test of v2, v3 against v1 on conversion: v1:34 v2:33 v3:33"
    assert st.phase == Phase.PROGRESSING and st.experiment and st.experiment["state"] == "Running"
    assert st.weights == {"v1": 67, "v2": 33, "v3": 0} and st.step_started_at is None  # v3 not loaded: no weight
    assert not analysing(spec(), st) and "waiting for v3" in st.message
    st, events = decide(spec(), st, ALL_READY, None, T0 + 3)
    assert events == [] and st.weights == {"v1": 34, "v2": 33, "v3": 33} and st.step_started_at == T0 + 3
    assert analysing(spec(), st) and next_due(spec(), st) == 5.0
    assert set(routed_versions(spec(), st)) == set(VERSIONS)


def test_a_winner_is_promoted_and_the_others_retire_after_the_delay() -> None:
    st = running()
    look = experiment.evaluate(spec(), st, rates(v1=(1000, 10000), v2=(1300, 10000), v3=(1000, 10000)), T0 + 5)
    st, events = decide(spec(), st, ALL_READY, look, T0 + 5)
    assert reasons(events) == ["ExperimentConcluded", "RolloutPromoted"]
    assert events[0].message.startswith("v2 won on conversion: +0.03 [") and "against v1 at 0.975" in events[0].message
    assert st.phase == Phase.PROMOTING and st.stable_version == "v2"
    assert st.weights == {"v2": 100, "v1": 0, "v3": 0}
    assert st.experiment is not None and (st.experiment["state"], st.experiment["winner"]) == ("Winner", "v2")
    assert st.experiment["comparisons"]["v2"]["decision"] == "better"  # the evidence stays in the status
    assert not analysing(spec(), st)
    st, events = decide(spec(), st, ALL_READY, None, T0 + 36)
    assert st.phase == Phase.SUCCEEDED and reasons(events) == ["RolloutSucceeded"]
    assert st.retired == ("v1", "v3") and routed_versions(spec(), st) == ["v2"]
    st, events = decide(spec(), st, ALL_READY, None, T0 + 40)
    assert st.phase == Phase.SUCCEEDED and events == []  # concluded: not started again while the spec names it


def test_without_a_winner_stable_stays_at_the_deadline() -> None:
    timed = spec(maxDuration="1m")
    st, _ = decide(timed, RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}), ALL_READY,
                   None, T0)
    look = experiment.evaluate(timed, st, rates(v1=(100, 1000), v2=(101, 1000), v3=(99, 1000)), T0 + 30)
    st, events = decide(timed, st, ALL_READY, look, T0 + 30)
    assert events == [] and st.phase == Phase.PROGRESSING and st.weights == {"v1": 34, "v2": 33, "v3": 33}
    assert "v2: undecided" in st.message
    st, events = decide(timed, st, ALL_READY, None, T0 + 61)
    assert reasons(events) == ["ExperimentConcluded"] and events[0].message.startswith(
        "no challenger was better within 61s: v1 stays stable; v2: undecided")
    assert st.phase == Phase.READY and st.stable_version == "v1" and st.weights == {"v1": 100, "v2": 0, "v3": 0}
    assert st.experiment is not None and st.experiment["state"] == "NoWinner" and st.experiment["winner"] is None


def test_every_challenger_worse_ends_the_experiment_early_keeping_stable() -> None:
    st = running()
    look = experiment.evaluate(spec(), st, rates(v1=(3000, 10000), v2=(1000, 10000), v3=(1200, 10000)), T0 + 5)
    st, events = decide(spec(), st, ALL_READY, look, T0 + 5)
    assert reasons(events) == ["ExperimentConcluded"] and st.weights == {"v1": 100, "v2": 0, "v3": 0}
    assert st.experiment is not None and st.experiment["state"] == "NoWinner"


def test_removing_a_running_experiment_aborts_it_and_naming_it_again_starts_afresh() -> None:
    st = running()
    plain = parse_spec({"versions": [{"name": v, "uri": f"{v}.mnn"} for v in VERSIONS], "stable": "v1"})
    st, events = decide(plain, st, ALL_READY, None, T0 + 5)
    assert reasons(events) == ["ExperimentAborted", "WeightsUpdated"] and st.weights == {"v1": 100}
    assert st.experiment is not None and st.experiment["state"] == "Aborted"
    st, events = decide(spec(), st, ALL_READY, None, T0 + 6)
    assert reasons(events) == ["ExperimentStarted"] and st.experiment and st.experiment["state"] == "Running"


def test_actions_are_ignored_during_an_experiment_saying_why() -> None:
    st, events = decide(spec(), running(), replace(ALL_READY, action="promote", action_token="promote:1"), None,
                        T0 + 1)
    assert reasons(events) == ["ActionIgnored"] and "an experiment is running" in events[0].message


def ab_on_a_real_runtime(model_dir: Any, name: str, metrics: list[dict[str, Any]], failure_limit: int = 2,
                         ) -> tuple[RolloutStatus, Any, Any]:
    """A 50/50 A/B of v1 and v2 judged by ``metrics``, run by the operator's own Reconciler (the
    demo's local ports) on a real runtime while simulated users convert 10% with v1 and 30% with
    v2 and post feedback. Returns the final status, the rollout (events, history) and the users;
    the config is applied (``wait_applied``) before the runtime stops."""
    from mnn_rollout.demo.ports import LocalRollout
    from mnn_rollout.local.outcomes import Conversions
    from mnn_rollout.local.process import LocalRuntime
    from mnn_rollout.local.traffic import Traffic

    raw = {"model": "scorer", "stable": "v1",
           "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}],
           "experiment": {"weights": {"v1": 50, "v2": 50}, "metric": "conversion", "maxDuration": "40s"},
           "strategy": {"analysis": {"interval": "1s", "failureLimit": failure_limit, "metrics": metrics},
                        "scaleDownDelaySeconds": 1},
           "progressDeadlineSeconds": 60}
    rollout = LocalRollout(raw, model_dir / f"{name}.yaml", name="scorer", time_limit=50)
    rollout.prepare()
    runtime = LocalRuntime(model_dir / f"{name}.yaml", model_dir / "runtime.log", feedback_token="experiment-token")
    runtime.start()
    users = Conversions(runtime.url, "scorer", {"v1": 0.10, "v2": 0.30}, "experiment-token").start()
    traffic = Traffic(runtime.url, "scorer", users=500, rate=150, connections=2, max_seconds=60,
                      on_answer=users.answered).start()
    try:
        final = rollout.run(runtime.url)
        assert rollout.wait_applied()
    finally:
        traffic.stop()
        users.stop()
        assert runtime.stop() == 0
    return final, rollout, users


CONVERSION = {"name": "conversion", "compare": "stable", "margin": 0, "effect": 0.1}


def test_an_experiment_against_a_real_runtime_promotes_the_version_users_convert_more_with(model_dir: Any) -> None:
    """A 50/50 split is held while undecided; the sequential test finds v2 better and promotes it."""
    from mnn_rollout.contract.config import load_config_file

    final, rollout, users = ab_on_a_real_runtime(model_dir, "ab", [CONVERSION])
    assert final.phase == Phase.SUCCEEDED and final.stable_version == "v2", final.message
    assert final.experiment is not None and (final.experiment["state"], final.experiment["winner"]) == ("Winner", "v2")
    evidence = final.experiment["comparisons"]["v2"]
    assert evidence["decision"] == "better" and evidence["lower"] > 0 and evidence["stable"]["n"] >= 100
    assert reasons([e for _, e in rollout.events])[:2] == ["ExperimentStarted", "ChildrenCreated"]
    assert {"ExperimentConcluded", "RolloutPromoted", "RolloutSucceeded"} <= set(reasons([e for _, e in rollout.events]))
    served = [st.weights for _, st in rollout.history if st.phase == Phase.PROGRESSING]
    assert {"v1": 50, "v2": 50} in served  # the split was held while undecided
    assert [v.name for v in load_config_file(model_dir / "ab.yaml").versions] == ["v2"]
    assert users.counted > 0 and users.failed == 0


# -- guards: the challengers are held to the analysis's thresholds and alerts, as a canary is --------


def guarded(limit: int = 2) -> Any:
    """spec() with an error-rate guard (max 5%) and a latency guard (p99 under 0.2 s)."""
    return parse_spec({
        "versions": [{"name": v, "uri": f"{v}.mnn"} for v in VERSIONS], "stable": "v1",
        "experiment": {"weights": {"v1": 34, "v2": 33, "v3": 33}, "metric": "conversion"},
        "strategy": {"analysis": {"interval": "5s", "failureLimit": limit, "minRequests": 50, "metrics": [
            {"name": "conversion", "compare": "stable", "margin": 0, "effect": 0.01},
            {"name": "error-rate", "max": 0.05}, {"name": "latency-p99", "max": 0.2}]}},
        "progressDeadlineSeconds": 3600,
    })


def served(requests: float, errors: float, p99: float = 0.01, conv: tuple[int, int] = (100, 1000)) -> Sample:
    return Sample(requests=requests, errors=errors, latency={"p99": p99},
                  counts={"conversion": {"successes": float(conv[0]), "trials": float(conv[1])}})


def test_a_challenger_over_a_guard_fails_the_look_even_when_it_converts_better() -> None:
    st = running()
    samples = {"v1": served(1000, 0), "v2": served(1000, 300, conv=(1600, 10000)), "v3": served(1000, 0, p99=0.5)}
    look = experiment.evaluate(guarded(), st, samples, T0 + 5)
    assert look.breached == ("v2", "v3") and look.verdict == FAIL
    assert look.message == ("v2, v3 breached a guard: error-rate (v2) = 0.3 breached error rate <= 0.05; "
                            "latency-p99 (v3) = 0.5 breached p99 seconds <= 0.2")
    st, events = decide(guarded(), st, ALL_READY, look, T0 + 5)
    assert events == [] and st.phase == Phase.PROGRESSING and st.stable_version == "v1"  # not promoted
    assert st.failures == 1 and "(1/2 failed looks); no promotion meanwhile" in st.message
    assert st.weights == {"v1": 34, "v2": 33, "v3": 33}  # failureLimit 2: the split holds for one more look
    st, events = decide(guarded(), st, ALL_READY, experiment.evaluate(guarded(), st, samples, T0 + 10), T0 + 10)
    assert reasons(events) == ["ExperimentAborted"] and "v1 takes all the traffic back" in events[0].message
    assert st.phase == Phase.ROLLED_BACK and st.weights == {"v1": 100, "v2": 0, "v3": 0}
    assert st.experiment is not None and st.experiment["state"] == "Aborted" and st.abort_reason == look.message
    assert not analysing(guarded(), st)
    st, events = decide(guarded(), st, ALL_READY, None, T0 + 20)
    assert events == [] and st.phase == Phase.ROLLED_BACK  # stays aborted while the spec names it


def test_a_clean_look_resets_the_count_and_one_without_enough_traffic_judges_no_guard() -> None:
    st = running()
    bad = {"v1": served(1000, 0), "v2": served(1000, 300), "v3": served(1000, 0)}
    st, _ = decide(guarded(), st, ALL_READY, experiment.evaluate(guarded(), st, bad, T0 + 5), T0 + 5)
    assert st.failures == 1
    # 49 < minRequests: no verdict either way (v2's 2 errors would be 4% of 50 requests, within the 5% max)
    thin = experiment.evaluate(guarded(), st, {"v1": served(1000, 0), "v2": served(49, 2), "v3": served(49, 0)},
                               T0 + 10)
    assert thin.breached is None and thin.verdict == INCONCLUSIVE
    st, _ = decide(guarded(), st, ALL_READY, thin, T0 + 10)
    assert st.failures == 1
    clean = experiment.evaluate(guarded(), st, {"v1": served(1000, 0), "v2": served(1000, 10), "v3": served(1000, 0)},
                                T0 + 15)
    assert clean.breached == () and [m.verdict for m in clean.metrics if "(" in m.name] == [PASS] * 4
    st, _ = decide(guarded(), st, ALL_READY, clean, T0 + 15)
    assert st.failures == 0 and st.phase == Phase.PROGRESSING


def test_a_better_challenger_is_promoted_only_once_judged_on_its_guards_in_that_look() -> None:
    """Found in review: the metric's counts build up over the whole step, the guards count the
    interval; a challenger too thin in the interval, or with no request count, was promoted unguarded."""
    st = running()
    conv = {"v1": (1000, 10000), "v2": (1600, 10000), "v3": (1000, 10000)}
    thin = served(49, 2, p99=9.0, conv=conv["v2"])  # its 2 errors: 4% of minRequests, within the max
    uncounted = Sample(requests=None, counts=served(0, 0, conv=conv["v2"]).counts)
    for v2 in (thin, uncounted):
        samples = {"v1": served(1000, 0, conv=conv["v1"]), "v2": v2, "v3": served(1000, 0, conv=conv["v3"])}
        look = experiment.evaluate(guarded(), st, samples, T0 + 5)
        assert look.verdict == INCONCLUSIVE and look.message.startswith(
            "v2 is better than v1 but not judged on its guards in this look"), look.message
        after, events = decide(guarded(), st, ALL_READY, look, T0 + 5)
        assert events == [] and after.stable_version == "v1" and after.phase == Phase.PROGRESSING
    samples = {"v1": served(1000, 0, conv=conv["v1"]), "v2": served(1000, 5, conv=conv["v2"]),
               "v3": served(1000, 0, conv=conv["v3"])}
    st, events = decide(guarded(), st, ALL_READY, experiment.evaluate(guarded(), st, samples, T0 + 10), T0 + 10)
    assert reasons(events) == ["ExperimentConcluded", "RolloutPromoted"] and st.stable_version == "v2"


def test_a_thin_challenger_whose_errors_break_the_rate_even_at_min_requests_is_judged_on_them() -> None:
    """Fewer than minRequests (50) in the interval, but 3 errors are 6% of 50, over the 5% max whatever
    the rest would have been: the look fails on the error rate alone (its thin p99 is not judged), and
    a challenger better on the metric is not promoted; 2 errors (4%) stay unjudged."""
    st = running()
    conv = {"v1": (1000, 10000), "v2": (1600, 10000), "v3": (1000, 10000)}
    samples = {"v1": served(1000, 0, conv=conv["v1"]), "v2": served(20, 3, p99=9.0, conv=conv["v2"]),
               "v3": served(1000, 0, conv=conv["v3"])}
    look = experiment.evaluate(guarded(), st, samples, T0 + 5)
    assert look.verdict == FAIL and look.breached == ("v2",), look
    assert [m.name for m in look.metrics if m.name.endswith("(v2)")] == ["error-rate (v2)"]
    st, events = decide(guarded(), st, ALL_READY, look, T0 + 5)
    assert st.failures == 1 and st.stable_version == "v1" and events == []
    samples["v2"] = served(20, 2, p99=9.0, conv=conv["v2"])
    look = experiment.evaluate(guarded(), st, samples, T0 + 10)
    assert look.verdict == INCONCLUSIVE and look.breached == (), look


def test_an_alert_firing_for_a_challenger_aborts_the_experiment_at_once() -> None:
    st, events = decide(guarded(limit=5), running(), replace(ALL_READY, alert="HighErrorRate"), None, T0 + 1)
    assert reasons(events) == ["ExperimentAborted"] and events[0].message.startswith("alert HighErrorRate is firing")
    assert st.phase == Phase.ROLLED_BACK and st.weights == {"v1": 100, "v2": 0, "v3": 0}
    loading = World(versions_ready={"v1": True, "v2": True, "v3": False}, ready_pods=2, desired_pods=2,
                    alert="HighErrorRate")
    st, events = decide(guarded(), RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}),
                        loading, None, T0)
    assert reasons(events) == ["ExperimentStarted", "ExperimentAborted"]  # not held until v3 loads
    assert st.phase == Phase.ROLLED_BACK and st.weights == {"v1": 100}


def test_an_alert_mark_names_a_challenger_or_any_of_them() -> None:
    from rollout_operator.reconcile import _guarded, firing_alert

    st = running()
    assert _guarded(spec(), st) == ["v2", "v3"]
    assert [firing_alert("Slow@t0@v3", v) for v in _guarded(spec(), st)] == [None, "Slow"]
    assert [firing_alert("Slow@t0@v2,v3", v) for v in _guarded(spec(), st)] == ["Slow", "Slow"]  # by object: all
    assert firing_alert("Slow@t0@v1", "v2") is None
    assert firing_alert("Slow@t0@v2,v3", "v9") is None  # found in review: a later canary is not rolled back by it


def test_a_challenger_breaching_a_guard_on_a_real_runtime_aborts_the_experiment(model_dir: Any) -> None:
    """The guards are sampled by the same provider as the metric: a p99 bound no forward can meet
    (1 µs) fails the challenger at its first judged look (failureLimit 1), and stable takes all the
    traffic back, though users convert more with the challenger."""
    final, rollout, _ = ab_on_a_real_runtime(model_dir, "guarded", [CONVERSION, {"name": "latency-p99", "max": 0.000001}],
                                             failure_limit=1)
    assert final.phase == Phase.ROLLED_BACK and final.stable_version == "v1", final.message
    assert final.weights == {"v1": 100, "v2": 0}
    assert final.experiment is not None and final.experiment["state"] == "Aborted"
    assert final.abort_reason is not None and final.abort_reason.startswith("v2 breached a guard: latency-p99 (v2) = ")
    assert "ExperimentAborted" in reasons([e for _, e in rollout.events])
    assert "RolloutPromoted" not in reasons([e for _, e in rollout.events])
