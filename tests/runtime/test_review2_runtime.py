"""The supervisor and its workers (second review): what it takes for stuck, and what it is not."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import yaml

from mnn_rollout.local.net import wait_for, write_atomic
from mnn_runtime.dataplane import WORKERS_DIFFER
from tests.runtime.test_workers import children, supervising, two_workers

pytestmark = pytest.mark.timeout(120)

# A supervisor of two workers that load as ``serve --workers`` does, one load at a time in the pod
# (engine.one_load_at_a_time), each load standing for 1.5 s at start (a version loaded again in each
# worker: threads > 1) and 3 s once serving (a version loaded again for a request, on a thread).
# MNN's load holds the GIL throughout (measured: a 0.21 s load of the 52 MB example left another
# thread a gap of 0.17 s): the worker's loop says nothing while it loads, but does while its
# loading thread waits for the lock. Limits: ready_timeout 1 s, hang_timeout 1 s. argv[1]: a
# directory for the markers.
LOADS = """
import logging, os, socket, sys, threading, time
from pathlib import Path
from mnn_runtime import engine
from mnn_runtime.workers import Supervisor
from mnn_runtime.workers_channel import ALIVE_MESSAGE, send_message

logging.basicConfig(level=logging.INFO, format="%(message)s")
out = Path(sys.argv[1])
engine.fork_parent(True)  # the pod's load lock, made before the fork as serve_workers makes it


def serve_one(channel, ready_fd):
    with engine.one_load_at_a_time():
        time.sleep(1.5)
    os.write(ready_fd, b"r")
    channel.setblocking(False)
    in_mnn = threading.Event()

    def loop():  # the event loop: silent while the load holds the GIL
        while True:
            if not in_mnn.is_set():
                send_message(os.getpid(), channel, ALIVE_MESSAGE, quiet=True)
            time.sleep(0.2)

    threading.Thread(target=loop, daemon=True).start()
    with engine.one_load_at_a_time():
        in_mnn.set()
        time.sleep(3)
        in_mnn.clear()
    (out / f"loaded-{os.getpid()}").write_text("")
    while True:
        time.sleep(60)


sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
sys.exit(Supervisor(2, sock, serve_one, None, ready_timeout=1.0, hang_timeout=1.0).run())
"""


def test_a_worker_loading_a_model_or_waiting_for_the_pods_load_is_not_killed_as_stuck(tmp_path: Path) -> None:
    """A worker inside a model load says nothing (MNN holds the GIL), and one about to serve may
    wait for another process's load (one at a time in the pod): the supervisor took both for stuck
    and killed them. Before: with a 2-GB model's load (> 30 s), a pinned request for an unloaded
    version killed the worker loading it, and the next request killed the next one; workers that
    load at start one after the other were killed past ready_timeout (60 s). Here (1 s limits,
    loads of 1.5 and 3 s) every worker was killed, the first ones while loading; now none is."""
    with supervising(LOADS, tmp_path) as (proc, log_path):
        deadline = time.monotonic() + 60
        first = []
        while len(first) < 2:
            assert time.monotonic() < deadline, log_path.read_text()
            first = children(proc.pid)
            time.sleep(0.05)
        while len(loaded := sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("loaded-*"))) < 2:
            assert time.monotonic() < deadline, f"no two workers loaded in 60 s:\n{log_path.read_text()}"
            time.sleep(0.1)
        log = log_path.read_text()
        assert loaded == sorted(first) == sorted(children(proc.pid)), log
        assert "killed" not in log and "died" not in log, log


# A supervisor of one worker whose first process, once serving, never comes out of a model load
# (a read that never returns): it holds the pod's load lock, which every other load waits for.
# hang_timeout 1 s, load_timeout 3 s. argv[1]: a directory for the markers.
STUCK_IN_LOAD = """
import logging, os, socket, sys, time
from pathlib import Path
from mnn_runtime import engine
from mnn_runtime.workers import Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s")
out = Path(sys.argv[1])
engine.fork_parent(True)


def serve_one(channel, ready_fd):
    os.write(ready_fd, b"r")
    first = not (out / "first").exists()
    (out / ("first" if first else "next")).write_text(str(os.getpid()))
    with engine.one_load_at_a_time():
        while first:
            time.sleep(60)
    while True:
        time.sleep(60)


sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
sys.exit(Supervisor(1, sock, serve_one, None, hang_timeout=1.0, load_timeout=3.0).run())
"""


def test_a_worker_stuck_inside_a_model_load_is_killed_after_load_timeout(tmp_path: Path) -> None:
    """The other side of the one above: a worker that never comes out of a load holds every other
    load of the pod; past ``load_timeout`` (600 s; here 3 s) it is killed and replaced."""
    with supervising(STUCK_IN_LOAD, tmp_path) as (proc, log_path):
        deadline = time.monotonic() + 60
        while not (tmp_path / "next").exists():
            assert time.monotonic() < deadline, f"the stuck worker was not replaced in 60 s:\n{log_path.read_text()}"
            time.sleep(0.1)
        first = int((tmp_path / "first").read_text())
        log = log_path.read_text()
        assert re.search(rf"worker pid {first} has been inside one model load for [345] s \(stuck\)", log), log


def test_a_roll_does_not_make_the_pod_look_as_if_it_served_another_table(large_dir: Path, tmp_path: Path) -> None:
    """A roll (a version added, or loaded again for a request) starts a new worker before it
    retires the old one; until the new one served and said what it routes by, /status said
    ``workers-differ`` although it got no connection: WeightsServed turned False mid-rollout and
    back. Repro with ``large`` on 2 threads (each new worker loads its own copy): the pod showed
    the new config's table, then workers-differ for 0.34 s (15 of 360 statuses), then the table."""
    config = {"model": "scorer", "stable": "v1", "weights": {"v1": 100, "large": 0},
              "versions": [{"name": "v1", "uri": str(large_dir / "v1.mnn")},
                           {"name": "large", "uri": str(large_dir / "large.mnn"), "engine": {"threads": 2}}]}
    path = tmp_path / "runtime.yaml"
    write_atomic(path, yaml.safe_dump(config))
    with two_workers(path, tmp_path / "server.log") as server:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            def status() -> dict[str, object]:
                return client.get("/v2/models/scorer/status").json()  # type: ignore[no-any-return]

            table = wait_for(lambda: (d := status()["table_digest"]) != WORKERS_DIFFER and d, 30, "one table")
            config["versions"].append({"name": "v2", "uri": str(large_dir / "v1.mnn")})  # type: ignore[attr-defined]
            config["weights"] = {"v1": 100, "large": 0, "v2": 0}
            write_atomic(path, yaml.safe_dump(config))
            seen = []
            while "workers replaced" not in server.log():
                assert len(seen) < 3000, server.log()
                now = status()
                seen.append((now["table_digest"], "v2" in now["versions"]))  # type: ignore[operator]
                time.sleep(0.01)
        assert any(v2 for _, v2 in seen), "no status listed v2 during the roll"
        assert [digest for digest, _ in seen if digest != table] == [], seen
