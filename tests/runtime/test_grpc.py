"""OIP v2 over gRPC: tritonclient.grpc and the generated stub against the gRPC front end, which
must answer, route, refuse and count exactly like REST (both share one DataPlane)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import uvicorn
import tritonclient.grpc as triton
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from mnn_rollout.local.net import wait_for
from mnn_runtime import grpc_h2
from mnn_runtime.dataplane import InferResult
from mnn_runtime.feedback import version_in
from mnn_runtime.grpc_server import GrpcThread, infer_response, serve_with_uvicorn
from mnn_runtime.grpc_v2 import grpc_predict_v2_pb2 as pb
from mnn_runtime.grpc_v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from mnn_runtime.model import LoadedModel
from mnn_rollout.contract.routing import RoutingTable
from mnn_runtime.server import Runtime, build_runtime

HOST = "127.0.0.1"


class Served:
    """A runtime served over gRPC and REST. ``with_rest``: gRPC and uvicorn share one event loop
    (uvloop) in a background thread, as ``serve --grpc-port`` runs them; else gRPC alone on a
    loop of its own (GrpcThread)."""

    def __init__(self, runtime: Runtime, with_rest: bool) -> None:
        self.runtime = runtime
        self.uvicorn: uvicorn.Server | None = None
        self.grpc_thread: GrpcThread | None = None
        if with_rest:
            port = self._start_both()
        else:
            self.grpc_thread = GrpcThread(runtime.dataplane, HOST, 0)
            port = self.grpc_thread.port
        self.address = f"{HOST}:{port}"
        self.client = triton.InferenceServerClient(self.address)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)

    def _start_both(self) -> int:
        """What ``serve --grpc-port`` runs (run_with_uvicorn), on a thread of its own."""
        sock = socket.socket()
        sock.bind((HOST, 0))
        self.rest = httpx.Client(base_url=f"http://{HOST}:{sock.getsockname()[1]}", timeout=10)
        config = uvicorn.Config(self.runtime.app, log_level="warning", access_log=False)
        self.uvicorn = uvicorn.Server(config)
        started: list[int] = []
        ready = threading.Event()

        def on_start(server: grpc.aio.Server) -> None:
            self.loop_type = type(asyncio.get_running_loop()).__module__
            started.append(server.bound_port)
            ready.set()

        def run() -> None:
            assert self.uvicorn is not None
            with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
                runner.run(serve_with_uvicorn(self.uvicorn, self.runtime.dataplane, HOST, 0, sockets=[sock],
                                              grace=1, started=on_start))

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(30), "gRPC did not start"
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return started[0]

    def close(self) -> None:
        self.client.close()
        self.channel.close()
        if self.uvicorn is not None:
            self.rest.close()
            self.uvicorn.should_exit = True
            self.thread.join(20)
            assert not self.thread.is_alive(), "uvicorn + gRPC did not stop"
        if self.grpc_thread is not None:
            self.grpc_thread.stop(grace=1)
        self.runtime.close()


@pytest.fixture(scope="module")
def served(examples_dir: Path) -> Iterator[Served]:
    s = Served(build_runtime(examples_dir / "runtime.yaml"), with_rest=True)
    yield s
    s.close()


@pytest.fixture(scope="module")
def small(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """v1 only loads (v2's file is missing), and messages are limited to 4096 bytes."""
    config = tmp_path_factory.mktemp("grpc") / "runtime.yaml"
    config.write_text(
        "model: scorer\n"
        f"versions:\n  - {{name: v1, uri: {examples_dir / 'v1.mnn'}}}\n  - {{name: v2, uri: missing.mnn}}\n"
        "weights: {v1: 100, v2: 0}\nstable: v1\nserver: {max_body_bytes: 4096}\n"
    )
    s = Served(build_runtime(config), with_rest=False)
    yield s
    s.close()


@pytest.fixture(scope="module")
def models(examples_dir: Path) -> dict[str, LoadedModel]:
    return {v: LoadedModel.load(examples_dir / f"{v}.mnn") for v in ("v1", "v2")}


def features(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, 64), dtype=np.float32)


def triton_input(x: np.ndarray, name: str = "features") -> triton.InferInput:
    inp = triton.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def grpc_error(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


@pytest.mark.parametrize("version, request_id, tensors", [
    ("v2", "", [("score", "FP32", [1, 1], b"\x00\x00\x80?")]),
    ("", "req-é-1", [("score", "FP32", [3, 1], b"\x01" * 12)]),
    ("v1", "x" * 200, [("a", "FP32", [4, 100], b"\x02" * 1600), ("b", "INT64", [], b"\x03" * 8),
                       ("c", "UINT8", [70000], b"\x04" * 70000)]),
    ("v3", "id", []),
])
def test_the_response_is_the_bytes_protobuf_serializes(version: str, request_id: str,
                                                        tensors: list[tuple[str, str, list[int], bytes]]) -> None:
    """infer_response reuses serialized pieces: each call (a first and a cached second) must give
    exactly what protobuf gives for the whole message, which clients parse back the same."""
    result = InferResult(200, b"", version or None, id=request_id, tensors=tensors)
    expected = pb.ModelInferResponse(
        model_name="scorer", model_version=version, id=request_id,
        outputs=[pb.ModelInferResponse.InferOutputTensor(name=n, datatype=d, shape=s) for n, d, s, _ in tensors],
        raw_output_contents=[data for *_, data in tensors])
    for _ in range(2):
        got = infer_response("scorer", result)
        assert got == expected.SerializeToString()
        assert pb.ModelInferResponse.FromString(got) == expected


def test_health_and_server_metadata(served: Served) -> None:
    assert served.loop_type.startswith("uvloop")  # gRPC shares uvicorn's uvloop loop
    assert served.client.is_server_live()
    assert served.client.is_server_ready()
    meta = served.client.get_server_metadata()
    assert meta.name == "mnn-rollout" and "model_version_routing" in meta.extensions


def test_model_ready_per_version_and_unknown_names(served: Served) -> None:
    assert served.client.is_model_ready("scorer")
    assert served.client.is_model_ready("scorer", "v1")
    assert served.client.is_model_ready("scorer", "v2")
    err = grpc_error(lambda: served.client.is_model_ready("scorer", "v9"))
    assert err.status() == "StatusCode.NOT_FOUND" and "'v9'" in err.message()
    err = grpc_error(lambda: served.client.is_model_ready("nope"))
    assert err.status() == "StatusCode.NOT_FOUND"


def test_model_metadata(served: Served) -> None:
    meta = served.client.get_model_metadata("scorer")
    assert meta.name == "scorer" and meta.platform == "mnn" and list(meta.versions) == ["v1", "v2"]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("features", "FP32", [-1, 64])]
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("scores", "FP32", [-1, 32])]
    assert list(served.client.get_model_metadata("scorer", "v2").inputs[0].shape) == [-1, 64]


def test_pinned_infer_matches_mnn_exactly(served: Served, models: dict[str, LoadedModel]) -> None:
    x = features(4)
    result = served.client.infer("scorer", [triton_input(x)], model_version="v1")
    np.testing.assert_array_equal(result.as_numpy("scores"), models["v1"].infer([x])[0])
    assert result.get_response().model_version == "v1"
    # the pin header, like REST's X-Model-Version
    result = served.client.infer("scorer", [triton_input(x)], headers={"x-model-version": "v2"},
                                 outputs=[triton.InferRequestedOutput("scores")], request_id="r-1")
    np.testing.assert_array_equal(result.as_numpy("scores"), models["v2"].infer([x])[0])
    assert result.get_response().model_version == "v2" and result.get_response().id == "r-1"


def test_routed_infer_follows_the_routing_table(served: Served) -> None:
    table = RoutingTable.build("scorer", {"v1": 90, "v2": 10}, "v1")
    inp = triton_input(features(1))
    keys = [f"user-{i}" for i in range(50)]
    got = [served.client.infer("scorer", [inp], headers={"x-user-id": k}).get_response().model_version for k in keys]
    assert got == [table.route(k) for k in keys]
    assert set(got) == {"v1", "v2"}  # both versions are exercised by these keys
    by_param = [served.client.infer("scorer", [inp], parameters={"user_id": k}).get_response().model_version
                for k in keys[:10]]
    assert by_param == got[:10]


def raw_call(served: Served, metadata: dict[str, bytes], **request: Any) -> dict[str, str]:
    """The trailers of a ModelInfer call sent over a raw HTTP/2 client, its metadata as raw bytes
    (grpcio sends only printable ASCII in text metadata; other clients send UTF-8)."""
    from tests.runtime.test_grpc_h2 import Client

    x = features(1)
    message = pb.ModelInferRequest(model_name="scorer", raw_input_contents=[x.tobytes()], inputs=[
        pb.ModelInferRequest.InferInputTensor(name="features", datatype="FP32", shape=[1, 64])], **request)
    client = Client(int(served.address.rpartition(":")[2]))
    try:
        extra = {k: v.decode("latin-1") for k, v in metadata.items()}  # encoded back to the same bytes
        trailers, _, _ = client.answer(client.call("/inference.GRPCInferenceService/ModelInfer",
                                                   message.SerializeToString(), extra))
        return trailers
    finally:
        client.sock.close()


def test_a_non_ascii_user_key_in_metadata_routes_as_the_same_key_in_parameters(served: Served) -> None:
    table = RoutingTable.build("scorer", {"v1": 90, "v2": 10}, "v1")
    keys = [f"Zoë-{i}" for i in range(60)]
    assert {table.route(k) for k in keys} == {"v1", "v2"}
    inp = triton_input(features(1))
    for key in keys:
        by_metadata = raw_call(served, {"x-user-id": key.encode()})
        by_param = served.client.infer("scorer", [inp], parameters={"user_id": key}).get_response().model_version
        assert by_metadata["grpc-status"] == "0" and by_metadata["x-model-version"] == by_param == table.route(key)
    refused = raw_call(served, {"x-user-id": b"Zo\xeb"})
    assert refused["grpc-status"] == "3"  # INVALID_ARGUMENT
    assert "header X-User-Id: b'Zo\\xeb' is not UTF-8" in urllib.parse.unquote(refused["grpc-message"])


def test_a_blank_user_key_in_metadata_is_no_key_and_a_float_user_id_is_refused(served: Served) -> None:
    seen = [raw_call(served, {"x-user-id": b"  "})["x-model-version"] for _ in range(100)]
    assert set(seen) == {"v1", "v2"}  # weighted random, not one bucket
    err = grpc_error(lambda: served.client.infer("scorer", [triton_input(features(1))],
                                                 parameters={"user_id": 4242.0}))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.message() == "parameters.user_id: 4242.0 is not a user key; valid: a string or an integer"


def test_a_request_id_in_the_made_form_naming_another_version_is_replaced(served: Served) -> None:
    inp = triton_input(features(1))
    other = served.client.infer("scorer", [inp], model_version="v1", request_id="0123456789abcdef.v2")
    assert other.get_response().id != "0123456789abcdef.v2" and version_in(other.get_response().id) == "v1"
    same = served.client.infer("scorer", [inp], model_version="v1", request_id="0123456789abcdef.v1")
    assert same.get_response().id == "0123456789abcdef.v1"


def test_wrong_shape_is_invalid_argument_with_the_rest_message(served: Served) -> None:
    x = features(4)[:, :32].copy()
    err = grpc_error(lambda: served.client.infer("scorer", [triton_input(x)], model_version="v1"))
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert err.message().startswith("inputs[0].shape: [4, 32]")
    rest = served.rest.post("/v2/models/scorer/versions/v1/infer", json={"inputs": [
        {"name": "features", "datatype": "FP32", "shape": [4, 32], "data": x.ravel().tolist()}]})
    assert rest.status_code == 400 and rest.json()["error"] == err.message()


def test_unknown_model_and_version_are_not_found(served: Served) -> None:
    inp = triton_input(features(1))
    err = grpc_error(lambda: served.client.infer("nope", [inp]))
    assert err.status() == "StatusCode.NOT_FOUND" and err.message() == "model 'nope' does not exist; valid: ['scorer']"
    err = grpc_error(lambda: served.client.infer("scorer", [inp], model_version="v9"))
    assert err.status() == "StatusCode.NOT_FOUND" and "'v9'" in err.message()


def test_typed_contents_through_the_generated_stub(served: Served, models: dict[str, LoadedModel]) -> None:
    x = features(4, seed=5)
    request = pb.ModelInferRequest(model_name="scorer", model_version="v2")
    request.inputs.add(name="features", datatype="FP32", shape=[4, 64]).contents.fp32_contents.extend(x.ravel())
    response, call = served.stub.ModelInfer.with_call(request, timeout=10)
    assert response.model_version == "v2" and ("x-model-version", "v2") in call.trailing_metadata()
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("scores", "FP32", [4, 32])
    got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(4, 32)
    np.testing.assert_array_equal(got, models["v2"].infer([x])[0])
    # integer contents of an INT32 tensor reach the model's FP32 input check like REST data does
    bad = pb.ModelInferRequest(model_name="scorer", model_version="v2")
    bad.inputs.add(name="features", datatype="INT32", shape=[1, 64]).contents.int_contents.extend(range(64))
    with pytest.raises(grpc.RpcError) as info:
        served.stub.ModelInfer(bad, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("inputs[0].datatype: INT32 does not match input 'features'")
    assert ("x-model-version", "v2") in info.value.trailing_metadata()
    short = pb.ModelInferRequest(model_name="scorer", model_version="v1")
    short.inputs.add(name="features", datatype="FP32", shape=[1, 64]).contents.fp32_contents.extend([0.5] * 10)
    with pytest.raises(grpc.RpcError) as info:
        served.stub.ModelInfer(short, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "inputs[0].data: has 10 elements but shape [1, 64] needs 64"


def test_raw_contents_that_lie_about_their_size_are_invalid_argument(served: Served) -> None:
    request = pb.ModelInferRequest(model_name="scorer", model_version="v1")
    request.inputs.add(name="features", datatype="FP32", shape=[1, 64])
    request.raw_input_contents.append(b"\0" * 100)
    with pytest.raises(grpc.RpcError) as info:
        served.stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "100 bytes, but shape [1, 64] of FP32 needs 256" in info.value.details()
    request.raw_input_contents[0] = b"\0" * 256
    request.raw_input_contents.append(b"\0" * 256)  # two raw entries for one input
    with pytest.raises(grpc.RpcError) as info:
        served.stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "binary data: inputs claim 256 bytes but the body carries 512"


def test_a_shape_with_a_0_beside_a_huge_dimension_is_invalid_argument_counted_as_a_client_error(
        served: Served) -> None:
    request = pb.ModelInferRequest(model_name="scorer", model_version="v1")
    request.inputs.add(name="features", datatype="FP32", shape=[2**62, 0])
    before = request_counts(served.runtime.metrics.exposition().decode())
    with pytest.raises(grpc.RpcError) as info:
        served.stub.ModelInfer(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("inputs[0].shape: [4611686018427387904, 0] is beyond what a tensor can hold")
    after = request_counts(served.runtime.metrics.exposition().decode())
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {("v1", "client_error"): 1}


def test_a_port_in_use_is_an_os_error(small: Served) -> None:
    port = int(small.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="cannot bind"):
        GrpcThread(small.runtime.dataplane, HOST, port)


def test_not_ready_version_is_unavailable_and_oversized_messages_are_refused(small: Served) -> None:
    inp = triton_input(features(1))
    err = grpc_error(lambda: small.client.infer("scorer", [inp], model_version="v2"))
    assert err.status() == "StatusCode.UNAVAILABLE"
    reason = small.runtime.registry.snapshot.versions["v2"].reason
    assert reason and err.message() == f"version 'v2' is not ready: {reason}"  # REST's 503 text
    assert small.client.infer("scorer", [triton_input(features(15))]).get_response().model_version == "v1"
    err = grpc_error(lambda: small.client.infer("scorer", [triton_input(features(17))]))  # 4352 tensor bytes
    assert err.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert small.client.is_server_live()  # the connection and server survive it


def test_a_limit_lowered_while_serving_applies_to_grpc(small: Served) -> None:
    registry = small.runtime.registry
    before = registry.snapshot.config
    lowered = before.model_copy(update={"server": before.server.model_copy(update={"max_body_bytes": 2048})})
    registry.apply(lowered)
    try:
        err = grpc_error(lambda: small.client.infer("scorer", [triton_input(features(10))]))  # 2560 bytes
        assert err.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "over the limit of 2048 bytes" in err.message()
    finally:
        registry.apply(before)


def request_counts(text: str) -> dict[tuple[str, str], float]:
    counts = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "mnn_inference_requests_total":
                counts[(s.labels["version"], s.labels["outcome"])] = s.value
    return counts


def test_grpc_requests_are_counted_by_version_like_rest(served: Served) -> None:
    x = features(2)
    good = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 64], "data": x.ravel().tolist()}]}
    bad = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 32], "data": x[:, :32].ravel().tolist()}]}
    keys = [f"k{i}" for i in range(12)]

    def via_rest() -> None:
        for version in ("v1", "v1", "v2"):
            assert served.rest.post(f"/v2/models/scorer/versions/{version}/infer", json=good).status_code == 200
        for k in keys:
            assert served.rest.post("/v2/models/scorer/infer", json=good, headers={"X-User-Id": k}).status_code == 200
        assert served.rest.post("/v2/models/scorer/versions/v2/infer", json=bad).status_code == 400
        assert served.rest.post("/v2/models/scorer/versions/v9/infer", json=good).status_code == 404

    def via_grpc() -> None:
        c = served.client
        for version in ("v1", "v1", "v2"):
            c.infer("scorer", [triton_input(x)], model_version=version)
        for k in keys:
            c.infer("scorer", [triton_input(x)], headers={"x-user-id": k})
        grpc_error(lambda: c.infer("scorer", [triton_input(x[:, :32].copy())], model_version="v2"))
        grpc_error(lambda: c.infer("scorer", [triton_input(x)], model_version="v9"))

    deltas = []
    for send in (via_rest, via_grpc):
        before = request_counts(served.runtime.metrics.exposition().decode())
        send()
        after = request_counts(served.runtime.metrics.exposition().decode())
        deltas.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
    rest, grpc_ = deltas
    assert grpc_ == rest
    assert rest[("v2", "client_error")] == 1 and rest[("unrouted", "client_error")] == 1
    assert rest[("v1", "success")] + rest[("v2", "success")] == 3 + len(keys)


def test_a_channel_let_go_when_idle_reconnects_on_its_next_call(small: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """grpcio's channel after the server closed its idle connection with GOAWAY (NO_ERROR): its next
    call opens a new connection and is answered, without an error reaching the caller."""
    monkeypatch.setattr(grpc_h2, "CONNECTION_IDLE_TIMEOUT", 0.4, raising=False)
    assert small.grpc_thread is not None
    server = small.grpc_thread.server
    before, old = server.calls, set(server.connections)
    with grpc.insecure_channel(small.address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ModelReady(pb.ModelReadyRequest(name="scorer", version="v1"), timeout=5).ready
        mine = wait_for(lambda: [c for c in list(server.connections) if c not in old], 5, "the channel's connection")
        wait_for(lambda: all(c.closed for c in mine), 5, "the idle connection closed by the server")
        assert stub.ModelReady(pb.ModelReadyRequest(name="scorer", version="v1"), timeout=5).ready
        assert not any(c in server.connections for c in mine) and server.calls == before + 2
