"""What a pod of ``serve --workers`` reports as each version's readiness in ``/v2/models/M/status``
while its workers are replaced one at a time after a version was added: never ``ready`` while a
serving worker still cannot serve it (it routes that version's share to the fallback)."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mnn_runtime.registry import FAILED, PENDING, READY
from tests.runtime.test_review_podstatus import _settled
from tests.runtime.test_workers import _status, _write, children, server  # noqa: F401 - the fixture
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)


def _version(state: str, reason: str | None = None) -> dict[str, Any]:
    return {"state": state, "ready": state == READY, "reason": reason, "uri": "x.mnn"}


def test_the_pod_publishes_what_each_serving_worker_serves_and_status_waits_for_the_lagging_one(
        tmp_path: Path) -> None:
    """The supervisor publishes the versions each serving worker said it can serve; a worker's
    /status marks a version another serving worker cannot serve as pending (naming that worker),
    keeps its own reason when it failed, and counts no version served before the workers said."""
    from mnn_runtime.dataplane import _pod_versions
    from mnn_runtime.workers import Supervisor
    from mnn_runtime.workers_channel import routing_of

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sup = Supervisor(2, sock, lambda channel, fd: None, None, target="b")
    weights = {"v1": 100, "v3": 0}
    sup.children, sup.ready = {101: 0, 102: 1}, {101, 102}
    sup._said(101, routing_of("b", weights, ["v1", "v3"]))  # replaced already: serves v3
    sup._said(102, routing_of("b", weights, ["v1"]))  # old: v3 pending
    sup._publish()
    pod = sup.routing.read()
    assert pod == {"table_digest": "b", "weights": weights, "lagging": [],
                   "serves": {"101": ["v1", "v3"], "102": ["v1"]}}
    mine = {"v1": _version(READY), "v3": _version(READY)}
    assert _pod_versions(pod, mine, 101) == {
        "v1": _version(READY), "v3": _version(PENDING, "worker pid 102 has not loaded it yet")}
    failed = {"v1": _version(READY), "v3": _version(FAILED, "bad file")}
    assert _pod_versions(pod, failed, 101) == failed  # its own failure stands
    assert _pod_versions(pod, {"v3": _version(PENDING, "own")}, 102) == {"v3": _version(PENDING, "own")}
    sup.children[103] = 0  # starting (serves nothing, said nothing): does not hold v3 back
    sup._routing_changed = True
    sup._publish()
    assert sup.routing.read()["serves"] == {"101": ["v1", "v3"], "102": ["v1"]}  # type: ignore[index]
    sup.ready.add(103)  # serving, nothing said yet: it serves no version as far as the pod knows
    sup._routing_changed = True
    sup._publish()
    assert _pod_versions(sup.routing.read(), {"v1": _version(READY)}, 101) == {
        "v1": _version(PENDING, "worker pid 103 has not loaded it yet")}
    sup.retiring.add(102)  # replaced by 103, which says it serves both: v3 is served pod-wide
    sup._said(103, routing_of("b", weights, ["v1", "v3"]))
    sup._publish()
    assert _pod_versions(sup.routing.read(), mine, 101) == mine
    assert _pod_versions(None, mine, 101) == {  # nothing published yet
        name: _version(PENDING, "the pod's workers have not said yet which versions they serve") for name in mine}
    sock.close()


def test_a_version_is_not_ready_in_the_pods_status_until_every_serving_worker_can_serve_it(
        server: RuntimeServer, model_dir: Path) -> None:  # noqa: F811 - the fixture
    """A version is added (weight 0): the supervisor loads it and replaces the workers one at a
    time. The second replacement is held back (stopped before it serves), so the old worker of its
    slot still serves, with the new version pending (its share would go to the fallback). Before,
    the first replacement answered /status with the version ready: the operator would give it
    weight. Now every status says it is pending, naming the old worker, until that one is replaced."""
    assert server.proc is not None
    sup = server.proc.pid
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    _settled(server.url, config["weights"])
    before = set(children(sup))
    config["versions"].append({"name": "v3", "uri": config["versions"][0]["uri"]})
    config["weights"] = {**config["weights"], "v3": 0}
    _write(model_dir, config)
    deadline = time.monotonic() + 30
    first = held = None
    while held is None:  # the first replacement serves, then the second is forked: stop it at once
        assert time.monotonic() < deadline, server.log()
        new = [pid for pid in children(sup) if pid not in before and pid != first]
        if first is None and new:
            first = new[0]
        elif first is not None and f"worker pid {first} serves" in server.log() and new:
            held = new[0]
            os.kill(held, signal.SIGSTOP)
        time.sleep(0.002)
    try:
        assert f"worker pid {held} serves" not in server.log(), "the held-back worker served before it was stopped"
        seen = []
        for _ in range(8):  # fresh connections: dealt in turn to the first replacement and the old worker
            v3 = _status(server.url)["versions"]["v3"]  # type: ignore[index]
            seen.append((v3["ready"], v3["state"], v3["reason"]))
    finally:
        os.kill(held, signal.SIGCONT)
    assert all(not ready and state == PENDING for ready, state, _ in seen), seen
    lagging = [reason for _, _, reason in seen if "has not loaded it yet" in reason]
    assert lagging and all(any(reason == f"worker pid {pid} has not loaded it yet" for pid in before)
                           for reason in lagging), (seen, before)
    while "workers replaced" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    while not all(_status(server.url)["versions"]["v3"]["ready"] for _ in range(4)):  # type: ignore[index]
        assert time.monotonic() < deadline, [_status(server.url) for _ in range(2)]
        time.sleep(0.1)
