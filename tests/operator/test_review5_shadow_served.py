"""Review 5: a shadow step's clock. A shadow step keeps the weights (the canary at 0) and its table,
so WeightsServed was True at the ConfigMap write and the step's pause ran while the pods had not
taken the shadow (its checks saw too few shadow requests). Now the pods report what they shadow
(``/status``'s ``shadow``) and WeightsServed compares it with the step's; pods that do not report it
(an older runtime) count from the write, as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mnn_rollout.contract.config import parse_config_text
from rollout_operator import children
from rollout_operator.observe import Observation, PodView
from rollout_operator.reconcile import Reconciler
from rollout_operator.status import Phase, RolloutStatus, condition
from tests.operator.test_review3_timing import SLOW, SetTime, at
from tests.operator.test_rollback_pending import T0, Looks, WeightedPods, reconcile

SHADOW = {**SLOW, "strategy": {**SLOW["strategy"], "steps": [
    {"shadow": 20, "pause": "30s"}, {"shadow": 50, "pause": "30s"}, {"weight": 20, "pause": "30s"}]}}
TWENTY = {"version": "v2", "percent": 20}


class ShadowPods(WeightedPods):
    """``WeightedPods`` serving the ConfigMap's weights at once (once written), reporting ``shadow``: what the pod took
    (``take``), nothing at first; or no ``shadow`` at all (``reports_shadow`` False: an older runtime)."""

    reports_shadow = True
    shadow: dict[str, Any] | None = None
    lagging: list[int] = []  # /status's lagging_workers
    loading = False  # v2 is not loaded yet

    def take(self) -> None:
        """The pod takes the ConfigMap's shadow."""
        shadow = parse_config_text(self.config_text).shadow
        self.shadow = None if shadow is None else shadow.model_dump()

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        self.applied = bool(self.config_text)  # the weights, at once (once written)
        (pod,) = super().observe_pods(target, port, model).pods
        status = {**(pod.status or {}), **({"shadow": self.shadow} if self.reports_shadow else {}),
                  "lagging_workers": self.lagging}
        if self.loading:
            status["versions"] = {**status["versions"], "v2": {"ready": False, "state": "pending"}}
        return Observation([PodView(pod.name, pod.ip, pod.port, pod.ready, status)])


def shadow_step(tmp_path: Path, reports_shadow: bool = True) -> tuple[ShadowPods, Reconciler, Looks, SetTime]:
    """SHADOW's canary at its first step (shadow 20%, weight 0), written at T0 once the pod loaded v2
    (its weights, v1:100, served since T0-10); the pod shadows nothing."""
    ports, looks, clock = ShadowPods(SHADOW, tmp_path / "runtime.yaml"), Looks(), SetTime()
    ports.reports_shadow, ports.loading = reports_shadow, True
    rec = Reconciler(ports, analyzer=looks, clock=clock)
    clock.now = T0 - 10
    for _ in range(3):
        reconcile(ports, rec)
    st = ports.status()
    assert st.shadow_percent is None and served(st).get("status") == "True", (st.message, served(st))
    ports.loading = False
    clock.now = T0
    reconcile(ports, rec)
    st = ports.status()
    assert st.shadow_percent == 20 and st.weights == {"v1": 100, "v2": 0} and st.step_started_at == T0, st.message
    assert parse_config_text(ports.config_text).shadow is not None
    return ports, rec, looks, clock


def served(st: RolloutStatus) -> dict[str, Any]:
    return condition(st, "WeightsServed") or {}


def test_a_shadow_step_taken_late_starts_its_clock_when_every_pod_shadows(tmp_path: Path) -> None:
    """Found in review: the pod took the shadow 25s after the write, and the 30s step advanced at
    T0+30 on checks of a pod shadowing nothing (WeightsServed True from the write). Now its pause runs
    from T0+25; the next shadow step (50%, same weights) waits for the pod to take 50% too."""
    ports, rec, looks, clock = shadow_step(tmp_path)
    for t in (10, 20):
        st = at(ports, rec, clock, T0 + t, looks)
        assert served(st).get("status") == "False" and st.current_step == 0 and st.step_served_at is None
        assert "pod-a shadows nothing, not 20% of stable's requests on v2" in st.message, st.message
    ports.take()  # at T0+25
    st = at(ports, rec, clock, T0 + 25)
    assert served(st).get("status") == "True", served(st)
    assert served(st).get("message") == "every pod serves v1:100 and shadows 20% of stable's requests on v2"
    st = at(ports, rec, clock, T0 + 30, looks)
    assert st.step_served_at == T0 + 25 and st.current_step == 0, st.message
    for t in (40, 50):
        st = at(ports, rec, clock, T0 + t, looks)
        assert st.current_step == 0, st.message
    st = at(ports, rec, clock, T0 + 56, looks)  # 30s shadowed, a pass measured on it: the next shadow step
    assert st.current_step == 1 and st.shadow_percent == 50 and st.step_served_at is None, st.message
    for t in (60, 70):  # the pod still shadows 20%: the weights alone (unchanged) do not start the clock
        st = at(ports, rec, clock, T0 + t, looks)
        assert st.step_served_at is None and served(st).get("status") == "False", st.message
        assert "pod-a shadows 20% of stable's requests on v2, not 50%" in st.message, st.message
    ports.take()
    at(ports, rec, clock, T0 + 75)
    st = at(ports, rec, clock, T0 + 76)
    assert st.step_served_at == T0 + 75 and st.current_step == 1, st.message


def test_a_shadow_step_no_pod_takes_fails_at_the_progress_deadline_naming_the_pod(tmp_path: Path) -> None:
    ports, rec, looks, clock = shadow_step(tmp_path)
    st = at(ports, rec, clock, T0 + 100, looks)
    assert st.phase == Phase.PROGRESSING and st.current_step == 0 and st.step_served_at is None
    st = at(ports, rec, clock, T0 + 121)
    assert st.phase == Phase.FAILED and st.shadow_percent is None, st.message
    assert st.abort_reason is not None and "pod-a shadows nothing, not 20% of stable's requests on v2" \
        in st.abort_reason, st.abort_reason


def test_a_pod_whose_workers_differ_on_the_shadow_is_not_served_and_names_the_lagging_worker(
        tmp_path: Path) -> None:
    """A pod with a worker that missed the shadow config reports ``shadow: workers-differ``."""
    ports, rec, looks, clock = shadow_step(tmp_path)
    ports.shadow = "workers-differ"  # type: ignore[assignment]
    ports.lagging = [4242]
    st = at(ports, rec, clock, T0 + 10)
    assert served(st).get("status") == "False" and st.step_served_at is None
    assert served(st).get("message", "").startswith(
        "pod-a: worker 4242 does not shadow as the pod's newest config yet (the other workers do)"), served(st)


def test_pods_that_do_not_report_their_shadow_count_the_step_from_the_write(tmp_path: Path) -> None:
    """An older runtime says nothing of its shadow: judged by weights and table alone, as before."""
    ports, rec, looks, clock = shadow_step(tmp_path, reports_shadow=False)
    at(ports, rec, clock, T0 + 1)
    st = at(ports, rec, clock, T0 + 10, looks)
    assert st.step_served_at == T0 and served(st).get("status") == "True", st.message
    for t in (20, 30):
        st = at(ports, rec, clock, T0 + t, looks)
    assert st.current_step == 1 and st.shadow_percent == 50, st.message
