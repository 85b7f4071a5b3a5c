"""The supervisor and its workers (second review): what it takes for stuck, and what it is not."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runtime.test_workers import children

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
    log_path = tmp_path / "supervisor.log"
    with log_path.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-c", LOADS, str(tmp_path)], stderr=out, stdout=out)
    try:
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
    finally:
        proc.terminate()
        proc.wait(20)
