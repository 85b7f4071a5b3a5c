"""Worker processes that share one copy of the weights.

The parent loads and warms every version (one MNN thread: fork-safe), binds the listening
socket, then forks the workers: the weights are shared copy-on-write. The parent accepts the
connections and deals them out to the workers; each worker serves its connections with its own
event loop. Only the parent follows the config: it sends every change to the workers (weights
change in every worker at once), and when a version is added or its file changes, it loads the
file (once, on a thread) and replaces the workers one by one, so new weights are shared as well.
The parent supervises: a worker that dies is replaced (the others keep serving), SIGTERM is
passed on and every worker drains its in-flight requests before exiting.

Metrics use prometheus-client's multiprocess mode: every worker writes its samples to files in
one directory and /metrics sums them, so a scrape shows the whole pod. A dead worker's counters
stay in the sum (the pod's totals never go backwards); its live gauges are dropped.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import queue
import select
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONFIG_MESSAGE = b"config\n"  # a config from the supervisor to a worker: this, then its YAML
MAX_CONFIG_BYTES = 192 * 1024  # under the socket's send buffer (~208 KB by default)


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when its supervisor dies, so no worker outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may use: its affinity, capped by a cgroup CPU quota (a container's
    ``limits.cpu``, rounded up), so ``--workers auto`` in a pod follows the pod, not the node."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota(cgroup_root)
    if quota is not None:
        count = min(count, max(1, math.ceil(quota)))
    return max(1, count)


def _cgroup_quota(root: Path) -> float | None:
    """CPUs allowed by cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


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
    return sock


class Supervisor:
    """Fork ``workers`` children running ``serve_one(channel, ready_fd)``; replace any that dies.

    This process accepts every connection on ``sock`` and hands it to a worker over that worker's
    ``channel`` (a Unix socket; the file descriptor travels as SCM_RIGHTS), round robin over the
    workers that serve and are not being retired. Workers sharing one listening socket instead
    let whichever woke first take a whole burst of connections (measured: all 32 of a load
    generator's on one worker in one round of three), and a worker being retired could not give
    back the connections waiting in its queue. Each child writes one byte to ``ready_fd`` once it
    serves. ``offer(config)`` (from any
    thread) hands the supervisor a new config: it applies it in this process with ``apply``, and
    when that loaded a new or changed version, replaces the workers one at a time (a new one is
    forked with the new weights, and once it serves, the old one is retired: SIGUSR2, it stops
    accepting, finishes what it holds and exits), so the new weights are shared too and no
    request is dropped.
    """

    def __init__(self, workers: int, sock: socket.socket, serve_one: Callable[[socket.socket, int], None],
                 metrics_dir: Path | None, apply: Callable[[Any], bool] | None = None,
                 ready_timeout: float = 60.0) -> None:
        self.workers = workers
        self.sock = sock
        self.serve_one = serve_one
        self.metrics_dir = metrics_dir
        self.apply = apply
        self.ready_timeout = ready_timeout
        self.children: dict[int, int] = {}  # pid -> slot
        self.retiring: set[int] = set()
        self.ready: set[int] = set()
        self._ready_fds: dict[int, int] = {}  # read end of each child's ready pipe
        self._channels: dict[int, socket.socket] = {}  # pid -> where its connections are sent
        self._turn = 0
        sock.setblocking(False)
        self.stopping = False
        self.restarts = 0
        self._pending: queue.SimpleQueue[tuple[Any, bytes]] = queue.SimpleQueue()
        self._deferred: tuple[Any, bytes] | None = None  # sent to the workers, not applied here yet
        self._loader: threading.Thread | None = None  # applying a config (loading) off the main loop
        self._loaded: list[bool] = []  # the loader's answer: must the workers be replaced?
        self._respawn: dict[int, float] = {}  # slot -> when to start its new worker
        self._crashes: dict[int, list[float]] = {}  # slot -> recent unexpected deaths (for backoff)
        self._main_calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def offer(self, config: Any, text: bytes = b"") -> None:
        """Hand a new config to the supervisor loop (thread-safe, returns at once); ``text`` is
        sent to every worker before the supervisor applies the config itself."""
        self._pending.put((config, text))
        self._wake()

    def call_in_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the supervisor's own thread (thread-safe): what another thread must not
        do itself, such as writing metrics a fork could catch half-done."""
        self._main_calls.put(fn)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _spawn(self, slot: int) -> int:
        ready_r, ready_w = os.pipe()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = os.fork()
        except OSError as exc:  # out of memory or processes: try again later, never crash
            log.error("cannot start worker %d: %s; retrying", slot, exc)
            for fd in (ready_r, ready_w):
                os.close(fd)
            ours.close()
            theirs.close()
            self._respawn[slot] = time.monotonic() + 1.0
            return -1
        if pid == 0:  # the worker
            _die_with_parent()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (ready_r, self._wake_r, self._wake_w, *self._ready_fds.values()):
                os.close(fd)
            for other in (ours, self.sock, *self._channels.values()):
                other.close()
            code = 0
            try:
                self.serve_one(theirs, ready_w)
            except BaseException:  # noqa: BLE001 - a worker reports and exits, never returns to the parent loop
                log.exception("worker %d failed", slot)
                code = 1
            finally:
                os._exit(code)
        os.close(ready_w)
        theirs.close()
        ours.setblocking(False)  # a worker that stops reading must never block the supervisor
        self.children[pid] = slot
        self._ready_fds[pid] = ready_r
        self._channels[pid] = ours
        log.info("worker %d started (pid %d)", slot, pid)
        if self.stopping:  # SIGTERM came while this one was being started: it stops with the rest
            os.kill(pid, signal.SIGTERM)
        elif self._deferred is not None and self._deferred[1]:
            self._send_config(pid, ours, self._deferred[1])  # newer than what it was forked with
        return pid

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._wake()

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGCHLD, lambda *_: self._wake())
        # Keep the garbage collector off the parent's objects in the workers: a collection
        # writes to every object it visits, which would copy the shared pages into each worker.
        gc.freeze()
        for slot in range(self.workers):
            self._spawn(slot)
        while self.children or (self._respawn and not self.stopping):
            self._wait(0.1 if self._respawn else 0.5)
            self._reap()
            if not self.stopping:
                self._apply_pending()
        if self._loader is not None:
            self._loader.join(timeout=30)
        self.sock.close()
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return 0

    def _wait(self, timeout: float) -> None:
        """Hand over new connections until woken (a signal, a config) or a child reports ready,
        at most ``timeout``."""
        listening = self.sock.fileno() if not self.stopping else -1
        fds = [self._wake_r, *self._ready_fds.values(), *([listening] if listening >= 0 else [])]
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            return
        by_fd = {fd: pid for pid, fd in self._ready_fds.items()}
        for fd in readable:
            if fd == self._wake_r:
                os.read(fd, 4096)
                while not self._main_calls.empty():
                    try:
                        self._main_calls.get()()
                    except Exception:  # noqa: BLE001 - one bad call must not stop the supervisor
                        log.exception("supervisor call failed")
                continue
            if fd == listening:
                self._accept()
                continue
            pid = by_fd[fd]
            os.read(fd, 1)  # a byte: the child serves; b"" (EOF): it died first
            os.close(fd)
            del self._ready_fds[pid]
            if pid in self.children:
                self.ready.add(pid)

    def _accept(self) -> None:
        for _ in range(256):  # a burst, then back to the loop (signals, children, configs)
            if self.stopping or not any(pid not in self.retiring for pid in self.children):
                return  # leave them in the backlog: a worker is on its way (or we are stopping)
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, a connection reset while queued
                log.warning("accept failed: %s", exc)
                return
            with conn:
                if conn.family in (socket.AF_INET, socket.AF_INET6):
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._hand_over(conn)

    def _hand_over(self, conn: socket.socket) -> None:
        """Send ``conn`` to the next worker in turn (serving ones first); the caller closes our copy."""
        live = [pid for pid in self.children if pid not in self.retiring]
        order = [pid for pid in live if pid in self.ready] or live
        for i in range(len(order)):
            pid = order[(self._turn + i) % len(order)]
            try:
                socket.send_fds(self._channels[pid], [b"c"], [conn.fileno()])
            except OSError:  # it died, or its channel is full (it stopped reading): the next one
                continue
            self._turn = (self._turn + i + 1) % max(1, len(order))
            return
        log.error("no worker could take a connection (all busy or gone); it is closed")

    def _broadcast(self, text: bytes) -> None:
        """Send a config to every worker (they apply new weights at once; a version they do not
        have yet stays pending until they are replaced)."""
        for pid, channel in list(self._channels.items()):
            if pid not in self.retiring:
                self._send_config(pid, channel, text)

    @staticmethod
    def _send_config(pid: int, channel: socket.socket, text: bytes) -> None:
        message = CONFIG_MESSAGE + text
        if len(message) > MAX_CONFIG_BYTES:
            log.error("config of %d bytes is over %d: workers keep theirs", len(message), MAX_CONFIG_BYTES)
            return
        try:
            channel.send(message)
        except OSError as exc:  # a worker that died: it is replaced from the newest state
            log.warning("worker pid %d did not take the new config: %s", pid, exc)

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid not in self.children:
                continue
            slot = self.children.pop(pid)
            self.ready.discard(pid)
            fd = self._ready_fds.pop(pid, None)
            if fd is not None:
                os.close(fd)
            channel = self._channels.pop(pid, None)
            if channel is not None:
                channel.close()
            self._mark_dead(pid)
            if pid in self.retiring:
                self.retiring.discard(pid)
                log.info("worker %d (pid %d) retired", slot, pid)
            elif not self.stopping:
                self.restarts += 1
                log.error("worker %d (pid %d) died with status %d; starting a new one", slot, pid, status)
                if any(s == slot for s in self.children.values()):
                    continue  # its replacement (a roll) is already there
                # at once, unless this slot keeps dying: then up to 5 s between tries
                now = time.monotonic()
                recent = [t for t in self._crashes.get(slot, []) if now - t < 30] + [now]
                self._crashes[slot] = recent
                self._respawn[slot] = now + (0 if len(recent) == 1 else min(5.0, 0.1 * 2 ** len(recent)))
        self._respawn_due()

    def _respawn_due(self) -> None:
        if self.stopping or self._loader is not None:  # never fork while the loader is inside MNN
            return
        now = time.monotonic()
        for slot, due in sorted(self._respawn.items()):
            if due <= now:
                del self._respawn[slot]
                self._spawn(slot)

    def _forward_pending(self) -> None:
        """Send the newest config handed in to every worker now; this process applies it later
        (it may have to load a version first)."""
        newest = None
        while not self._pending.empty():
            newest = self._pending.get()  # only the newest matters
        if newest is not None:
            self._deferred = newest
            if newest[1]:
                self._broadcast(newest[1])

    def _apply_pending(self) -> None:
        """Apply the newest config in this process on a loader thread (loading a version can take
        seconds: connections keep being handed out meanwhile); once done, replace the workers if
        it loaded something."""
        self._forward_pending()
        if self._loader is not None:
            if self._loader.is_alive():
                return
            self._loader = None
            if self._loaded.pop():
                self._roll()
            self._reap()  # respawns that waited for the load
        if self._deferred is None or self.apply is None:
            return
        config, _ = self._deferred
        self._deferred = None
        apply = self.apply

        def load() -> None:
            try:
                changed = apply(config)
            except Exception:  # noqa: BLE001 - a bad update must never take the supervisor down
                log.exception("the supervisor could not apply a new config; workers keep theirs")
                changed = False
            self._loaded.append(changed)
            self._wake()

        self._loader = threading.Thread(target=load, name="config-load", daemon=True)
        self._loader.start()

    def _roll(self) -> None:
        """Replace every worker by one forked now (sharing what was just loaded), one at a time."""
        gc.freeze()
        for old, slot in sorted(self.children.items(), key=lambda item: item[1]):
            if self.stopping or old in self.retiring or old not in self.children:
                continue
            new = self._spawn(slot)
            deadline = time.monotonic() + self.ready_timeout
            while new not in self.ready and time.monotonic() < deadline and not self.stopping:
                self._wait(0.2)
                self._reap()
                self._forward_pending()  # new weights reach the workers during a roll too
                if new not in self.children:  # it died before serving (and was replaced): follow that one
                    new = next((p for p, s in self.children.items() if s == slot and p != old), new)
            if new not in self.ready:
                log.error("worker %d: its replacement (pid %d) is not serving after %.0f s; keeping pid %d",
                          slot, new, self.ready_timeout, old)
                if new in self.children:
                    self.retiring.add(new)  # not respawned when reaped
                    os.kill(new, signal.SIGKILL)
                continue
            if old not in self.children:  # it died meanwhile: its replacement serves already
                continue
            self.retiring.add(old)
            try:
                os.kill(old, signal.SIGUSR2)
            except ProcessLookupError:
                pass
        log.info("workers replaced with the new versions loaded")

    def _mark_dead(self, pid: int) -> None:
        if self.metrics_dir is None:
            return
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.metrics_dir))
