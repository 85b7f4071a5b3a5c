"""The Alertmanager webhook (rollout_operator/alerts.py) over real HTTP against the API emulator,
and end to end behind a real Alertmanager (and Prometheus alerting rules)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import pytest
import yaml

from mnn_rollout.local.net import wait_for
from rollout_operator.alerts import EVICTED_THREADS, MAX_CONNECTIONS, AlertWebhook, instance
from rollout_operator.kube import KubeClient
from rollout_operator.reconcile import ALERT_ANNOTATION
from testbed.k8s.harness import EmulatorProcess
from testbed.promstack import (  # noqa: F401  (fixtures)
    Alertmanager,
    Prometheus,
    alertmanager_factory,
    prometheus_factory,
    send,
    write_runtime_config,
)
from tests.k8s.helpers import create_namespace
from tests.runtime_server import RuntimeServer

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "modeldeployment.yaml"
TOKEN = "webhook-s3cret"
STARTS_AT = "2025-01-02T03:04:05.678Z"
CANARY_STATUS = {"canaryVersion": "v2", "stableVersion": "v1", "phase": "Progressing"}


@pytest.fixture
def emu(k8s_emulator_factory: Callable[..., EmulatorProcess]) -> EmulatorProcess:
    return k8s_emulator_factory(crds=[CRD])


@pytest.fixture
def kube(emu: EmulatorProcess) -> Iterator[KubeClient]:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(emu.kubeconfig_path), client_configuration=cfg)
    client = KubeClient(cfg)
    yield client
    client.close()


def create_md(kube: KubeClient, name: str = "scorer", namespace: str = "default", model: str = "scorer",
              status: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ModelDeployment like examples/scorer-canary.yaml, with its status set through /status."""
    md = yaml.safe_load((ROOT / "examples" / "scorer-canary.yaml").read_text())
    md["metadata"] = {"name": name, "namespace": namespace}
    md["spec"]["model"] = model
    kube.create(md)
    if status is not None:
        kube.patch("ModelDeployment", namespace, name, {"status": status}, subresource="status")
    live = kube.get("ModelDeployment", namespace, name)
    assert live is not None
    return live


@pytest.fixture
def scorer(kube: KubeClient) -> dict[str, Any]:
    return create_md(kube, status=CANARY_STATUS)


@contextlib.contextmanager
def serving(kube: KubeClient, token: str = TOKEN, **settings: Any) -> Iterator[AlertWebhook]:
    """An AlertWebhook on a free loopback port taking ``token``, started; stopped and closed after."""
    hook = AlertWebhook(kube, "127.0.0.1", 0, lambda: token, **settings)
    hook.start()
    try:
        yield hook
    finally:
        hook.stop()
        hook.server.server_close()


@pytest.fixture
def webhook(kube: KubeClient) -> Iterator[AlertWebhook]:
    with serving(kube) as hook:
        yield hook


def url(hook: AlertWebhook) -> str:
    return f"http://127.0.0.1:{hook.port}/alerts"


def post(hook: AlertWebhook, payload: Any, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    if isinstance(payload, bytes):
        return httpx.post(url(hook), content=payload, headers=headers, timeout=10)
    return httpx.post(url(hook), json=payload, headers=headers, timeout=10)


def alert(labels: dict[str, str], status: str = "firing", starts_at: str = STARTS_AT) -> dict[str, Any]:
    return {"status": status, "labels": labels, "annotations": {}, "startsAt": starts_at,
            "endsAt": "0001-01-01T00:00:00Z", "generatorURL": "", "fingerprint": "0"}


def payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    firing = any(a.get("status") == "firing" for a in alerts)
    return {"version": "4", "status": "firing" if firing else "resolved", "receiver": "mnn-rollout",
            "groupKey": "{}:{}", "groupLabels": {}, "commonLabels": {}, "commonAnnotations": {},
            "externalURL": "http://127.0.0.1:9093", "truncatedAlerts": 0, "alerts": list(alerts)}


def mark(kube: KubeClient, name: str = "scorer", namespace: str = "default") -> str | None:
    md = kube.get("ModelDeployment", namespace, name)
    assert md is not None
    return (md["metadata"].get("annotations") or {}).get(ALERT_ANNOTATION)


def marked(labels: dict[str, str], versions: str = "v2", starts_at: str = STARTS_AT) -> str:
    """The mark an alert with ``labels`` leaves: its name, start, instance (its labels' hash), versions."""
    return f"{labels['alertname'].replace(';', '_').replace('@', '_')}@{starts_at}@{instance(labels)}@{versions}"


def md_writes(emu: EmulatorProcess) -> int:
    return len(emu.write_requests("modeldeployments"))


def test_a_missing_or_wrong_bearer_token_gets_401_and_changes_nothing(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    writes = md_writes(emu)
    body = payload(alert({"alertname": "A", "namespace": "default", "modeldeployment": "scorer"}))
    for token in (None, "wrong", TOKEN + "x", TOKEN[:-1], TOKEN.upper()):
        resp = post(webhook, body, token=token)
        assert resp.status_code == 401, (token, resp.text)
        assert "bearer token" in resp.json()["error"]
    resp = httpx.post(url(webhook), json=body, headers={"Authorization": TOKEN}, timeout=10)  # no "Bearer "
    assert resp.status_code == 401
    assert md_writes(emu) == writes and mark(kube) is None


def test_an_empty_configured_token_refuses_everyone(emu: EmulatorProcess, kube: KubeClient,
                                                    scorer: dict[str, Any]) -> None:
    with serving(kube, token="") as hook:
        body = payload(alert({"alertname": "A", "namespace": "default", "modeldeployment": "scorer"}))
        assert post(hook, body, token="anything").status_code == 401
        assert post(hook, body, token=None).status_code == 401
        resp = httpx.post(url(hook), json=body, headers={"Authorization": "Bearer"}, timeout=10)
        assert resp.status_code == 401
    assert mark(kube) is None


def test_malformed_payloads_get_400_naming_the_problem_and_change_nothing(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    writes = md_writes(emu)
    good_labels = {"alertname": "A", "namespace": "default", "modeldeployment": "scorer"}
    cases: list[tuple[Any, str]] = [
        (b"{not json", "body is not JSON"),
        (b"\xff\xfe", "body is not JSON"),
        (b"", "body is not JSON"),
        ([1, 2], "body: expected an object"),
        ({"status": "firing"}, "alerts: required, a list"),
        ({"alerts": {"labels": good_labels}}, "alerts: required, a list"),
        (payload({"status": "firing", "startsAt": STARTS_AT}), "alerts[0].labels: required, an object"),
        (payload(alert(good_labels), {"status": "firing", "labels": ["a"]}), "alerts[1].labels: required"),
        (payload(alert(good_labels, status="pending")), "alerts[0].status: 'pending' is not firing or resolved"),
        (payload({"labels": good_labels}), "alerts[0].status: None is not firing or resolved"),
    ]
    for body, message in cases:
        resp = post(webhook, body)
        assert resp.status_code == 400, (body, resp.text)
        assert message in resp.json()["error"], (body, resp.json())
    assert md_writes(emu) == writes and mark(kube) is None


def raw_post(hook: AlertWebhook, content_length: bytes, body: bytes = b'{"alerts": []}') -> bytes:
    """The reply to a POST /alerts sent as bytes with this Content-Length (a socket.timeout if none)."""
    with socket.create_connection(("127.0.0.1", hook.port), timeout=5) as sock:
        sock.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
                     + b"\r\nContent-Length: " + content_length + b"\r\n\r\n" + body)
        return closed_by_server(sock)


def test_a_content_length_that_is_not_a_whole_number_gets_400_naming_it_and_an_over_large_one_413(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    writes = md_writes(emu)
    for given in (b"abc", b"-1", b"1.5", b"1_4", b"0x10", b"\xb2"):  # before the fix: no reply, or a hang on -1
        reply = raw_post(webhook, given)
        status, _, body = reply.partition(b"\r\n\r\n")
        assert status.startswith(b"HTTP/1.0 400 "), (given, reply)
        error = json.loads(body)["error"]
        assert error.startswith(f"Content-Length: {given.decode('latin-1')!r} is not a whole number"), error
    reply = raw_post(webhook, str((1 << 20) + 1).encode())
    assert reply.startswith(b"HTTP/1.0 413 ") and b"Content-Length: 1048577, a body over 1048576 bytes" in reply
    # int() refuses over 4,300 digits: before the fix, a traceback and no reply
    for given in (b"9" * 5000, b"0" * 4 + b"1" * 4999, b"9" * 10):
        reply = raw_post(webhook, given)
        assert reply.startswith(b"HTTP/1.0 413 "), (given[:20], reply)
        digits = len(given.lstrip(b"0"))
        assert json.loads(reply.partition(b"\r\n\r\n")[2]) == {
            "error": f"Content-Length: {digits} digits, a body over 1048576 bytes"}
    assert raw_post(webhook, b" 14 ").startswith(b"HTTP/1.0 200 ")  # whitespace around it is allowed
    assert raw_post(webhook, b"0" * 5000 + b"14").startswith(b"HTTP/1.0 200 ")  # and leading zeros, however many
    assert md_writes(emu) == writes and mark(kube) is None


def test_other_paths_are_404_and_healthz_answers(webhook: AlertWebhook) -> None:
    base = f"http://127.0.0.1:{webhook.port}"
    assert httpx.get(base + "/healthz", timeout=5).status_code == 200
    assert httpx.get(base + "/alerts", timeout=5).status_code == 404
    resp = httpx.post(base + "/other", json=payload(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert resp.status_code == 404 and "/other" in resp.json()["error"]


def test_a_firing_alert_naming_namespace_and_modeldeployment_marks_it_once(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    labels = {"alertname": "MNNCanaryHighErrorRate", "namespace": "default", "modeldeployment": "scorer",
              "severity": "critical"}
    body = payload(alert(labels))
    writes = md_writes(emu)
    resp = post(webhook, body)
    assert resp.status_code == 200 and resp.json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(labels)  # the alert, its start, which one, the canary it hit
    assert md_writes(emu) == writes + 1
    # Alertmanager repeats notifications: the same alert again writes nothing
    for _ in range(3):
        resp = post(webhook, body)
        assert resp.status_code == 200 and resp.json() == {"rolledBack": []}
    assert md_writes(emu) == writes + 1
    # a new firing of the same alert (another startsAt) is a new mark
    later = "2025-01-02T04:00:00Z"
    resp = post(webhook, payload(alert(labels, starts_at=later)))
    assert resp.json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(labels, starts_at=later) and md_writes(emu) == writes + 2


def test_an_alert_naming_a_modeldeployment_that_does_not_exist_marks_nothing(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    writes = md_writes(emu)
    for labels in ({"namespace": "default", "modeldeployment": "nope"},
                   {"namespace": "elsewhere", "modeldeployment": "scorer"},
                   {"modeldeployment": "scorer"},  # no namespace and no model/version: names nothing
                   {"alertname": "Unrelated", "severity": "info"}):
        resp = post(webhook, payload(alert(labels)))
        assert resp.status_code == 200 and resp.json() == {"rolledBack": []}, labels
    assert md_writes(emu) == writes and mark(kube) is None


def test_a_firing_alert_naming_the_canary_by_model_and_version_marks_only_that_modeldeployment(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    create_md(kube, name="ranker", model="ranker", status=CANARY_STATUS)  # same versions, other model
    create_md(kube, name="scorer-idle", model="scorer", status={"stableVersion": "v1", "phase": "Ready"})
    writes = md_writes(emu)
    # the stable version, an unknown version, another model: nothing to roll back
    for labels in ({"model": "scorer", "version": "v1"}, {"model": "scorer", "version": "v3"},
                   {"model": "nope", "version": "v2"}, {"model": "scorer", "version": "v2", "namespace": "other"}):
        resp = post(webhook, payload(alert({"alertname": "A", **labels})))
        assert resp.status_code == 200 and resp.json() == {"rolledBack": []}, labels
    assert md_writes(emu) == writes
    latency = {"alertname": "MNNCanaryHighLatency", "model": "scorer", "version": "v2"}
    resp = post(webhook, payload(alert(latency)))
    assert resp.status_code == 200 and resp.json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(latency)
    assert mark(kube, "ranker") is None and mark(kube, "scorer-idle") is None
    assert md_writes(emu) == writes + 1


def test_an_alert_for_a_canary_held_under_its_last_valid_spec_marks_it(
        emu: EmulatorProcess, kube: KubeClient, webhook: AlertWebhook) -> None:
    """A canary whose spec became invalid mid-rollout still serves its users (held under the last
    valid spec): its alert is marked, and rolls it back. Before, the webhook dropped it (phase
    InvalidSpec was not in flight), and Alertmanager sent it again only after repeat_interval."""
    create_md(kube, status={**CANARY_STATUS, "phase": "InvalidSpec", "phaseBeforeInvalid": "Progressing"})
    create_md(kube, name="done", status={**CANARY_STATUS, "phase": "InvalidSpec", "phaseBeforeInvalid": "RolledBack"})
    labels = {"alertname": "A", "model": "scorer", "version": "v2"}
    resp = post(webhook, payload(alert(labels)))
    assert resp.status_code == 200 and resp.json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == marked(labels) and mark(kube, "done") is None


EXPERIMENT_STATUS = {"stableVersion": "v1", "phase": "Progressing", "experiment": {
    "state": "Running", "control": "v1", "weights": {"v1": 50, "v2": 50}, "metric": "conversion"}}


def test_an_alert_naming_a_challenger_of_a_running_experiment_marks_it(
        emu: EmulatorProcess, kube: KubeClient, webhook: AlertWebhook) -> None:
    create_md(kube, status=EXPERIMENT_STATUS)
    create_md(kube, name="done", model="done", status={**EXPERIMENT_STATUS, "experiment": {
        **EXPERIMENT_STATUS["experiment"], "state": "Winner"}})  # type: ignore[dict-item]
    writes = md_writes(emu)
    for labels in ({"model": "scorer", "version": "v1"},  # the control: nothing to abort
                   {"model": "done", "version": "v2"}):  # a concluded experiment
        resp = post(webhook, payload(alert({"alertname": "A", **labels})))
        assert resp.status_code == 200 and resp.json() == {"rolledBack": []}, labels
    assert md_writes(emu) == writes
    errors = {"alertname": "ChallengerErrors", "model": "scorer", "version": "v2"}
    resp = post(webhook, payload(alert(errors)))
    assert resp.json() == {"rolledBack": ["default/scorer"]} and mark(kube) == marked(errors)
    # named by the object, not a version: the mark names every challenger
    down = {"alertname": "PodsDown", "namespace": "default", "name": "scorer"}
    resp = post(webhook, payload(alert(down)))
    assert resp.json() == {"rolledBack": ["default/scorer"]}
    assert mark(kube) == f"{marked(errors)};{marked(down)}"  # both fire


def test_the_namespaces_option_limits_model_and_version_lookups(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any]) -> None:
    with serving(kube, namespaces=["team-a"]) as hook:
        resp = post(hook, payload(alert({"alertname": "A", "model": "scorer", "version": "v2"})))
        assert resp.status_code == 200 and resp.json() == {"rolledBack": []}
    assert mark(kube) is None


def test_resolved_alerts_mark_nothing_and_are_logged(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook,
        caplog: pytest.LogCaptureFixture) -> None:
    writes = md_writes(emu)
    with caplog.at_level(logging.INFO, logger="rollout_operator.alerts"):
        resp = post(webhook, payload(
            alert({"alertname": "MNNCanaryHighErrorRate", "model": "scorer", "version": "v2"}, status="resolved"),
            alert({"alertname": "Other", "namespace": "default", "modeldeployment": "scorer"}, status="resolved")))
    assert resp.status_code == 200 and resp.json() == {"rolledBack": []}
    # each resolve remembered (alert-resolved), for a firing arriving after it: no mark
    assert md_writes(emu) == writes + 2 and mark(kube) is None
    resolved = [r.getMessage() for r in caplog.records if "resolved" in r.getMessage()]
    assert len(resolved) == 2 and "alert MNNCanaryHighErrorRate resolved" in resolved[0]


def test_a_mark_stays_while_its_alert_fires_and_goes_when_that_alert_resolves(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    firing = alert({"alertname": "MNNCanaryHighErrorRate", "model": "scorer", "version": "v2"})
    assert post(webhook, payload(firing)).json() == {"rolledBack": ["default/scorer"]}
    writes = md_writes(emu)
    # another alert, or another firing of this one, resolving: the mark stays
    for other in (alert({"alertname": "Other", "model": "scorer", "version": "v2"}, status="resolved"),
                  {**firing, "status": "resolved", "startsAt": "2025-01-09T00:00:00Z"}):
        assert post(webhook, payload(other)).status_code == 200
    assert mark(kube) == marked(firing["labels"]) and md_writes(emu) == writes + 2  # each resolve remembered
    # this alert resolving removes its mark: a retried canary is no longer rolled back by it
    assert post(webhook, payload({**firing, "status": "resolved"})).status_code == 200
    assert mark(kube) is None and md_writes(emu) == writes + 3


def test_two_alerts_firing_keep_a_mark_each_and_one_resolving_leaves_the_other(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    """Found in review: one annotation held one mark, so a second alert replaced the first, and when
    the second resolved the mark was gone while the first still fired: a retry went ahead."""
    from rollout_operator.reconcile import firing_alert

    errors = alert({"alertname": "CanaryErrors", "model": "scorer", "version": "v2"})
    latency = alert({"alertname": "Canary;Slow@p99", "model": "scorer", "version": "v2"})  # separators kept out
    for one in (errors, latency, errors):  # the repeat writes nothing
        assert post(webhook, payload(one)).status_code == 200
    assert mark(kube) == f"{marked(errors['labels'])};{marked(latency['labels'])}"
    assert marked(latency["labels"]).startswith("Canary_Slow_p99@")
    assert post(webhook, payload({**latency, "status": "resolved"})).status_code == 200
    assert mark(kube) == marked(errors["labels"]) and firing_alert(mark(kube), "v2") == "CanaryErrors"
    assert post(webhook, payload({**errors, "status": "resolved"})).status_code == 200
    assert mark(kube) is None


@pytest.mark.parametrize("later", [STARTS_AT, "2025-01-02T03:05:00Z"])
def test_one_rule_firing_for_two_pods_keeps_a_mark_each(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook, later: str) -> None:
    """Found in review: marks were told apart by alert name (and start), so one rule firing per pod
    (Alertmanager grouping by [alertname, pod]) kept one mark: the second replaced the first, or, started
    in the same evaluation, shared it; either pod resolving took it off while the other still fired."""
    from rollout_operator.reconcile import firing_alert

    a = alert({"alertname": "CanaryErrors", "model": "scorer", "version": "v2", "pod": "a"})
    b = alert({"alertname": "CanaryErrors", "model": "scorer", "version": "v2", "pod": "b"}, starts_at=later)
    for one in (a, b):
        assert post(webhook, payload(one)).status_code == 200
    assert mark(kube) == f"{marked(a['labels'])};{marked(b['labels'], starts_at=later)}"
    assert post(webhook, payload({**b, "status": "resolved"})).status_code == 200
    assert mark(kube) == marked(a["labels"]) and firing_alert(mark(kube), "v2") == "CanaryErrors"
    assert post(webhook, payload({**a, "startsAt": "2025-01-03T00:00:00Z"})).status_code == 200  # pod a again
    assert mark(kube) == marked(a["labels"], starts_at="2025-01-03T00:00:00Z")  # in place of its earlier firing


@pytest.mark.parametrize("refired", [False, True])
def test_a_mark_of_the_previous_format_is_honoured_then_taken_off_when_its_alert_resolves(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook, refired: bool) -> None:
    """A mark an operator wrote before marks had an instance (name@startsAt@versions), left at the
    upgrade: still rolls the canary back, replaced by a re-sent firing, and taken off by the resolve
    (found by review: it stayed forever, rolling back every retry)."""
    from rollout_operator.reconcile import firing_alert

    kube.patch("ModelDeployment", "default", "scorer",
               {"metadata": {"annotations": {ALERT_ANNOTATION: f"CanaryErrors@{STARTS_AT}@v2"}}})
    assert firing_alert(mark(kube), "v2") == "CanaryErrors"
    firing = alert({"alertname": "CanaryErrors", "model": "scorer", "version": "v2"})
    if refired:  # Alertmanager's repeat: the new form in place of the old
        assert post(webhook, payload(firing)).status_code == 200
        assert mark(kube) == marked(firing["labels"])
    assert post(webhook, payload({**firing, "status": "resolved"})).status_code == 200
    assert mark(kube) is None


def test_a_mark_written_over_a_stale_read_keeps_what_was_written_meanwhile(
        kube: KubeClient, scorer: dict[str, Any]) -> None:
    """Two webhook calls at once (Alertmanager sends each group on its own): each write carries the
    resourceVersion it read, so the second meets a 409, reads again and keeps the first one's mark."""
    from rollout_operator.alerts import _remark, marks_of

    stale = kube.get("ModelDeployment", "default", "scorer")
    assert stale is not None
    assert _remark(kube, dict(stale), lambda marks: [*marks, "First@t0@i0@v2"])
    assert _remark(kube, stale, lambda marks: [*marks, "Second@t1@i1@v2"])  # read before the first write
    fresh = kube.get("ModelDeployment", "default", "scorer")
    assert fresh is not None and marks_of(fresh) == ["First@t0@i0@v2", "Second@t1@i1@v2"]


def test_a_kubernetes_api_failure_answers_503_so_alertmanager_retries(
        emu: EmulatorProcess, kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook) -> None:
    emu.inject_fault(500, method="PATCH", path="modeldeployments/scorer", times=5)  # more than the client retries
    body = payload(alert({"alertname": "A", "namespace": "default", "modeldeployment": "scorer"}))
    resp = post(webhook, body)
    assert resp.status_code == 503 and "500" in resp.json()["error"]
    assert mark(kube) is None
    assert post(webhook, body).json() == {"rolledBack": ["default/scorer"]}  # the retry succeeds


# -- connections: idle ones are closed, at most max_connections at once, unauthenticated ones give way --


def handler_threads() -> int:
    """Threads serving a webhook connection (socketserver names them after process_request_thread)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


def wait_until(check: Callable[[], bool], deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(0.02)


# A request whose token checks out and whose body (100 bytes announced, 1 sent) never finishes.
BODY_NEVER_FINISHED = (b"POST /alerts HTTP/1.0\r\nAuthorization: Bearer " + TOKEN.encode()
                       + b"\r\nContent-Length: 100\r\n\r\n{")


def closed_by_server(sock: socket.socket) -> bytes:
    """All the server sends on ``sock`` until it closes it (a socket.timeout if it does not)."""
    received = b""
    while chunk := sock.recv(4096):
        received += chunk
    return received


def test_idle_and_half_sent_connections_are_closed_after_the_idle_timeout_and_their_threads_end(
        kube: KubeClient) -> None:
    with serving(kube, idle_timeout_s=0.5) as hook:
        baseline = handler_threads()
        socks = [socket.create_connection(("127.0.0.1", hook.port), timeout=5) for _ in range(6)]
        try:
            socks[1].sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            socks[2].sendall(BODY_NEVER_FINISHED)
            wait_until(lambda: handler_threads() == baseline + 6, 5, "a thread serving each connection")
            for sock in socks:
                assert closed_by_server(sock) == b""  # no reply: a read timed out (before the fix: socket.timeout)
            wait_until(lambda: handler_threads() == baseline, 5, "the connections' threads end")
            assert healthz(hook) == 200
        finally:
            for sock in socks:
                sock.close()


def healthz(hook: AlertWebhook) -> int | None:
    """GET /healthz's status; None when the connection is dropped."""
    try:
        return httpx.get(f"http://127.0.0.1:{hook.port}/healthz", timeout=5).status_code
    except httpx.TransportError:
        return None


def authenticated(hook: AlertWebhook) -> int:
    """Connections being served whose bearer token checked out."""
    with hook.server.lock:
        return sum(slot.authenticated for slot in hook.server.slots.values())


def test_a_connection_over_a_cap_of_authenticated_ones_is_answered_503_at_once_and_a_freed_slot_serves_again(
        kube: KubeClient) -> None:
    with serving(kube, idle_timeout_s=30, max_connections=4) as hook:
        baseline = handler_threads()
        socks = [socket.create_connection(("127.0.0.1", hook.port), timeout=5) for _ in range(4)]
        try:
            for sock in socks:  # the token checks out, the body never finishes: none of them gives way
                sock.sendall(BODY_NEVER_FINISHED)
            wait_until(lambda: handler_threads() == baseline + 4, 5, "a thread serving each connection")
            wait_until(lambda: authenticated(hook) == 4, 5, "their tokens checked")
            with socket.create_connection(("127.0.0.1", hook.port), timeout=5) as over:
                reply = closed_by_server(over)  # before the fix: a fifth thread, and socket.timeout here
            assert reply.startswith(b"HTTP/1.0 503 ") and b"over 4 connections at once" in reply, reply
            assert handler_threads() == baseline + 4
            socks[0].close()
            wait_until(lambda: healthz(hook) == 200, 5, "a connection served once one of the four closed")
        finally:
            for sock in socks:
                sock.close()


def test_connections_sending_a_byte_at_a_time_are_closed_at_the_timeout_and_alertmanager_is_served(
        kube: KubeClient) -> None:
    """Clients sending a byte every 0.2 s, each read well within the timeout, held their slots for
    good: 64 of them (headers or a body, trickled) held every one, and Alertmanager's POST got 503 for
    as long as they kept sending. The timeout is now for a connection's whole request, from its accept."""
    with serving(kube, idle_timeout_s=1.0) as hook:
        baseline = handler_threads()
        socks: list[socket.socket] = []
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.2):
                for sock in socks:
                    try:
                        sock.send(b"a")
                    except OSError:  # closed by the server
                        pass

        trickler = threading.Thread(target=trickle, daemon=True)
        try:
            for i in range(MAX_CONNECTIONS + 4):  # the last 4 over the cap: the oldest unauthenticated give way
                sock = socket.create_connection(("127.0.0.1", hook.port), timeout=5)
                sock.sendall(b"POST /alerts HTTP/1.1\r\nHost: x\r\nX-" if i % 2 else
                             b"POST /alerts HTTP/1.1\r\nAuthorization: Bearer " + TOKEN.encode()
                             + b"\r\nContent-Length: 100000\r\n\r\n{")
                socks.append(sock)
                time.sleep(0.005)  # a burst overflows the listen backlog (5): a connect then waits 1 s for a SYN resent
            trickler.start()
            started = time.monotonic()
            wait_until(lambda: handler_threads() == baseline + MAX_CONNECTIONS, 5, "every slot held by a trickler")
            while (status := post(hook, payload()).status_code) != 200:
                # before the fix: 503 ("over 64 connections at once") for as long as the tricklers send
                assert status == 503 and time.monotonic() - started < 5, (status, time.monotonic() - started)
                time.sleep(0.1)
            wait_until(lambda: handler_threads() == baseline, 5,
                       "the tricklers' connections closed, their threads ended")
        finally:
            stop.set()
            for sock in socks:
                sock.close()


def test_at_the_cap_a_new_connection_closes_the_oldest_one_whose_token_has_not_checked_out(
        kube: KubeClient) -> None:
    with serving(kube, idle_timeout_s=30, max_connections=4) as hook:
        baseline = handler_threads()
        socks = [socket.create_connection(("127.0.0.1", hook.port), timeout=5)]
        try:
            socks[0].sendall(BODY_NEVER_FINISHED)  # the oldest, but its token checked out
            wait_until(lambda: authenticated(hook) == 1, 5, "its token checked")
            for i in range(3):  # idle, or headers half sent
                socks.append(socket.create_connection(("127.0.0.1", hook.port), timeout=5))
                socks[-1].sendall(b"POST /alerts HTTP/1.0\r\nX-" if i else b"")
                wait_until(lambda: handler_threads() == baseline + len(socks), 5, "a thread serving each connection")
            assert healthz(hook) == 200  # before: 503, over 4 connections at once
            assert closed_by_server(socks[1]) == b""  # the oldest without a checked token, closed without a reply
            wait_until(lambda: handler_threads() == baseline + 3, 5, "its thread ends")
            socks.append(socket.create_connection(("127.0.0.1", hook.port), timeout=5))  # the cap reached again
            wait_until(lambda: handler_threads() == baseline + 4, 5, "a thread serving it")
            assert post(hook, payload()).status_code == 200  # the next oldest gives way
            assert closed_by_server(socks[2]) == b""
            socks[0].sendall(b" " * 99)  # the authenticated one, untouched, finishes its body
            assert closed_by_server(socks[0]).startswith(b"HTTP/1.0 400 ")  # "{" and spaces: not JSON
        finally:
            for sock in socks:
                sock.close()


def test_clients_without_the_token_reconnecting_as_soon_as_closed_do_not_keep_alertmanager_out(
        kube: KubeClient) -> None:
    """Closing a connection at its deadline freed its slot, but a client reconnecting at once took it
    back: cap + 2 such clients, each sending half a header then waiting, held every slot, and nearly
    every authenticated POST got 503. A connection whose token has not checked out now gives way."""
    cap = 8
    with serving(kube, idle_timeout_s=1.0, max_connections=cap) as hook:
        baseline = handler_threads()
        stop = threading.Event()
        connects = [0] * (cap + 2)

        def reconnect(i: int) -> None:
            deadline = time.monotonic() + 20
            while not stop.is_set() and time.monotonic() < deadline:
                try:
                    with socket.create_connection(("127.0.0.1", hook.port), timeout=3) as sock:
                        connects[i] += 1
                        sock.sendall(b"POST /alerts HTTP/1.0\r\nX-")
                        sock.recv(1)  # until the server closes it (or answers 503)
                except OSError:
                    pass
                time.sleep(0.005)  # as good as at once, and a small load for the test

        attackers = [threading.Thread(target=reconnect, args=(i,), daemon=True) for i in range(cap + 2)]
        served: list[tuple[int | None, float]] = []  # status (None: connection dropped), seconds into the attack
        most_threads = 0
        try:
            for attacker in attackers:
                attacker.start()
            wait_until(lambda: handler_threads() >= baseline + cap, 5, "every slot held by an attacker")
            time.sleep(0.5)
            before, started = sum(connects), time.monotonic()
            while len(served) < 12 and time.monotonic() - started < 8:
                try:
                    status: int | None = post(hook, payload()).status_code  # before the fix: 503 nearly always
                except httpx.TransportError:
                    status = None
                served.append((status, time.monotonic() - started))
                most_threads = max(most_threads, handler_threads() - baseline)
                time.sleep(0.25)
            assert sum(connects) - before > 4 * cap, "the attackers kept reconnecting"
        finally:
            stop.set()
            for attacker in attackers:
                attacker.join(timeout=5)
        assert not any(attacker.is_alive() for attacker in attackers)
        statuses = [status for status, _ in served]
        assert len(served) >= 8 and statuses.count(200) >= 0.9 * len(served), served
        assert any(status == 200 and at < 1 for status, at in served), served
        assert most_threads <= cap + EVICTED_THREADS, most_threads
        wait_until(lambda: handler_threads() == baseline, 5, "the attackers' connections closed, their threads ended")


# -- end to end: a real Alertmanager (and Prometheus) in front of the webhook ---------------------


def wait_for_mark(kube: KubeClient, deadline_s: float, prefix: str, poll: Callable[[], None] = lambda: None,
                  namespace: str = "default") -> tuple[str, float]:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        poll()
        value = mark(kube, namespace=namespace)
        if value is not None and value.startswith(prefix):
            return value, time.monotonic() - started
        time.sleep(0.05)
    raise AssertionError(f"no {prefix!r} mark within {deadline_s} s (mark: {mark(kube, namespace=namespace)!r})")


def test_an_alert_posted_to_alertmanager_reaches_the_webhook_and_marks_the_canary(
        kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook,
        alertmanager_factory: Callable[..., Alertmanager]) -> None:  # noqa: F811
    am = alertmanager_factory(url(webhook), TOKEN)
    posted = time.monotonic()
    am.post_alerts([{"labels": {"alertname": "MNNCanaryHighErrorRate", "model": "scorer", "version": "v2",
                                "severity": "critical"},
                     "annotations": {"summary": "scorer v2 fails 100% of requests"}}])
    value, elapsed = wait_for_mark(kube, 30, "MNNCanaryHighErrorRate@")
    print(f"\nAlertmanager API -> webhook mark: {time.monotonic() - posted:.2f} s")
    # the alert's own startsAt, as Alertmanager set it (the webhook gets ns, its API shows ms)
    starts_at = value.split("@", 1)[1]
    assert starts_at[:23] == am.alerts()[0]["startsAt"][:23]


def test_alertmanager_with_the_wrong_token_is_refused_and_marks_nothing(
        kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook,
        alertmanager_factory: Callable[..., Alertmanager]) -> None:  # noqa: F811
    am = alertmanager_factory(url(webhook), "not-the-token")
    am.post_alerts([{"labels": {"alertname": "A", "model": "scorer", "version": "v2"}}])
    deadline = time.monotonic() + 15
    while "401" not in am.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "401" in am.log(), am.log()  # Alertmanager tried, and the webhook said no
    assert mark(kube) is None


def fast_rules(path: Path) -> Path:
    """The project's rules (examples/prometheus-rules.yaml) with 10 s windows and ``for: 1s``, at ``path``."""
    rules = (ROOT / "examples" / "prometheus-rules.yaml").read_text()
    assert "[1m]" in rules and "for: 30s" in rules
    path.write_text(rules.replace("[1m]", "[10s]").replace("for: 30s", "for: 1s").replace("for: 1m", "for: 1s"))
    return path


def test_canary_errors_scraped_by_prometheus_fire_a_rule_that_marks_the_canary(
        kube: KubeClient, scorer: dict[str, Any], webhook: AlertWebhook, examples_dir: Path, tmp_path: Path,
        start_server: Callable[..., RuntimeServer],
        prometheus_factory: Callable[..., Prometheus],  # noqa: F811
        alertmanager_factory: Callable[..., Alertmanager]) -> None:  # noqa: F811
    """The project's rule (examples/prometheus-rules.yaml) with 10 s windows and ``for: 1s``."""
    config = write_runtime_config(examples_dir, tmp_path / "runtime.yaml", versions=("v1", "v2"),
                                  weights={"v1": 90, "v2": 10})
    pod = start_server(config)
    rules = fast_rules(tmp_path / "rules.yaml")
    am = alertmanager_factory(url(webhook), TOKEN)
    prom = prometheus_factory([f"127.0.0.1:{pod.port}"], rule_files=[rules], alertmanager_url=am.url)
    prom.wait_for_up(30)
    send(pod.url, "v1", good=20)
    onset = time.monotonic()
    value, _ = wait_for_mark(kube, 40, "MNNCanaryHighErrorRate@",
                             poll=lambda: send(pod.url, "v2", good=1, bad=1) and None)
    print(f"\nerror onset -> webhook mark (1 s scrape/evaluation, for: 1s): {time.monotonic() - onset:.2f} s")
    assert prom.alerts() and prom.alerts()[0]["labels"]["version"] == "v2"


def test_the_rules_keep_the_namespace_so_a_failing_canary_never_rolls_back_its_namesake(
        emu: EmulatorProcess, kube: KubeClient, webhook: AlertWebhook, examples_dir: Path, tmp_path: Path,
        start_server: Callable[..., RuntimeServer],
        prometheus_factory: Callable[..., Prometheus],  # noqa: F811
        alertmanager_factory: Callable[..., Alertmanager]) -> None:  # noqa: F811
    """Found in review: the rules summed ``by (model, version)``, so every alert reached the webhook
    without a namespace, and a v2 canary failing in staging rolled back prod's healthy v2 canary of
    the same model too. Each pod is scraped with the labels the chart's PodMonitor gives it."""
    config = write_runtime_config(examples_dir, tmp_path / "runtime.yaml", versions=("v1", "v2"),
                                  weights={"v1": 90, "v2": 10})
    pods = {ns: start_server(config) for ns in ("staging", "prod")}
    for ns in pods:
        create_namespace(emu, ns)
        create_md(kube, namespace=ns, status=CANARY_STATUS)
    labelled = {f"127.0.0.1:{pod.port}": {"namespace": ns, "modeldeployment": "scorer"} for ns, pod in pods.items()}
    am = alertmanager_factory(url(webhook), TOKEN)
    prom = prometheus_factory(list(labelled), rule_files=[fast_rules(tmp_path / "rules.yaml")],
                              alertmanager_url=am.url, target_labels=labelled)
    prom.wait_for_up(30)

    def traffic() -> None:
        send(pods["staging"].url, "v2", good=1, bad=1)
        send(pods["prod"].url, "v2", good=2)

    wait_for_mark(kube, 40, "MNNCanaryHighErrorRate@", poll=traffic, namespace="staging")
    # Alertmanager times a notification once the webhook has answered it: the one that marked staging
    # is done, and it marked nothing else
    latency = re.compile(r'^alertmanager_notification_latency_seconds_count\{[^}]*integration="webhook"[^}]*\} (\S+)$',
                         re.M)
    wait_for(lambda: sum(float(n) for n in latency.findall(httpx.get(am.url + "/metrics", timeout=5).text)) >= 1,
             15, "Alertmanager's webhook notification answered")
    assert mark(kube, namespace="prod") is None
    firing = [a["labels"] for a in prom.alerts()]
    assert firing and all(a.get("namespace") == "staging" for a in firing), firing
