"""Review 3: the rollout engine's clocks. A step's pause and the analysis that lets it advance count
from when every pod serves the step's weights (condition WeightsServed), not from the ConfigMap write;
the progress deadline still counts from the write. An experiment's duration runs only while its split
is served and it is not held. The operator's own Reconciler runs on the demo's in-memory ports, with
pods that take the ConfigMap's weights late (a real kubelet takes seconds to a minute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_operator import experiment
from rollout_operator.analyzer import counted_since
from rollout_operator.observe import Observation, PodView
from rollout_operator.reconcile import Reconciler
from rollout_operator.rollout import World, decide
from rollout_operator.spec import parse_spec
from rollout_operator.status import Phase, RolloutStatus, condition, with_condition
from rollout_operator.verdicts import PASS, Analysis, MetricResult
from tests.operator.test_rollback_pending import T0, VERSIONS, Looks, WeightedPods, reconcile

# steps of 30s, checks every 10s
SLOW: dict[str, Any] = {
    "versions": VERSIONS[:2], "canary": "v2", "progressDeadlineSeconds": 120,
    "strategy": {"steps": [{"weight": 20, "pause": "30s"}, {"weight": 50, "pause": "30s"}],
                 "analysis": {"interval": "10s", "failureLimit": 1, "minRequests": 10,
                              "metrics": [{"name": "error-rate", "max": 0.05}]}}}


class SetTime:
    """The reconciler's time, set by the test."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def passing() -> Analysis:
    return Analysis(T0, PASS, (MetricResult("error-rate", 0.0, "error rate <= 0.05", PASS),), 100)


def late_pods(tmp_path: Path, spec: dict[str, Any]) -> tuple[WeightedPods, Reconciler, Looks, SetTime]:
    """``spec``'s canary at step 1 (v1 80%, v2 20%) written at T0; the pod still routes by v1:100."""
    ports, looks, clock = WeightedPods(spec, tmp_path / "runtime.yaml"), Looks(), SetTime()
    rec = Reconciler(ports, analyzer=looks, clock=clock)
    for _ in range(3):
        reconcile(ports, rec)
    st = ports.status()
    assert st.weights == {"v1": 80, "v2": 20} == ports.served() and st.step_started_at == T0
    return ports, rec, looks, clock


def at(ports: WeightedPods, rec: Reconciler, clock: SetTime, now: float, look: Looks | None = None) -> RolloutStatus:
    """A reconcile at ``now`` (with a passing look when ``look`` is given)."""
    clock.now = now
    if look is not None:
        look.next = passing()
    reconcile(ports, rec)
    return ports.status()


def test_a_step_served_late_advances_only_a_pause_after_the_pods_serve_its_weights(tmp_path: Path) -> None:
    """Found in review: a step's pause counted from the ConfigMap write. Pods that took the weights
    25s late served the 30s step's 20% for 5s, and a check whose interval was mostly on v1:100 let it
    advance at T0+30. Now the pause, and the checks that count, start when every pod serves it."""
    ports, rec, looks, clock = late_pods(tmp_path, SLOW)
    for t in (10, 20):
        st = at(ports, rec, clock, T0 + t, looks)
        assert (condition(st, "WeightsServed") or {}).get("status") == "False" and st.current_step == 0
        assert "every pod" in st.message and "pod-a serves v1:100" in st.message, st.message
    ports.applied = True  # the pod takes the new weights at T0+25
    st = at(ports, rec, clock, T0 + 25)
    assert (condition(st, "WeightsServed") or {}).get("status") == "True"
    st = at(ports, rec, clock, T0 + 26)
    assert st.step_served_at == T0 + 25 and st.step_started_at == T0
    st = at(ports, rec, clock, T0 + 30, looks)  # a pass, but over [T0+20, T0+30]: 5s on the step's weights
    assert st.current_step == 0 and st.weights == {"v1": 80, "v2": 20}, st.message
    for t in (40, 50):
        st = at(ports, rec, clock, T0 + t, looks)
        assert st.current_step == 0, st.message
    st = at(ports, rec, clock, T0 + 55, looks)  # 30s served and a pass measured on them: next step
    assert st.current_step == 1 and st.weights == {"v1": 50, "v2": 50} and st.step_served_at is None



def test_the_providers_count_a_step_from_when_its_weights_are_served(tmp_path: Path) -> None:
    """Prometheus's window and the per-step counts of compare: stable metrics began at the write
    (``SampleContext.since``), so they took in traffic routed by the previous weights."""
    ports, rec, looks, clock = late_pods(tmp_path, SLOW)
    assert counted_since(at(ports, rec, clock, T0 + 10, looks)) == T0  # not served yet: from the write
    ports.applied = True
    at(ports, rec, clock, T0 + 25)
    st = at(ports, rec, clock, T0 + 26)
    assert st.step_served_at == T0 + 25 and counted_since(st) == T0 + 25

def test_a_step_never_served_still_fails_at_the_progress_deadline_from_the_write(tmp_path: Path) -> None:
    ports, rec, looks, clock = late_pods(tmp_path, SLOW)
    st = at(ports, rec, clock, T0 + 100, looks)
    assert st.phase == Phase.PROGRESSING and st.current_step == 0
    st = at(ports, rec, clock, T0 + 121)
    assert st.phase == Phase.FAILED and st.weights == {"v1": 100, "v2": 0}
    assert st.abort_reason is not None and "pod-a serves v1:100" in st.abort_reason, st.abort_reason


def test_pods_that_do_not_report_their_weights_count_the_step_from_the_write(tmp_path: Path) -> None:
    """An older runtime says nothing of its weights (WeightsServed Unknown): nothing to wait for."""
    ports, rec, looks, clock = late_pods(tmp_path, SLOW)
    ports.reports = False
    at(ports, rec, clock, T0 + 1)
    st = at(ports, rec, clock, T0 + 10, looks)
    assert st.step_served_at == T0
    for t in (20, 30):
        st = at(ports, rec, clock, T0 + t, looks)
    assert st.current_step == 1, st.message



# -- experiments --------------------------------------------------------------------------------

EXPERIMENT = parse_spec({
    "versions": [{"name": v, "uri": f"{v}.mnn"} for v in ("v1", "v2")], "stable": "v1",
    "experiment": {"weights": {"v1": 50, "v2": 50}, "metric": "conversion", "maxDuration": "100s"},
    "strategy": {"analysis": {"interval": "5s", "metrics": [
        {"name": "conversion", "compare": "stable", "margin": 0, "effect": 0.01}]}},
    "progressDeadlineSeconds": 600})
BOTH = World(versions_ready={"v1": True, "v2": True}, ready_pods=2, desired_pods=2)


def split_written() -> RolloutStatus:
    """The experiment started and its split written at T0 (nothing said yet of the pods)."""
    st, _ = decide(EXPERIMENT, RolloutStatus(stable_version="v1", phase=Phase.READY, weights={"v1": 100}), BOTH,
                   None, T0)
    assert st.weights == {"v1": 50, "v2": 50} and st.step_started_at == T0
    return st


def served(st: RolloutStatus, status: str, at: float) -> RolloutStatus:
    """Condition WeightsServed as the reconcile after a decision records it."""
    return with_condition(st, "WeightsServed", status, "Served" if status == "True" else "Applying",
                          "every pod serves v1:50, v2:50" if status == "True" else "pod-a serves v1:100", at)


def test_an_experiment_held_by_spec_paused_does_not_spend_its_duration() -> None:
    """Found in review: maxDuration ran while the experiment was held (spec.paused, an invalid spec):
    10s of a 100s experiment, paused for 490s, ended at once on resume as NoWinner, "no challenger was
    better within 501s". Now held time does not count: it ends after 100s of running."""
    st, _ = decide(EXPERIMENT, split_written(), BOTH, None, T0 + 10)
    paused = EXPERIMENT.model_copy(update={"paused": True})
    for t in (11, 300, 500):
        st, _ = decide(paused, st, BOTH, None, T0 + t)
        assert st.phase == Phase.PROGRESSING and "held" in st.message
    st, events = decide(EXPERIMENT, st, BOTH, None, T0 + 501)
    assert (st.experiment or {}).get("state") == experiment.RUNNING and events == [], st.message
    st, events = decide(EXPERIMENT, st, BOTH, None, T0 + 589)  # 11s before the pause, 88s after it
    assert (st.experiment or {}).get("state") == experiment.RUNNING and events == [], st.message
    st, events = decide(EXPERIMENT, st, BOTH, None, T0 + 590)
    assert (st.experiment or {}).get("state") == experiment.NO_WINNER and st.weights == {"v1": 100, "v2": 0}
    assert "within 100s" in (st.experiment or {}).get("message", ""), st.experiment


def test_an_experiment_with_a_version_unloaded_on_a_pod_does_not_spend_its_duration() -> None:
    """A challenger not loaded on every pod routes its share to the fallback (stable): no data."""
    st, _ = decide(EXPERIMENT, split_written(), BOTH, None, T0 + 10)
    v2_gone = World(versions_ready={"v1": True, "v2": False}, reasons={"v2": "pod-b: loading"}, ready_pods=2,
                    desired_pods=2)
    for t in (11, 500):
        st, _ = decide(EXPERIMENT, st, v2_gone, None, T0 + t)
        assert "pod-b: loading" in st.message and st.weights == {"v1": 50, "v2": 50}, st.message
    for t in (501, 589):
        st, _ = decide(EXPERIMENT, st, BOTH, None, T0 + t)
        assert (st.experiment or {}).get("state") == experiment.RUNNING, st.message
    st, _ = decide(EXPERIMENT, st, BOTH, None, T0 + 590)
    assert (st.experiment or {}).get("state") == experiment.NO_WINNER


def test_an_experiment_runs_its_duration_from_when_every_pod_serves_the_split() -> None:
    """Found in review: the split's clock started at the ConfigMap write."""
    st = served(split_written(), "False", T0)
    st, _ = decide(EXPERIMENT, st, BOTH, None, T0 + 150)  # 150s after the write, no pod serves the split yet
    assert (st.experiment or {}).get("state") == experiment.RUNNING and "pod-a serves v1:100" in st.message
    st, _ = decide(EXPERIMENT, served(st, "True", T0 + 160), BOTH, None, T0 + 161)
    assert st.step_served_at == T0 + 160 and (st.experiment or {}).get("state") == experiment.RUNNING
    st, _ = decide(EXPERIMENT, st, BOTH, None, T0 + 259)
    assert (st.experiment or {}).get("state") == experiment.RUNNING
    st, _ = decide(EXPERIMENT, st, BOTH, None, T0 + 260)
    assert (st.experiment or {}).get("state") == experiment.NO_WINNER


def test_an_experiment_whose_split_no_pod_serves_is_aborted_at_the_progress_deadline() -> None:
    st = served(split_written(), "False", T0)
    st, _ = decide(EXPERIMENT, st, BOTH, None, T0 + 600)
    assert (st.experiment or {}).get("state") == experiment.RUNNING
    st, events = decide(EXPERIMENT, st, BOTH, None, T0 + 601)
    assert (st.experiment or {}).get("state") == experiment.ABORTED and st.weights == {"v1": 100, "v2": 0}
    assert "ExperimentAborted" in [e.reason for e in events] and "pod-a serves v1:100" in (st.abort_reason or "")


# -- a pod whose workers differ -----------------------------------------------------------------

def test_a_pod_whose_workers_differ_names_the_lagging_workers() -> None:
    """Found in review: a pod whose workers route by different tables (``table_digest:
    workers-differ``, a lagging worker's weights) was said to route "by another table" (or to serve
    the lagging worker's weights, as if the whole pod did), without naming the workers; /status
    names them in ``lagging_workers``."""
    weights = {"v1": 80, "v2": 20}
    versions = {v: {"ready": True, "state": "ready"} for v in weights}

    def differing(name: str, lagging_weights: dict[str, int], lagging: Any) -> PodView:
        return PodView(name, "127.0.0.9", 8080, True, {"weights": lagging_weights, "versions": versions,
                                                       "table_digest": "workers-differ", "lagging_workers": lagging})

    table = {"weights": weights}
    same = Observation([differing("pod-a", weights, [4242])]).serving(weights, table)
    assert same == (False, "pod-a: worker 4242 does not route by the pod's newest table yet (the other workers do)")
    behind = Observation([differing("pod-a", {"v1": 100}, [4242, 4243])]).serving(weights, table)
    assert behind == (False, "pod-a: workers 4242, 4243 do not route by the pod's newest table yet (v1:100; "
                             "the other workers do)")
    unnamed = Observation([differing("pod-a", weights, None)]).serving(weights, table)
    assert unnamed == (False, "pod-a: its workers route by different tables (the runtime names none lagging)")
