"""Triton's binary tensor extension: tritonclient with binary_data=True, and lying lengths."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from mnn_runtime.model import LoadedModel
from tests.runtime_server import RuntimeServer

INFER = "/v2/models/scorer/versions/v1/infer"


@pytest.fixture(scope="module")
def server(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RuntimeServer]:
    srv = RuntimeServer(examples_dir / "runtime.yaml", log_path=tmp_path_factory.mktemp("bin") / "server.log")
    srv.start()
    yield srv
    srv.stop()


def test_tritonclient_binary_inputs_and_outputs_match_mnn(server: RuntimeServer, examples_dir: Path) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=f"{server.host}:{server.port}")
    x = np.random.default_rng(3).random((5, 64), dtype=np.float32)
    inp = triton.InferInput("features", [5, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = triton.InferRequestedOutput("scores", binary_data=True)
    result = client.infer("scorer", [inp], model_version="v1", outputs=[out])
    expected = LoadedModel.load(examples_dir / "v1.mnn").infer([x])[0]
    np.testing.assert_array_equal(result.as_numpy("scores"), expected)
    assert result.get_response()["model_version"] == "v1"
    everything = client.infer("scorer", [inp], model_version="v1")  # no outputs named: all binary
    np.testing.assert_array_equal(everything.as_numpy("scores"), expected)
    client.close()


def raw_request(server: RuntimeServer, header: dict[str, object], binary: bytes,
                json_length: int | None = None) -> httpx.Response:
    head = json.dumps(header).encode()
    length = len(head) if json_length is None else json_length
    return httpx.post(server.url + INFER, content=head + binary, timeout=10,
                      headers={"Inference-Header-Content-Length": str(length), "Content-Type": "application/octet-stream"})


def tensor(size: int, shape: list[int] | None = None) -> dict[str, object]:
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": shape or [1, 64],
                        "parameters": {"binary_data_size": size}}]}


@pytest.mark.parametrize(
    ("header", "binary", "json_length", "message"),
    [
        (tensor(256), b"\0" * 100, None, "inputs claim 256 bytes but the body carries 100"),
        (tensor(100), b"\0" * 100, None, "100 bytes, but shape [1, 64] of FP32 needs 256"),
        (tensor(256), b"\0" * 256, 10_000_000, "is outside the body"),
        (tensor(256), b"\0" * 256, 0, "is outside the body"),
        (tensor(256), b"\0" * 256, 7, "not valid JSON"),
        (tensor(-5), b"", None, "binary_data_size: -5 is not a byte count"),
        (tensor(256), np.full(64, np.nan, np.float32).tobytes(), None, "NaN or infinite"),
        (tensor(0, [0, 2**63 - 1]), b"", None, "inputs[0].shape: [0, 9223372036854775807] is beyond what a tensor"),
    ],
)
def test_binary_bodies_whose_lengths_lie_get_400(server: RuntimeServer, header: dict[str, object], binary: bytes,
                                                 json_length: int | None, message: str) -> None:
    r = raw_request(server, header, binary, json_length)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]
    assert server.alive()


@pytest.mark.parametrize(("length", "message"), [
    (b"lots", "Inference-Header-Content-Length: 'lots' is not a byte count"),
    (b"\xb2", "Inference-Header-Content-Length: '\u00b2' is not a byte count"),  # '²': isdigit(), yet no int
    (b"1" * 5000, "Inference-Header-Content-Length: " + "1" * 40 + " is outside the body of 2 bytes"),
], ids=["word", "superscript-two", "5000-digits"])
def test_a_header_length_that_is_no_byte_count_gets_400(server: RuntimeServer, length: bytes, message: str) -> None:
    r = httpx.post(server.url + INFER, content=b"{}", headers={"Inference-Header-Content-Length": length})
    assert r.status_code == 400 and r.json()["error"] == message
    assert "Traceback" not in server.log()


@pytest.mark.parametrize("arr", [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),  # not C order
    np.arange(24, dtype=np.int64).reshape(4, 6)[::2, 1::2],  # a strided view
    np.arange(6, dtype=">f4").reshape(2, 3),  # big-endian
    np.array([True, False, True]),
    np.arange(5, dtype=np.uint8),
], ids=["c-order", "fortran", "strided", "big-endian", "bool", "uint8"])
def test_outputs_go_as_little_endian_bytes_in_c_order(arr: np.ndarray) -> None:
    from mnn_runtime.dataplane import _wire_bytes

    got = _wire_bytes(arr)
    assert got == b"".join(np.array(v, dtype=arr.dtype.newbyteorder("<")).tobytes() for v in arr.flat)
    np.testing.assert_array_equal(np.frombuffer(got, dtype=arr.dtype.newbyteorder("<")).reshape(arr.shape), arr)
