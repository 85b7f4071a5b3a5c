"""The inference hot path as a bare ASGI app in front of FastAPI.

Profiling (py-spy, c=32) showed FastAPI/Starlette's middleware stack, exception wrappers and
dependency solving taking about a third of the event loop's time per inference request, more
than the data plane itself. ``POST /v2/models/{m}[/versions/{v}]/infer`` is therefore answered
here, straight from ASGI; every other route (health, metadata, metrics, the OpenAPI document,
which still describes the infer routes) goes to the FastAPI app.

uvicorn writes a response's head and body with a write each: two syscalls and two TCP segments
(the client wakes up twice). An infer response served by uvicorn's httptools protocol goes out in
one write instead (``_send``).
"""

from __future__ import annotations

from typing import Any

import orjson

from .binary import RESPONSE_HEADER
from .dataplane import VERSION_HEADER, DataPlane
from .errors import InferenceError
from .rest import read_body

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


class _OneWrite:
    """Stands in for a uvicorn request cycle's transport while a response is sent: what is written
    is kept, and written at once (with a close asked for meanwhile) by ``finish``."""

    __slots__ = ("transport", "parts", "close_asked")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.parts: list[bytes] = []
        self.close_asked = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.close_asked = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def finish(self) -> None:
        if self.parts:
            self.transport.write(b"".join(self.parts))
        if self.close_asked:
            self.transport.close()


async def _send(send: Any, status: int, body: bytes, content_type: bytes,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    cycle: Any = getattr(send, "__self__", None)  # uvicorn's RequestResponseCycle (httptools or h11)
    real = getattr(cycle, "transport", None)
    if real is None or getattr(cycle, "response_started", True):
        await send(start)
        await send({"type": "http.response.body", "body": body})
        return
    shim = cycle.transport = _OneWrite(real)
    try:
        await send(start)
        await send({"type": "http.response.body", "body": body})
    finally:
        cycle.transport = real
        shim.finish()
