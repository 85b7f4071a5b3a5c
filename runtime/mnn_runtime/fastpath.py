"""The inference hot path as a bare ASGI app in front of FastAPI.

Profiling (py-spy, c=32) showed FastAPI/Starlette's middleware stack, exception wrappers and
dependency solving taking about a third of the event loop's time per inference request, more
than the data plane itself. ``POST /v2/models/{m}[/versions/{v}]/infer`` is therefore answered
here, straight from ASGI; every other route (health, metadata, metrics, the OpenAPI document,
which still describes the infer routes) goes to the FastAPI app.
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


async def _send(send: Any, status: int, body: bytes, content_type: bytes,
                extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode()), *(extra or [])]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
