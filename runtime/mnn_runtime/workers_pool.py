"""The worker processes under the supervisor (``workers.Supervisor`` builds on this): forking
one per slot, knowing which serve, and replacing one that dies."""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

from .workers_channel import CONNECTION, GRPC_CONNECTION, channel_pair
from .workers_metrics import mark_dead
from .workers_process import STOP_SIGNALS, run_worker

log = logging.getLogger(__name__)


class WorkerPool:
    """``workers`` slots, each with one child forked to run ``serve_one(channel, ready_fd)``.

    Each child writes one byte to ``ready_fd`` once it serves (``ready`` then holds its pid) and
    gets its connections and configs over ``channel``. A child that dies unexpectedly is replaced
    at once, or, when its slot keeps dying, after a back-off of up to 5 s. One being retired
    (its pid in ``retiring``) is not replaced. ``_wake`` (a self-pipe) wakes the loop that runs
    the pool: a child exited, a signal came. Subclasses hook ``_may_fork`` (may a replacement be
    forked now?) and ``_started`` (a child was just forked).
    """

    def __init__(self, workers: int, sock: socket.socket, serve_one: Callable[[socket.socket, int], None],
                 metrics_dir: Path | None, grpc_sock: socket.socket | None = None) -> None:
        self.workers = workers
        # listening socket -> the kind of connection it takes (serve --grpc-port: gRPC's too)
        self.listeners = {sock: CONNECTION, **({grpc_sock: GRPC_CONNECTION} if grpc_sock is not None else {})}
        self.serve_one = serve_one
        self.metrics_dir = metrics_dir
        self.children: dict[int, int] = {}  # pid -> slot
        self.retiring: set[int] = set()
        self.ready: set[int] = set()
        self._ready_fds: dict[int, int] = {}  # read end of each child's ready pipe
        self._channels: dict[int, socket.socket] = {}  # pid -> where its connections are sent
        self.stopping = False
        self.restarts = 0
        self._respawn: dict[int, float] = {}  # slot -> when to start its new worker
        self._crashes: dict[int, list[float]] = {}  # slot -> recent unexpected deaths (for backoff)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass

    def _may_fork(self) -> bool:
        """May a replacement be forked now? (Besides not stopping.)"""
        return True

    def _started(self, pid: int, channel: socket.socket) -> None:
        """A worker was just forked (and is not being stopped)."""

    def _spawn(self, slot: int) -> int:
        ready_r, ready_w = os.pipe()
        ours, theirs = channel_pair()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # until the child has its own handlers
        try:
            pid = os.fork()
        except OSError as exc:  # out of memory or processes: try again later, never crash
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            log.error("cannot start worker %d: %s; retrying", slot, exc)
            for fd in (ready_r, ready_w):
                os.close(fd)
            ours.close()
            theirs.close()
            self._respawn[slot] = time.monotonic() + 1.0
            return -1
        if pid == 0:  # the worker
            run_worker(slot, self.serve_one, theirs, ready_w,
                       inherited_fds=(ready_r, self._wake_r, self._wake_w, *self._ready_fds.values()),
                       inherited_sockets=(ours, *self.listeners, *self._channels.values()))
        try:
            os.close(ready_w)
            theirs.close()
            ours.setblocking(False)  # a worker that stops reading must never block the supervisor
            self.children[pid] = slot
            self._ready_fds[pid] = ready_r
            self._channels[pid] = ours
        finally:  # a SIGTERM sent meanwhile now runs _stop, which sees this worker
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        log.info("worker %d started (pid %d)", slot, pid)
        if self.stopping:  # SIGTERM came while this one was being started: it stops with the rest
            os.kill(pid, signal.SIGTERM)
        else:
            self._started(pid, ours)
        return pid

    def _stop(self, signum: int, _frame: object) -> None:
        self.stopping = True
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._wake()

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
            mark_dead(pid, self.metrics_dir)
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
        if self.stopping or not self._may_fork():
            return
        now = time.monotonic()
        for slot, due in sorted(self._respawn.items()):
            if due <= now:
                del self._respawn[slot]
                self._spawn(slot)
