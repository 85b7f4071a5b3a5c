"""A worker that loads versions of its own after its fork (threads > 1 or a GPU backend: each worker
loads its own copy, one load at a time in the pod) is getting on, not stuck: its loads back to back
are each bounded by ``load_timeout``, and their time is not counted in its overall cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime.test_review3_workers import wait_for_log
from tests.runtime.test_review6_lifecycle import ONE_WORKER, worker
from tests.runtime.test_workers import supervising

pytestmark = pytest.mark.timeout(180)

# A supervisor of one worker (ready_timeout 1 s, load_timeout 3 s: a starting worker is given up
# 4 s after it was started, and one inside one load for 3 s is killed) whose worker, before it serves,
# loads twelve versions of its own one after the other, 0.4 s each: 4.8 s in all, longer than both.
# With a file "roll" in argv[1] the first worker serves at once, then a config that loaded a version
# is offered and the roll's new worker (worker-1) is the one that loads. Each worker writes its pid to
# argv[1]/worker-N, N from 0 in start order.
OWN_LOADS = """
import logging, os, socket, sys, threading, time
from pathlib import Path
from mnn_runtime import engine
from mnn_runtime.workers import Supervisor

logging.basicConfig(level=logging.INFO, format="%(message)s")
out = Path(sys.argv[1])
roll = (out / "roll").exists()
engine.fork_parent(True)  # the pod's load lock, made before the fork as serve_workers makes it


def serve_one(channel, ready_fd):
    n = len(list(out.glob("worker-*")))
    (out / f"worker-{n}").write_text(str(os.getpid()))
    if n == (1 if roll else 0):
        for _ in range(12):
            with engine.one_load_at_a_time():
                time.sleep(0.4)
        (out / f"loaded-{n}").write_text("")
    os.write(ready_fd, b"r")
    while True:
        time.sleep(60)
""" + ONE_WORKER


def test_a_worker_loading_its_own_versions_longer_than_the_cap_is_let_serve(tmp_path: Path) -> None:
    """Loads one process ran back to back looked like one load to the supervisor (it knew the
    holder's pid only), and a starting worker's own loads counted in its overall cap: a worker
    loading many versions of its own (say 16 of ~40 s on a GPU) was killed as "inside one model
    load" after ``load_timeout``, or given up at ``ready_timeout + load_timeout``, and its
    replacement did the same, for ever. Repro: the worker here was killed after 3 s in its loads
    and replaced; now it serves after its 4.8 s of loads."""
    with supervising(OWN_LOADS, tmp_path) as (_, log_path):
        first = worker(tmp_path, 0)
        log = wait_for_log(log_path, f"worker pid {first} serves", 60)
        assert (tmp_path / "loaded-0").exists(), log
        assert "killed" not in log and "does not serve" not in log, log
        assert not (tmp_path / "worker-1").exists(), log


def test_a_rolls_new_worker_loading_its_own_versions_longer_than_the_cap_replaces_the_old_one(
        tmp_path: Path) -> None:
    """The same in a roll (a version added that each worker loads for itself): the roll's new
    worker was given up at the cap while it loaded, and the old worker kept; now it serves and the
    old one is retired."""
    (tmp_path / "roll").write_text("")
    with supervising(OWN_LOADS, tmp_path) as (_, log_path):
        worker(tmp_path, 0)
        new = worker(tmp_path, 1)
        log = wait_for_log(log_path, "workers replaced with the new versions loaded", 60)
        assert f"worker pid {new} serves" in log, log
        assert (tmp_path / "loaded-1").exists(), log
        assert "keeping pid" not in log and "killed" not in log, log

