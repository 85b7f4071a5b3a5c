"""The wire between the supervisor and its workers.

The supervisor binds the listening socket (``bind``) and accepts every connection itself. Each
worker has a channel: one end of a Unix SOCK_SEQPACKET socket pair (``channel_pair``), over which
the supervisor sends it either an accepted connection (one byte saying which server it is for,
``CONNECTION`` HTTP or ``GRPC_CONNECTION`` gRPC, the file descriptor travelling as SCM_RIGHTS:
``send_connection``) or a config (``CONFIG_MESSAGE`` then the config's YAML, in one message when
it fits in ``MAX_CONFIG_BYTES``, else ``CONFIG_MESSAGE`` alone with, as SCM_RIGHTS, an in-memory
file holding it: ``send_config``, read by ``config_text``), or the versions to unload
(``OFFLOAD_MESSAGE`` then their names, comma-separated). The worker's end is read by the worker's
HTTP server (``server._Server._receive``). A worker writes back three kinds of message: a version
it loaded again for a request (``RELOAD_MESSAGE`` then its name), so that the supervisor loads it
too and forks workers that share it (``workers.Supervisor``); ``AGAIN_MESSAGE``: a config reached
it without its file (it had no descriptor left), the supervisor sends the newest again; and
``ALIVE_MESSAGE`` then what it routes by (``routing_of``), every ``ALIVE_SECONDS`` from its event
loop (by which the supervisor tells a worker whose loop is stuck) and at once after each config it
applied. From those the supervisor writes what the whole pod routes by into ``PodRouting``, memory
shared with every worker, which a worker's ``/status`` reports instead of its own routing alone.
"""

from __future__ import annotations

import array
import errno
import json
import logging
import mmap
import os
import socket
import struct
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)

CONFIG_MESSAGE = b"config\n"  # a config from the supervisor to a worker: this, then its YAML
OFFLOAD_MESSAGE = b"offload\n"  # supervisor -> worker: unload these versions (names, comma-separated)
RELOAD_MESSAGE = b"reload\n"  # worker -> supervisor: this version was loaded again for a request
AGAIN_MESSAGE = b"again\n"  # worker -> supervisor: a config came without its file; send it again
ALIVE_MESSAGE = b"alive\n"  # worker -> supervisor: its loop runs; then what it routes by (routing_of)
ALIVE_SECONDS = 1.0
CONNECTION = b"c"  # supervisor -> worker: an accepted HTTP connection (its descriptor beside)
GRPC_CONNECTION = b"g"  # supervisor -> worker: an accepted gRPC connection (serve --grpc-port)
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


def send_connection(channel: socket.socket, conn: socket.socket, kind: bytes = CONNECTION) -> None:
    """Send ``conn`` (for the server ``kind`` names) over a worker's channel; OSError when the
    worker died or stopped reading."""
    socket.send_fds(channel, [kind], [conn.fileno()])


def receive(channel: socket.socket) -> tuple[bytes, list[int], int]:
    """One message from the channel: (its bytes, the descriptors sent with it, recvmsg's flags). The
    descriptors are close-on-exec: a child the worker starts (a profile's) must not hold its
    connections open after the worker closed them. (Python 3.11's ``socket.recv_fds`` drops the
    flag ``MSG_CMSG_CLOEXEC`` that does this.)"""
    fds = array.array("i")
    data, ancillary, flags, _ = channel.recvmsg(MAX_CONFIG_BYTES, socket.CMSG_LEN(64 * fds.itemsize),
                                                socket.MSG_CMSG_CLOEXEC)
    for level, kind, raw in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
    return data, list(fds), flags


def send_config(pid: int, channel: socket.socket, text: bytes, quiet: bool = False) -> bool:
    """Send a config's YAML to the worker ``pid``: in the message when it fits, else in an
    in-memory file whose descriptor travels with it (a ModelDeployment's config has no bound: many
    versions, long uris); False when it did not take it (logged unless ``quiet``), never raised."""
    if len(CONFIG_MESSAGE) + len(text) <= MAX_CONFIG_BYTES:
        return send_message(pid, channel, CONFIG_MESSAGE + text, quiet)
    try:
        fd = _in_memory_file(text)
    except OSError as exc:  # out of memory or descriptors: like a full channel, sent again later
        if not quiet:
            log.warning("worker pid %d did not take the config of %d bytes: %s", pid, len(text), exc)
        return False
    try:
        return send_message(pid, channel, CONFIG_MESSAGE, quiet, fd)
    finally:
        os.close(fd)  # the worker's copy (in flight or received) keeps the file


def _in_memory_file(text: bytes) -> int:
    """A descriptor of a file in memory (a memfd) holding ``text``; without memfd (not Linux, or a
    seccomp profile refusing it) an unlinked temporary file. OSError when neither can be made."""
    try:
        fd = os.memfd_create("mnn-rollout-config")
    except (AttributeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise  # out of descriptors or memory: a file would fail too (sent again later)
        fd, path = tempfile.mkstemp(prefix="mnn-rollout-config-")
        os.unlink(path)
    try:
        view = memoryview(text)
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        os.close(fd)
        raise
    return fd


def config_text(message: bytes, fds: list[int]) -> bytes | None:
    """The YAML of a config message the worker received (``send_config``), its descriptors closed;
    None when it is not one."""
    if not message.startswith(CONFIG_MESSAGE):
        return None
    if not fds:
        return message[len(CONFIG_MESSAGE):]
    with open(fds[0], "rb", closefd=True) as file:
        for fd in fds[1:]:
            os.close(fd)
        file.seek(0)
        return file.read()


def send_message(pid: int, channel: socket.socket, message: bytes, quiet: bool = False, fd: int | None = None) -> bool:
    """Send one message (with descriptor ``fd``, if any) over the channel of worker ``pid``; False
    when it failed (logged unless ``quiet``), never raised."""
    if len(message) > MAX_CONFIG_BYTES:
        log.error("a message of %d bytes is over %d: workers keep their state", len(message), MAX_CONFIG_BYTES)
        return False
    try:
        if fd is None:
            channel.send(message)
        else:
            socket.send_fds(channel, [message], [fd])
    except OSError as exc:  # died (replaced from the newest state), or its channel is full (sent again)
        if not quiet:
            log.warning("worker pid %d did not take the message %r: %s", pid, message.split(b"\n", 1)[0], exc)
        return False
    return True


def routing_of(table_digest: str, weights: Mapping[str, int], serves: Iterable[str] = (),
               shadow: Mapping[str, Any] | None = None) -> bytes:
    """What a worker routes by, as it tells the supervisor after ``ALIVE_MESSAGE``: the table, the
    weights, the versions it can serve now (any of its versions not listed, pending or failed,
    it cannot: it routes their share to the fallback), and what it shadows (``shadow.setting``)."""
    return json.dumps({"table_digest": table_digest, "weights": dict(weights), "serves": sorted(serves),
                       "shadow": dict(shadow) if shadow is not None else None}).encode()


class PodRouting:
    """What every worker of the pod routes by, as the supervisor last heard it, in memory shared
    with the workers (an anonymous shared mapping: made before they are forked). The supervisor
    ``write``s ``{"table_digest": the digest every live worker routes by, or None when they differ
    (or one has not said yet), "weights": theirs (when they differ: a lagging worker's),
    "lagging": the pids of workers not routing by (or not shadowing as) the newest config sent, "serves":
    {pid (a string): the versions that serving worker can serve, [] until it said}, and, when every
    serving worker said the same table, "shadow": what they all shadow, or ``WORKERS_DIFFER`` (absent:
    none of them shadows anything)}``; a worker ``read``s it
    for ``/status`` only. A sequence number, odd while a write is under way, tells a reader that
    saw half a write to read again."""

    SIZE = 64 * 1024
    _WORD = struct.Struct("=Q")  # at 0 the sequence number, at 8 the payload's length, then the payload
    _DATA = 16

    def __init__(self) -> None:
        self._mem = mmap.mmap(-1, self.SIZE)  # MAP_SHARED | MAP_ANONYMOUS: the workers see every write
        self._seq = 0

    def write(self, state: Mapping[str, Any]) -> None:
        data = json.dumps(state).encode()
        if len(data) > self.SIZE - self._DATA:  # thousands of versions or workers: say only that they differ
            # (and, with no "serves", /status counts no version as served by the whole pod)
            data = json.dumps({"table_digest": None, "weights": None, "lagging": []}).encode()
        self._WORD.pack_into(self._mem, 0, self._seq + 1)
        self._WORD.pack_into(self._mem, 8, len(data))
        self._mem[self._DATA:self._DATA + len(data)] = data
        self._seq += 2
        self._WORD.pack_into(self._mem, 0, self._seq)

    def read(self) -> dict[str, Any] | None:
        """The last state written; None when nothing was, or no whole one could be read."""
        for _ in range(100):
            (seq,) = self._WORD.unpack_from(self._mem, 0)
            if seq % 2:
                continue
            (length,) = self._WORD.unpack_from(self._mem, 8)
            data = self._mem[self._DATA:self._DATA + min(length, self.SIZE - self._DATA)]
            if self._WORD.unpack_from(self._mem, 0)[0] != seq:
                continue
            if not seq:
                return None
            try:
                state = json.loads(data)
            except ValueError:
                continue
            return state if isinstance(state, dict) else None
        return None
