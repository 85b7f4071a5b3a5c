"""Review 8: a scrape never sees half of a feedback item. Each item adds 1 to the version's
``mnn_feedback_total`` (trials) and its value to ``mnn_feedback_value_sum`` (successes) and its
square to ``mnn_feedback_value_squared_sum``; with ``--workers`` these live in two files of each
worker (``counter_<pid>.db``, ``gauge_sum_<pid>.db``) that a scrape in another worker read one
after the other, so a scrape could count an item's success without its trial (successes >
trials: the sequential test then dropped that step) or its trial without its success (the next
interval then had one more success than trials)."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from mnn_rollout.local.net import wait_for
from mnn_runtime.workers_metrics import FEEDBACK_LOCK, feedback_writes
from tests.runtime.test_feedback import infer
from tests.runtime.test_metrics import value
from tests.runtime_server import FEEDBACK_TOKEN, RuntimeServer

pytestmark = pytest.mark.timeout(300)
POSTERS, POSTS, ITEMS = 2, 100, 200  # per poster: POSTS posts of ITEMS items, each of value 1
SCRAPES, SECONDS = 2000, 180.0


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_no_scrape_counts_part_of_a_feedback_item(model_dir: Path, tmp_path: Path, workers: int) -> None:
    server = RuntimeServer(model_dir / "runtime.yaml", tmp_path / "server.log", extra_args=["--workers", str(workers)])
    server.start()
    try:
        url = server.url
        rid = wait_for(lambda: next((r for r, v in (infer(url, f"u{time.monotonic_ns()}"),) if v == "v1"), None),
                       60, "a response of v1")
        body = [{"id": rid, "value": 1}] * ITEMS  # every value 1: a whole scrape has trials = successes = squares
        deadline = time.monotonic() + SECONDS
        errors: list[str] = []

        def post() -> None:
            headers = {"Authorization": f"Bearer {FEEDBACK_TOKEN}"}
            for _ in range(POSTS):
                if time.monotonic() > deadline:
                    return
                with httpx.Client(timeout=60) as c:  # a connection each: with workers, any worker may answer
                    r = c.post(url + "/v2/models/scorer/feedback", json=body, headers=headers)
                if r.status_code != 200 or r.json() != {"counted": ITEMS, "unmatched": 0}:
                    errors.append(r.text)
                    return

        posters = [threading.Thread(target=post, daemon=True) for _ in range(POSTERS)]
        for t in posters:
            t.start()
        torn: list[tuple[float, float, float]] = []
        during = 0  # scrapes that saw some of the feedback but not all of it: made while it was being counted
        for _ in range(SCRAPES):
            if not any(t.is_alive() for t in posters) or time.monotonic() > deadline:
                break
            with httpx.Client(timeout=60) as c:
                text = c.get(url + "/metrics").text
            n, s, q = (value(text, name, model="scorer", version="v1") for name in
                       ("mnn_feedback_total", "mnn_feedback_value_sum", "mnn_feedback_value_squared_sum"))
            if not n == s == q:
                torn.append((n, s, q))
            during += 0 < n < POSTERS * POSTS * ITEMS
        for t in posters:
            t.join(timeout=max(1.0, deadline - time.monotonic()))
        assert not errors, errors[:3]
        assert during >= 20, f"only {during} scrapes while feedback was being counted: the test proves nothing"
        assert not torn, (f"{len(torn)} of {during} scrapes counted part of an item (trials, successes, squares); "
                          f"successes > trials in {sum(s > n for n, s, _ in torn)}: {torn[:5]}")
        total = POSTERS * POSTS * ITEMS
        text = httpx.get(url + "/metrics").text
        assert value(text, "mnn_feedback_total", model="scorer", version="v1") == total
    finally:
        server.stop()


def test_a_forked_worker_locks_through_a_descriptor_of_its_own(tmp_path: Path) -> None:
    """A worker forked from a process that holds the lock must not lock through the inherited
    descriptor: its unlock would let go of the lock the other process holds through it."""
    with feedback_writes(tmp_path):  # this process holds the lock (as a worker writing an item)
        pid = os.fork()
        if pid == 0:  # the child: one item, then out
            try:
                with feedback_writes(tmp_path):
                    pass
            finally:
                os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        probe = os.open(tmp_path / FEEDBACK_LOCK, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):  # a scrape still waits: this process's lock holds
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
    probe = os.open(tmp_path / FEEDBACK_LOCK, os.O_RDONLY)
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and can read once it is let go
    finally:
        os.close(probe)
