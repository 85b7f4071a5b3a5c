"""The wire between the supervisor and its workers.

The supervisor binds the listening socket (``bind``) and accepts every connection itself. Each
worker has a channel: one end of a Unix SOCK_SEQPACKET socket pair (``channel_pair``), over which
the supervisor sends it either an accepted connection (one byte, the file descriptor travelling
as SCM_RIGHTS: ``send_connection``) or a config (``CONFIG_MESSAGE`` then the config's YAML, in
one message of at most ``MAX_CONFIG_BYTES``: ``send_config``). The worker's end is read by the
worker's HTTP server (``server._Server._receive``).
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)

CONFIG_MESSAGE = b"config\n"  # a config from the supervisor to a worker: this, then its YAML
MAX_CONFIG_BYTES = 192 * 1024  # under the socket's send buffer (~208 KB by default)


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(the supervisor's end, the worker's end) of a new worker's channel."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def send_connection(channel: socket.socket, conn: socket.socket) -> None:
    """Send ``conn`` over a worker's channel; OSError when the worker died or stopped reading."""
    socket.send_fds(channel, [b"c"], [conn.fileno()])


def send_config(pid: int, channel: socket.socket, text: bytes) -> None:
    """Send a config's YAML to the worker ``pid``; a failure is logged, never raised."""
    message = CONFIG_MESSAGE + text
    if len(message) > MAX_CONFIG_BYTES:
        log.error("config of %d bytes is over %d: workers keep theirs", len(message), MAX_CONFIG_BYTES)
        return
    try:
        channel.send(message)
    except OSError as exc:  # a worker that died: it is replaced from the newest state
        log.warning("worker pid %d did not take the new config: %s", pid, exc)
