"""Review 4 of this session's operator changes: a step's clock from WeightsServed (stepServedAt), the
experiment's held time, the Alertmanager webhook's resolved memory, the Prometheus provider's scoping.
Driven through the operator's own Reconciler on the demo's in-memory ports (pods that take the
ConfigMap's weights late), as test_review3_timing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollout_operator.status import Phase, condition
from tests.operator.test_review3_timing import SLOW, at, late_pods
from tests.operator.test_rollback_pending import T0


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
