"""Open Inference Protocol v2 over REST: thin handlers that translate HTTP <-> the data plane."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from mnn_rollout.contract.config import ADMIN_TOKEN_ENV, FEEDBACK_TOKEN_ENV

from .binary import RESPONSE_HEADER
from .codec import count
from .dataplane import VERSION_HEADER, DataPlane
from .errors import BadRequest, InferenceError, PayloadTooLarge
from .metrics import CONTENT_TYPE, RuntimeMetrics
from .profile import DEFAULT_TIMEOUT, MAX_RUNS, MAX_TIMEOUT, ProfileError, Profiler

JSON = "application/json"
T = TypeVar("T")

_TENSOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "datatype", "shape", "data"],
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string", "enum": ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8",
                                                  "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "data": {"type": "array", "description": "Flat (row-major) or nested like shape."},
    },
}
_INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {
            JSON: {
                "schema": {
                    "type": "object",
                    "required": ["inputs"],
                    "properties": {
                        "id": {"type": "string"},
                        "parameters": {"type": "object", "description": "user_id: the routing key."},
                        "inputs": {"type": "array", "items": _TENSOR_SCHEMA},
                        "outputs": {"type": "array", "items": {"type": "object",
                                                                "properties": {"name": {"type": "string"}}}},
                    },
                }
            }
        },
    },
    "responses": {
        "200": {"description": "Outputs; `model_version` and the X-Model-Version header name the version."},
        "400": {"description": "Bad request: `{\"error\": ...}` names the field and value."},
        "404": {"description": "Unknown model or version."},
        "413": {"description": "Body larger than the configured limit."},
        "503": {"description": "The version is not ready."},
    },
}


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> Response:
    return Response(content=body, status_code=status, media_type=JSON, headers=headers)


def _error(exc: InferenceError) -> Response:
    return _json(exc.status_code, orjson.dumps({"error": exc.message}))


def _obj(payload: dict[str, Any]) -> Response:
    return _json(200, orjson.dumps(payload))


def declared_too_large(declared: str, limit: int) -> PayloadTooLarge | None:
    """The 413 for a request whose Content-Length is over ``limit`` (refused before its body is read)."""
    size = count(declared)
    if size is not None and size > limit:
        return PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit} bytes")
    return None


def body_too_large(limit: int) -> PayloadTooLarge:
    """The 413 for a body found over ``limit`` while it is read (no Content-Length, or a wrong one)."""
    return PayloadTooLarge(f"body is over the limit of {limit} bytes")


async def read_body(headers: Mapping[str, str], receive: Any, limit: int) -> bytes | None:
    """The request body from ASGI ``receive``, refusing (413) anything over ``limit`` before
    reading it all; None when the client went away."""
    refused = declared_too_large(headers.get("content-length", ""), limit)
    if refused is not None:
        raise refused
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
        more = message.get("more_body", False)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _runs(text: str | None) -> int:
    """The ``runs`` query parameter: 1..MAX_RUNS, default 10."""
    if text is None:
        return 10
    runs = count(text)
    if runs is None or not 1 <= runs <= MAX_RUNS:
        raise BadRequest(f"runs: {text!r} must be a whole number from 1 to {MAX_RUNS}")
    return runs


def _timeout(text: str | None) -> int:
    """The ``timeout`` query parameter of a profile, seconds: 1..MAX_TIMEOUT, default DEFAULT_TIMEOUT."""
    if text is None:
        return DEFAULT_TIMEOUT
    seconds = count(text)
    if seconds is None or not 1 <= seconds <= MAX_TIMEOUT:
        raise BadRequest(f"timeout: {text!r} must be a whole number of seconds from 1 to {MAX_TIMEOUT}")
    return seconds


async def _unless_gone(request: Request, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Await ``work`` while the client stays; when it goes away (ASGI ``http.disconnect``), cancel
    the work and wait for it to wind up. (False, None) when the client left first."""
    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))
    if task.cancelled():
        return False, None
    return True, task.result()


class V2Endpoints:
    """One method per OIP v2 REST endpoint."""

    def __init__(self, dataplane: DataPlane, metrics: RuntimeMetrics, admin_token: str | None = None,
                 feedback_token: str | None = None, profiler: Profiler | None = None) -> None:
        self.dataplane = dataplane
        self.metrics = metrics
        self.admin_token = admin_token.encode() if admin_token is not None else None
        self.feedback_token = feedback_token.encode() if feedback_token is not None else None
        self.profiler = profiler or Profiler()

    async def live(self) -> Response:
        return _obj({"live": self.dataplane.live()})

    async def ready(self) -> Response:
        ready = self.dataplane.ready()
        return _json(200 if ready else 503, b'{"ready":true}' if ready else b'{"ready":false}')

    async def server_metadata(self) -> Response:
        return _obj(self.dataplane.server_metadata())

    async def model_metadata(self, model_name: str, version: str | None = None) -> Response:
        try:
            return _obj(self.dataplane.model_metadata(model_name, version))
        except InferenceError as exc:
            return _error(exc)

    async def model_ready(self, model_name: str, version: str | None = None) -> Response:
        try:
            ready = self.dataplane.model_ready(model_name, version)
        except InferenceError as exc:
            return _error(exc)
        return _obj({"name": model_name, "ready": ready}) if ready else _json(
            503, b'{"ready":false}'
        )

    async def model_status(self, model_name: str) -> Response:
        try:  # ``feedback``: whether this runtime takes feedback (it has a token)
            return _obj({**self.dataplane.model_status(model_name), "feedback": self.feedback_token is not None})
        except InferenceError as exc:
            return _error(exc)

    async def infer(self, request: Request, model_name: str, version: str | None = None) -> Response:
        limit = self.dataplane.registry.snapshot.config.server.max_body_bytes
        try:
            body = await read_body(request.headers, request.receive, limit)
        except InferenceError as exc:
            return _error(exc)
        if body is None:
            return Response(status_code=499)
        result = await self.dataplane.infer(model_name, version, body, request.headers)
        headers = {VERSION_HEADER: result.version} if result.version else {}
        if result.json_length is not None:
            headers[RESPONSE_HEADER] = str(result.json_length)
            return Response(content=result.body, status_code=result.status, headers=headers,
                            media_type="application/octet-stream")
        return _json(result.status, result.body, headers or None)

    async def profile(self, request: Request, model_name: str, version: str) -> Response:
        """Per-operator timing of a loaded version on its own session, in a child process stopped at
        ``timeout`` seconds or when the client goes away (an admin call: bearer token)."""
        refused = _gate(request, self.admin_token, "admin", "profiling", ADMIN_TOKEN_ENV)
        if refused is not None:
            return refused
        try:
            runs = _runs(request.query_params.get("runs"))
            timeout = _timeout(request.query_params.get("timeout"))
            model = self.dataplane.loaded_model(model_name, version)
            shapes = {spec.name: shape for spec, shape in zip(model.inputs, model.warm_shapes)}
            stayed, result = await _unless_gone(
                request, self.profiler.run(Path(model.path), model.sha256, runs, shapes, timeout))
            if not stayed or result is None:
                return Response(status_code=499)
        except InferenceError as exc:
            return _error(exc)
        except ProfileError as exc:
            return _json(500, orjson.dumps({"error": f"profiling version {version!r} failed: {exc}"}))
        return _obj(result.as_dict())

    async def feedback(self, request: Request, model_name: str) -> Response:
        """Outcomes of answered requests, counted per version (``feedback.py``), behind a bearer
        token: they decide rollouts and experiments, so a runtime without a token takes none."""
        refused = _gate(request, self.feedback_token, "feedback", "feedback", FEEDBACK_TOKEN_ENV)
        if refused is not None:
            return refused
        try:
            limit = self.dataplane.registry.snapshot.config.server.max_body_bytes
            body = await read_body(dict(request.headers), request.receive, limit)
            return _obj(self.dataplane.feedback(model_name, body or b""))
        except InferenceError as exc:
            return _error(exc)

    async def metrics_endpoint(self) -> Response:
        return Response(content=self.metrics.exposition(), media_type=CONTENT_TYPE)


def _gate(request: Request, token: bytes | None, realm: str, what: str, env: str) -> Response | None:
    """None when the runtime has the ``realm`` token (``--{realm}-token-file``, ``env``) and the
    request carries it; else 403 (no token: ``what`` is off, and how to turn it on) or the 401."""
    if token is None:
        return _json(403, orjson.dumps({"error": f"{what} is disabled: start the runtime with --{realm}-token-file "
                                                 f"PATH (or {env}; in a cluster, spec.runtime.{realm}.secretName)"}))
    return _unauthorized(request, token, realm)


def _unauthorized(request: Request, token: bytes, realm: str) -> Response | None:
    """None when the request carries ``Authorization: Bearer <token>``; else the 401 to answer."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token):
        return None
    challenge = f'Bearer realm="mnn-rollout {realm}"' + (', error="invalid_token"' if given else "")
    return _json(401, orjson.dumps({"error": f"a valid {realm} token is required: Authorization: Bearer TOKEN"}),
                 {"WWW-Authenticate": challenge})


def create_app(dataplane: DataPlane, metrics: RuntimeMetrics, admin_token: str | None = None,
               feedback_token: str | None = None, profiler: Profiler | None = None) -> FastAPI:
    """Build the app and register every route explicitly; ``admin_token`` enables the admin
    endpoints (profiling, by ``profiler``: the server stops it when it shuts down) for requests
    that carry it, ``feedback_token`` guards the feedback one."""
    app = FastAPI(title="mnn-rollout runtime", version="v2", docs_url=None, redoc_url=None)
    ep = V2Endpoints(dataplane, metrics, admin_token, feedback_token, profiler)
    app.add_api_route("/v2/health/live", ep.live, methods=["GET"])
    app.add_api_route("/v2/health/ready", ep.ready, methods=["GET"])
    app.add_api_route("/v2", ep.server_metadata, methods=["GET"])
    app.add_api_route("/v2/models/{model_name}", ep.model_metadata, methods=["GET"])
    app.add_api_route("/v2/models/{model_name}/versions/{version}", ep.model_metadata, methods=["GET"])
    app.add_api_route("/v2/models/{model_name}/ready", ep.model_ready, methods=["GET"])
    app.add_api_route("/v2/models/{model_name}/status", ep.model_status, methods=["GET"],
                      summary="mnn-rollout extension: state, reason and weight of every version")
    app.add_api_route("/v2/models/{model_name}/versions/{version}/ready", ep.model_ready, methods=["GET"])
    app.add_api_route("/v2/models/{model_name}/infer", ep.infer, methods=["POST"], openapi_extra=_INFER_OPENAPI)
    app.add_api_route(
        "/v2/models/{model_name}/versions/{version}/infer", ep.infer, methods=["POST"],
        openapi_extra=_INFER_OPENAPI,
    )
    app.add_api_route("/v2/models/{model_name}/versions/{version}/profile", ep.profile, methods=["GET"],
                      summary="mnn-rollout extension (admin, bearer token): per-operator timing of a version, "
                              "?runs=1..1000 (default 10), ?timeout=1..600 s (default 60; past it, 504)")
    app.add_api_route("/v2/models/{model_name}/feedback", ep.feedback, methods=["POST"],
                      summary="mnn-rollout extension: outcomes of answered requests, [{id, value}], counted per version")
    app.add_api_route("/metrics", ep.metrics_endpoint, methods=["GET"], include_in_schema=False)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
            return _json(400, orjson.dumps({"error": str(exc.errors())}))

    return app
