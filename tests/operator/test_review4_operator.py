"""Review 4 of this session's operator changes: a step's clock from WeightsServed (stepServedAt), the
experiment's held time, the Alertmanager webhook's resolved memory, the Prometheus provider's scoping.
Driven through the operator's own Reconciler on the demo's in-memory ports (pods that take the
ConfigMap's weights late), as test_review3_timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_operator import children
from rollout_operator.observe import Observation, PodView
from rollout_operator.reconcile import Reconciler
from rollout_operator.status import Phase, condition
from tests.operator.test_review3_timing import SLOW, SetTime, at, late_pods
from tests.operator.test_rollback_pending import T0, Looks, WeightedPods, reconcile


def test_a_step_whose_pause_fills_the_progress_deadline_is_not_failed_for_its_weights_served_late(
        tmp_path: Path) -> None:
    """Found in review: the pause counts from when the pods serve the step (stepServedAt) but the
    deadline from the write, so a step whose pause fits progressDeadlineSeconds (110s of 120s; a
    "10m" step under the default 600s) failed whenever the pods took its weights later than the
    deadline's slack: served 25s late, "rolled back to v1: step 1/2 held 130s (last analysis: pass)"
    at the first reconcile past T0+120, where before this session it advanced at T0+110. Now a served
    step's hold counts from when it was served."""
    spec: dict[str, Any] = {**SLOW, "strategy": {**SLOW["strategy"], "steps": [
        {"weight": 20, "pause": "110s"}, {"weight": 50, "pause": "30s"}]}}
    ports, rec, looks, clock = late_pods(tmp_path, spec)
    ports.applied = True  # the pod takes the new weights at T0+25
    st = at(ports, rec, clock, T0 + 25)
    assert (condition(st, "WeightsServed") or {}).get("status") == "True"
    for t in range(30, 135, 10):
        st = at(ports, rec, clock, T0 + t, looks)
        assert st.phase == Phase.PROGRESSING and st.current_step == 0, (t, st.message)
    assert st.step_served_at == T0 + 25
    st = at(ports, rec, clock, T0 + 135, looks)  # its 110s served, and passing all along
    assert st.phase == Phase.PROGRESSING and st.current_step == 1 and st.weights == {"v1": 50, "v2": 50}, st.message


def test_a_served_step_still_fails_at_the_progress_deadline_when_its_checks_hold(tmp_path: Path) -> None:
    """The hold a deadline bounds, once served, counts from then: no pass, failed 120s after it."""
    ports, rec, looks, clock = late_pods(tmp_path, SLOW)
    ports.applied = True
    at(ports, rec, clock, T0 + 25)
    st = at(ports, rec, clock, T0 + 145)
    assert st.phase == Phase.PROGRESSING and st.current_step == 0, st.message
    st = at(ports, rec, clock, T0 + 146)
    assert st.phase == Phase.FAILED and st.weights == {"v1": 100, "v2": 0}
    assert st.abort_reason is not None and "no analysis yet" in st.abort_reason, st.abort_reason


class BlinkingPods(WeightedPods):
    """WeightedPods whose one pod does not answer /status while ``down`` (a timeout under load)."""

    down = False

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        if self.down:
            return Observation([PodView("pod-a", "127.0.0.1", port, True, None, "timed out")])
        return super().observe_pods(target, port, model)


def test_a_pod_that_misses_one_status_look_does_not_start_the_step_clock_at_the_write(tmp_path: Path) -> None:
    """Found in review: a look at which no ready pod answered (a 1s /status timeout) made WeightsServed
    Unknown, as for "pods that do not report their weights (an older runtime)", and the next decision
    set stepServedAt to the write: the step advanced at T0+30 on checks of a pod that never took its
    weights (it still routed by v1:100). Now a ready pod that did not answer is not confirmed
    (WeightsServed False, naming it), with other pods answering too."""
    ports = BlinkingPods(SLOW, tmp_path / "runtime.yaml")
    looks, clock = Looks(), SetTime()
    rec = Reconciler(ports, analyzer=looks, clock=clock)
    for _ in range(3):
        reconcile(ports, rec)
    ports.down = True
    st = at(ports, rec, clock, T0 + 5)
    served = condition(st, "WeightsServed") or {}
    assert served.get("status") == "False" and served.get("message", "").startswith("pod-a did not answer (timed out)")
    ports.down = False
    for t in (10, 20, 30, 40):
        st = at(ports, rec, clock, T0 + t, looks)
        assert st.current_step == 0 and st.weights == {"v1": 80, "v2": 20}, (t, st.message)
        assert st.step_served_at is None and "waiting for every pod to serve" in st.message, (t, st.message)
    assert "pod-a serves v1:100" in st.message
    ports.applied = True
    at(ports, rec, clock, T0 + 45)
    st = at(ports, rec, clock, T0 + 46)
    assert st.step_served_at == T0 + 45


def test_a_ready_pod_that_does_not_answer_is_not_said_to_serve_the_weights() -> None:
    """pod-b's /status timed out at the look where pod-a served the step: "every pod serves" was
    claimed (and the step's clock started) while pod-b may still route by the old weights."""
    weights = {"v1": 80, "v2": 20}
    versions = {v: {"ready": True, "state": "ready"} for v in weights}
    pod_a = PodView("pod-a", "127.0.0.9", 8080, True, {"weights": weights, "versions": versions})
    pod_b = PodView("pod-b", "127.0.0.10", 8080, True, None, "timed out")
    assert Observation([pod_a, pod_b]).serving(weights) == (False, "pod-b did not answer (timed out)")
    older = PodView("pod-a", "127.0.0.9", 8080, True, {"versions": versions})  # an older runtime: no weights
    assert Observation([older, pod_b]).serving(weights) == (None, "")
    unready = PodView("pod-b", "127.0.0.10", 8080, False, None, "connection refused")
    assert Observation([pod_a, unready]).serving(weights) == (True, "")
