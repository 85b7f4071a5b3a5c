"""The runtime's workers and profiles across their lives (sixth review): a shutdown stops a running
profile at once; the profiling child runs at a lower CPU priority than serving; a worker started
outside a roll, like a roll's, is given up at an overall cap while model loads keep running."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from mnn_rollout.local.net import wait_for
from mnn_rollout.local.process import stat_fields

from tests.runtime.test_review3_profile import SLOW, gone, in_background, profiling_child, slow_beside_v1
from tests.runtime.test_review3_workers import wait_for_log
from tests.runtime.test_workers import all_serving, supervising

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one-process", "workers"])
def test_a_shutdown_stops_a_running_profile_at_once_and_answers_503(tmp_path: Path, examples_dir: Path,
                                                                    workers: list[str]) -> None:
    """SIGTERM while a profile ran held the shutdown for the whole drain (the profile's request in
    flight: 5 s for its connection, 10 s for the request), then cancelled it: a 500 and a
    CancelledError traceback in the log, the child killed only then. Repro: exit 15.3 s after
    SIGTERM (one process), 15.4 s (--workers 2). Now the child is killed at once and the request
    answers 503 naming the shutdown; the server exits in about a second."""
    with slow_beside_v1(tmp_path, examples_dir, *workers) as srv:
        assert srv.proc is not None
        if workers:
            all_serving(srv, tmp_path / "server.log")
        thread, answers = in_background(srv.url + SLOW + "?runs=1000&timeout=600")  # ~15 min of work
        child = profiling_child(srv)
        started = time.monotonic()
        srv.proc.terminate()
        code = srv.proc.wait(timeout=60)
        took = time.monotonic() - started
        thread.join(timeout=30)
        log = srv.log()
        assert code == 0, log
        assert answers, "no answer"
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json() == {"error": "the server is shutting down; the profile was stopped"}
        assert gone(child)
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert f"profiling process {child} killed: the server is shutting down" in log, log
        assert took < 6, f"exited {took:.1f} s after SIGTERM (the drain lasts up to 15 s)\n{log}"


def nice(pid: int) -> int:
    """A process's nice value (field 19 of /proc/PID/stat)."""
    return int(stat_fields(pid)[16])


def parent(pid: int) -> int:
    return int(stat_fields(pid)[1])


def test_the_profiling_child_runs_at_a_lower_cpu_priority_than_its_worker(tmp_path: Path,
                                                                          examples_dir: Path) -> None:
    """The profiling child took a whole core at the worker's priority, competing with serving for
    it; now it lowers its own (nice +10)."""
    with slow_beside_v1(tmp_path, examples_dir, "--workers", "2") as srv:
        all_serving(srv, tmp_path / "server.log")
        thread, answers = in_background(srv.url + SLOW + "?runs=1000&timeout=600")
        child = profiling_child(srv)
        worker = parent(child)
        assert "mnn_runtime.profile" not in Path(f"/proc/{worker}/cmdline").read_text()
        wait_for(lambda: nice(child) >= nice(worker) + 10, 20, f"the profiling child {child} niced")
    thread.join(timeout=30)  # the shutdown stopped it
    assert answers and answers[0].status_code == 503, answers


# A supervisor of one worker in a pod where model loads run back to back (each 0.4 s, each by a
# process of its own, as workers loading versions one after the other), from before it starts.
# ready_timeout 1 s, load_timeout 3 s: a worker not serving is given up 4 s after it was started.
# Without a file "roll" in argv[1], the first worker dies before it serves and its replacement never
# serves; with it, the first serves, a config that loaded a version is offered, and the roll's new
# worker never serves. Each worker writes its pid to argv[1]/worker-N, N from 0 in start order.
LOADS = """
import logging, os, socket, sys, threading, time
from pathlib import Path
from mnn_runtime import engine
from mnn_runtime.workers import Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s")
out = Path(sys.argv[1])
roll = (out / "roll").exists()
engine.fork_parent(True)  # the pod's load lock, made before the fork as serve_workers makes it

supervisor_pid = os.getpid()
if os.fork() == 0:  # the loads, until the supervisor is gone (90 s at most)
    until = time.monotonic() + 90
    while os.getppid() == supervisor_pid and time.monotonic() < until:
        pid = os.fork()
        if pid == 0:
            with engine.one_load_at_a_time():
                time.sleep(0.4)
            os._exit(0)
        os.waitpid(pid, 0)
    os._exit(0)


def serve_one(channel, ready_fd):
    n = len(list(out.glob("worker-*")))
    (out / f"worker-{n}").write_text(str(os.getpid()))
    if n == 0:
        if not roll:
            os._exit(1)  # dies before it serves: replaced outside a roll
        os.write(ready_fd, b"r")
    while True:
        time.sleep(60)

"""
# The supervisor of LOADS (and of other scripts defining ``out``, ``roll`` and ``serve_one``): one
# worker, ready_timeout 1 s, load_timeout 3 s; with ``roll``, a config offered once worker-0 started.
ONE_WORKER = """
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen()
supervisor = Supervisor(1, sock, serve_one, None, apply=lambda config: True, ready_timeout=1.0, load_timeout=3.0,
                        hang_timeout=600.0)  # its workers say nothing (no loop): never judged hung


def offer():
    while not (out / "worker-0").exists():
        time.sleep(0.05)
    supervisor.offer("a config that loaded a version")


if roll:
    threading.Thread(target=offer, daemon=True).start()
sys.exit(supervisor.run())
"""
LOADS += ONE_WORKER
CAP = 1.0 + 3.0  # LOADS's ready_timeout + load_timeout


def worker(tmp_path: Path, n: int) -> int:
    """The pid of LOADS's worker ``n``, once it started."""
    return int(wait_for(lambda: (tmp_path / f"worker-{n}").exists() and (tmp_path / f"worker-{n}").read_text(),
                        30, f"worker {n} started"))


def test_a_replacement_outside_a_roll_is_given_up_at_the_cap_while_loads_keep_running(tmp_path: Path) -> None:
    """A worker started outside a roll (here the replacement of one that died) had its ready clock
    restarted while any model load ran in the pod, with no overall cap: loads back to back kept it
    waiting for ever (here 30 s and more, for a 1 s ready_timeout). Now, as a roll's, it is killed
    ready_timeout + load_timeout after it was started, and logged as not serving."""
    with supervising(LOADS, tmp_path) as (_, log_path):
        replacement = worker(tmp_path, 1)
        log = wait_for_log(log_path, f"worker pid {replacement} does not serve", 30)
        given_up = re.search(rf"worker pid {replacement} does not serve (\d+) s", log)
        assert given_up and int(given_up.group(1)) >= CAP - 0.5, log
        assert "model loads in the pod included" in log, log
        worker(tmp_path, 2)  # and replaced, as one that died


def test_a_rolls_new_worker_is_given_up_at_the_cap_while_loads_keep_running(tmp_path: Path) -> None:
    """The roll's overall cap (ready_timeout + load_timeout from its new worker's start, whatever
    loads run) had no test: a new worker that never serves while loads keep running is given up at
    the cap and the old worker keeps serving."""
    (tmp_path / "roll").write_text("")
    with supervising(LOADS, tmp_path) as (_, log_path):
        old, new = worker(tmp_path, 0), worker(tmp_path, 1)
        log = wait_for_log(log_path, f"keeping pid {old}", 30)
        given_up = re.search(rf"its replacement \(pid {new}\) \D*(\d+) s after it was started", log)
        assert given_up and int(given_up.group(1)) >= CAP - 0.5, log
        wait_for(lambda: gone(new), 10, f"the roll's new worker {new} killed")
        assert not gone(old) and f"(pid {old}) retired" not in log_path.read_text(), log_path.read_text()
