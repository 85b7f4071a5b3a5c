"""Condition Progressing follows the rollout: True when a rollout starts, is retried or restarts on
a new canary, and once it is promoted; False when it is rolled back or aborted. lastTransitionTime
changes only when its status does. Before, only a rollback wrote it (as False), so a retried or new
canary went on showing the last rollback's reason to ``kubectl describe`` and ``kubectl wait``."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rollout_operator.rollout import decide
from rollout_operator.status import Phase, RolloutStatus, condition, iso
from rollout_operator.verdicts import FAIL, PASS
from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_rollout import annotate, canary, phase, start_stable
from tests.operator.test_rollout import READY, T0, progressing, spec, verdict


def progressing_condition(st: RolloutStatus) -> tuple[str, str, str | None]:
    cond = condition(st, "Progressing") or {}
    return cond.get("status", ""), cond.get("reason", ""), cond.get("lastTransitionTime")


def rolled_back() -> RolloutStatus:
    st, _ = decide(spec(), progressing(failures=1), READY, verdict(FAIL, 0.3), T0)
    assert st.phase == Phase.ROLLED_BACK
    assert progressing_condition(st) == ("False", "AnalysisFailed", iso(T0))
    return st


def test_a_retried_canary_is_progressing_again_and_says_why() -> None:
    retried, _ = decide(spec(), rolled_back(), replace(READY, action="retry"), None, T0 + 60)
    assert retried.phase == Phase.PROGRESSING
    # before: ("False", "AnalysisFailed", ...): "error-rate = 0.3 breached ..." while the retry runs
    assert progressing_condition(retried) == ("True", "RolloutRetried", iso(T0 + 60))
    assert "retrying canary v2" in (condition(retried, "Progressing") or {})["message"]
    later, _ = decide(spec(), retried, READY, verdict(PASS, at=T0 + 71), T0 + 71)
    assert later.current_step == 1
    assert progressing_condition(later) == ("True", "RolloutRetried", iso(T0 + 60))  # no transition: kept


def test_a_new_canary_after_a_rollback_is_progressing_with_the_time_it_started() -> None:
    s = spec(versions=[{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"},
                       {"name": "v3", "uri": "v3.mnn"}], canary="v3")
    ready = replace(READY, versions_ready={"v1": True, "v2": True, "v3": True})
    st, _ = decide(s, rolled_back(), ready, None, T0 + 30)
    assert st.phase == Phase.PROGRESSING and st.canary_version == "v3"
    assert progressing_condition(st) == ("True", "RolloutStarted", iso(T0 + 30))
    # a file edit restarts the same canary: still True, reason and message updated, time kept
    edited = spec(versions=[{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"},
                            {"name": "v3", "uri": "v3-fixed.mnn"}], canary="v3")
    st, _ = decide(edited, st, ready, None, T0 + 40)
    assert progressing_condition(st) == ("True", "CanaryFileChanged", iso(T0 + 30))


def test_a_promoted_rollout_no_longer_shows_an_earlier_rollback() -> None:
    retried, _ = decide(spec(), rolled_back(), replace(READY, action="retry"), None, T0 + 60)
    st, _ = decide(spec(), replace(retried, current_step=1, canary_weight=50, weights={"v2": 50, "v1": 50}),
                   READY, verdict(PASS, at=T0 + 71), T0 + 71)
    assert st.phase == Phase.PROMOTING
    assert progressing_condition(st) == ("True", "RolloutPromoted", iso(T0 + 60))
    st, _ = decide(spec(), st, READY, None, T0 + 120)
    assert st.phase == Phase.SUCCEEDED
    assert progressing_condition(st) == ("True", "RolloutSucceeded", iso(T0 + 60))


def test_a_canary_removed_mid_rollout_is_no_longer_progressing() -> None:
    st, _ = decide(spec(), RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}), READY,
                   None, T0)
    assert progressing_condition(st) == ("True", "RolloutStarted", iso(T0))
    st, _ = decide(spec(canary=None), st, READY, None, T0 + 5)
    assert st.phase == Phase.READY
    assert progressing_condition(st) == ("False", "RolloutAborted", iso(T0 + 5))


def test_a_status_left_stale_by_an_earlier_operator_is_corrected_while_the_rollout_runs() -> None:
    stale = rolled_back()
    running = replace(progressing(), conditions=stale.conditions)  # phase Progressing, condition False
    st, _ = decide(spec(), running, READY, None, T0 + 2)
    assert st.phase == Phase.PROGRESSING
    assert progressing_condition(st)[:2] == ("True", "RolloutProgressing")


def progressing_in(cluster: Cluster) -> list[tuple[str, str]]:
    return [(c["status"], c["reason"]) for c in cluster.status().get("conditions") or [] if c["type"] == "Progressing"]


@pytest.mark.timeout(180)
def test_an_aborted_then_retried_canary_shows_progressing_true_in_the_cluster(cluster: Cluster) -> None:
    start_stable(cluster)
    cluster.apply(canary(cluster, steps=[{"weight": 10}, {"weight": 40}]))
    wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 10, 60, "step 1 waits")
    assert progressing_in(cluster) == [("True", "RolloutStarted")]
    annotate(cluster, "abort")
    wait_for(lambda: phase(cluster) == "RolledBack", 20, "abort")
    assert progressing_in(cluster) == [("False", "ManualAbort")]
    annotate(cluster, "retry")
    wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 10, 20, "retry -> step 1")
    assert progressing_in(cluster) == [("True", "RolloutRetried")]  # before: still False ManualAbort
