"""A gRPC server for unary calls, straight on asyncio (HTTP/2, RFC 9113; gRPC over HTTP/2).

Why not grpcio's server: profiled under h2load, grpc.aio spent ~300 µs of CPU per call on this
machine before the handler ran (its C core, the Cython glue and the poller thread that hands
every completion to the event loop), more than a whole REST request costs. Here a call is parsed
and answered in the event loop's own ``data_received``, with no thread and one write per response.

What it does: the connection preface and SETTINGS (applied both ways), HPACK (``hpack``), PING,
WINDOW_UPDATE and flow control in both directions, RST_STREAM (a running call is cancelled),
GOAWAY (both ways; ``stop`` drains), CONTINUATION, padding, gzip/deflate request messages,
``grpc-timeout`` (DEADLINE_EXCEEDED), message size limits checked from the length prefix (before the
message is read), the metadata size limit. What it does not: TLS, server streaming or client
streaming calls, server push, priorities (ignored, as RFC 9113 allows).

Against a hostile peer (the port is on the network): resets of running calls have a budget (rapid
reset), a header block a size, a count of CONTINUATION frames and a decoded size (decompression
bombs), the request bytes held across a connection's streams a cap (``MAX_BUFFERED``), a frame
begun must end within ``FRAME_TIMEOUT`` (slow loris), a call's request that stalls between frames is
let go after ``REQUEST_IDLE_TIMEOUT`` (a swept check, not a timer per call), a connection with no
call for ``CONNECTION_IDLE_TIMEOUT`` is sent GOAWAY and closed (one that the client abandoned, or a
half-open one, was held forever), no control frame walks
every open stream, and a peer that does not read what it is sent is not read from
(``pause_writing``). The receive windows are not policed (a peer that overruns them is held by those
caps instead)."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from . import eager, hpack

log = logging.getLogger(__name__)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED = 0x0, 0x1, 0x2, 0x3, 0x5
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x6, 0x7, 0x8, 0x9, 0xB

# gRPC status codes
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND = 0, 1, 2, 3, 4, 5
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

MAX_FRAME = 1 << 20  # what we take (SETTINGS_MAX_FRAME_SIZE): big messages in few frames
STREAM_WINDOW = 1 << 20  # each call's receive window; topped up as its data arrives
CONNECTION_WINDOW = 1 << 24
MAX_STREAMS = 1000  # concurrent calls per connection
MAX_METADATA = 16384  # decoded request metadata, as HTTP/2 counts it (SETTINGS_MAX_HEADER_LIST_SIZE)
MAX_HEADER_BLOCK = 1 << 18  # encoded header block across CONTINUATION frames: beyond, the peer is abusive
MAX_HEADER_LIST = 4 * MAX_METADATA  # decoded header list: beyond, decoding stops (a decompression bomb)
MAX_CONTINUATIONS = 32  # CONTINUATION frames of one header block (empty ones cost work, not bytes)
MAX_BUFFERED = 64 << 20  # request bytes held across a connection's streams (at least twice the message limit)
RESET_BURST, RESET_RATE = 1000, 100.0  # running calls a client may reset: at once, then per second
FRAME_TIMEOUT = 30.0  # seconds to finish a frame (the preface, a header block) once begun
# seconds a call's request may go without a byte of its message before it is answered DEADLINE_EXCEEDED
# and its bytes let go: a stalled upload held its stream and its bytes as long as the connection lived
# (nginx's client_body_timeout is 60 s too). A request that keeps arriving, however slowly, is never cut.
REQUEST_IDLE_TIMEOUT = 60.0
# seconds a connection may go with no call open and none begun before it is sent GOAWAY (NO_ERROR) and
# closed (within a quarter more: a swept check). A client that went away without closing (its pod
# deleted, its node cut off: a half-open TCP connection) held its descriptor and its state as long as
# the process lived. A live client reconnects on its next call, as after grpc-go's MaxConnectionIdle.
CONNECTION_IDLE_TIMEOUT = 300.0

_FRAME_HEAD = struct.Struct(">BHBBI")  # length (24 bits as 8 + 16), type, flags, stream id
_DATA_HEAD = struct.Struct(">BHBBIBI")  # a DATA frame's head, then a gRPC message's prefix (flag, length)
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME_HEAD.pack(n >> 16, n & 0xFFFF, kind, flags, stream) + payload


# Response header blocks (literal, never indexed in the peer's table: no encoder state).
_RESPONSE_HEADERS = b"\x88" + hpack.encode_indexed_name(31, "application/grpc")  # :status 200, content-type
_GRPC_OK = hpack.encode_literal("grpc-status", "0")


def _percent_encode(message: str) -> bytes:
    """grpc-message: UTF-8, with bytes outside printable ASCII and '%' percent-encoded."""
    raw = message.encode("utf-8", "replace")
    if all(0x20 <= b <= 0x7E and b != 0x25 for b in raw):
        return raw
    return b"".join(bytes((b,)) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in raw)


def _status_block(code: int, message: str, trailers: tuple[tuple[str, str], ...]) -> bytes:
    block = hpack.encode_literal("grpc-status", str(code))
    if message:
        block += hpack.encode_literal("grpc-message", _percent_encode(message))
    for key, value in trailers:
        block += hpack.encode_literal(key, value)
    return block


class GrpcError(Exception):
    """A call that ends with a non-OK status; ``trailers``: metadata sent with it."""

    def __init__(self, code: int, message: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


# A unary method: (request message, its text metadata: a dict of its own, without pseudo-headers
# or -bin keys) -> (response message, trailing metadata)
Handler = Callable[[bytes, dict[str, str]], Awaitable[tuple[bytes, tuple[tuple[str, str], ...]]]]


class _Stream:
    __slots__ = ("id", "headers", "metadata", "chunks", "size", "expected", "send_window", "pending", "task",
                 "timer", "answered", "remote_closed", "unacked", "handler", "trailers", "heard")

    def __init__(self, stream_id: int, send_window: int) -> None:
        self.id = stream_id
        self.headers: dict[str, str] = {}  # pseudo-headers (":path", ...)
        self.metadata: dict[str, str] = {}  # the call's metadata: the handler's own copy
        self.chunks: list[bytes] = []
        self.size = 0  # message bytes received (the 5-byte prefix included)
        self.expected = -1  # the message's length once its prefix arrived
        self.send_window = send_window  # beyond the peer's initial window (which can change): may be < 0
        self.pending: bytearray | None = None  # DATA waiting for the peer's window
        self.task: asyncio.Task[Any] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.answered = False  # our END_STREAM sent (or queued behind pending data)
        self.remote_closed = False
        self.unacked = 0  # bytes received since our last WINDOW_UPDATE for this stream
        self.handler: Handler | None = None
        self.trailers = b""  # the trailer block, sent once pending data is out
        self.heard = 0.0  # loop time of the request's last frame (while it is not complete)


def _split(headers: list[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str], int]:
    """(pseudo-headers, text metadata, size as SETTINGS_MAX_HEADER_LIST_SIZE counts it) of a header
    list. Binary metadata (keys ending in ``-bin``, base64 values) is counted and left out: no
    handler reads it, and a header block is split once however many calls carry it (``_prepared``)."""
    pseudo, meta, size = {}, {}, 0
    for name, value in headers:
        size += len(name) + len(value) + 32
        if name[:1] == ":":
            pseudo[name] = value
        elif not name.endswith("-bin"):
            meta[name] = value
    return pseudo, meta, size


_trailer_blocks: dict[tuple[tuple[str, str], ...], bytes] = {}


def _ok_block(trailers: tuple[tuple[str, str], ...]) -> bytes:
    """The trailers of a successful call (encoded once per distinct set: a version name, usually)."""
    block = _trailer_blocks.get(trailers)
    if block is None:
        block = _GRPC_OK + b"".join(hpack.encode_literal(k, v) for k, v in trailers)
        if len(_trailer_blocks) < 256:
            _trailer_blocks[trailers] = block
    return block


class H2Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying unary gRPC calls."""

    def __init__(self, server: GrpcServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.preface_seen = False
        self.decoder = hpack.Decoder(max_list=MAX_HEADER_LIST)
        self.streams: dict[int, _Stream] = {}
        self.last_stream = 0
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.unacked = 0  # connection-level bytes received since our last WINDOW_UPDATE
        self.continuing: tuple[int, int, list[bytes]] | None = None  # (stream, flags, fragments)
        # header block -> (the decoder's list for it, pseudo-headers, metadata, size): see _header_block
        self._prepared: dict[bytes, tuple[list[tuple[str, str]], dict[str, str], dict[str, str], int]] = {}
        self.goaway_sent = False
        self.peer_goaway = False
        self.closed = False
        self.buffered = 0  # request bytes held in the streams' chunks
        self.resets, self.reset_clock = float(RESET_BURST), 0.0  # the client's budget of resets
        self.stall: asyncio.TimerHandle | None = None  # the check of a frame begun and not complete (_stalled)
        self.frame_began = 0.0  # loop time the frame (or preface) left incomplete by the last read began
        self.block_began = 0.0  # loop time the header block awaiting CONTINUATION frames began
        self.waiting: dict[int, _Stream] = {}  # streams whose answer waits for the peer's window
        self.most_window = 0  # at least every stream's send_window (that beyond the initial one)
        self.reads: asyncio.TimerHandle | None = None  # the sweep of stalled requests (_reads_due)
        self.reading_paused = False  # by pause_writing: the peer's frames are not read meanwhile
        self.resumed = 0.0  # loop time reading last resumed
        self.idle: asyncio.TimerHandle | None = None  # the check for a connection with no calls (_idle_due)

    # -- transport -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.server.connections.add(self)
        self.frame_began = self.loop.time()  # the preface is due
        self.stall = self.loop.call_at(self.frame_began + FRAME_TIMEOUT, self._stalled)
        self.idle = self.loop.call_later(CONNECTION_IDLE_TIMEOUT / 4, self._idle_due, 0, 0)
        settings = struct.pack(">HIHIHIHI", 0x3, MAX_STREAMS, 0x4, STREAM_WINDOW, 0x5, MAX_FRAME,
                               0x6, MAX_METADATA)
        self._write(frame(SETTINGS, 0, 0, settings)
                    + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", CONNECTION_WINDOW - 65535)))
        if self.server.draining:
            self.goaway(NO_ERROR)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if self.reads is not None:
            self.reads.cancel()
            self.reads = None
        if self.idle is not None:
            self.idle.cancel()
            self.idle = None
        self.server.connections.discard(self)
        for stream in list(self.streams.values()):
            self._cancel(stream)
        self.streams.clear()
        self.server._connection_closed()

    def pause_writing(self) -> None:  # a peer that does not read its answers is sent no more
        if self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self.reading_paused = False
            self.resumed = self.loop.time()  # the requests' silence is counted from here (_reads_due)

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def goaway(self, code: int, debug: bytes = b"") -> None:
        """No new calls on this connection; it closes once the running ones are answered."""
        if not self.goaway_sent:
            self.goaway_sent = True
            self._write(frame(GOAWAY, 0, 0, struct.pack(">II", self.last_stream, code) + debug))
        if code != NO_ERROR or not self.streams:
            self._close()

    def _close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()

    def _connection_error(self, code: int, why: str) -> None:
        log.debug("gRPC connection error %d: %s", code, why)
        self.goaway_sent = False  # say why, even after a graceful GOAWAY
        self.goaway(code, why.encode()[:200])

    # -- reading frames --------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        carried = bool(buf)
        if carried:  # the rest of a frame (or preface) begun in an earlier read: read on from its start
            buf += data
            data = bytes(buf)
            buf.clear()
        # else (nearly every read: whole frames) the frames are read from data itself, each payload
        # one slice of it; what is left of a frame not yet whole waits in buf
        pos = 0
        if not self.preface_seen:
            if len(data) < 24:
                if not PREFACE.startswith(data):
                    self._connection_error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    return
                buf += data
                return
            if data[:24] != PREFACE:
                self._connection_error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                return
            self.preface_seen = True
            pos = 24
        end = len(data)
        unpack = _FRAME_HEAD.unpack_from
        while end - pos >= 9 and not self.closed:
            hi, lo, kind, flags, stream_id = unpack(data, pos)
            length = (hi << 16) | lo
            if length > MAX_FRAME:
                self._connection_error(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                return
            if end - pos - 9 < length:
                break
            payload = data[pos + 9:pos + 9 + length]
            pos += 9 + length
            try:
                self._frame(kind, flags, stream_id & 0x7FFFFFFF, payload)
            except hpack.HPACKError as exc:
                self._connection_error(COMPRESSION_ERROR, str(exc))
        if pos < end and not self.closed:
            buf += data[pos:] if pos else data
            if pos or not carried:  # it began in this read (else the one begun earlier goes on)
                self.frame_began = self.loop.time()
        if (buf or self.continuing is not None) and self.stall is None and not self.closed:
            self.stall = self.loop.call_at(self._frame_due(), self._stalled)

    def _frame_due(self) -> float:
        """When the frame under way (or the header block, from its HEADERS frame on) must be complete."""
        return (self.block_began if self.continuing is not None else self.frame_began) + FRAME_TIMEOUT

    def _stalled(self) -> None:
        """A frame begun ``FRAME_TIMEOUT`` ago (or the preface, or a header block) is still not
        complete: a slow-loris peer holding its buffer and its connection. Not a timeout of idle
        connections: between frames, a client may wait as long as it likes. One timer, armed when
        a read leaves a frame incomplete and none is: it looks again when the one under way is due
        (reads of whole frames, nearly all, cost nothing)."""
        self.stall = None
        if self.closed or (self.preface_seen and not self.buffer and self.continuing is None):
            return
        due = self._frame_due()
        if due > self.loop.time():  # the one it was armed for ended; the one under way now began later
            self.stall = self.loop.call_at(due, self._stalled)
            return
        self._connection_error(PROTOCOL_ERROR, f"frame not complete after {FRAME_TIMEOUT:g} s")

    def _idle_due(self, last_stream: int, quiet: int) -> None:
        """Every quarter of ``CONNECTION_IDLE_TIMEOUT``: a quarter is quiet when no call began in it
        (``last_stream`` did not move: no cost per call) and none is open at its end. After five quiet
        quarters in a row no call was open for at least the timeout: GOAWAY (NO_ERROR), and the
        connection closes, having no calls. PINGs and other control frames do not count as calls
        (grpc-go's MaxConnectionIdle counts the same way)."""
        self.idle = None
        if self.closed:
            return
        quiet = quiet + 1 if not self.streams and self.last_stream == last_stream else 0
        if quiet > 4:
            log.debug("gRPC connection idle for %g s: closed", CONNECTION_IDLE_TIMEOUT)
            self.goaway(NO_ERROR, b"idle")
            return
        self.idle = self.loop.call_later(CONNECTION_IDLE_TIMEOUT / 4, self._idle_due, self.last_stream, quiet)

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is not None and kind != CONTINUATION:
            self._connection_error(PROTOCOL_ERROR, "expected CONTINUATION")
            return
        if kind == DATA:
            self._data(flags, stream_id, payload)
        elif kind == HEADERS:
            self._headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            self._continuation(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == PING:
            if len(payload) != 8 or stream_id:
                self._connection_error(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "bad PING")
            elif not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif kind == SETTINGS:
            self._settings(flags, stream_id, payload)
        elif kind == RST_STREAM:
            if len(payload) != 4 or not stream_id:
                self._connection_error(PROTOCOL_ERROR, "bad RST_STREAM")
                return
            stream = self.streams.pop(stream_id, None)
            if stream is not None:
                self._cancel(stream)
                if not stream.answered:  # a call cancelled while it ran (CVE-2023-44487: rapid reset)
                    now = self.loop.time()
                    self.resets = min(RESET_BURST, self.resets + (now - self.reset_clock) * RESET_RATE) - 1
                    self.reset_clock = now
                    if self.resets < 0:
                        self._connection_error(ENHANCE_YOUR_CALM, "too many calls reset")
                        return
                self._maybe_close()
        elif kind == GOAWAY:
            self.peer_goaway = True
            self._maybe_close()
        elif kind == PUSH_PROMISE:
            self._connection_error(PROTOCOL_ERROR, "a client cannot push")
        elif kind == PRIORITY and (len(payload) != 5 or not stream_id):
            self._connection_error(PROTOCOL_ERROR, "bad PRIORITY")
        # unknown frame types are ignored (RFC 9113 5.5)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id or len(payload) % 6:
            self._connection_error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "bad SETTINGS")
            return
        if flags & ACK:
            return
        window = self.peer_initial_window
        for key, value in struct.iter_unpack(">HI", payload):
            if key == 0x4:  # INITIAL_WINDOW_SIZE: applies to every stream's send window (once, below)
                if value > 0x7FFFFFFF:
                    self._connection_error(FLOW_CONTROL_ERROR, "window too large")
                    return
                window = value
            elif key == 0x5:
                if not 16384 <= value <= 16777215:
                    self._connection_error(PROTOCOL_ERROR, "bad MAX_FRAME_SIZE")
                    return
                self.peer_max_frame = value
            elif key == 0x2 and value > 1:
                self._connection_error(PROTOCOL_ERROR, "bad ENABLE_PUSH")
                return
        if window + self.most_window > 0x7FFFFFFF:  # a stream's window may pass 2^31-1: look (seldom)
            self.most_window = max((s.send_window for s in self.streams.values()), default=0)
            if window + self.most_window > 0x7FFFFFFF:
                self._connection_error(FLOW_CONTROL_ERROR, "a stream's window over 2^31-1")
                return
        self.peer_initial_window = window  # every stream's window moves with it: no walk of the streams
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_all()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._connection_error(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
            return
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                self._connection_error(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
                return
            self.send_window += increment
            if self.send_window > 0x7FFFFFFF:
                self._connection_error(FLOW_CONTROL_ERROR, "window over 2^31-1")
                return
            self._flush_all()
            return
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream.send_window += increment
            self.most_window = max(self.most_window, stream.send_window)
            if not increment or stream.send_window + self.peer_initial_window > 0x7FFFFFFF:  # RFC 9113 6.9, 6.9.1
                self._write(frame(RST_STREAM, 0, stream_id,
                                  struct.pack(">I", FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR)))
                del self.streams[stream_id]
                self._cancel(stream)
                self._maybe_close()
            elif stream.pending:
                self._flush(stream)

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        start, end = 0, len(payload)
        if flags & PADDED:
            if not payload:
                self._connection_error(PROTOCOL_ERROR, "bad padding")
                return
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end or not stream_id:
            self._connection_error(PROTOCOL_ERROR, "bad HEADERS")
            return
        if end - start > MAX_HEADER_BLOCK:
            self._connection_error(ENHANCE_YOUR_CALM, "header block too large")
            return
        block = payload[start:end]
        if flags & END_HEADERS:
            self._header_block(stream_id, flags, block)
        else:
            self.continuing = (stream_id, flags, [block])
            self.block_began = self.loop.time()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self.continuing is None or self.continuing[0] != stream_id:
            self._connection_error(PROTOCOL_ERROR, "unexpected CONTINUATION")
            return
        _, first_flags, fragments = self.continuing
        fragments.append(payload)
        if len(fragments) > MAX_CONTINUATIONS or sum(map(len, fragments)) > MAX_HEADER_BLOCK:
            self._connection_error(ENHANCE_YOUR_CALM, "header block too large")
            return
        if flags & END_HEADERS:
            self.continuing = None
            self._header_block(stream_id, first_flags, b"".join(fragments))

    def _header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        headers = self.decoder.decode(block)  # always: the table must follow the peer's
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers of a request: they only end it
            if not flags & END_STREAM:
                self._connection_error(PROTOCOL_ERROR, "trailers without END_STREAM")
                return
            if stream.remote_closed:
                self._connection_error(STREAM_CLOSED, f"HEADERS after END_STREAM on stream {stream_id}")
                return
            self._end_of_request(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self.last_stream:
            if stream_id % 2 == 0 or stream_id > self.last_stream:
                self._connection_error(PROTOCOL_ERROR, f"stream {stream_id} cannot be opened")
            return  # a stream we closed: nothing to do
        if self.goaway_sent:
            return  # above the last stream our GOAWAY announced: the client retries it elsewhere
        self.last_stream = stream_id
        if len(self.streams) >= MAX_STREAMS:
            self._write(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
            return
        stream = _Stream(stream_id, 0)
        self.streams[stream_id] = stream
        self.server.calls += 1
        if flags & END_STREAM:
            stream.remote_closed = True
        else:  # its message is still to come: the sweep watches it until it is whole
            stream.heard = self.loop.time()
            if self.reads is None:
                self.reads = self.loop.call_later(REQUEST_IDLE_TIMEOUT, self._reads_due)
        prepared = self._prepared.get(block)
        if prepared is not None and prepared[0] is headers:  # the decoder's cached answer: split already
            _, stream.headers, meta, size = prepared
            stream.metadata = dict(meta)
        else:
            pseudo, meta, size = _split(headers)
            stream.headers, stream.metadata = pseudo, dict(meta)
            if len(block) <= 256:  # what the decoder caches (larger blocks would only be held)
                if len(self._prepared) >= 64:
                    self._prepared.clear()
                self._prepared[block] = (headers, pseudo, meta, size)
        pseudo, meta = stream.headers, stream.metadata
        path = pseudo.get(":path", "")
        if size > MAX_METADATA:
            self._answer_error(stream, RESOURCE_EXHAUSTED, f"metadata of {size} bytes is over the limit of "
                                                           f"{MAX_METADATA} bytes")
        elif pseudo.get(":method") != "POST" or not meta.get("content-type", "").startswith("application/grpc"):
            self._answer_http(stream, 415 if pseudo.get(":method") == "POST" else 405)
        else:
            stream.handler = self.server.handlers.get(path)
            if stream.handler is None:
                self._answer_error(stream, UNIMPLEMENTED, f"method {path!r} is not implemented")
            else:
                timeout = meta.get("grpc-timeout")
                if timeout:
                    self._deadline(stream, timeout)
        if flags & END_STREAM and not stream.answered:
            self._end_of_request(stream)

    def _deadline(self, stream: _Stream, text: str) -> None:
        unit = _TIMEOUT_UNITS.get(text[-1:])
        # ASCII digits: str.isdigit() alone takes '²' too, and int() refusing it raised out of data_received
        if unit is None or not text[:-1].isascii() or not text[:-1].isdigit() or len(text) > 9:
            self._answer_error(stream, INTERNAL, f"grpc-timeout: {text!r} is not a timeout")
            return
        seconds = int(text[:-1]) * unit
        stream.timer = self.loop.call_later(seconds, self._expired, stream)

    def _expired(self, stream: _Stream) -> None:
        stream.timer = None
        if not stream.answered and self.streams.get(stream.id) is stream:
            if stream.task is not None:
                stream.task.cancel()
                stream.task = None
            self._answer_error(stream, DEADLINE_EXCEEDED, "deadline exceeded")

    def _reads_due(self) -> None:
        """Answer each call whose request has had no bytes for ``REQUEST_IDLE_TIMEOUT`` (its stream,
        its held bytes and its window let go: ``_done`` resets a stream the client still sends on);
        look again when the next one would be due. One timer per connection, not one per call. Not
        while reading is paused (a peer not reading its answers), nor counting the time it was."""
        self.reads = None
        if self.closed:
            return
        now, due = self.loop.time(), None
        if self.reading_paused:  # we are not reading what it sends: no request is stalled by the client
            self.reads = self.loop.call_later(REQUEST_IDLE_TIMEOUT, self._reads_due)
            return
        for stream in list(self.streams.values()):
            if stream.remote_closed or stream.answered:
                continue
            at = max(stream.heard, self.resumed) + REQUEST_IDLE_TIMEOUT
            if at <= now:
                self._answer_error(stream, DEADLINE_EXCEEDED, f"the request had no data for "
                                                              f"{REQUEST_IDLE_TIMEOUT:g} s: the server let it go")
            elif due is None or at < due:
                due = at
        if due is not None:
            self.reads = self.loop.call_later(due - now, self._reads_due)

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        length = len(payload)
        if not stream_id:
            self._connection_error(PROTOCOL_ERROR, "DATA on stream 0")
            return
        self.unacked += length
        if self.unacked >= CONNECTION_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacked)))
            self.unacked = 0
        stream = self.streams.get(stream_id)
        if stream is None:
            if stream_id > self.last_stream:
                self._connection_error(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
            return  # a stream already answered and closed: dropped, counted above
        if stream.remote_closed:
            self._connection_error(PROTOCOL_ERROR, f"DATA after END_STREAM on stream {stream_id}")
            return
        if flags & PADDED:
            if not payload or payload[0] >= length:
                self._connection_error(PROTOCOL_ERROR, "bad padding")
                return
            payload = payload[1:length - payload[0]]
        if not stream.answered and payload:
            stream.chunks.append(payload)
            stream.size += len(payload)
            self.buffered += len(payload)
            if self.buffered > MAX_BUFFERED and self.buffered > 2 * self.server.max_message():
                self._answer_error(stream, RESOURCE_EXHAUSTED, "too many request bytes held on this connection")
                return
            if stream.expected < 0 and stream.size >= 5:
                self._prefix(stream)
            if 0 <= stream.expected < stream.size - 5 and not stream.answered:
                self._answer_error(stream, UNIMPLEMENTED, "a unary call carries one request message, got more")
        if flags & END_STREAM:
            stream.remote_closed = True
            if not stream.answered:
                self._end_of_request(stream)
            elif self.streams.get(stream_id) is stream and stream.pending is None:
                self._forget(stream)
        elif not stream.answered:
            if payload:  # bytes of its message (not an empty or padding-only frame): it is still coming
                stream.heard = self.loop.time()
            stream.unacked += length
            if stream.unacked >= STREAM_WINDOW // 2:
                self._write(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", stream.unacked)))
                stream.unacked = 0

    def _prefix(self, stream: _Stream) -> None:
        head = b"".join(stream.chunks)[:5]
        stream.expected = int.from_bytes(head[1:5], "big")
        limit = self.server.max_message()
        if stream.expected > limit:
            self._answer_error(stream, RESOURCE_EXHAUSTED,
                               f"body of {stream.expected} bytes is over the limit of {limit} bytes")

    def _end_of_request(self, stream: _Stream) -> None:
        stream.remote_closed = True
        if stream.answered:
            return
        if stream.size < 5 or stream.size - 5 != stream.expected:
            self._answer_error(stream, INTERNAL, "the call carries no complete request message")
            return
        data = stream.chunks[0] if len(stream.chunks) == 1 else b"".join(stream.chunks)
        stream.chunks = []
        self.buffered -= stream.size
        compressed = data[0]
        message = data[5:]
        if compressed:
            try:
                message = self._decompress(stream, message)
            except GrpcError as exc:
                self._answer_error(stream, exc.code, exc.message)
                return
        assert stream.handler is not None
        done, task = eager.start(self.loop, self._call(stream, stream.handler, message))
        if not done:  # it waits (a batcher, a version loading again): cancelled if the call is reset
            stream.task = task

    def _decompress(self, stream: _Stream, message: bytes) -> bytes:
        encoding = stream.metadata.get("grpc-encoding", "identity")
        if encoding not in ("gzip", "deflate"):
            raise GrpcError(UNIMPLEMENTED if encoding != "identity" else INTERNAL,
                            f"compressed message with grpc-encoding {encoding!r}; valid: gzip, deflate")
        limit = self.server.max_message()
        inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            out = inflater.decompress(message, limit + 1)
        except zlib.error as exc:
            raise GrpcError(INTERNAL, f"cannot decompress the message ({encoding}): {exc}") from None
        if len(out) > limit or inflater.unconsumed_tail:
            raise GrpcError(RESOURCE_EXHAUSTED, f"body of more than {limit} bytes once decompressed is over "
                                                f"the limit of {limit} bytes")
        return out

    # -- answering -------------------------------------------------------------------------------

    async def _call(self, stream: _Stream, handler: Handler, message: bytes) -> None:
        try:
            reply, trailers = await handler(message, stream.metadata)
            block = _ok_block(trailers)
        except GrpcError as exc:
            self._answer_error(stream, exc.code, exc.message, exc.trailers)
            return
        except asyncio.CancelledError:
            return  # the client reset the call, or its deadline passed (answered by _expired)
        except Exception as exc:  # a bug costs one call, never the connection
            log.exception("gRPC call %s failed", stream.headers.get(":path"))
            self._answer_error(stream, UNKNOWN, f"internal error: {type(exc).__name__}: {exc}")
            return
        finally:
            stream.task = None
        self._answer(stream, reply, block)

    def _answer(self, stream: _Stream, reply: bytes, trailer_block: bytes) -> None:
        if stream.answered or self.streams.get(stream.id) is not stream:
            return
        stream.answered = True
        self._stop_timer(stream)
        n = len(reply)
        sid = stream.id
        d = n + 5  # the DATA frame: the message and its prefix
        if d <= min(self.send_window, stream.send_window + self.peer_initial_window, self.peer_max_frame):
            self.send_window -= d
            stream.send_window -= d
            t = len(trailer_block)
            # HEADERS, DATA (its head and the message's prefix packed at once), trailers: one write
            self._write(b"".join((_FRAME_HEAD.pack(0, len(_RESPONSE_HEADERS), HEADERS, END_HEADERS, sid),
                                  _RESPONSE_HEADERS, _DATA_HEAD.pack(d >> 16, d & 0xFFFF, DATA, 0, sid, 0, n), reply,
                                  _FRAME_HEAD.pack(t >> 16, t & 0xFFFF, HEADERS, END_STREAM | END_HEADERS, sid),
                                  trailer_block)))
            self._done(stream)
            return
        self._write(frame(HEADERS, END_HEADERS, sid, _RESPONSE_HEADERS))
        stream.pending = bytearray(struct.pack(">BI", 0, n) + reply)
        stream.trailers = trailer_block
        self.waiting[sid] = stream
        self._flush(stream)

    def _answer_error(self, stream: _Stream, code: int, message: str,
                      trailers: tuple[tuple[str, str], ...] = ()) -> None:
        """A trailers-only response (gRPC's way to fail a call before any message)."""
        if stream.answered or self.streams.get(stream.id) is not stream:
            return
        stream.answered = True
        self._stop_timer(stream)
        self._write(frame(HEADERS, END_STREAM | END_HEADERS, stream.id,
                          _RESPONSE_HEADERS + _status_block(code, message, trailers)))
        self._done(stream)

    def _answer_http(self, stream: _Stream, status: int) -> None:
        stream.answered = True
        block = hpack.encode_indexed_name(8, str(status))  # :status (its name from the static table)
        self._write(frame(HEADERS, END_STREAM | END_HEADERS, stream.id, block))
        self._done(stream)

    def _flush(self, stream: _Stream) -> None:
        pending = stream.pending
        if pending is None:
            return
        out = []
        while pending:
            n = min(len(pending), self.send_window, stream.send_window + self.peer_initial_window, self.peer_max_frame)
            if n <= 0:
                break
            out.append(frame(DATA, 0, stream.id, bytes(pending[:n])))
            del pending[:n]
            self.send_window -= n
            stream.send_window -= n
        if not pending:
            out.append(frame(HEADERS, END_STREAM | END_HEADERS, stream.id, stream.trailers))
            stream.pending = None
            self.waiting.pop(stream.id, None)
        self._write(b"".join(out))
        if stream.pending is None:
            self._done(stream)

    def _flush_all(self) -> None:
        for stream in list(self.waiting.values()):
            if self.send_window <= 0:
                return
            self._flush(stream)

    def _done(self, stream: _Stream) -> None:
        """Our side of the call ended: close it (or tell a client still sending to stop)."""
        if not stream.remote_closed:
            self._write(frame(RST_STREAM, 0, stream.id, struct.pack(">I", NO_ERROR)))
        self._forget(stream)

    def _forget(self, stream: _Stream) -> None:
        if self.streams.get(stream.id) is stream:
            del self.streams[stream.id]
        if stream.chunks:  # a request that never reached its handler
            self.buffered -= stream.size
            stream.chunks = []
        self._maybe_close()

    def _maybe_close(self) -> None:
        if not self.streams and (self.goaway_sent or self.peer_goaway):
            if not self.goaway_sent:
                self.goaway(NO_ERROR)
            self._close()
            self.server._connection_closed()

    def _stop_timer(self, stream: _Stream) -> None:
        if stream.timer is not None:
            stream.timer.cancel()
            stream.timer = None

    def _cancel(self, stream: _Stream) -> None:
        self._stop_timer(stream)
        if stream.pending is not None:
            self.waiting.pop(stream.id, None)
        if stream.chunks:
            self.buffered -= stream.size
            stream.chunks = []
        if stream.task is not None:
            stream.task.cancel()
            stream.task = None


class GrpcServer:
    """Unary gRPC ``handlers`` (by path, ``/package.Service/Method``) served on the running loop."""

    def __init__(self, handlers: Mapping[str, Handler], max_message: Callable[[], int]) -> None:
        self.handlers = dict(handlers)
        self.max_message = max_message  # the request message limit, read at every call
        self.loop = asyncio.get_running_loop()
        self.connections: set[H2Connection] = set()
        self.servers: list[asyncio.AbstractServer] = []
        self.bound_port = 0
        self.draining = False
        self.calls = 0  # calls received, over every connection (per process)
        self._idle = asyncio.Event()

    async def bind(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen on ``host:port`` (every address it resolves to, on one port); raises OSError when
        the port is taken."""
        infos = await self.loop.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        both = len({info[0] for info in infos}) > 1  # IPv4 and IPv6: each socket takes its own family only
        seen = set()
        for family, kind, proto, _, address in infos:
            if (family, address[0]) in seen:
                continue
            seen.add((family, address[0]))
            sock = socket.socket(family, kind, proto)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and both:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind((address[0], self.bound_port or port, *address[2:]))
                sock.listen(backlog)
            except OSError:
                sock.close()
                self.close()
                raise
            self.bound_port = sock.getsockname()[1]
            self.servers.append(await self.loop.create_server(self.connection, sock=sock))
        return self.bound_port

    def connection(self) -> H2Connection:
        """The protocol for a new connection: one this server listens for, or one accepted elsewhere
        (``serve --workers``: the supervisor accepts and deals them out; a worker serves each with
        ``loop.connect_accepted_socket``). One that comes while draining is sent GOAWAY."""
        return H2Connection(self)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    def drain(self) -> None:
        """No new connections or calls: GOAWAY every connection (each closes once its running calls
        are answered; its client reconnects, elsewhere)."""
        self.draining = True
        self.close()
        for conn in list(self.connections):
            conn.goaway(NO_ERROR)

    async def stop(self, grace: float | None = 10.0) -> None:
        """Stop taking connections, GOAWAY every one (no new calls), let running calls finish for
        up to ``grace`` seconds, then close what is left."""
        self._idle.clear()
        self.drain()
        if grace and any(c.streams for c in self.connections):
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        for conn in list(self.connections):
            conn._close()
        for server in self.servers:
            await server.wait_closed()

    def _connection_closed(self) -> None:
        if not any(c.streams for c in self.connections if not c.closed):
            self._idle.set()
