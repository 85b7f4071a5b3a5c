"""Review of the webhook's bookkeeping when Alertmanager's notifications for one alert arrive out of
order (an HA pair each sending, two routes sending the same alert, a slow call answered after the
next one): a firing older than what was already handled for that alert changes nothing; a new
firing of it still marks the canary."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from rollout_operator.alerts import AlertWebhook
from rollout_operator.kube import KubeClient
from rollout_operator.reconcile import firing_alert
from testbed.k8s.harness import EmulatorProcess
from testbed.promstack import Alertmanager, alertmanager_factory  # noqa: F401  (fixtures)
from tests.operator.test_alerts_webhook import (  # noqa: F401  (fixtures)
    TOKEN,
    alert,
    emu,
    kube,
    mark,
    marked,
    md_writes,
    payload,
    post,
    scorer,
    url,
    wait_for_mark,
    webhook,
)

LABELS = {"alertname": "CanaryErrors", "model": "scorer", "version": "v2"}
LATER = "2025-01-02T03:20:00.5Z"


def resolved(kube: KubeClient, name: str = "scorer") -> str | None:
    """What the webhook remembers of the object's resolved alerts."""
    from rollout_operator.alerts import RESOLVED_ANNOTATION

    md = kube.get("ModelDeployment", "default", name)
    assert md is not None
    return (md["metadata"].get("annotations") or {}).get(RESOLVED_ANNOTATION)


def test_a_firing_notification_arriving_after_its_resolved_one_does_not_mark_the_canary_again(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Found in review: the late firing put the mark back, and since Alertmanager had already sent the
    resolve, nothing took it off: every retry of the canary was rolled back until cleared by hand."""
    firing = alert(LABELS)
    assert post(webhook, payload(firing)).json() == {"rolledBack": ["default/scorer"]}
    ended = {**firing, "status": "resolved", "endsAt": "2025-01-02T03:10:00Z"}
    assert post(webhook, payload(ended)).status_code == 200
    assert mark(kube) is None
    writes = md_writes(emu)
    resp = post(webhook, payload(firing))  # the firing notification, late (before the fix: marked again)
    assert resp.status_code == 200 and resp.json() == {"rolledBack": []}
    assert mark(kube) is None and md_writes(emu) == writes
    # the same alert firing again after its resolve: Alertmanager gives it a later startsAt; it marks
    again = alert(LABELS, starts_at=LATER)
    assert post(webhook, payload(again)).json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(LABELS, starts_at=LATER) and firing_alert(mark(kube), "v2") == "CanaryErrors"
    assert resolved(kube) is None  # the newer firing took the place of what was remembered of the older
    assert post(webhook, payload({**again, "status": "resolved"})).status_code == 200
    assert mark(kube) is None


def test_a_firing_older_than_the_mark_of_the_same_alert_neither_replaces_it_nor_outlives_its_resolve(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Found in review: the older firing replaced the newer one's mark, so the newer one's resolve
    found no mark of its own and the older mark stayed for good."""
    assert post(webhook, payload(alert(LABELS, starts_at=LATER))).json() == {"rolledBack": ["default/scorer"]}
    writes = md_writes(emu)
    assert post(webhook, payload(alert(LABELS))).json() == {"rolledBack": []}  # the earlier firing, late
    assert mark(kube) == marked(LABELS, starts_at=LATER) and md_writes(emu) == writes
    assert post(webhook, payload(alert(LABELS, status="resolved", starts_at=LATER))).status_code == 200
    assert mark(kube) is None
    # a firing later than the mark (still firing: Alertmanager sent no resolve in between) takes its place
    assert post(webhook, payload(alert(LABELS))).json() == {"rolledBack": []}  # older than the resolve: stale
    latest = "2025-01-02T05:00:00Z"
    assert post(webhook, payload(alert(LABELS, starts_at=latest))).json() == {"rolledBack": ["default/scorer"]}
    offset = "2025-01-02T06:00:00.000000001+01:00"  # a nanosecond after 05:00 UTC
    assert post(webhook, payload(alert(LABELS, starts_at=offset))).json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(LABELS, starts_at=offset)
    assert post(webhook, payload(alert(LABELS, starts_at="2025-01-02T06:00:00+01:00"))).json() == {
        "rolledBack": []}  # 05:00 UTC, as the latest but one: older


def test_starts_are_compared_as_times_not_as_text(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Alertmanager writes nanoseconds, trimmed of trailing zeros: .5Z is later than .123456789Z."""
    precise = "2025-01-02T03:20:00.123456789Z"
    assert post(webhook, payload(alert(LABELS, starts_at=precise))).json() == {"rolledBack": ["default/scorer"]}
    assert post(webhook, payload(alert(LABELS, starts_at=LATER))).json() == {"rolledBack": ["default/scorer"]}
    assert post(webhook, payload(alert(LABELS, starts_at=precise))).json() == {"rolledBack": []}
    assert mark(kube) == marked(LABELS, starts_at=LATER)


def test_what_the_webhook_remembers_of_resolved_alerts_is_bounded_per_object(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """One rule firing per pod, pods coming and going: each resolve is remembered, the oldest forgotten."""
    from rollout_operator.alerts import MAX_RESOLVED

    pods = [alert({**LABELS, "pod": f"p{i}"}) for i in range(MAX_RESOLVED + 3)]
    for one in pods:
        assert post(webhook, payload(one)).json() == {"rolledBack": ["default/scorer"]}
        assert post(webhook, payload({**one, "status": "resolved"})).status_code == 200
    remembered = (resolved(kube) or "").split(";")
    assert len(remembered) == MAX_RESOLVED and mark(kube) is None
    assert remembered[-1] == marked(pods[-1]["labels"]).rsplit("@", 1)[0]  # name@startsAt@instance
    assert post(webhook, payload(pods[-1])).json() == {"rolledBack": []}  # remembered: stale
    # forgotten: marks again (the price of the bound; only for an alert this many resolves back)
    assert post(webhook, payload(pods[0])).json() == {"rolledBack": ["default/scorer"]}


def test_the_reply_names_each_object_once_however_many_alerts_marked_it(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Found in review: two alerts marking one object listed it twice."""
    down = {"alertname": "PodsDown", "namespace": "default", "modeldeployment": "scorer"}
    resp = post(webhook, payload(alert(LABELS), alert(down)))
    assert resp.json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == f"{marked(LABELS)};{marked(down)}"


def test_behind_a_real_alertmanager_an_alert_firing_again_after_its_resolve_marks_the_canary_again(
        kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook,
        alertmanager_factory: Callable[..., Alertmanager]) -> None:  # noqa: F811
    """What the webhook relies on: Alertmanager gives an alert firing again after its resolve a later
    startsAt than the resolved one (so it is not taken for a late notification of that one)."""
    am = alertmanager_factory(url(webhook), TOKEN)
    am.post_alerts([{"labels": LABELS}])
    first, _ = wait_for_mark(kube, 30, "CanaryErrors@")
    # ended now (its API shows the start in ms only: Alertmanager keeps the start it has, to the ns)
    am.post_alerts([{"labels": LABELS, "endsAt": datetime.now(timezone.utc).isoformat()}])
    deadline = time.monotonic() + 30
    while mark(kube) is not None:
        assert time.monotonic() < deadline, f"the resolve did not take the mark off: {mark(kube)!r}"
        time.sleep(0.05)
    assert resolved(kube) == first.rsplit("@", 1)[0]
    am.post_alerts([{"labels": LABELS}])  # firing again
    again, _ = wait_for_mark(kube, 30, "CanaryErrors@")
    assert again.split("@")[1] > first.split("@")[1] and again.split("@")[2:] == first.split("@")[2:]
    assert resolved(kube) is None


def test_a_starts_at_that_is_not_a_time_gets_400_naming_it_and_marks_nothing(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Found in review: startsAt went into the mark unchecked. ``...Z;x`` split the mark at the ``;``
    into ``CanaryErrors@...Z`` (no versions: rolls back every later canary, whatever its version) and
    ``x@<instance>@v2``, and the alert's resolve, looking for the whole mark, took neither off."""
    writes = md_writes(emu)
    for starts_at in ("2025-01-02T03:04:05Z;x", "2025-01-02T03:04:05@Z", "yesterday", 5, None):
        resp = post(webhook, payload({**alert(LABELS), "startsAt": starts_at}))
        assert resp.status_code == 400, (starts_at, resp.text)
        assert resp.json() == {"error": f"alerts[0].startsAt: {starts_at!r} is not an RFC 3339 time"}
    assert md_writes(emu) == writes and mark(kube) is None
