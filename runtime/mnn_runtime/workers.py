"""Worker processes that share one copy of the weights.

The parent loads and warms every version (one MNN thread: fork-safe), binds the listening
socket, then forks the workers: the weights are shared copy-on-write. Each worker serves the
shared socket with its own event loop and follows the routing config itself. The parent
supervises: a worker that dies is replaced (the others keep serving), SIGTERM is passed on and
every worker drains its in-flight requests before exiting.

Metrics use prometheus-client's multiprocess mode: every worker writes its samples to files in
one directory and /metrics sums them, so a scrape shows the whole pod. A dead worker's counters
stay in the sum (the pod's totals never go backwards); its live gauges are dropped.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when its supervisor dies, so no worker outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def enable_multiprocess_metrics() -> Path:
    """Switch prometheus-client to multiprocess values; call before any metric is created."""
    from prometheus_client import values

    path = Path(tempfile.mkdtemp(prefix="mnn-rollout-metrics-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    values.ValueClass = values.MultiProcessValue()
    return path


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Supervisor:
    """Fork ``workers`` children running ``serve_one(sock)``; replace any that dies."""

    def __init__(self, workers: int, sock: socket.socket, serve_one: Callable[[socket.socket], None],
                 metrics_dir: Path | None) -> None:
        self.workers = workers
        self.sock = sock
        self.serve_one = serve_one
        self.metrics_dir = metrics_dir
        self.children: dict[int, int] = {}  # pid -> slot
        self.stopping = False
        self.restarts = 0

    def _spawn(self, slot: int) -> None:
        pid = os.fork()
        if pid == 0:  # the worker
            _die_with_parent()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            code = 0
            try:
                self.serve_one(self.sock)
            except BaseException:  # noqa: BLE001 - a worker reports and exits, never returns to the parent loop
                log.exception("worker %d failed", slot)
                code = 1
            finally:
                os._exit(code)
        self.children[pid] = slot
        log.info("worker %d started (pid %d)", slot, pid)

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        # Keep the garbage collector off the parent's objects in the workers: a collection
        # writes to every object it visits, which would copy the shared pages into each worker.
        gc.freeze()
        for slot in range(self.workers):
            self._spawn(slot)
        while self.children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid not in self.children:
                continue
            slot = self.children.pop(pid)
            self._mark_dead(pid)
            if not self.stopping:
                self.restarts += 1
                log.error("worker %d (pid %d) died with status %d; starting a new one", slot, pid, status)
                time.sleep(0.1)
                self._spawn(slot)
        self.sock.close()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return 0

    def _mark_dead(self, pid: int) -> None:
        if self.metrics_dir is None:
            return
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))
