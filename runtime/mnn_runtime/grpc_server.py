"""Open Inference Protocol v2 over gRPC: a thin servicer that translates gRPC <-> the data plane.

``ModelInfer`` hands each request to ``DataPlane.infer`` as the object a REST body with binary
tensors parses to, and its raw tensor bytes as the binary part (no JSON is written or read on the
way), so validation, routing, pinning, metrics and error texts are exactly the REST ones:

- ``raw_input_contents`` (what tritonclient sends) become binary tensors;
- typed ``contents`` (``fp32_contents``, ``int_contents``, ...) become the tensor's JSON ``data``
  and are checked against its datatype like REST ``data`` is;
- the routing key is the gRPC metadata named like the routing header (``x-user-id``), else the
  request parameter (``user_id``); ``model_version`` in the request or ``x-model-version`` in the
  metadata pins a version;
- outputs come back in ``raw_output_contents``; ``model_version`` and the trailing metadata
  ``x-model-version`` (also on errors, once the version is known) name the version that served;
- REST statuses map to gRPC codes, with the REST message as the details.

The server refuses messages over the config's ``server.max_body_bytes`` (RESOURCE_EXHAUSTED, REST's
413 text), read at every call from the message's length prefix, before the message is taken in: a
changed limit applies at once.

The transport is ``grpc_h2`` (HTTP/2 on the event loop, no grpcio server): grpc.aio cost ~300 µs
of CPU per call before the servicer ran (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from google.protobuf.message import DecodeError

from . import grpc_h2 as h2
from .dataplane import PIN_HEADER, DataPlane, InferResult
from .errors import InferenceError
from .grpc_h2 import GrpcError, GrpcServer
from .grpc_v2 import grpc_predict_v2_pb2 as pb

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

VERSION_METADATA = PIN_HEADER  # "x-model-version": gRPC metadata keys are lowercase
SERVICE = "/inference.GRPCInferenceService/"

STATUS_CODES: dict[int, int] = {  # REST status -> gRPC status code
    400: h2.INVALID_ARGUMENT,
    404: h2.NOT_FOUND,
    413: h2.RESOURCE_EXHAUSTED,
    500: h2.INTERNAL,
    503: h2.UNAVAILABLE,
}
Reply = tuple[bytes, tuple[tuple[str, str], ...]]

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


def request_object(request: pb.ModelInferRequest) -> tuple[dict[str, Any], bytes]:
    """The request as the data plane reads a REST one (its JSON object, then the binary part)."""
    raw = request.raw_input_contents
    inputs = []
    for i, tensor in enumerate(request.inputs):
        # shape[:] is a list, at half the cost of list(shape)
        obj: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape[:]}
        if i < len(raw):
            obj["parameters"] = {"binary_data_size": len(raw[i])}
        else:
            obj["data"] = _contents_data(tensor)
        inputs.append(obj)
    body: dict[str, Any] = {"inputs": inputs}
    if request.parameters:
        body["parameters"] = {key: _param_value(value) for key, value in request.parameters.items()}
    if request.outputs:
        body["outputs"] = [{"name": out.name} for out in request.outputs]
    if request.id:
        body["id"] = request.id
    return body, raw[0] if len(raw) == 1 else b"".join(raw)


def _varint(n: int) -> bytes:
    """A protobuf base-128 varint (a length, a field's size)."""
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes(((n & 0x7F) | 0x80, n >> 7))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Serialized pieces of ModelInferResponse that repeat from call to call, each made by protobuf once:
# (model, version) -> its fields 1 and 2; (name, datatype, *shape) -> one `outputs` entry (field 5,
# with its tag and length). Bounded, should shapes vary without end.
_heads: dict[tuple[str, str], bytes] = {}
_output_entries: dict[tuple[Any, ...], bytes] = {}
_PIECES = 4096


def infer_response(model: str, result: InferResult) -> bytes:
    """The serialized gRPC response for a successful data plane result (its raw outputs): the bytes
    ``ModelInferResponse(...).SerializeToString()`` gives (fields in number order), with what repeats
    serialized once. Building the message each call cost ~1.5 µs, this ~0.9."""
    version = result.version or ""
    head = _heads.get((model, version))
    if head is None:
        head = pb.ModelInferResponse(model_name=model, model_version=version).SerializeToString()
        if len(_heads) < _PIECES:
            _heads[(model, version)] = head
    parts = [head]
    if result.id:
        raw_id = result.id.encode()
        parts.append(b"\x1a" + _varint(len(raw_id)) + raw_id)  # field 3, length-delimited
    tensors = result.tensors or ()
    for name, datatype, shape, _ in tensors:
        key = (name, datatype, *shape)
        entry = _output_entries.get(key)
        if entry is None:
            tensor = pb.ModelInferResponse.InferOutputTensor(name=name, datatype=datatype, shape=shape)
            entry = tensor.SerializeToString()
            entry = b"\x2a" + _varint(len(entry)) + entry  # field 5, length-delimited
            if len(_output_entries) < _PIECES:
                _output_entries[key] = entry
        parts.append(entry)
    for *_, data in tensors:
        parts.append(b"\x32" + _varint(len(data)))  # field 6 (raw_output_contents), length-delimited
        parts.append(data)
    return b"".join(parts)


def _error_message(body: bytes) -> str:
    try:
        return str(orjson.loads(body)["error"])
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return body.decode("utf-8", "replace")


def _parse(kind: Any, message: bytes) -> Any:
    try:
        return kind.FromString(message)
    except DecodeError as exc:
        raise GrpcError(h2.INTERNAL, f"request: cannot be read as {kind.DESCRIPTOR.full_name}: {exc}") from None


def _refused(exc: InferenceError, version: str | None = None) -> GrpcError:
    trailing = ((VERSION_METADATA, version),) if version else ()
    return GrpcError(STATUS_CODES.get(exc.status_code, h2.INTERNAL), exc.message, trailing)


class InferenceServicer:
    """One method per OIP v2 RPC, each a translation to and from the data plane: (request
    message, request metadata) -> (response message, trailing metadata), or GrpcError."""

    def __init__(self, dataplane: DataPlane) -> None:
        self.dataplane = dataplane

    def handlers(self) -> dict[str, Callable[[bytes, dict[str, str]], Awaitable[Reply]]]:
        return {SERVICE + name: getattr(self, name) for name in
                ("ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata", "ModelInfer")}

    async def ServerLive(self, message: bytes, metadata: dict[str, str]) -> Reply:
        _parse(pb.ServerLiveRequest, message)
        return pb.ServerLiveResponse(live=self.dataplane.live()).SerializeToString(), ()

    async def ServerReady(self, message: bytes, metadata: dict[str, str]) -> Reply:
        _parse(pb.ServerReadyRequest, message)
        return pb.ServerReadyResponse(ready=self.dataplane.ready()).SerializeToString(), ()

    async def ServerMetadata(self, message: bytes, metadata: dict[str, str]) -> Reply:
        _parse(pb.ServerMetadataRequest, message)
        meta = self.dataplane.server_metadata()
        return pb.ServerMetadataResponse(name=meta["name"], version=meta["version"],
                                         extensions=meta["extensions"]).SerializeToString(), ()

    async def ModelReady(self, message: bytes, metadata: dict[str, str]) -> Reply:
        request = _parse(pb.ModelReadyRequest, message)
        try:
            ready = self.dataplane.model_ready(request.name, request.version or None)
        except InferenceError as exc:
            raise _refused(exc) from None
        return pb.ModelReadyResponse(ready=ready).SerializeToString(), ()

    async def ModelMetadata(self, message: bytes, metadata: dict[str, str]) -> Reply:
        request = _parse(pb.ModelMetadataRequest, message)
        try:
            meta = self.dataplane.model_metadata(request.name, request.version or None)
        except InferenceError as exc:
            raise _refused(exc) from None

        def tensors(specs: list[dict[str, Any]]) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [pb.ModelMetadataResponse.TensorMetadata(name=t["name"], datatype=t["datatype"], shape=t["shape"])
                    for t in specs]

        return pb.ModelMetadataResponse(name=meta["name"], versions=meta["versions"], platform=meta["platform"],
                                        inputs=tensors(meta["inputs"]),
                                        outputs=tensors(meta["outputs"])).SerializeToString(), ()

    async def ModelInfer(self, message: bytes, metadata: dict[str, str]) -> Reply:
        request = _parse(pb.ModelInferRequest, message)
        result = await self.dataplane.infer(request.model_name, request.model_version or None, b"",
                                            metadata, request_object(request))
        if result.status != 200:
            trailing = ((VERSION_METADATA, result.version),) if result.version else ()
            raise GrpcError(STATUS_CODES.get(result.status, h2.INTERNAL), _error_message(result.body), trailing)
        # the version that served, in the trailers: sent with the status at no cost
        return (infer_response(request.model_name, result),
                ((VERSION_METADATA, result.version),) if result.version else ())


async def start_grpc(dataplane: DataPlane, host: str, port: int | None) -> GrpcServer:
    """Start serving OIP v2 gRPC on ``host:port`` in the running event loop. Port 0 picks a free
    port: read it from ``server.bound_port``. A port in use is an OSError. Port None listens
    nowhere: the connections are handed to it (``server.connection``; a worker of ``serve --workers``, whose
    supervisor accepts them)."""
    server = GrpcServer(InferenceServicer(dataplane).handlers(),
                        lambda: dataplane.registry.snapshot.config.server.max_body_bytes)
    if port is None:
        log.info("serving OIP v2 gRPC on the connections the supervisor hands over")
        return server
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = await server.bind(host, port)
    except OSError as exc:
        raise OSError(f"gRPC: cannot bind {address}: {exc}") from None
    log.info("serving OIP v2 gRPC on %s:%s", host, bound)
    return server


async def stop_grpc(server: GrpcServer, grace: float | None = 10.0) -> None:
    """Stop taking new RPCs and let running ones finish for up to ``grace`` seconds."""
    await server.stop(grace)


async def serve_with_uvicorn(
    server: uvicorn.Server,
    dataplane: DataPlane,
    host: str,
    grpc_port: int | None,
    sockets: list[socket.socket] | None = None,
    grace: float = 10.0,
    started: Callable[[GrpcServer], None] | None = None,
) -> None:
    """Serve gRPC beside ``server`` (uvicorn) on the running loop until uvicorn exits (``grpc_port``
    None: on connections handed to it, see ``start_grpc``). Shutdown (SIGTERM) drains both at once:
    gRPC stops taking RPCs and finishes running ones for up to ``grace`` seconds while uvicorn
    drains HTTP."""
    grpc_server = await start_grpc(dataplane, host, grpc_port)
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


def run_with_uvicorn(server: uvicorn.Server, dataplane: DataPlane, host: str, grpc_port: int | None,
                     started: Callable[[GrpcServer], None] | None = None) -> None:
    """``server.run()`` with gRPC on the same event loop (uvicorn's loop factory: uvloop);
    ``started`` is given the gRPC server once it serves."""
    with asyncio.Runner(loop_factory=server.config.get_loop_factory()) as runner:
        runner.run(serve_with_uvicorn(server, dataplane, host, grpc_port, started=started))


class GrpcThread:
    """The gRPC server on an event loop of its own in a daemon thread, for callers that run no
    loop of their own (tests, or a server whose loop is not at hand)."""

    def __init__(self, dataplane: DataPlane, host: str, port: int) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc", daemon=True)
        self._thread.start()
        try:
            self.server = asyncio.run_coroutine_threadsafe(start_grpc(dataplane, host, port), self.loop).result(30)
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


def serve_grpc_in_thread(dataplane: DataPlane, host: str, port: int) -> GrpcThread:
    return GrpcThread(dataplane, host, port)


__all__ = ["InferenceServicer", "GrpcThread", "request_object", "infer_response", "run_with_uvicorn",
           "serve_grpc_in_thread", "serve_with_uvicorn", "start_grpc", "stop_grpc", "STATUS_CODES"]
