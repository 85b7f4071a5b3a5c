"""A rollback survives the operator being cut between its two writes.

The Reconciler writes the children (the routing) before the status that describes them. A
rollback cut in between (a crash, the operator's exit) left the routing on stable while the status
still said "step 1 at 20%"; the next operator decided again from that status, found too little
canary traffic to judge, and gave the canary its share back until it breached again. Now the
status records the rollback as pending first (condition RollbackPending), and the next reconcile
finishes it. The operator's own Reconciler runs here on the demo's in-memory ports, with the
children write cut once where a crash would cut it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest

from mnn_rollout.contract.config import parse_config_text
from mnn_rollout.contract.routing import table_digest
from mnn_rollout.demo.ports import LocalPorts
from rollout_operator import children
from rollout_operator.kube import ApiError
from rollout_operator.observe import Observation, PodView
from rollout_operator.ports import REJECTED
from rollout_operator.reconcile import Outcome, Reconciler
from rollout_operator.sequential import BETTER, Comparison
from rollout_operator.spec import ModelDeploymentSpec
from rollout_operator.status import ROLLBACK_PENDING, Phase, RolloutStatus, condition
from rollout_operator.verdicts import FAIL, PASS, Analysis, MetricResult

T0 = 1_800_000_000.0
VERSIONS = [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}, {"name": "v3", "uri": "v3.mnn"}]
ANALYSIS: dict[str, Any] = {"interval": "1s", "failureLimit": 1, "minRequests": 10,
                            "metrics": [{"name": "error-rate", "max": 0.05}]}
CANARY: dict[str, Any] = {
    "versions": VERSIONS[:2], "canary": "v2",
    "strategy": {"steps": [{"weight": 20, "pause": "1h"}, {"weight": 50, "pause": "1h"}], "analysis": ANALYSIS}}
EXPERIMENT: dict[str, Any] = {
    "versions": VERSIONS, "stable": "v1",
    "experiment": {"weights": {"v1": 50, "v2": 25, "v3": 25}, "metric": "conversion", "maxDuration": "1h"},
    "strategy": {"analysis": {**ANALYSIS, "metrics": [
        *ANALYSIS["metrics"], {"name": "conversion", "compare": "stable", "margin": 0, "effect": 0.01}]}}}
BAD_EXPERIMENT = {**EXPERIMENT, "experiment": {**EXPERIMENT["experiment"], "weights": {"v1": 50, "v9": 50}}}


class Cut(Exception):
    """Where a crash or the operator's exit would stop the reconcile."""


class Ports(LocalPorts):
    """The demo's in-memory ports, with every version loaded on one ready pod, and a children
    write that can be cut once."""

    def __init__(self, spec: dict[str, Any], config: Path) -> None:
        super().__init__({"apiVersion": f"{children.GROUP}/v1alpha1", "kind": "ModelDeployment",
                          "metadata": {"name": "scorer", "namespace": "ml", "uid": "u-1", "generation": 1,
                                       "resourceVersion": "1"}, "spec": spec}, config)
        self.cut_next_children_write = False
        self.status_writes: list[dict[str, Any]] = []

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        versions = {v["name"]: {"ready": True, "uri": v["uri"]} for v in VERSIONS}
        return Observation([PodView("pod-a", "127.0.0.1", port, True, {"versions": versions})])

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        if self.cut_next_children_write:
            self.cut_next_children_write = False
            raise Cut()
        return super().write_children(objs)

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> str | None:
        self.status_writes.append(status)
        return super().store_status(body, status)

    def served(self) -> dict[str, int]:
        """The weights the routing ConfigMap gives the runtime now."""
        return {k: v for k, v in parse_config_text(self.config_text).weights.items() if v}

    def status(self) -> RolloutStatus:
        return RolloutStatus.from_dict(self.body.get("status"))


class Looks:
    """The analyzer: None (nothing to judge) until a verdict is set, which is given once."""

    def __init__(self) -> None:
        self.next: Analysis | None = None
        self.calls = 0

    def __call__(self, spec: ModelDeploymentSpec, status: RolloutStatus, body: dict[str, Any], observation: Any,
                 now: float) -> Analysis | None:
        self.calls += 1
        given, self.next = self.next, None
        return None if given is None else replace(given, at=now)


class Ticks:
    """The reconciler's time: one second later at every reading."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


P = TypeVar("P", bound=Ports)


def setup_on(tmp_path: Path, spec: dict[str, Any], ports_type: type[P]) -> tuple[P, Reconciler, Looks]:
    """``spec`` on ports of ``ports_type``, its Reconciler (on Ticks) and its analyzer."""
    ports, looks = ports_type(spec, tmp_path / "runtime.yaml"), Looks()
    return ports, Reconciler(ports, analyzer=looks, clock=Ticks()), looks


def setup(tmp_path: Path, spec: dict[str, Any]) -> tuple[Ports, Reconciler, Looks]:
    return setup_on(tmp_path, spec, Ports)


def reconcile(ports: Ports, rec: Reconciler) -> Outcome:
    outcome = rec.reconcile(ports.body)
    assert outcome is not None
    return outcome


def failing(errors: float, breached: tuple[str, ...] | None = None) -> Analysis:
    metric = MetricResult("error-rate", errors, "error rate <= 0.05", FAIL)
    return Analysis(T0, FAIL, (metric,), 100, message=f"error-rate {errors} breached 0.05", breached=breached)


def with_failure_limit(limit: int) -> dict[str, Any]:
    """CANARY with its analysis's ``failureLimit`` set."""
    return {**CANARY, "strategy": {**CANARY["strategy"], "analysis": {**ANALYSIS, "failureLimit": limit}}}


def at_step_on(tmp_path: Path, spec: dict[str, Any], ports_type: type[P]) -> tuple[P, Reconciler, Looks]:
    """The canary of ``spec`` at step 1 (v1 80%, v2 20%), on ports of ``ports_type``."""
    ports, rec, looks = setup_on(tmp_path, spec, ports_type)
    for _ in range(3):
        reconcile(ports, rec)
    return ports, rec, looks


def at_step(tmp_path: Path) -> tuple[Ports, Reconciler, Looks]:
    """The canary at step 1 (v1 80%, v2 20%)."""
    return at_step_on(tmp_path, CANARY, Ports)


def rolled_back(tmp_path: Path) -> tuple[Ports, Reconciler, Looks]:
    """The canary rolled back at step 1 on a failing look."""
    ports, rec, looks = at_step(tmp_path)
    looks.next = failing(0.3)
    reconcile(ports, rec)
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}
    return ports, rec, looks


def cut_rollback(tmp_path: Path) -> tuple[Ports, Reconciler, Looks]:
    """A canary at step 1 whose rollback was decided and cut before its routing write (where a
    crash or the operator's exit would stop it)."""
    ports, rec, looks = at_step(tmp_path)
    looks.next = failing(0.3)
    ports.cut_next_children_write = True
    with pytest.raises(Cut):
        reconcile(ports, rec)
    assert condition(ports.status(), ROLLBACK_PENDING) is not None and ports.served() == {"v1": 80, "v2": 20}
    return ports, rec, looks


def test_a_rollback_cut_before_its_routing_write_is_finished_by_the_next_reconcile(tmp_path: Path) -> None:
    ports, rec, looks = cut_rollback(tmp_path)
    assert looks.next is None  # the failing look was taken
    cut = ports.status()
    # the status says what the routing serves, and that a rollback is pending, with its reason
    assert cut.phase == Phase.PROGRESSING and cut.weights == {"v1": 80, "v2": 20} == ports.served()
    pending = condition(cut, ROLLBACK_PENDING)
    assert pending is not None and pending["status"] == "True" and pending["reason"] == "AnalysisFailed"
    assert "0.3" in pending["message"], pending

    # the next operator: no look to judge (the canary had no traffic meanwhile), yet the rollback ends
    calls = looks.calls
    outcome = reconcile(ports, rec)
    assert looks.calls == calls + 1  # it did look
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and done.weights == {"v1": 100, "v2": 0}
    assert ports.served() == {"v1": 100}
    assert done.abort_reason is not None and done.abort_reason.startswith("AnalysisFailed: ") and "0.3" in done.abort_reason
    assert condition(done, ROLLBACK_PENDING) is None
    assert "RolloutAborted" in [e.reason for e in outcome.events]
    # and it stays rolled back
    reconcile(ports, rec)
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}


def test_an_uncut_rollback_records_the_pending_rollback_then_the_result(tmp_path: Path) -> None:
    ports, rec, looks = at_step(tmp_path)
    before = len(ports.status_writes)
    looks.next = failing(0.3)
    reconcile(ports, rec)
    intent, result = ports.status_writes[before:]
    assert RolloutStatus.from_dict(intent).weights == {"v1": 80, "v2": 20}
    assert condition(RolloutStatus.from_dict(intent), ROLLBACK_PENDING) is not None
    assert RolloutStatus.from_dict(result).phase == Phase.ROLLED_BACK
    assert condition(RolloutStatus.from_dict(result), ROLLBACK_PENDING) is None
    assert ports.served() == {"v1": 100}


def test_a_pending_rollback_for_a_canary_no_longer_named_is_dropped(tmp_path: Path) -> None:
    ports, rec, _ = cut_rollback(tmp_path)
    # meanwhile the user names another canary: that one starts; the old decision does not touch it
    ports.body["spec"] = {**CANARY, "versions": VERSIONS, "canary": "v3"}
    ports.body["metadata"]["generation"] = 2
    outcome = reconcile(ports, rec)
    now = ports.status()
    assert now.phase == Phase.PROGRESSING and now.canary_version == "v3" and now.abort_reason is None
    assert condition(now, ROLLBACK_PENDING) is None
    assert "RolloutAborted" not in [e.reason for e in outcome.events]


def test_an_experiment_aborted_and_cut_is_aborted_by_the_next_reconcile(tmp_path: Path) -> None:
    ports, rec, looks = setup(tmp_path, EXPERIMENT)
    for _ in range(2):
        reconcile(ports, rec)
    assert ports.served() == {"v1": 50, "v2": 25, "v3": 25}
    looks.next = failing(0.3, breached=("v2",))
    ports.cut_next_children_write = True
    with pytest.raises(Cut):
        reconcile(ports, rec)
    assert looks.next is None
    cut = ports.status()
    assert cut.weights == {"v1": 50, "v2": 25, "v3": 25} == ports.served()
    pending = condition(cut, ROLLBACK_PENDING)
    assert pending is not None and pending["reason"] == "ExperimentAborted"
    outcome = reconcile(ports, rec)
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}
    assert (done.experiment or {}).get("state") == "Aborted" and done.abort_reason == pending["message"]
    assert "ExperimentAborted" in [e.reason for e in outcome.events]
    assert condition(done, ROLLBACK_PENDING) is None


def set_spec(ports: Ports, spec: dict[str, Any]) -> None:
    ports.body["spec"] = spec
    ports.body["metadata"]["generation"] += 1


def invalid_round_trip(ports: Ports, rec: Reconciler, served: dict[str, int] | None = None) -> None:
    """The user saves a spec that names no version as canary (what is served meanwhile: ``served``, by
    default what was), then puts the right one back."""
    served = served or ports.served()
    set_spec(ports, {**CANARY, "canary": "v9"})
    reconcile(ports, rec)
    assert ports.status().phase == Phase.INVALID_SPEC and ports.served() == served
    set_spec(ports, CANARY)
    reconcile(ports, rec)


def test_an_invalid_spec_saved_meanwhile_does_not_drop_a_pending_rollback(tmp_path: Path) -> None:
    """Found in review: InvalidSpec replaced the phase, and the rollback (decided for a rollout
    "in progress") was dropped once the spec was fixed: the canary got its share back. (The canary
    is held under the last valid spec meanwhile, which finishes the rollback at once.)"""
    ports, rec, _ = cut_rollback(tmp_path)
    invalid_round_trip(ports, rec, served={"v1": 100})
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}, done
    assert done.abort_reason is not None and done.abort_reason.startswith("AnalysisFailed: ")


def test_a_rolled_back_canary_stays_rolled_back_through_an_invalid_spec(tmp_path: Path) -> None:
    """Found in review (older than the pending rollback): after an invalid spec was fixed, a
    rolled-back canary went on at its step weight, without a retry."""
    ports, rec, _ = rolled_back(tmp_path)
    invalid_round_trip(ports, rec)
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}
    assert ports.status().phase_before_invalid is None


@pytest.mark.parametrize("verb", ["promote-full", "promote", "abort"])
def test_an_action_meeting_a_pending_rollback_is_ignored_with_the_reason(tmp_path: Path, verb: str) -> None:
    """Found in review: promote-full was recorded as applied, though the canary was rolled back."""
    ports, rec, _ = cut_rollback(tmp_path)
    ports.body["metadata"]["annotations"] = {"mnnrollout.io/action": f"{verb}:1"}
    reconcile(ports, rec)
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}
    assert done.last_action == f"{verb}:1" and done.action_result is not None
    assert done.action_result.startswith("ignored: canary v2 is being rolled back (AnalysisFailed: "), done


def test_a_retry_meeting_a_pending_rollback_waits_for_it_then_applies(tmp_path: Path) -> None:
    ports, rec, _ = cut_rollback(tmp_path)
    ports.body["metadata"]["annotations"] = {"mnnrollout.io/action": "retry:1"}
    reconcile(ports, rec)
    rolled = ports.status()
    assert rolled.phase == Phase.ROLLED_BACK and rolled.pending_action is not None
    assert rolled.pending_action.startswith("retry:1: canary v2 is being rolled back")
    outcome = reconcile(ports, rec)  # the retry applies to the canary now rolled back
    retried = ports.status()
    assert retried.phase == Phase.PROGRESSING and retried.action_result == "applied" and retried.pending_action is None
    assert "RolloutRetried" in [e.reason for e in outcome.events]


def test_a_new_rollback_over_a_stale_pending_one_is_recorded_as_its_own(tmp_path: Path) -> None:
    """Found in review: a status still holding the pending rollback of a canary since replaced
    kept it instead of recording the new canary's rollback; cut again, that rollback was lost."""
    ports, rec, _ = cut_rollback(tmp_path)
    set_spec(ports, {**CANARY, "versions": VERSIONS, "canary": "v3"})
    ports.body["metadata"]["annotations"] = {"mnnrollout.io/alert": "CanaryErrors@2027-01-15T08:00:00Z@v3"}
    ports.cut_next_children_write = True
    with pytest.raises(Cut):  # v3 starts and is rolled back by the alert in the same decision: cut
        reconcile(ports, rec)
    pending = condition(ports.status(), ROLLBACK_PENDING)
    assert pending is not None and pending["reason"] == "AlertFiring", pending
    ports.body["metadata"]["annotations"] = {}  # the alert resolves meanwhile
    reconcile(ports, rec)
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and done.canary_version == "v3" and ports.served() == {"v1": 100}
    assert done.abort_reason is not None and done.abort_reason.startswith("AlertFiring: ")


@pytest.mark.parametrize("landed", [True, False])
def test_a_status_write_whose_answer_was_lost_is_known_by_the_status_it_left(tmp_path: Path, landed: bool) -> None:
    """Found in review: the final status PUT landed, its answer was lost, and the client's retry
    met the new version (409): the reconcile took it for a conflict, and the rollback's Event and
    metric were never given (the next reconcile found nothing to decide). A 409 after an attempt
    that may have landed now reads the object: its own status there means the write happened."""
    ports, rec, looks = at_step(tmp_path)
    calls, store = [0], ports.store_status

    def lost_answer(body: dict[str, Any], status: dict[str, Any]) -> str | None:
        calls[0] += 1
        if calls[0] == 2:  # the final write (the first records the pending rollback)
            if landed:
                store(body, status)
            raise ApiError(409, "the object has been modified", "Conflict", attempts=2, ambiguous=True)
        return store(body, status)

    ports.store_status = lost_answer  # type: ignore[method-assign]
    looks.next = failing(0.3)
    outcome = reconcile(ports, rec)
    assert outcome.conflict is not landed and outcome.wrote_status is landed
    assert ("RolloutAborted" in [e.reason for e in outcome.events]) is landed
    again = reconcile(ports, rec)  # the next reconcile: the rollback is done, said once in all
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}
    said = [e.reason for e in (*outcome.events, *again.events)].count("RolloutAborted")
    assert said == 1, (outcome.events, again.events)


def written_by_an_earlier_operator(ports: Ports, rec: Reconciler, good: dict[str, Any] = CANARY,
                                   bad: dict[str, Any] | None = None,
                                   tweak: Callable[[RolloutStatus], RolloutStatus] = lambda s: s) -> Outcome:
    """The user saves an invalid spec; the status is then what an operator that did not record
    phaseBeforeInvalid wrote (this one's, without the field, changed by ``tweak``); the user puts
    the right spec back."""
    set_spec(ports, bad or {**CANARY, "canary": "v9"})
    reconcile(ports, rec)
    old = ports.status()
    assert old.phase == Phase.INVALID_SPEC and old.phase_before_invalid is not None
    ports.body["status"] = tweak(replace(old, phase_before_invalid=None)).to_dict()
    assert "phaseBeforeInvalid" not in ports.body["status"]
    set_spec(ports, good)
    return reconcile(ports, rec)


def test_a_rolled_back_canary_stays_rolled_back_after_an_invalid_spec_an_earlier_operator_recorded(
        tmp_path: Path) -> None:
    """An earlier operator's InvalidSpec status has no phaseBeforeInvalid: resumed as Initializing,
    the rolled-back canary went back to its step weight without a retry. The phase is read from
    what the status kept (rolledBackAt)."""
    ports, rec, _ = rolled_back(tmp_path)
    written_by_an_earlier_operator(ports, rec)
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}, done
    assert done.abort_reason is not None and done.abort_reason.startswith("AnalysisFailed: ")


def test_a_canary_at_a_step_goes_on_at_it_after_an_invalid_spec_an_earlier_operator_recorded(
        tmp_path: Path) -> None:
    ports, rec, _ = at_step(tmp_path)
    before = ports.status()
    assert before.phase == Phase.PROGRESSING and ports.served() == {"v1": 80, "v2": 20}, before
    written_by_an_earlier_operator(ports, rec)
    done = ports.status()
    assert done.phase == Phase.PROGRESSING and ports.served() == {"v1": 80, "v2": 20}, done
    assert done.rollout_started_at == before.rollout_started_at and done.current_step == before.current_step


@pytest.mark.parametrize("case", ["at its step, no rolloutStartedAt", "waiting for its weight"])
def test_a_stale_rolled_back_at_from_an_earlier_operator_does_not_freeze_a_running_canary(
        tmp_path: Path, case: str) -> None:
    """Found in review: earlier operators left rolledBackAt behind when a rolled-back canary was
    retried; read as "rolled back", the canary then held its weight with no analysis and no alert
    check until a retry. A rollback counts only if no rollout started after it and the canary has
    no weight: each case here is caught by one of the two."""
    ports, rec, _ = at_step(tmp_path)
    before = ports.status()
    assert before.phase == Phase.PROGRESSING and before.rollout_started_at is not None
    stale = replace(before, rolled_back_at=before.rollout_started_at - 100, abort_reason="AnalysisFailed: error-rate")
    if case == "waiting for its weight":  # retried, the step not started yet: weight 0, as after a rollback
        stale = replace(stale, canary_weight=0, weights={"v1": 100, "v2": 0})
    else:
        stale = replace(stale, rollout_started_at=None)
    written_by_an_earlier_operator(ports, rec, tweak=lambda s: replace(
        stale, phase=s.phase, message=s.message, conditions=s.conditions, observed_generation=s.observed_generation))
    done = ports.status()
    assert done.phase == Phase.PROGRESSING and ports.served() == {"v1": 80, "v2": 20}, done


def test_an_aborted_experiment_stays_rolled_back_after_an_invalid_spec_an_earlier_operator_recorded(
        tmp_path: Path) -> None:
    """Found in review: it resumed as Initializing, and stayed there."""
    ports, rec, looks = setup(tmp_path, EXPERIMENT)
    for _ in range(2):
        reconcile(ports, rec)
    looks.next = failing(0.3, breached=("v2",))
    reconcile(ports, rec)
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}
    written_by_an_earlier_operator(ports, rec, EXPERIMENT, BAD_EXPERIMENT)
    reconcile(ports, rec)
    done = ports.status()
    assert done.phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}, done


def experiment_won(tmp_path: Path) -> tuple[Ports, Reconciler, dict[str, Any], dict[str, Any]]:
    """The experiment won by v2 on a look: v2 promoted, the old stable not retired yet; with the spec
    to put back and an invalid one."""
    ports, rec, looks = setup(tmp_path, EXPERIMENT)
    for _ in range(2):
        reconcile(ports, rec)
    better = Comparison(BETTER, 0.2, 0.1, 0.3, 0.6, 0.5, 500, 1000, 0.975, "v2 converts more")
    looks.next = Analysis(T0, PASS, (), 500, "v2 is better than v1", comparisons={"v2": better}, breached=())
    reconcile(ports, rec)
    status = ports.status()
    assert status.phase == Phase.PROMOTING and (status.experiment or {}).get("state") == "Winner", status
    assert status.stable_version == "v2" and ports.served() == {"v2": 100}
    return ports, rec, EXPERIMENT, BAD_EXPERIMENT


def canary_promoted(tmp_path: Path) -> tuple[Ports, Reconciler, dict[str, Any], dict[str, Any]]:
    """The canary promoted fully by a user at step 1; the old stable not retired yet; with the spec
    to put back and an invalid one."""
    ports, rec, _ = at_step(tmp_path)
    ports.body["metadata"]["annotations"] = {"mnnrollout.io/action": "promote-full:1"}
    reconcile(ports, rec)
    assert ports.status().phase == Phase.PROMOTING
    return ports, rec, CANARY, {**CANARY, "canary": "v9"}


# The canary promotion and the experiment's Winner branch: resumed as Initializing, the promotion
# never retired the old stable (found in review); the winner kept its 100% but the old stable never left.
PROMOTIONS = pytest.mark.parametrize("promotion", [canary_promoted, experiment_won], ids=["canary", "experiment"])


@PROMOTIONS
def test_a_promotion_still_retires_the_old_stable_after_an_invalid_spec_an_earlier_operator_recorded(
        tmp_path: Path, promotion: Callable[[Path], tuple[Ports, Reconciler, dict[str, Any], dict[str, Any]]]) -> None:
    ports, rec, good, bad = promotion(tmp_path)
    written_by_an_earlier_operator(ports, rec, good, bad)
    assert ports.status().phase == Phase.PROMOTING and ports.served() == {"v2": 100}
    rec.clock.now += 10_000
    reconcile(ports, rec)
    done = ports.status()
    assert done.phase == Phase.SUCCEEDED and "v1" in done.retired and ports.served() == {"v2": 100}, done


@PROMOTIONS
def test_a_finished_promotion_stays_succeeded_after_an_invalid_spec_an_earlier_operator_recorded(
        tmp_path: Path, promotion: Callable[[Path], tuple[Ports, Reconciler, dict[str, Any], dict[str, Any]]]) -> None:
    ports, rec, good, bad = promotion(tmp_path)
    rec.clock.now += 10_000
    reconcile(ports, rec)
    assert ports.status().phase == Phase.SUCCEEDED and "v1" in ports.status().retired
    assert ports.served() == {"v2": 100}
    outcome = written_by_an_earlier_operator(ports, rec, good, bad)
    rec.clock.now += 10_000
    later = reconcile(ports, rec)
    done = ports.status()
    assert done.phase == Phase.SUCCEEDED and ports.served() == {"v2": 100}, done
    assert "RolloutSucceeded" not in [e.reason for e in (*outcome.events, *later.events)]

# -- an invalid spec mid-rollout: the canary is held under the last valid spec, still guarded ---------

def held(ports: Ports, rec: Reconciler, spec: dict[str, Any], says: str) -> None:
    """Save ``spec`` (invalid) over the canary at step 1: InvalidSpec naming the problem, the routing
    unchanged, no step moved."""
    set_spec(ports, spec)
    for _ in range(2):
        outcome = reconcile(ports, rec)
    st = ports.status()
    assert st.phase == Phase.INVALID_SPEC and says in st.message and "held under the last valid spec" in st.message
    assert ports.served() == {"v1": 80, "v2": 20} and st.last_valid_spec == CANARY, st
    assert outcome.children == {} or all(v == "unchanged" for v in outcome.children.values()), outcome.children


@pytest.mark.parametrize("spec, says", [
    ({**CANARY, "runtime": {"port": "eighty"}}, "runtime.port"),
    # the default stable renamed: its share would go to a version nobody chose (and the reconcile raised)
    ({**CANARY, "versions": [{"name": "v1-int8", "uri": "v1.mnn"}, VERSIONS[1]]},
     "spec.versions: the stable version 'v1' is not listed, and it serves 80% of requests"),
    # the default stable removed: the canary became stable at 100%, unanalysed
    ({**CANARY, "versions": [VERSIONS[1]]}, "the stable version 'v1' is not listed"),
])
def test_a_canary_whose_spec_turns_invalid_is_held_and_still_rolled_back_by_a_failing_check(
        tmp_path: Path, spec: dict[str, Any], says: str) -> None:
    """Found in review: while the spec was invalid neither the analysis nor alerts ran, so a failing
    canary kept its users until someone fixed the spec. Now it is held under the last valid spec."""
    ports, rec, looks = at_step(tmp_path)
    held(ports, rec, spec, says)
    calls = looks.calls
    looks.next = failing(0.3)
    outcome = reconcile(ports, rec)
    assert looks.calls == calls + 1 and ports.served() == {"v1": 100}, ports.status()
    st = ports.status()
    assert st.phase == Phase.INVALID_SPEC and st.phase_before_invalid == Phase.ROLLED_BACK
    assert "RolloutAborted" in [e.reason for e in outcome.events] and st.last_valid_spec is None
    set_spec(ports, CANARY)  # fixed: it stays rolled back (retry to go again)
    reconcile(ports, rec)
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}


@pytest.mark.parametrize("annotation", ["mnnrollout.io/alert", "mnnrollout.io/action"])
def test_a_canary_held_under_an_invalid_spec_is_rolled_back_by_an_alert_or_an_abort(
        tmp_path: Path, annotation: str) -> None:
    ports, rec, _ = at_step(tmp_path)
    held(ports, rec, {**CANARY, "canary": "v9"}, "v9")
    value = "CanaryErrors@2030-01-01T00:00:00Z@v2" if annotation.endswith("alert") else "abort:1"
    ports.body["metadata"]["annotations"] = {annotation: value}
    reconcile(ports, rec)
    assert ports.served() == {"v1": 100} and ports.status().phase_before_invalid == Phase.ROLLED_BACK


def test_a_held_canary_resumes_where_it_was_once_the_spec_is_fixed(tmp_path: Path) -> None:
    ports, rec, looks = at_step(tmp_path)
    step_started = ports.status().step_started_at
    held(ports, rec, {**CANARY, "canary": "v9"}, "v9")
    looks.next = replace(failing(0.0), verdict=PASS)  # a pass while held moves nothing
    reconcile(ports, rec)
    assert ports.served() == {"v1": 80, "v2": 20} and ports.status().phase == Phase.INVALID_SPEC
    set_spec(ports, CANARY)
    reconcile(ports, rec)
    st = ports.status()
    assert st.phase == Phase.PROGRESSING and st.current_step == 0 and ports.served() == {"v1": 80, "v2": 20}
    assert st.step_started_at is not None and step_started is not None and st.step_started_at > step_started


class RejectingPorts(Ports):
    """The API refuses the routing ConfigMap (an admission policy, say) while ``reject`` is set."""

    reject = False

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        objs = list(objs)
        kept = [o for o in objs if not (self.reject and o["kind"] == "ConfigMap")]
        out = super().write_children(kept)
        for o in objs:
            if o not in kept:
                out[f"ConfigMap/{o['metadata']['name']}"] = f"{REJECTED}admission webhook denied the request"
        return out


def test_a_rollback_whose_routing_write_is_refused_is_not_reported_done_and_is_finished_once_accepted(
        tmp_path: Path) -> None:
    """Found in review: with the routing ConfigMap refused (422), the status still said RolledBack
    {v1: 100} and dropped the pending record, while the pods kept serving 80/20."""
    ports, rec, looks = at_step_on(tmp_path, CANARY, RejectingPorts)
    assert ports.served() == {"v1": 80, "v2": 20}
    ports.reject, looks.next = True, failing(0.3)
    outcome = reconcile(ports, rec)
    st = ports.status()
    assert ports.served() == {"v1": 80, "v2": 20}  # the routing was not written
    assert st.phase == Phase.PROGRESSING and st.weights == {"v1": 80, "v2": 20}, st  # as served
    assert condition(st, ROLLBACK_PENDING) is not None and (condition(st, "ChildRejected") or {})["status"] == "True"
    assert "RolloutAborted" not in [e.reason for e in outcome.events]
    ports.reject = False  # the policy lifted: the next try finishes the rollback, with no new failing check
    outcome = reconcile(ports, rec)
    st = ports.status()
    assert st.phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100} and condition(st, ROLLBACK_PENDING) is None
    assert "RolloutAborted" in [e.reason for e in outcome.events]


class WeightedPods(Ports):
    """One ready pod that reports the weights it routes by, those of the ConfigMap once ``applied``,
    and the digest of its table: the ConfigMap's, or ``digest`` when set (an older table)."""

    applied = False
    reports = True  # False: a runtime that does not report its weights
    digest: str | None = None

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        versions = {v["name"]: {"ready": True, "uri": v["uri"]} for v in VERSIONS}
        weights = self.served() if self.applied else {"v1": 100}
        table = parse_config_text(self.config_text).routing.table if self.applied else None
        status: dict[str, Any] = {"versions": versions, **({"weights": weights} if self.reports else {})}
        if table is not None:
            status["table_digest"] = self.digest or table_digest(table)
        return Observation([PodView("pod-a", "127.0.0.1", port, True, status)])


def test_the_status_says_whether_the_pods_serve_its_weights_yet(tmp_path: Path) -> None:
    """Found in review: status.weights were claimed as what every pod serves the moment the ConfigMap
    was written. They are the routing's; condition WeightsServed says whether the pods serve them."""
    ports, rec, _ = at_step_on(tmp_path, CANARY, WeightedPods)
    st = ports.status()
    assert st.weights == {"v1": 80, "v2": 20} == ports.served()
    served = condition(st, "WeightsServed")
    assert served is not None and served["status"] == "False", served
    assert served["message"] == "pod-a serves v1:100; applying v1:80, v2:20"
    ports.applied = True
    reconcile(ports, rec)
    served = condition(ports.status(), "WeightsServed")
    assert served is not None and served["status"] == "True" and served["message"] == "every pod serves v1:80, v2:20"
    ports.digest = "0123456789abcdef"  # the same weights by another table (after a change and back)
    reconcile(ports, rec)
    served = condition(ports.status(), "WeightsServed")
    assert served is not None and served["status"] == "False", served
    assert served["message"].startswith("pod-a routes by another table of these weights (digest 0123456789abcdef")
    ports.digest = None
    reconcile(ports, rec)
    assert condition(ports.status(), "WeightsServed")["status"] == "True"  # type: ignore[index]
    ports.reports, ports.applied = False, False  # an older runtime: nothing claimed either way, nor polled for
    reconcile(ports, rec)
    served = condition(ports.status(), "WeightsServed")
    assert served is not None and served["status"] == "Unknown", served


@pytest.mark.parametrize("name", ["3d-detector", "scorer.eu", "s" * 64])
def test_a_name_that_cannot_name_the_service_is_an_invalid_spec_before_any_child_is_written(
        tmp_path: Path, name: str) -> None:
    """The Service is named after the ModelDeployment: a name the API accepts for the object (a DNS
    subdomain) but not for a Service (a DNS-1035 label) had every other child written and the
    Service refused (a real API server's 422). Now nothing is written and the status says why."""
    ports, rec, _ = setup(tmp_path, CANARY)
    ports.body["metadata"]["name"] = name
    outcome = reconcile(ports, rec)
    st = ports.status()
    assert st.phase == Phase.INVALID_SPEC and st.message.startswith(f"metadata.name: {name!r} cannot name")
    assert outcome.children == {} and not (tmp_path / "runtime.yaml").exists()


# -- found by a second review of the above -----------------------------------------------------------

def test_removing_the_stable_while_naming_a_loaded_one_moves_its_share_there(tmp_path: Path) -> None:
    """v3 loaded at weight 0, the canary v2 at 20%: versions [v2, v3] with stable v3 kept weights
    {v1: 80, v2: 20} while the routing dropped v1, and every reconcile raised (weights summing to 20)."""
    ports, rec, _ = setup(tmp_path, {**CANARY, "versions": VERSIONS})
    for _ in range(3):
        reconcile(ports, rec)
    assert ports.served() == {"v1": 80, "v2": 20}
    set_spec(ports, {**CANARY, "versions": VERSIONS[1:], "stable": "v3"})
    reconcile(ports, rec)
    st = ports.status()
    assert ports.served() == {"v3": 80, "v2": 20} and st.stable_version == "v3" and st.weights == {"v3": 80, "v2": 20}
    assert st.phase == Phase.PROGRESSING and st.canary_weight == 20


class ModelPods(Ports):
    """Records the port and model name each look asked the pods for."""

    def __init__(self, spec: dict[str, Any], config: Path) -> None:
        super().__init__(spec, config)
        self.looked: list[tuple[int, str]] = []

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        self.looked.append((port, model))
        return super().observe_pods(target, port, model)


def test_a_canary_held_for_an_unlisted_stable_keeps_the_model_name_and_port_it_served(tmp_path: Path) -> None:
    """Held under the last valid spec, the routing was written with the new spec's model name (and
    the pods looked for on its port): every request to the old name got 404."""
    ports, rec, _ = at_step_on(tmp_path, CANARY, ModelPods)
    set_spec(ports, {**CANARY, "model": "other", "runtime": {"port": 9000},
                     "versions": [{"name": "v1-int8", "uri": "v1.mnn"}, VERSIONS[1]]})
    reconcile(ports, rec)
    assert ports.status().phase == Phase.INVALID_SPEC and "'v1' is not listed" in ports.status().message
    assert parse_config_text(ports.config_text).model == "scorer" and ports.served() == {"v1": 80, "v2": 20}
    assert ports.looked[-1] == (8080, "scorer")


def test_a_canary_of_an_object_whose_name_is_now_refused_is_held_and_still_guarded(tmp_path: Path) -> None:
    """An object created before names were checked (its Service refused, the rest serving): a canary
    at 20% was no longer checked nor rolled back."""
    ports, rec, looks = at_step(tmp_path)
    ports.body["metadata"]["name"] = "3d-scorer"
    reconcile(ports, rec)
    assert ports.status().phase == Phase.INVALID_SPEC and ports.served() == {"v1": 80, "v2": 20}
    looks.next = failing(0.3)
    reconcile(ports, rec)
    assert ports.served() == {"v1": 100} and ports.status().phase_before_invalid == Phase.ROLLED_BACK


def test_an_experiment_under_an_invalid_spec_is_held_and_still_aborted_by_an_alert(tmp_path: Path) -> None:
    ports, rec, _ = setup(tmp_path, EXPERIMENT)
    for _ in range(2):
        reconcile(ports, rec)
    assert ports.served() == {"v1": 50, "v2": 25, "v3": 25}
    set_spec(ports, {**EXPERIMENT, "runtime": {"port": "eighty"}})
    reconcile(ports, rec)
    st = ports.status()
    assert st.phase == Phase.INVALID_SPEC and "held" in st.message and ports.served() == {"v1": 50, "v2": 25, "v3": 25}
    ports.body["metadata"]["annotations"] = {"mnnrollout.io/alert": "ChallengerErrors@2030-01-01T00:00:00Z@v2,v3"}
    reconcile(ports, rec)
    assert ports.served() == {"v1": 100}  # before: the challengers kept half the users, the alert ignored


class ConfigPods(Ports):
    """One ready pod that has loaded exactly the versions the routing ConfigMap lists."""

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        listed = [v.name for v in parse_config_text(self.config_text).versions] if self.config_text else []
        versions = {v["name"]: {"ready": True, "uri": v["uri"]} for v in VERSIONS if v["name"] in listed}
        return Observation([PodView("pod-a", "127.0.0.1", port, True, {"versions": versions})])


def test_spec_stable_set_back_to_a_retired_version_is_loaded_then_takes_over(tmp_path: Path) -> None:
    """A new spec.stable takes over once loaded, but a retired version was not routed, so never
    loaded: going back to the version a promotion retired never took effect."""
    ports, rec, _ = at_step_on(tmp_path, CANARY, ConfigPods)
    ticks = rec.clock
    assert isinstance(ticks, Ticks)
    ports.body["metadata"]["annotations"] = {"mnnrollout.io/action": "promote-full:1"}
    reconcile(ports, rec)
    ticks.now += 10_000
    reconcile(ports, rec)
    assert ports.status().phase == Phase.SUCCEEDED and "v1" in ports.status().retired
    set_spec(ports, {"versions": VERSIONS[:2], "stable": "v1"})
    reconcile(ports, rec)  # v1 routed at weight 0 (loaded), v2 still serving
    assert ports.served() == {"v2": 100} and "v1" in [v.name for v in parse_config_text(ports.config_text).versions]
    reconcile(ports, rec)  # loaded now: it takes over
    assert ports.status().stable_version == "v1" and ports.served() == {"v1": 100}


def test_failed_checks_still_add_up_while_the_routing_write_is_refused(tmp_path: Path) -> None:
    """With failureLimit 2, the status restored after each refused routing write dropped the checks'
    record too: failures never added up to a rollback."""
    ports, rec, looks = at_step_on(tmp_path, with_failure_limit(2), RejectingPorts)
    ports.reject = True
    for failures in (1, 2):
        looks.next = failing(0.3)
        reconcile(ports, rec)
        assert ports.status().failures == failures or condition(ports.status(), ROLLBACK_PENDING) is not None
    assert condition(ports.status(), ROLLBACK_PENDING) is not None and ports.served() == {"v1": 80, "v2": 20}
    ports.reject = False
    reconcile(ports, rec)
    assert ports.status().phase == Phase.ROLLED_BACK and ports.served() == {"v1": 100}


def test_a_restart_decided_while_the_routing_write_is_refused_keeps_the_serving_canarys_record(
        tmp_path: Path) -> None:
    """Found by review: the checks' record kept over a refused write was the decision's, so a decision
    that restarted the canary (its file edited) erased the failures of the file still serving."""
    spec = with_failure_limit(3)
    ports, rec, looks = at_step_on(tmp_path, spec, RejectingPorts)
    looks.next = failing(0.3)
    reconcile(ports, rec)
    assert ports.status().failures == 1
    ports.reject = True
    set_spec(ports, {**spec, "versions": [VERSIONS[0], {"name": "v2", "uri": "v2-new.mnn"}]})
    reconcile(ports, rec)
    st = ports.status()
    assert st.failures == 1 and st.analysis and st.canary_file == "v2.mnn@" and ports.served() == {"v1": 80, "v2": 20}
