"""Review 5: what a pod shadows, in ``/v2/models/M/status``. A shadow step changes no weight and the
table's digest leaves the shadow out, so the operator could not tell a pod that took a shadow config
from one that did not: the step's clock started at the ConfigMap write. Now ``/status`` says
``shadow`` (``{"version", "percent"}`` or null), for the whole pod with ``--workers``."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from mnn_rollout.local.net import wait_for
from mnn_runtime.dataplane import WORKERS_DIFFER
from tests.runtime.test_workers import (  # noqa: F401 - server is the fixture
    _status,
    _write,
    channel_full,
    server,
)
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)


def _settled(url: str, shadow: dict[str, Any] | None, seconds: float = 20) -> list[dict[str, Any]]:
    """Wait until 6 statuses (fresh connections: both workers) report ``shadow`` for the whole pod,
    no worker lagging; returns them."""
    deadline = time.monotonic() + seconds
    while True:
        seen: list[dict[str, Any]] = [_status(url) for _ in range(6)]
        if all(s.get("shadow", "absent") == shadow and s.get("lagging_workers") == [] for s in seen):
            return seen
        assert time.monotonic() < deadline, f"the pod does not settle on shadow {shadow}: {seen}"
        time.sleep(0.2)


def test_a_shadow_change_shows_in_the_pods_status_once_every_worker_took_it(
        server: RuntimeServer, model_dir: Path) -> None:  # noqa: F811 - the fixture
    """Two workers; the config gains a shadow of v2 at 20%, then 50% while one worker is stopped
    with its channel full (it misses the config). Before, /status had no word of the shadow (its
    weights and table_digest are the same with or without one). Now it reports the shadow every
    worker runs; while one lags, "workers-differ" and that worker's pid, the table unchanged."""
    assert server.proc is not None
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    digest = _settled(server.url, None)[0]["table_digest"]
    config["shadow"] = {"version": "v2", "percent": 20}
    _write(model_dir, config)
    first = _settled(server.url, {"version": "v2", "percent": 20})
    assert {s["table_digest"] for s in first} == {digest}  # a shadow change leaves the table as it is
    with channel_full(server) as stuck:
        config["shadow"] = {"version": "v2", "percent": 50}
        _write(model_dir, config)
        deadline = time.monotonic() + 20
        while f"worker pid {stuck} did not take the message b'config'" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        while server.log().count("applied new config from the supervisor") < 3:  # the other worker did
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        # it logs the config, then tells the supervisor, which then publishes the pod's routing
        wait_for(lambda: _status(server.url).get("lagging_workers") == [stuck], 20, "the other worker's word heard")
        during = [_status(server.url) for _ in range(4)]  # all dealt to the other worker
    assert [(s["shadow"], s["table_digest"], s["lagging_workers"]) for s in during] == \
        [(WORKERS_DIFFER, digest, [stuck])] * 4, during
    _settled(server.url, {"version": "v2", "percent": 50})
    del config["shadow"]
    _write(model_dir, config)
    _settled(server.url, None)


def test_the_supervisor_counts_a_worker_on_another_shadow_as_lagging(tmp_path: Path) -> None:
    """The pod-wide routing the supervisor writes: the shadow every serving worker said, none when
    none shadows anything, "workers-differ" while they differ; a worker not shadowing as the newest
    config does lags behind it, though its table is the newest."""
    from mnn_runtime.workers import Supervisor
    from mnn_runtime.workers_channel import routing_of

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    weights = {"v1": 90, "v2": 10}
    low, high = {"version": "v2", "percent": 20}, {"version": "v2", "percent": 50}
    sup = Supervisor(2, sock, lambda channel, fd: None, None, target="a")
    sup.children = {101: 0, 102: 1}
    sup.ready = {101, 102}

    def said(shadow101: dict[str, Any] | None, shadow102: dict[str, Any] | None) -> dict[str, Any]:
        sup._said(101, routing_of("a", weights, ["v1", "v2"], shadow101))
        sup._said(102, routing_of("a", weights, ["v1", "v2"], shadow102))
        sup._publish()
        pod = sup.routing.read()
        assert pod is not None and pod["table_digest"] == "a"
        return {key: pod[key] for key in ("shadow", "lagging") if key in pod}

    try:
        assert said(None, None) == {"lagging": []}
        sup.offer(None, b"shadow: low", "a", low)
        sup._forward_pending()
        assert said(low, None) == {"shadow": WORKERS_DIFFER, "lagging": [102]}
        assert said(low, low) == {"shadow": low, "lagging": []}
        sup.offer(None, b"shadow: high", "a", high)
        sup._forward_pending()
        assert said(low, high) == {"shadow": WORKERS_DIFFER, "lagging": [101]}
        assert said(high, high) == {"shadow": high, "lagging": []}
    finally:
        sock.close()
