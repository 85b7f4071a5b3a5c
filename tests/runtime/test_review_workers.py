"""The supervisor and its workers under faults: a worker that misses a config, hangs, or crashes;
what the pod then reports about what it serves."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.runtime.test_workers import (  # noqa: F401 - server is the fixture
    _status,
    channel_full,
    children,
    miss_weights,
    server,
)
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)


def test_a_worker_whose_channel_was_full_when_weights_changed_gets_them_once_it_reads_again(
        server: RuntimeServer, model_dir: Path) -> None:  # noqa: F811 - the fixture
    """A worker stuck (here: stopped) while connections pile up in its channel cannot take the new
    config then; it must get it once it reads again, not route by the old weights until the next
    change (while the other worker, answering the operator's status, reports the new ones)."""
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    with channel_full(server) as stuck:
        miss_weights(server, model_dir, config, {"v1": 40, "v2": 60}, stuck)
    deadline = time.monotonic() + 20
    while (seen := [_status(server.url)["weights"] for _ in range(6)]) != [{"v1": 40, "v2": 60}] * 6:
        assert time.monotonic() < deadline, f"a worker still routes by the old weights: {seen}"
        time.sleep(0.2)


def test_a_worker_whose_loop_hangs_is_killed_and_replaced(server: RuntimeServer) -> None:  # noqa: F811
    """A worker whose event loop is stuck (here: stopped; in a pod, a forward that never returns)
    answers nothing, and the connections dealt to it wait for ever while its probes fail only now
    and then (dealt in turn): the supervisor must notice its silence, kill it and start another."""
    assert server.proc is not None
    stuck = children(server.proc.pid)[0]
    os.kill(stuck, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 90
        while stuck in (now := children(server.proc.pid)) or len(now) != 2:
            assert time.monotonic() < deadline, f"the stuck worker {stuck} is still there: {now}"
            time.sleep(0.2)
    finally:
        try:
            os.kill(stuck, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert f"worker pid {stuck} has not answered" in server.log()
    for _ in range(6):  # a new connection each: dealt to both workers
        assert httpx.get(server.url + "/v2/health/ready", timeout=5).status_code == 200
