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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it), and not one this process was given
    before: two calls in a row may otherwise get the same port back before either is bound."""
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
