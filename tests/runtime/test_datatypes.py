"""Integer and byte inputs: INT32, INT64 and UINT8 tensors reach real MNN models of those types."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.runtime_server import RuntimeServer


def cast_model(path: Path, elem_type: int) -> None:
    """y = float(x) * 2 with x of the given ONNX element type, dynamic batch, width 4."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from mnn_runtime.convert import convert

    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT), helper.make_node("Mul", ["xf", "two"], ["y"])]
    graph = helper.make_graph(
        nodes, "cast", [helper.make_tensor_value_info("x", elem_type, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(np.array(2.0, np.float32), "two")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path.with_suffix(".onnx"))
    convert(path.with_suffix(".onnx"), path)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    from onnx import TensorProto

    root = tmp_path_factory.mktemp("dtypes")
    cast_model(root / "ints.mnn", TensorProto.INT64)
    cast_model(root / "bytes.mnn", TensorProto.UINT8)
    (root / "runtime.yaml").write_text(yaml.safe_dump({
        "model": "cast", "versions": [{"name": "ints", "uri": "ints.mnn"}, {"name": "bytes", "uri": "bytes.mnn"}],
    }))
    server = RuntimeServer(root / "runtime.yaml", log_path=root / "server.log")
    server.start()
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c
    server.stop()


def infer(client: httpx.Client, version: str, datatype: str, data: list[object]) -> httpx.Response:
    return client.post(f"/v2/models/cast/versions/{version}/infer",
                       json={"inputs": [{"name": "x", "datatype": datatype, "shape": [1, 4], "data": data}]})


def test_metadata_reports_integer_and_byte_inputs(client: httpx.Client) -> None:
    assert client.get("/v2/models/cast/versions/ints").json()["inputs"][0]["datatype"] == "INT32"
    assert client.get("/v2/models/cast/versions/bytes").json()["inputs"][0]["datatype"] == "UINT8"


@pytest.mark.parametrize("datatype", ["INT32", "INT64", "INT16", "UINT8"])
def test_integer_tensors_reach_an_int_model(client: httpx.Client, datatype: str) -> None:
    r = infer(client, "ints", datatype, [1, 2, 3, 100])
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 200.0]


def test_uint8_tensors_reach_a_byte_model(client: httpx.Client) -> None:
    r = infer(client, "bytes", "UINT8", [0, 1, 128, 255])
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["data"] == [0.0, 2.0, 256.0, 510.0]


@pytest.mark.parametrize(
    ("version", "datatype", "data", "message"),
    [
        ("ints", "INT64", [1, 2, 3, 2**40], "values outside the INT32 range of input 'x'"),
        ("ints", "INT64", [1, 2, 3, 2**70], "integers beyond 64 bits"),
        ("ints", "INT32", [1, 2, 3, 2**40], "values outside the INT32 range"),
        ("ints", "FP32", [1.0, 2.0, 3.0, 4.0], "FP32 does not match input 'x' of type INT32"),
        ("ints", "INT32", [1.5, 2, 3, 4], "holds non-integer values"),
        ("bytes", "UINT8", [0, 1, 2, 256], "values outside the UINT8 range"),
        ("bytes", "UINT8", [0, 1, 2, -1], "values outside the UINT8 range"),
        ("bytes", "INT32", [0, 1, 2, 3], "INT32 does not match input 'x' of type UINT8"),
    ],
)
def test_integer_tensors_out_of_range_or_of_the_wrong_type_get_400(
    client: httpx.Client, version: str, datatype: str, data: list[object], message: str
) -> None:
    r = infer(client, version, datatype, data)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]
