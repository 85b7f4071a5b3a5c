"""A worker process, from the moment it is forked: what it drops of the supervisor's, how it
serves, and that it never returns into the supervisor's code."""

from __future__ import annotations

import logging
import os
import signal
import socket
from collections.abc import Callable, Iterable
from typing import NoReturn

log = logging.getLogger(__name__)

# Blocked in the supervisor across a fork (``WorkerPool._spawn``), until the child has the default
# handlers back: one that arrived in between ran the supervisor's Python handler in the child (which
# then served on, its SIGTERM lost, and the supervisor waited for it for ever).
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when its supervisor dies, so no worker outlives it."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_worker(slot: int, serve_one: Callable[[socket.socket, int], None], channel: socket.socket, ready_fd: int,
               inherited_fds: Iterable[int], inherited_sockets: Iterable[socket.socket]) -> NoReturn:
    """In the child just forked for ``slot`` (``STOP_SIGNALS`` blocked): die with the supervisor, take
    the default signal handlers back (then unblock them), close what belongs to the supervisor
    (``inherited_fds``: pipe ends; ``inherited_sockets``: the listening socket and the other workers'
    channels), then run
    ``serve_one(channel, ready_fd)`` and exit with 0, or 1 when it raised."""
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one sent meanwhile stops it now
    for fd in inherited_fds:
        os.close(fd)
    for other in inherited_sockets:
        other.close()
    code = 0
    try:
        serve_one(channel, ready_fd)
    except BaseException:  # noqa: BLE001 - a worker reports and exits, never returns to the parent loop
        log.exception("worker %d failed", slot)
        code = 1
    finally:
        os._exit(code)
