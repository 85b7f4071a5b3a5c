"""The runtime's workers and profiles across their lives (sixth review): a shutdown stops a running
profile at once; the profiling child runs at a lower CPU priority than serving; a worker started
outside a roll, like a roll's, is given up at an overall cap while model loads keep running."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mnn_rollout.local.net import wait_for

from tests.runtime.test_review3_profile import SLOW, gone, in_background, profiling_child, slow_beside_v1
from tests.runtime.test_workers import all_serving

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
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


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
