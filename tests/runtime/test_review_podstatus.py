"""What a pod of ``serve --workers`` reports in ``/v2/models/M/status`` while its workers do not all
route by the same table: never the new table (the operator would count the pod as serving it)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml

from mnn_rollout.local.net import wait_for
from mnn_runtime.dataplane import WORKERS_DIFFER
from tests.runtime.test_workers import (  # noqa: F401 - server is the fixture
    _status,
    _write,
    channel_full,
    children,
    miss_weights,
    server,
    supervising,
)
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)


def _settled(url: str, weights: dict[str, int], seconds: float = 20) -> str:
    """Wait until 6 statuses (fresh connections: both workers) report ``weights`` for the whole pod,
    no worker lagging; returns their table digest."""
    deadline = time.monotonic() + seconds
    while True:
        seen = [_status(url) for _ in range(6)]
        digests = {s["table_digest"] for s in seen}
        if all(s["weights"] == weights and s.get("lagging_workers", []) == [] for s in seen) and len(digests) == 1:
            return str(digests.pop())
        assert time.monotonic() < deadline, f"the pod does not settle on {weights}: {seen}"
        time.sleep(0.2)


def test_a_pod_whose_worker_missed_new_weights_does_not_report_them(
        server: RuntimeServer, model_dir: Path) -> None:  # noqa: F811 - the fixture
    """One worker stuck (stopped) with its channel full misses weights 90/10 -> 40/60; the
    supervisor deals every connection to the other one, which applied them. Before, that one
    answered /status with 40/60 and the new table's digest: the operator counted the pod as
    serving a table one of its workers did not route by. Now the pod reports the table every
    worker routes by (here, none: ``workers-differ``), the lagging worker's weights and its pid;
    and the new table once the stuck worker has taken it."""
    assert server.proc is not None
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    old = config["weights"]
    old_digest = _settled(server.url, old)
    with channel_full(server) as stuck:
        miss_weights(server, model_dir, config, {"v1": 40, "v2": 60}, stuck)
        deadline = time.monotonic() + 20
        while server.log().count("applied new config from the supervisor") < 1:  # the other worker did
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        # it logs the config, then tells the supervisor, which then publishes the pod's routing
        wait_for(lambda: _status(server.url).get("lagging_workers") == [stuck], 20, "the other worker's word heard")
        during = [_status(server.url) for _ in range(6)]  # all dealt to the other worker
    new_digest = _settled(server.url, {"v1": 40, "v2": 60})
    assert new_digest not in (old_digest, WORKERS_DIFFER)
    assert [(s["table_digest"], s["weights"], s.get("lagging_workers")) for s in during] == \
        [(WORKERS_DIFFER, old, [stuck])] * 6, during


def test_a_pod_whose_worker_is_busy_when_weights_change_reports_them_once_it_applied_them(
        server: RuntimeServer, model_dir: Path) -> None:  # noqa: F811 - the fixture
    """A worker whose loop is busy (stopped) has the new config in its channel, unread: the other
    worker's /status must not report the new table until it is read and applied (the connections
    dealt to the stopped worker meanwhile wait; those time out here)."""
    assert server.proc is not None
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    old = config["weights"]
    _settled(server.url, old)
    stuck = children(server.proc.pid)[0]
    os.kill(stuck, signal.SIGSTOP)
    answered: list[dict[str, object]] = []
    try:
        config["weights"] = {"v1": 40, "v2": 60}
        _write(model_dir, config)
        deadline = time.monotonic() + 20
        while server.log().count("applied new config from the supervisor") < 1:  # the other worker did
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        while len(answered) < 4:
            assert time.monotonic() < deadline, answered
            try:
                answered.append(httpx.get(server.url + "/v2/models/scorer/status", timeout=1).json())
            except httpx.TimeoutException:
                pass  # dealt to the stopped worker
    finally:
        os.kill(stuck, signal.SIGCONT)
    new_digest = _settled(server.url, {"v1": 40, "v2": 60})
    assert [(s["table_digest"] != new_digest, s["weights"], stuck in s.get("lagging_workers", []))  # type: ignore[operator]
            for s in answered] == [(True, old, True)] * 4, answered


def _routing(pod: dict[str, object] | None) -> dict[str, object]:
    """The published routing without what each worker serves (test_review_podversions checks that)."""
    assert pod is not None
    return {key: value for key, value in pod.items() if key != "serves"}


def test_the_supervisor_publishes_a_table_only_once_every_live_worker_said_it_routes_by_it(
        tmp_path: Path) -> None:
    """The pod-wide routing the supervisor writes for the workers' /status: the table all live
    workers said they route by; a serving worker that has not said it yet makes them differ, one still
    starting (serving nothing) only lags; one being retired does not count; and a worker forked before a
    write reads it."""
    from mnn_runtime.workers import Supervisor
    from mnn_runtime.workers_channel import channel_pair, routing_of

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sup = Supervisor(2, sock, lambda channel, fd: None, None, target="a")
    old, new = {"v1": 90, "v2": 10}, {"v1": 40, "v2": 60}
    sup.children = {101: 0, 102: 1}
    sup.ready = {101, 102}  # both serve
    sup._said(101, routing_of("a", old))
    sup._publish()
    # 102 has said nothing
    assert _routing(sup.routing.read()) == {"table_digest": None, "weights": old, "lagging": [102]}
    sup._said(102, routing_of("a", old))
    sup._publish()
    assert _routing(sup.routing.read()) == {"table_digest": "a", "weights": old, "lagging": []}
    sup.offer(None, b"weights: new", "b")
    sup._forward_pending()  # sent (to no channel here): both lag behind b, and both still route by a
    assert _routing(sup.routing.read()) == {"table_digest": "a", "weights": old, "lagging": [101, 102]}
    sup._said(101, routing_of("b", new))
    sup._publish()
    assert _routing(sup.routing.read()) == {"table_digest": None, "weights": old, "lagging": [102]}
    del sup.children[102]  # it died; 103 replaces it
    sup.children[103] = 1
    ours, theirs = channel_pair()
    sup._deferred = (None, b"weights: new")
    sup._started(103, ours)
    sup._publish()  # 103 serves nothing yet: the pod routes by what 101 says; 103 lags
    assert _routing(sup.routing.read()) == {"table_digest": "b", "weights": new, "lagging": [103]}
    sup.ready.add(103)  # it serves, and has said nothing yet: the workers differ
    sup._routing_changed = True
    sup._publish()
    assert _routing(sup.routing.read()) == {"table_digest": None, "weights": new, "lagging": [103]}
    sup._said(103, routing_of("b", new))
    sup._publish()
    assert _routing(sup.routing.read()) == {"table_digest": "b", "weights": new, "lagging": []}
    sup.children[104] = 0
    sup.retiring.add(101)  # 104 replaces 101; 101 is retired
    sup._said(101, routing_of("a", old))
    sup._said(104, routing_of("b", new))
    sup._publish()
    assert _routing(sup.routing.read()) == {"table_digest": "b", "weights": new, "lagging": []}
    read_r, read_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker forked before the next write
        os.read(go_r, 1)
        os.write(read_w, json.dumps(sup.routing.read()).encode())
        os._exit(0)
    sup._said(104, routing_of("c", old))
    sup._publish()
    os.write(go_w, b"x")
    assert _routing(json.loads(os.read(read_r, 4096))) == {"table_digest": None, "weights": old, "lagging": [104]}
    os.waitpid(pid, 0)
    for fd in (read_r, read_w, go_r, go_w):
        os.close(fd)
    for s in (ours, theirs, sock):
        s.close()


# A supervisor of one worker whose first process never says it serves (it hangs before, as one
# stuck in a load or a lock at start); the next one serves. argv[1]: a directory for its marker.
HANGS_FIRST = """
import logging, os, signal, socket, sys, time
from pathlib import Path
from mnn_runtime.workers import Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s")
marker = Path(sys.argv[1]) / "first-started"

def serve_one(channel, ready_fd):
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        while True:
            time.sleep(60)
    os.write(ready_fd, b"r")
    while True:
        time.sleep(60)

sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
sys.exit(Supervisor(1, sock, serve_one, None, ready_timeout=2.0).run())
"""


def test_a_worker_stuck_before_it_serves_is_killed_and_replaced(tmp_path: Path) -> None:
    """A worker that never says it serves (at start or after a respawn) was never killed: only a
    roll's replacement had a limit (60 s). It stayed for ever, a slot short, and with the pod's
    status waiting for every worker's word, the pod never counted as serving. Now it gets the same
    limit (here 2 s): killed, and a new one started, which serves."""
    with supervising(HANGS_FIRST, tmp_path) as (proc, log_path):
        deadline = time.monotonic() + 30
        # "worker pid N serves" (the killed one's line says "stuck before it serves" too)
        while not re.search(r"worker pid \d+ serves", log_path.read_text()):
            assert time.monotonic() < deadline, f"no worker serves 30 s on:\n{log_path.read_text()}"
            time.sleep(0.1)
        first = int((tmp_path / "first-started").read_text())
        log = log_path.read_text()
        assert f"worker pid {first} does not serve" in log, log
        assert f"worker pid {first} serves" not in log and children(proc.pid) != [first], log
    assert proc.returncode == 0
