"""Review of the webhook's matching: an alert naming a ModelDeployment and a version rolls back
only that version, whichever way it names the object."""

from __future__ import annotations

from typing import Any

from rollout_operator.alerts import AlertWebhook
from rollout_operator.kube import KubeClient
from testbed.k8s.harness import EmulatorProcess
from tests.operator.test_alerts_webhook import (  # noqa: F401  (fixtures)
    CANARY_STATUS,
    EXPERIMENT_STATUS,
    alert,
    create_md,
    emu,
    kube,
    mark,
    marked,
    md_writes,
    payload,
    post,
    webhook,
)


def test_an_alert_naming_the_object_and_another_version_than_the_canary_rolls_nothing_back(
        emu: EmulatorProcess, kube: KubeClient, webhook: AlertWebhook) -> None:
    """Found in review: an alert labelled ``namespace`` + ``modeldeployment`` + ``version`` (what a rule
    over the chart's PodMonitor series keeps) marked the object with whatever canary it had now. The
    v2 canary's alert, repeated by Alertmanager after v2 was rolled back and v3 started (or after v2 was
    promoted: an alert on the stable), rolled back v3; an alert on the stable v1 rolled back the canary;
    one naming an experiment's control aborted every challenger."""
    create_md(kube, status={**CANARY_STATUS, "canaryVersion": "v3"})
    create_md(kube, name="experiment", model="experiment", status=EXPERIMENT_STATUS)
    writes = md_writes(emu)
    for labels in ({"namespace": "default", "modeldeployment": "scorer", "version": "v2"},  # the old canary
                   {"namespace": "default", "modeldeployment": "scorer", "version": "v1"},  # the stable
                   {"namespace": "default", "name": "scorer", "version": "v2"},
                   {"namespace": "default", "modeldeployment": "experiment", "version": "v1"}):  # the control
        resp = post(webhook, payload(alert({"alertname": "CanaryErrors", **labels})))
        assert resp.status_code == 200 and resp.json() == {"rolledBack": []}, labels
    assert md_writes(emu) == writes and mark(kube) is None and mark(kube, "experiment") is None
    # the canary's own alert, and one naming the object alone, roll it back
    own = {"alertname": "CanaryErrors", "namespace": "default", "modeldeployment": "scorer", "version": "v3"}
    whole = {"alertname": "PodsDown", "namespace": "default", "modeldeployment": "scorer"}
    resp = post(webhook, payload(alert(own), alert(whole)))
    assert resp.json() == {"rolledBack": ["default/scorer"]}  # once, though two alerts marked it
    assert mark(kube) == f"{marked(own, 'v3')};{marked(whole, 'v3')}"
    challenger = {"alertname": "CanaryErrors", "namespace": "default", "modeldeployment": "experiment",
                  "version": "v2"}
    assert post(webhook, payload(alert(challenger))).json() == {"rolledBack": ["default/experiment"]}
    assert mark(kube, "experiment") == marked(challenger, "v2")
