"""Review of the webhook when an alert's resolved notification arrives before its firing one
(eighth review): Alertmanager retries a failed call, and an HA pair each sends, so a firing copy can
come after the resolve. The resolve is remembered on each object the alert names, marked or not, so
the late firing marks nothing; a firing with a later startsAt (the alert firing again) still marks."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_operator.alerts import MAX_RESOLVED, AlertWebhook
from rollout_operator.kube import KubeClient
from rollout_operator.wakeups import md_signature
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_alerts_webhook import (  # noqa: F401  (fixtures)
    CANARY_STATUS,
    alert,
    create_md,
    emu,
    kube,
    mark,
    marked,
    md_writes,
    payload,
    post,
    scorer,
    webhook,
)
from tests.operator.test_review3_alerts import LATER, LABELS, resolved

EARLIER = "2025-01-02T02:00:00Z"
BY_OBJECT = {"alertname": "PodsDown", "namespace": "default", "modeldeployment": "scorer"}


def md(kube: KubeClient, name: str = "scorer") -> dict[str, Any]:
    found = kube.get("ModelDeployment", "default", name)
    assert found is not None
    return found


@pytest.mark.parametrize("labels", [LABELS, BY_OBJECT], ids=["model-version", "namespace-modeldeployment"])
def test_a_resolve_arriving_before_its_firing_is_remembered_so_the_late_firing_marks_nothing(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook,
        labels: dict[str, str]) -> None:
    """Found in review: a resolve found no mark of its alert and was forgotten, so the firing that
    arrived after it marked the canary, and no resolve was left to come: rolled back until cleared by
    hand. The memory is the resolved annotation only: the operator does not wake for it."""
    idle = create_md(kube, name="idle")  # same model, no canary: not named, so not written
    before = md_signature(md(kube))
    firing = alert(labels)
    assert post(webhook, payload({**firing, "status": "resolved"})).json() == {"rolledBack": []}
    assert resolved(kube) == marked(labels).rsplit("@", 1)[0] and mark(kube) is None  # name@startsAt@instance
    assert md_signature(md(kube)) == before  # what wakes the operator's loop is unchanged
    assert md(kube, "idle")["metadata"]["resourceVersion"] == idle["metadata"]["resourceVersion"]
    writes = md_writes(emu)
    assert post(webhook, payload({**firing, "status": "resolved"})).status_code == 200  # the other replica's copy
    assert post(webhook, payload(firing)).json() == {"rolledBack": []}  # the firing, late (before: marked)
    assert post(webhook, payload(alert(labels, starts_at=EARLIER))).json() == {"rolledBack": []}
    assert mark(kube) is None and md_writes(emu) == writes
    # the alert firing again after its resolve: a later startsAt, marks, in place of the resolve remembered
    assert post(webhook, payload(alert(labels, starts_at=LATER))).json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(labels, starts_at=LATER) and resolved(kube) is None
    # a late copy of the earlier resolve: older than the mark, not remembered, the mark stays
    writes = md_writes(emu)
    assert post(webhook, payload({**firing, "status": "resolved"})).status_code == 200
    assert mark(kube) == marked(labels, starts_at=LATER) and resolved(kube) is None and md_writes(emu) == writes
    assert post(webhook, payload(alert(labels, status="resolved", starts_at=LATER))).status_code == 200
    assert mark(kube) is None


def test_a_later_resolve_replaces_an_earlier_one_and_an_earlier_one_arriving_late_is_not_remembered(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Each alert keeps its latest start only: resolves arriving out of order leave the later one."""
    assert post(webhook, payload(alert(LABELS, status="resolved"))).status_code == 200
    assert post(webhook, payload(alert(LABELS, status="resolved", starts_at=LATER))).status_code == 200
    assert resolved(kube) == marked(LABELS, starts_at=LATER).rsplit("@", 1)[0]
    writes = md_writes(emu)
    assert post(webhook, payload(alert(LABELS, status="resolved"))).status_code == 200
    assert post(webhook, payload(alert(LABELS, starts_at=LATER))).json() == {"rolledBack": []}  # late
    assert resolved(kube) == marked(LABELS, starts_at=LATER).rsplit("@", 1)[0] and md_writes(emu) == writes
    assert mark(kube) is None


def test_resolves_remembered_without_marks_are_bounded_oldest_forgotten(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """One rule per pod, each pod's resolve arriving first: the last MAX_RESOLVED are remembered."""
    pods = [alert({**LABELS, "pod": f"p{i}"}) for i in range(MAX_RESOLVED + 3)]
    for one in pods:
        assert post(webhook, payload({**one, "status": "resolved"})).status_code == 200
    remembered = (resolved(kube) or "").split(";")
    assert len(remembered) == MAX_RESOLVED and remembered[-1] == marked(pods[-1]["labels"]).rsplit("@", 1)[0]
    assert post(webhook, payload(pods[-1])).json() == {"rolledBack": []}  # late: marks nothing (before: marked)
    assert mark(kube) is None
    # forgotten: marks (the price of the bound, as for resolves that took a mark off)
    assert post(webhook, payload(pods[0])).json() == {"rolledBack": ["default/scorer"]}


def test_a_resolve_for_a_modeldeployment_without_a_canary_writes_nothing(
        emu: EmulatorProcess, kube: KubeClient, webhook: AlertWebhook) -> None:
    """Only objects the alert names (a canary or challenger in flight, as a firing needs) are written."""
    create_md(kube, status={"stableVersion": "v1", "phase": "Ready"})  # no canary
    create_md(kube, name="other", model="other", status=CANARY_STATUS)
    writes = md_writes(emu)
    resp = post(webhook, payload(alert(BY_OBJECT, status="resolved"), alert(LABELS, status="resolved")))
    assert resp.status_code == 200 and md_writes(emu) == writes and resolved(kube) is None
    assert post(webhook, payload(alert({**LABELS, "model": "other"}, status="resolved"))).status_code == 200
    assert resolved(kube, "other") is not None  # the positive signal: a named object is written
    assert md_writes(emu) == writes + 1 and resolved(kube) is None
