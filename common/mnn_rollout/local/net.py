"""Small things every local run needs: a free port, a bounded wait, a loopback check, an atomic
file write. One of each, shared by the demo, the tests and the benchmarks."""

from __future__ import annotations

import ipaddress
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")


def require_loopback(host: str) -> str:
    """``host`` when it is a loopback address (127.0.0.0/8); local load never goes elsewhere."""
    try:
        ok = ipaddress.ip_address(host) in LOOPBACK
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{host!r}: local runs only talk to loopback addresses (127.0.0.0/8)")
    return host


_HANDED_OUT: dict[int, None] = {}  # ports this process was given, oldest first (bounded)
_OWN_PORTS: list[int] = []  # a range of this process's own to take ports from, in turn (see own_ports)
_next_own = 0


def own_ports(ports: range) -> None:
    """Take this process's ports from ``ports`` from now on, in turn, instead of letting the OS pick.
    For processes that run beside each other (pytest-xdist's workers): the OS picks from the same
    ephemeral range for every process, so a port one handed out and has not bound yet could be
    given to another, or to an outgoing connection; ranges of their own below the ephemeral range
    (32768-60999 by default) cannot be. Child processes do not inherit it."""
    global _next_own
    _OWN_PORTS[:] = list(ports)
    _next_own = int.from_bytes(os.urandom(2), "big") % max(1, len(_OWN_PORTS))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, and not one this process was given before: two calls in
    a row may otherwise get the same port back before either is bound. The OS picks it, unless
    this process has a range of its own (``own_ports``)."""
    global _next_own
    if _OWN_PORTS:
        for _ in range(len(_OWN_PORTS)):
            port = _OWN_PORTS[_next_own]
            _next_own = (_next_own + 1) % len(_OWN_PORTS)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            return port
        raise OSError(f"no free port left in {_OWN_PORTS[0]}-{_OWN_PORTS[-1]}")
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            break
    _HANDED_OUT[port] = None
    while len(_HANDED_OUT) > 4096:
        del _HANDED_OUT[next(iter(_HANDED_OUT))]
    return port


class WaitTimeout(AssertionError):
    """``wait_for``'s condition was not met in time (an AssertionError, as a test's failed check)."""


def wait_for(check: Callable[[], T], timeout: float, what: str = "condition", interval: float = 0.05,
             retry_on: tuple[type[BaseException], ...] = (AssertionError,)) -> T:
    """Call ``check`` until it returns something truthy, and return that; raise AssertionError
    (:class:`WaitTimeout`) naming ``what`` and the last value (or exception) after ``timeout``
    seconds. Exceptions of the ``retry_on`` types count as "not yet"; any other is raised at once."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"{what} not met within {timeout:g} s (last: {last!r})")
        time.sleep(interval)


def write_atomic(path: Path, text: str) -> None:
    """Write a file another process follows: a temp file beside it, then one rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
