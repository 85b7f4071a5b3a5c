"""The Alertmanager webhook takes a burst of connections at once (seventh review)."""

from __future__ import annotations

import select
import socket
import time

from rollout_operator.alerts import MAX_CONNECTIONS, AlertWebhook
from rollout_operator.kube import KubeClient
from tests.operator.test_alerts_webhook import TOKEN, emu, kube  # noqa: F401  (fixtures)

BURST = 40


def test_a_burst_of_connections_is_held_in_the_backlog_not_dropped(kube: KubeClient) -> None:  # noqa: F811
    """The webhook listened with socketserver's default backlog of 5: connections arriving faster
    than its one accepting thread took them had their SYN dropped and waited ~1 s for the client's
    retry (about one in seven in a burst). Repro: with the server not accepting yet, 6 of 40
    connections were established; now all 40 are, held until it accepts them."""
    hook = AlertWebhook(kube, "127.0.0.1", 0, lambda: TOKEN)  # listening, not accepting yet
    socks = []
    try:
        for _ in range(BURST):
            s = socket.socket()
            s.setblocking(False)
            assert s.connect_ex(("127.0.0.1", hook.port)) in (0, 115)  # EINPROGRESS
            socks.append(s)
        connected: set[socket.socket] = set()
        deadline = time.monotonic() + 0.5  # a dropped SYN is sent again after 1 s
        while len(connected) < BURST and time.monotonic() < deadline:
            _, writable, _ = select.select([], [s for s in socks if s not in connected], [], 0.05)
            connected.update(s for s in writable if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0)
        assert len(connected) == BURST, f"{len(connected)} of {BURST} connections established"
        assert BURST < MAX_CONNECTIONS
        hook.start()  # and each is served once accepted: the first one's request answered
        first = socks[0]
        first.setblocking(True)
        first.settimeout(10)
        first.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert first.recv(64).startswith(b"HTTP/1."), "no answer"
    finally:
        for s in socks:
            s.close()
        if hook.thread.is_alive():
            hook.stop()
        hook.server.server_close()
