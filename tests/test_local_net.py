"""``free_port`` with a range of the process's own (what each pytest-xdist worker of ``make test``
takes its ports from): in turn, skipping one that is taken, and an error once none is left."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from mnn_rollout.local import net


@pytest.fixture
def restored() -> Iterator[None]:
    saved, cursor = list(net._OWN_PORTS), net._next_own
    yield
    net._OWN_PORTS[:], net._next_own = saved, cursor


def free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_ports_come_from_the_own_range_in_turn_skipping_a_taken_one(restored: None) -> None:
    base = next(b for b in range(20000, 30000, 3) if all(free(p) for p in range(b, b + 3)))
    ports = range(base, base + 3)  # three ports in a row that are free now, the middle one then taken
    net.own_ports(ports)
    net._next_own = 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 1))
        taken.listen()
        assert [net.free_port(), net.free_port()] == [base, base + 2]
        assert net.free_port() == base  # round again: the taken one is still skipped
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", base))
            b.bind(("127.0.0.1", base + 2))
            with pytest.raises(OSError, match=f"no free port left in {base}-{base + 2}"):
                net.free_port()
