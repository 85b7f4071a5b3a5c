"""Open Inference Protocol v2 over gRPC: a thin servicer that translates gRPC <-> the data plane.

``ModelInfer`` rebuilds each request as the body the REST binary extension accepts (a JSON header,
then the raw tensor bytes) and hands it to ``DataPlane.infer``, so validation, routing, pinning,
metrics and error texts are exactly the REST ones:

- ``raw_input_contents`` (what tritonclient sends) become binary tensors of that body;
- typed ``contents`` (``fp32_contents``, ``int_contents``, ...) become the tensor's JSON ``data``
  and are checked against its datatype like REST ``data`` is;
- the routing key is the gRPC metadata named like the routing header (``x-user-id``), else the
  request parameter (``user_id``); ``model_version`` in the request or ``x-model-version`` in the
  metadata pins a version;
- outputs come back in ``raw_output_contents``; ``model_version`` and the trailing metadata
  ``x-model-version`` (also on errors, once the version is known) name the version that served;
- REST statuses map to gRPC codes, with the REST message as the details.

The server refuses messages over the config's ``server.max_body_bytes`` (RESOURCE_EXHAUSTED): gRPC
enforces the limit in force at start, and ``ModelInfer`` re-checks against the current config, so
a lowered limit applies at once (a raised one applies from the next start).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
import numpy as np
import orjson

from . import binary as binary_ext
from .codec import OIP_DTYPES
from .dataplane import PIN_HEADER, DataPlane, InferResult
from .errors import InferenceError
from .grpc_v2 import grpc_predict_v2_pb2 as pb
from .grpc_v2 import grpc_predict_v2_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

VERSION_METADATA = PIN_HEADER  # "x-model-version": gRPC metadata keys are lowercase

STATUS_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
}

# The typed field that carries each datatype's values (BYTES aside: no model takes strings).
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents", "UINT16": "uint_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}
NUMERIC_FIELDS = ("bool_contents", "int_contents", "int64_contents", "uint_contents", "uint64_contents",
                  "fp32_contents", "fp64_contents")


def _param_value(param: pb.InferParameter) -> Any:
    choice = param.WhichOneof("parameter_choice")
    return None if choice is None else getattr(param, choice)


def _contents_data(tensor: pb.ModelInferRequest.InferInputTensor) -> Any:
    """The tensor's values from its typed contents: the field for its datatype, else the first
    field holding any (checked against the datatype by the data plane, like REST ``data``)."""
    if not tensor.HasField("contents"):
        return []
    contents = tensor.contents
    preferred = CONTENTS_FIELD.get(tensor.datatype)
    fields = [preferred] if preferred else []
    fields += [f for f in NUMERIC_FIELDS if f != preferred]
    for field in fields:
        values = getattr(contents, field)
        if len(values):
            return values[:]  # a list: the fastest way out of a repeated field (float32 -> exact float)
    return []


def request_body(request: pb.ModelInferRequest) -> tuple[bytes, int | None]:
    """The REST body (JSON, then the binary part) for a gRPC request, and the JSON part's length
    when a binary part follows."""
    raw = request.raw_input_contents
    inputs = []
    for i, tensor in enumerate(request.inputs):
        obj: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
        if i < len(raw):
            obj["parameters"] = {"binary_data_size": len(raw[i])}
        else:
            obj["data"] = _contents_data(tensor)
        inputs.append(obj)
    params = {key: _param_value(value) for key, value in request.parameters.items()}
    params["binary_data_output"] = True  # outputs go back as raw_output_contents
    body: dict[str, Any] = {"inputs": inputs, "parameters": params}
    if request.outputs:
        body["outputs"] = [{"name": out.name} for out in request.outputs]
    if request.id:
        body["id"] = request.id
    head = orjson.dumps(body)
    if not raw:
        return head, None
    return head + b"".join(raw), len(head)


def infer_response(result: InferResult) -> pb.ModelInferResponse:
    """The gRPC response for a successful data plane result (JSON head + raw outputs)."""
    length = result.json_length if result.json_length is not None else len(result.body)
    head = orjson.loads(result.body[:length])
    response = pb.ModelInferResponse(model_name=head["model_name"], model_version=head["model_version"],
                                     id=head.get("id", ""))
    offset = length
    for tensor in head["outputs"]:
        response.outputs.add(name=tensor["name"], datatype=tensor["datatype"], shape=tensor["shape"])
        if "data" in tensor:  # not asked in binary (never, as sent): encode it here
            dtype = OIP_DTYPES[tensor["datatype"]].newbyteorder("<")
            response.raw_output_contents.append(np.asarray(tensor["data"], dtype=dtype).tobytes())
            continue
        size = tensor["parameters"]["binary_data_size"]
        response.raw_output_contents.append(result.body[offset:offset + size])
        offset += size
    return response


def _metadata(context: Any) -> dict[str, str]:
    """Request metadata as headers: lowercase keys, text values only (``-bin`` keys are bytes)."""
    headers = {}
    for key, value in context.invocation_metadata() or ():
        if isinstance(value, str):
            headers[key.lower()] = value
    headers.pop(binary_ext.HEADER, None)  # ours to set
    return headers


def _error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body.decode("utf-8", "replace")


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """One method per OIP v2 RPC; each is a translation to and from the data plane."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    async def _abort(self, context: Any, status: int, message: str, version: str | None = None) -> NoReturn:
        trailing = ((VERSION_METADATA, version),) if version else ()
        await context.abort(STATUS_CODES.get(status, grpc.StatusCode.INTERNAL), message, trailing_metadata=trailing)
        raise AssertionError("unreachable: abort raises")

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=self.dataplane.live())

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.dataplane.ready())

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: Any) -> pb.ServerMetadataResponse:
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"], extensions=meta["extensions"])

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        try:
            ready = self.dataplane.model_ready(request.name, request.version or None)
        except InferenceError as exc:
            await self._abort(context, exc.status_code, exc.message)
        return pb.ModelReadyResponse(ready=ready)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:
        try:
            meta = self.dataplane.model_metadata(request.name, request.version or None)
        except InferenceError as exc:
            await self._abort(context, exc.status_code, exc.message)

        def tensors(specs: list[dict[str, Any]]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                    for t in specs]

        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=tensors(meta["inputs"]), outputs=tensors(meta["outputs"]))

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:
        limit = self.dataplane.registry.snapshot.config.server.max_body_bytes
        size = request.ByteSize()
        if size > limit:  # gRPC enforces the limit of the start; this one follows the config
            await self._abort(context, 413, f"body of {size} bytes is over the limit of {limit} bytes")
        headers = _metadata(context)
        body, json_length = request_body(request)
        if json_length is not None:
            headers[binary_ext.HEADER] = str(json_length)
        result = await self.dataplane.infer(request.model_name, request.model_version or None, body, headers)
        if result.status != 200:
            await self._abort(context, result.status, _error_message(result.body), result.version)
        if result.version:
            # trailing: sent with the status at no cost; initial metadata would be a send of its
            # own (~130 µs a request)
            context.set_trailing_metadata(((VERSION_METADATA, result.version),))
        return infer_response(result)


def _options(max_bytes: int, reuse_port: bool) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_bytes),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", int(reuse_port)),
    ]


async def start_grpc(dataplane: DataPlane, host: str, port: int, reuse_port: bool = False) -> grpc.aio.Server:
    """Start serving OIP v2 gRPC on ``host:port`` in the running event loop. Port 0 picks a free
    port: read it from ``server.bound_port``. A port in use is an OSError, unless ``reuse_port``
    (``serve --workers``: every worker binds the port and the kernel spreads connections)."""
    limit = dataplane.registry.snapshot.config.server.max_body_bytes
    server = grpc.aio.server(options=_options(limit, reuse_port))
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(dataplane), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"gRPC: cannot bind {address}: {exc}") from None
    await server.start()
    server.bound_port = bound
    log.info("serving OIP v2 gRPC on %s:%s (max message %d bytes)", host, bound, limit)
    return server


async def stop_grpc(server: grpc.aio.Server, grace: float | None = 10.0) -> None:
    """Stop taking new RPCs and let running ones finish for up to ``grace`` seconds."""
    await server.stop(grace)


async def serve_with_uvicorn(
    server: uvicorn.Server,
    dataplane: DataPlane,
    host: str,
    grpc_port: int,
    sockets: list[socket.socket] | None = None,
    reuse_port: bool = False,
    grace: float = 10.0,
    started: Callable[[grpc.aio.Server], None] | None = None,
) -> None:
    """Serve gRPC beside ``server`` (uvicorn) on the running loop until uvicorn exits. Shutdown
    (SIGTERM) drains both at once: gRPC stops taking RPCs and finishes running ones for up to
    ``grace`` seconds while uvicorn drains HTTP."""
    grpc_server = await start_grpc(dataplane, host, grpc_port, reuse_port)
    if started is not None:
        started(grpc_server)

    async def stop_with_uvicorn() -> None:
        while not server.should_exit:
            await asyncio.sleep(0.1)
        await stop_grpc(grpc_server, grace)

    stopper = asyncio.create_task(stop_with_uvicorn())
    try:
        await server.serve(sockets=sockets)
    finally:
        server.should_exit = True
        await stopper


def run_with_uvicorn(server: uvicorn.Server, dataplane: DataPlane, host: str, grpc_port: int,
                     reuse_port: bool = False) -> None:
    """``server.run()`` with gRPC on the same event loop (uvicorn's loop factory: uvloop)."""
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(serve_with_uvicorn(server, dataplane, host, grpc_port, None, reuse_port))


class GrpcThread:
    """The gRPC server on an event loop of its own in a daemon thread, for callers that run no
    loop of their own (tests, or a server whose loop is not at hand)."""

    def __init__(self, dataplane: DataPlane, host: str, port: int, reuse_port: bool = False) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc", daemon=True)
        self._thread.start()
        try:
            self.server = asyncio.run_coroutine_threadsafe(start_grpc(dataplane, host, port, reuse_port), self.loop).result(30)
        except BaseException:
            self._close_loop()
            raise
        self.port: int = self.server.bound_port

    def stop(self, grace: float | None = 10.0) -> None:
        asyncio.run_coroutine_threadsafe(stop_grpc(self.server, grace), self.loop).result()
        self._close_loop()

    def _close_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def serve_grpc_in_thread(dataplane: DataPlane, host: str, port: int, reuse_port: bool = False) -> GrpcThread:
    return GrpcThread(dataplane, host, port, reuse_port)


__all__ = ["InferenceServicer", "GrpcThread", "request_body", "infer_response", "run_with_uvicorn",
           "serve_grpc_in_thread", "serve_with_uvicorn", "start_grpc", "stop_grpc", "STATUS_CODES"]
