"""The inference hot path: infer requests answered without FastAPI, and mostly without ASGI.

Profiling (py-spy, c=32) showed FastAPI/Starlette's middleware stack, exception wrappers and
dependency solving taking about a third of the event loop's time per inference request, more
than the data plane itself. ``POST /v2/models/{m}[/versions/{v}]/infer`` is therefore answered
by ``InferFastPath``, straight from ASGI; every other route (health, metadata, metrics, the
OpenAPI document, which still describes the infer routes) goes to the FastAPI app.

uvicorn's request cycle then still cost ~45 µs of a ~180 µs request, so a plain infer request
is answered below ASGI, by ``InferProtocol`` (uvicorn's own HTTP protocol, extended), in one
write; the ASGI path answers the rest (see below) and any server other than uvicorn's httptools.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from . import eager
from .binary import RESPONSE_HEADER
from .dataplane import VERSION_HEADER, DataPlane, InferResult
from .errors import InferenceError
from .grpc_h2 import FRAME_TIMEOUT, REQUEST_IDLE_TIMEOUT
from .rest import body_too_large, declared_too_large, read_body

JSON = b"application/json"
OCTETS = b"application/octet-stream"


def _route(path: str) -> tuple[str, str | None] | None:
    parts = path.split("/")
    # ['', 'v2', 'models', m, 'infer'] or ['', 'v2', 'models', m, 'versions', v, 'infer']
    if len(parts) == 5 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "infer" and parts[3]:
        return parts[3], None
    if (len(parts) == 7 and parts[1] == "v2" and parts[2] == "models" and parts[4] == "versions"
            and parts[6] == "infer" and parts[3] and parts[5]):
        return parts[3], parts[5]
    return None


class InferFastPath:
    def __init__(self, app: Any, dataplane: DataPlane) -> None:
        self.app = app
        self.dataplane = dataplane
        # Set when this worker is being retired: every response says `Connection: close`, so
        # clients move to another worker between requests instead of losing one to a close.
        self.draining = False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self.draining and scope["type"] == "http":
            send = _closing(send)
        if scope["type"] == "http" and scope["method"] == "POST":
            target = _route(scope["path"])
            if target is not None:
                await self._infer(scope, receive, send, *target)
                return
        await self.app(scope, receive, send)

    async def _infer(self, scope: dict[str, Any], receive: Any, send: Any, model: str, version: str | None) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        limit = self.dataplane.registry.snapshot.config.server.max_body_bytes
        try:
            body = await read_body(headers, receive, limit)
        except InferenceError as exc:
            await _send(send, exc.status_code, _error(exc.message), JSON)
            return
        if body is None:
            return
        result = await self.dataplane.infer(model, version, body, headers)
        extra = [(VERSION_HEADER.lower().encode(), result.version.encode())] if result.version else []
        if result.json_length is not None:
            extra.append((RESPONSE_HEADER.lower().encode(), str(result.json_length).encode()))
            await _send(send, result.status, result.body, OCTETS, extra)
        else:
            await _send(send, result.status, result.body, JSON, extra)


def _closing(send: Any) -> Any:
    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
        await send(message)

    return wrapped


def _error(message: str) -> bytes:
    return orjson.dumps({"error": message})


async def _send(send: Any, status: int, body: bytes, content_type: bytes,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# -- the infer path without ASGI --------------------------------------------------------------------
#
# Under wrk at c=32, uvicorn's request cycle (the scope, an asyncio.Event and a Task per request,
# the receive/send messages, header checks) cost ~40-45 µs of a ~170 µs request. InferProtocol is
# uvicorn's own httptools protocol, and takes over only a plain infer request: POST to an infer
# route, no query or percent-escape, no `Expect: 100-continue`, not pipelined behind a response
# still being written, not while the client leaves its answers unread. Its body is gathered from the parser's callbacks and the data plane is run
# right there in `data_received`: a request that completes without waiting (the usual one: the
# forward runs on the loop) is answered in the same callback, in one write; one that waits (a
# batcher, a version loading again) carries on in a Task (``eager``). Everything else, and every
# other route, goes through uvicorn to the ASGI apps above as before; keep-alive, the idle timeout,
# pipelining, flow control and graceful shutdown stay uvicorn's (the cycle has the attributes it reads).

try:
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools missing: uvicorn's choice of protocol stands
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)


class _NoEvent:
    """What uvicorn's connection_lost sets on the current cycle (nobody waits on ours)."""

    @staticmethod
    def set() -> None:
        return None


_NO_EVENT = _NoEvent()
_DEFAULT_HEADERS: list[Any] = [None, b""]  # (uvicorn's default header list, its encoding): it changes every second


def _default_headers(listed: list[tuple[bytes, bytes]]) -> bytes:
    if _DEFAULT_HEADERS[0] is not listed:
        _DEFAULT_HEADERS[1] = b"".join(name + b": " + value + b"\r\n" for name, value in listed)
        _DEFAULT_HEADERS[0] = listed
    return _DEFAULT_HEADERS[1]


def _raw_route(url: bytes) -> tuple[str, str | None] | None:
    if not url.startswith(b"/v2/models/") or b"%" in url or b"?" in url or b"#" in url:
        return None
    try:
        return _route(url.decode("ascii"))
    except UnicodeDecodeError:
        return None


class _InferCycle:
    """One infer request on an InferProtocol connection."""

    __slots__ = ("protocol", "transport", "model", "version", "headers", "keep_alive", "limit",
                 "chunks", "size", "response_complete", "disconnected", "message_event")

    def __init__(self, protocol: InferProtocol, model: str, version: str | None, keep_alive: bool) -> None:
        self.protocol = protocol
        self.transport = protocol.transport
        self.model = model
        self.version = version
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in protocol.headers}
        self.keep_alive = keep_alive
        self.limit = protocol.fast.dataplane.registry.snapshot.config.server.max_body_bytes
        self.chunks: list[bytes] = []
        self.size = 0
        self.response_complete = False
        self.disconnected = False
        self.message_event = _NO_EVENT

    def body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            self.refuse(body_too_large(self.limit))
        else:
            self.chunks.append(data)

    def refuse(self, exc: InferenceError) -> None:
        self.chunks = []
        self.write(exc.status_code, _error(exc.message), JSON, b"")

    def run(self) -> None:
        chunks = self.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        protocol = self.protocol
        # Pipelined behind a request of the same read: not grouped (batching.Grouper), as the ones
        # behind a request that waits would go through ASGI (in order, but slower).
        pipelined, protocol.ran_in_read = protocol.ran_in_read, True
        try:
            done, value = eager.start(protocol.loop, protocol.fast.dataplane.infer(
                self.model, self.version, body, self.headers, at_once=pipelined))
        except Exception:  # the data plane answers every error itself: this is a bug, and costs one request
            log.exception("inference failed unexpectedly")
            self.write(500, _error("internal error"), JSON, b"")
            return
        if done:
            self.answer(value)
            return
        task = value
        tasks = self.protocol.tasks  # uvicorn's graceful shutdown waits for these
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        task.add_done_callback(self.finished)

    def finished(self, task: asyncio.Task[Any]) -> None:
        if task.cancelled():
            self.write(503, _error("the server is shutting down"), JSON, b"")
        elif task.exception() is not None:
            log.error("inference failed unexpectedly", exc_info=task.exception())
            self.write(500, _error("internal error"), JSON, b"")
        else:
            self.answer(task.result())

    def answer(self, result: InferResult) -> None:
        extra = b"x-model-version: " + result.version.encode() + b"\r\n" if result.version else b""
        if result.json_length is not None:
            extra += b"inference-header-content-length: " + str(result.json_length).encode() + b"\r\n"
            self.write(result.status, result.body, OCTETS, extra)
        else:
            self.write(result.status, result.body, JSON, extra)

    def write(self, status: int, body: bytes, content_type: bytes, extra: bytes) -> None:
        if self.response_complete:
            return
        self.response_complete = True
        if self.disconnected:
            return
        keep_alive = self.keep_alive and not self.protocol.fast.draining
        self.transport.write(b"".join((
            STATUS_LINE[status], _default_headers(self.protocol.server_state.default_headers),
            b"content-type: ", content_type, b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n", extra,
            b"\r\n" if keep_alive else b"connection: close\r\n\r\n", body)))
        if not keep_alive:
            self.transport.close()
        self.protocol.on_response_complete()


if HttpToolsProtocol is not None:
    class InferProtocol(HttpToolsProtocol):  # type: ignore[misc,valid-type]
        """uvicorn's httptools protocol, answering plain infer requests itself (see above)."""

        fast: InferFastPath  # set on the class made for a runtime by ``protocol_for``
        _idle_since: float | None = None  # when the last answer completed with nothing after it
        ran_in_read = False  # an infer request of the data being read was run already
        # Slow clients (slow loris), as the gRPC port bounds them (grpc_h2): a request's line and
        # headers must all arrive within `headers_timeout` of its first byte (a connection's first
        # request, of the connection), and its body may go `body_timeout` without a byte; else it
        # is answered 408 and the connection closed (a new connection that sent nothing is closed).
        # uvicorn bounds neither: a client trickling a byte now and then held its connection forever.
        headers_timeout = FRAME_TIMEOUT
        body_timeout = REQUEST_IDLE_TIMEOUT
        # A request's line and headers may come to `max_head_bytes` in all; beyond, it is answered 431
        # and the connection closed. uvicorn and httptools bound neither: a 128 MiB header was served
        # (the worker grew by 260 MB), and connections each holding an unfinished 32 MiB one added up.
        # 64 KiB: whatever a proxy in front lets through fits (nginx's large_client_header_buffers is
        # 4 x 8 KB, Envoy's max_request_headers_kb 60 KiB), and gRPC's metadata is held to 16 KiB.
        # Counted at the cost of a few attribute reads per request: the reads a head is still
        # incomplete after are all of it (one begun mid-read is counted from the next read: at most
        # one read, 256 KB, more), and a complete head is measured only when the reads it came in
        # were over the limit.
        max_head_bytes = 64 << 10
        _reading = 0  # 1: a request's line and headers are being read, 2: its body, 0: neither
        _heard = 0.0  # loop time of the last read
        _began = 0.0  # loop time of the read the request being read began in
        _due = 0.0  # when the timer fires (while it is armed)
        _got = 0  # bytes of the read under way
        _head = 0  # bytes of the reads since the request being read began (the one it began in included)
        _head_first = 0  # bytes of the read it began in
        _refused = False  # a head over the limit came behind an answer under way: the connection ends with it
        # The cycle whose answer is under way while newer ones (pipelined) hold self.cycle: uvicorn's
        # connection_lost tells only self.cycle that its client is gone, so the one answering wrote on
        # a closed transport (uvloop raises; asyncio's would ignore it). Common with --workers: the
        # supervisor hands over connections in batches, their requests already read, so all but the
        # first connection's first request wait for their turn (batching.Grouper), and a client that
        # pipelines and closes left a RuntimeError traceback per connection.
        _front: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._heard = self._began = self.loop.time()
            self._reading = 1  # its first request is due
            self._arm(self._began + self.headers_timeout)

        def data_received(self, data: bytes) -> None:
            self.ran_in_read = False
            self._heard = self.loop.time()
            self._got = len(data)
            if self._reading == 1:  # a head incomplete after the last read: this one holds more of it
                self._head += self._got
            super().data_received(data)
            if self._reading == 1 and self._head - self._head_first > self.max_head_bytes:
                self._head_too_large()  # still incomplete, over the limit in the reads after its first

        # The keep-alive timeout, without a timer per request. uvicorn cancels its timer when data
        # arrives and starts a new one after each answer: a uvloop timer made and torn down per
        # request (~3-8 µs of a ~75 µs request in process). Here one timer stays armed; activity
        # only marks the connection busy, answers note when it went idle, and the timer, when it
        # fires, closes the connection only if it has been idle the whole timeout since (else it
        # waits for the rest, or for the next answer to arm it again). Same rule as uvicorn's:
        # closed after `timeout_keep_alive` seconds with no data and no request under way. The same
        # timer times a request being read (headers_timeout, body_timeout above).

        def _unset_keepalive_if_required(self) -> None:
            self._idle_since = None  # data, or a request: not idle (the timer stays; it will see)

        def on_response_complete(self) -> None:
            # uvicorn's, but for the keep-alive timer (see above)
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self.flow.resume_reading()
            if self.pipeline:
                self._idle_since = None
                cycle, app = self.pipeline.pop()
                self._front = cycle
                self._start_asgi_task(cycle, app)
                return
            idle = self._idle_since = self.loop.time()
            at = idle + self.timeout_keep_alive
            if self.timeout_keep_alive_task is None or self._due > at:
                self._arm(at)

        def connection_lost(self, exc: Exception | None) -> None:
            front = self._front
            if front is not None and not front.response_complete:  # see _front
                front.disconnected = True
                front.message_event.set()
            super().connection_lost(exc)
            if self.timeout_keep_alive_task is not None:  # not left to fire for a closed connection
                self.timeout_keep_alive_task.cancel()
                self.timeout_keep_alive_task = None

        def _arm(self, at: float) -> None:
            """The timer fires at loop time ``at`` (and not later, if it was to fire later)."""
            if self.timeout_keep_alive_task is not None:
                self.timeout_keep_alive_task.cancel()
            self._due = at
            self.timeout_keep_alive_task = self.loop.call_at(at, self._keep_alive_due)

        def _keep_alive_due(self) -> None:
            self.timeout_keep_alive_task = None
            if self.transport.is_closing():
                return
            now = self.loop.time()
            if self._reading == 1:
                left = self._began + self.headers_timeout - now
            elif self._reading == 2:
                if self.flow.read_paused:  # we stopped reading (its answers or its body are not
                    self._heard = now  # being taken): the client's silence is not its own
                left = self._heard + self.body_timeout - now
            elif self._idle_since is None:
                return  # busy: the answer under way arms the timer again
            else:
                left = self._idle_since + self.timeout_keep_alive - now
            if left > 0:
                self._arm(now + left)
            elif self._reading:
                self._read_timed_out()
            else:
                self.timeout_keep_alive_handler()

        def _read_timed_out(self) -> None:
            """Answer 408 to a request that did not arrive in time (see headers_timeout) and close."""
            if self.scope is None:  # a new connection that sent nothing: there is nothing to answer
                self.transport.close()
                return
            if self._reading == 1:
                message = f"the request's headers did not all arrive within {self.headers_timeout:g} s"
            else:
                message = f"the request's body had no data for {self.body_timeout:g} s"
            log.debug("HTTP request timed out: %s", message)
            reading, self._reading = self._reading, 0
            cycle = self.cycle
            busy = cycle is not None and not cycle.response_complete
            if reading == 1 and busy:  # the answer before it is still under way: closed after it
                cycle.keep_alive = False
                return
            if reading == 2 and not busy:  # answered already (refused before its body came)
                self.transport.close()
                return
            if reading == 2 and type(cycle) is _InferCycle:  # its body stalled
                cycle.chunks, cycle.keep_alive = [], False
                cycle.write(408, _error(message), JSON, b"")
                return
            if reading == 2 and getattr(cycle, "response_started", False):
                self.transport.close()  # an ASGI app answering before its body came: it cannot be told
                return
            self._refuse(408, message)  # an ASGI app waiting for the body is told the client went away

        def _head_too_large(self) -> None:
            """Refuse the request being read, its line and headers over ``max_head_bytes``: 431 and
            close; with an answer still under way, close after it instead (as for a late head)."""
            message = f"the request's line and headers are over the limit of {self.max_head_bytes} bytes"
            log.debug("HTTP request refused: %s", message)
            self._reading = 0
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False
                self._refused = True  # nothing after it is run (on_headers_complete), nor read: not
                self.transport.pause_reading()  # through uvicorn's flow control, which would resume
                self.flow.read_paused = False  # reading after the answer under way
            elif not self.transport.is_closing():
                self._refuse(431, message)

        def _refuse(self, status: int, message: str) -> None:
            """Answer the request being read ``status`` (``{"error": message}``) and close the connection."""
            body = _error(message)
            self.transport.write(b"".join((
                STATUS_LINE[status], _default_headers(self.server_state.default_headers),
                b"content-type: application/json\r\ncontent-length: ", str(len(body)).encode(),
                b"\r\nconnection: close\r\n\r\n", body)))
            self.transport.close()

        def on_message_begin(self) -> None:
            # A request read right after an answer written in this same data_received: the
            # connection is busy again, so the keep-alive timer must not close it meanwhile.
            self._unset_keepalive_if_required()
            self._reading, self._began = 1, self._heard
            self._head = self._head_first = self._got
            at = self._heard + self.headers_timeout
            if self.timeout_keep_alive_task is None or self._due > at:  # (none while an answer was under way)
                self._arm(at)
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._reading = 2
            cycle = self.cycle
            parser = self.parser
            if cycle is not None and not cycle.response_complete and not self.pipeline:
                self._front = cycle  # answering still, and about to be replaced as self.cycle (see _front)
            if self._refused or self.transport.is_closing():
                # An answer written in this same data_received closed the connection (draining, or
                # a request not kept alive), or a head over the limit ends it: what is pipelined
                # behind it is not run, as uvicorn runs none (it would be answered to nobody, yet
                # counted and fed to the shadow).
                self._skip_request()
                return
            if self._head > self.max_head_bytes and (  # the reads it came in are over: measure the head
                    len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers) > self.max_head_bytes):
                self._head_too_large()
                self._skip_request()
                return
            # Not while the client is not reading its answers (flow.write_paused): uvicorn's cycle
            # then waits for the socket to drain, and stops reading meanwhile.
            if ((cycle is None or cycle.response_complete) and parser.get_method() == b"POST"
                    and not self.expect_100_continue and self.limit_concurrency is None
                    and not self.flow.write_paused and not parser.should_upgrade()):
                target = _raw_route(self.url)
                if target is not None:
                    keep_alive = parser.get_http_version() != "1.0" and parser.should_keep_alive()
                    new = self.cycle = _InferCycle(self, target[0], target[1], keep_alive)  # type: ignore[assignment]
                    refused = declared_too_large(new.headers.get("content-length", ""), new.limit)
                    if refused is not None:
                        new.refuse(refused)
                    return
            super().on_headers_complete()

        def _skip_request(self) -> None:
            """The rest of the request being read (its body, in this read) goes to a cycle answered already."""
            done = self.cycle = _InferCycle(self, "", None, False)  # type: ignore[assignment]
            done.response_complete = True

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            if type(cycle) is not _InferCycle:
                super().on_body(body)
            elif not cycle.response_complete:
                cycle.body(body)

        def on_message_complete(self) -> None:
            self._reading = 0
            cycle = self.cycle
            if type(cycle) is not _InferCycle:
                super().on_message_complete()
            elif not cycle.response_complete:
                cycle.run()


# What InferProtocol reads or calls of uvicorn's protocol (set in __init__ or on_message_begin).
_UVICORN_NAMES = ("cycle", "parser", "url", "headers", "scope", "expect_100_continue", "limit_concurrency",
                  "server_state", "tasks", "loop", "transport", "flow", "on_response_complete",
                  "_unset_keepalive_if_required", "pipeline", "_start_asgi_task", "timeout_keep_alive",
                  "timeout_keep_alive_task", "timeout_keep_alive_handler", "connection_made")


def _uvicorn_fits() -> bool:
    if HttpToolsProtocol is None:
        return False
    used: set[str] = set()
    for name in ("__init__", "on_message_begin"):
        code = getattr(getattr(HttpToolsProtocol, name, None), "__code__", None)
        used.update(code.co_names if code is not None else ())
    return all(name in used or hasattr(HttpToolsProtocol, name) for name in _UVICORN_NAMES)


def protocol_for(fast: InferFastPath) -> type[asyncio.Protocol] | str:
    """The HTTP protocol class to give uvicorn for ``fast``'s runtime: InferProtocol bound to it,
    or "httptools" (the ASGI path for every request) when uvicorn's protocol is not the one
    InferProtocol was written against."""
    if not _uvicorn_fits():
        log.warning("uvicorn's httptools protocol is not the expected one: infer requests take the ASGI path")
        return "httptools"
    return type("InferProtocol", (InferProtocol,), {"fast": fast})
