"""OIP v2 REST against a real server on loopback, with plain HTTP and tritonclient."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mnn_rollout.contract.config import parse_config_text
from mnn_rollout.contract.routing import RoutingTable, table_digest
from mnn_runtime.dataplane import DataPlane
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.model import LoadedModel
from mnn_runtime.registry import Registry
from tests.runtime.test_metrics import value
from tests.runtime_server import RuntimeServer

INFER = "/v2/models/scorer/infer"


def body(rows: int = 1, width: int = 64, **extra: object) -> dict[str, object]:
    data = np.linspace(0, 1, rows * width, dtype=np.float32).tolist()
    return {"inputs": [{"name": "features", "datatype": "FP32", "shape": [rows, width], "data": data}], **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, examples_dir: Path) -> Iterator[RuntimeServer]:
    root = tmp_path_factory.mktemp("rest")
    config = yaml.safe_load((examples_dir / "runtime.yaml").read_text())
    for v in config["versions"]:
        v["uri"] = str(examples_dir / v["uri"])
    config["versions"].append({"name": "v3", "uri": str(root / "missing.mnn")})
    config["server"] = {"max_body_bytes": 65536}
    path = root / "runtime.yaml"
    path.write_text(yaml.safe_dump(config))
    srv = RuntimeServer(path, log_path=root / "server.log")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: RuntimeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        yield c


def test_health_and_server_metadata(client: httpx.Client) -> None:
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").status_code == 200
    meta = client.get("/v2").json()
    assert meta["name"] == "mnn-rollout" and "version" in meta


def test_model_metadata_describes_the_stable_version_and_lists_ready_versions(client: httpx.Client) -> None:
    meta = client.get("/v2/models/scorer").json()
    assert meta["name"] == "scorer"
    assert meta["versions"] == ["v1", "v2"]
    assert meta["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, 32]}]
    assert meta["parameters"]["weights"] == {"v1": 90, "v2": 10, "v3": 0}
    assert client.get("/v2/models/scorer/versions/v2").json()["parameters"]["version"] == "v2"


def test_model_readiness_per_version(client: httpx.Client) -> None:
    assert client.get("/v2/models/scorer/ready").status_code == 200
    assert client.get("/v2/models/scorer/versions/v2/ready").status_code == 200
    assert client.get("/v2/models/scorer/versions/v3/ready").status_code == 503
    assert client.get("/v2/models/scorer/versions/v9/ready").status_code == 404
    assert client.get("/v2/models/other/ready").status_code == 404


def test_the_status_extension_reports_every_version_with_its_reason(client: httpx.Client) -> None:
    status = client.get("/v2/models/scorer/status").json()
    assert status["ready"] is True and status["weights"] == {"v1": 90, "v2": 10, "v3": 0}
    assert status["versions"]["v1"]["ready"] is True and status["versions"]["v1"]["state"] == "ready"
    assert status["versions"]["v3"]["ready"] is False
    assert "missing.mnn' does not exist" in status["versions"]["v3"]["reason"]
    assert client.get("/v2/models/other/status").status_code == 404


def test_the_status_names_the_table_it_routes_by_evolved_here_or_as_published(client: httpx.Client,
                                                                                 examples_dir: Path) -> None:
    evolved = RoutingTable.build("scorer", {"v1": 90, "v2": 10}, "v1")
    assert client.get("/v2/models/scorer/status").json()["table_digest"] == table_digest(evolved.encode())
    # as published: another table of the same weights (after 50/50 and back), its digest as the operator computes it
    published = RoutingTable.build("scorer", {"v1": 90, "v2": 10}, "v1",
                                   RoutingTable.build("scorer", {"v1": 50, "v2": 50}, "v1"))
    config = yaml.safe_load((examples_dir / "runtime.yaml").read_text())
    config["versions"] = [{**v, "uri": str(examples_dir / v["uri"])} for v in config["versions"]]
    config["routing"] = {"table": published.encode()}
    plane = DataPlane(Registry(parse_config_text(yaml.safe_dump(config)), examples_dir, RuntimeMetrics("scorer")),
                      RuntimeMetrics("scorer"))
    assert plane.model_status("scorer")["table_digest"] == table_digest(published.encode())
    assert table_digest(published.encode()) != table_digest(evolved.encode())


def test_a_failed_version_names_its_file_and_refuses_pinned_traffic_with_503(client: httpx.Client) -> None:
    r = client.post("/v2/models/scorer/versions/v3/infer", json=body())
    assert r.status_code == 503
    assert "missing.mnn" in r.json()["error"] and "does not exist" in r.json()["error"]


def test_requests_are_routed_by_the_user_key_header_and_name_their_version(client: httpx.Client) -> None:
    table = RoutingTable.build("scorer", {"v1": 90, "v2": 10}, "v1")
    for i in range(60):
        key = f"user-{i}"
        r = client.post(INFER, json=body(), headers={"X-User-Id": key})
        assert r.status_code == 200, r.text
        assert r.json()["model_version"] == r.headers["x-model-version"] == table.route(key)


def test_the_user_id_parameter_routes_like_the_header(client: httpx.Client) -> None:
    for i in range(30):
        key = f"param-{i}"
        by_header = client.post(INFER, json=body(), headers={"X-User-Id": key}).json()["model_version"]
        by_param = client.post(INFER, json=body(parameters={"user_id": key})).json()["model_version"]
        assert by_header == by_param


def test_a_non_ascii_user_key_routes_the_same_by_header_as_by_parameter(client: httpx.Client) -> None:
    table = RoutingTable.build("scorer", {"v1": 90, "v2": 10}, "v1")
    keys = [f"José-{i}" for i in range(200)]
    assert {table.route(k) for k in keys} == {"v1", "v2"}  # enough keys that a wrong hash shows
    for key in keys:
        by_header = client.post(INFER, json=body(), headers=[(b"X-User-Id", key.encode())])
        by_param = client.post(INFER, json=body(parameters={"user_id": key}))
        assert by_header.headers["x-model-version"] == by_param.headers["x-model-version"] == table.route(key)


def test_a_user_key_header_that_is_not_utf8_gets_400_naming_the_header(client: httpx.Client) -> None:
    r = client.post(INFER, json=body(), headers=[(b"X-User-Id", b"Jos\xe9")])
    assert r.status_code == 400
    assert err(r) == "header X-User-Id: b'Jos\\xe9' is not UTF-8; a user key must be UTF-8 text"


# (a blank header cannot be sent: HTTP strips the spaces around a value)
@pytest.mark.parametrize("how", ["empty header", "empty parameter", "blank parameter"])
def test_an_empty_user_key_is_no_key_and_is_split_by_weight(client: httpx.Client, how: str) -> None:
    blank = "" if how.startswith("empty") else "  "
    headers = {"X-User-Id": blank} if how.endswith("header") else {}
    extra = {"parameters": {"user_id": blank}} if how.endswith("parameter") else {}
    versions = [client.post(INFER, json=body(**extra), headers=headers).json()["model_version"] for _ in range(200)]
    assert 0.03 < versions.count("v2") / len(versions) < 0.2  # not every request in one bucket


@pytest.mark.parametrize("value", [4242.0, 1.5, True, [1], {"id": 1}])
def test_a_user_id_parameter_that_is_neither_a_string_nor_an_integer_gets_400(client: httpx.Client,
                                                                                value: object) -> None:
    r = client.post(INFER, json=body(parameters={"user_id": value}))
    assert r.status_code == 400
    assert err(r) == f"parameters.user_id: {value!r} is not a user key; valid: a string or an integer"


def test_a_version_is_pinned_by_header_or_by_the_versioned_url(client: httpx.Client) -> None:
    for _ in range(5):
        assert client.post(INFER, json=body(), headers={"X-Model-Version": "v2"}).json()["model_version"] == "v2"
        assert client.post("/v2/models/scorer/versions/v2/infer", json=body()).headers["x-model-version"] == "v2"


def test_requests_without_a_key_are_split_by_weight(client: httpx.Client) -> None:
    versions = [client.post(INFER, json=body()).json()["model_version"] for _ in range(400)]
    share = versions.count("v2") / len(versions)
    assert 0.03 < share < 0.2


def test_outputs_match_mnn_run_in_process(client: httpx.Client, examples_dir: Path) -> None:
    model = LoadedModel.load(examples_dir / "v2.mnn")
    req = body(rows=3)
    out = client.post("/v2/models/scorer/versions/v2/infer", json={**req, "id": "abc"}).json()
    expected = model.infer([np.asarray(req["inputs"][0]["data"], np.float32).reshape(3, 64)])[0]  # type: ignore[index]
    assert out["id"] == "abc"
    assert out["outputs"][0]["shape"] == [3, 32] and out["outputs"][0]["datatype"] == "FP32"
    np.testing.assert_allclose(np.asarray(out["outputs"][0]["data"]).reshape(3, 32), expected, rtol=1e-6)


def test_nested_data_and_fp16_inputs_are_accepted(client: httpx.Client) -> None:
    nested = np.full((2, 64), 0.5).tolist()
    r = client.post(INFER, json={"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 64],
                                             "data": nested}]})
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [2, 32]
    r16 = client.post(INFER, json={"inputs": [{"name": "features", "datatype": "FP16", "shape": [2, 64],
                                               "data": nested}]}, headers={"X-Model-Version": "v1"})
    r32 = client.post(INFER, json={"inputs": [{"name": "features", "datatype": "FP32", "shape": [2, 64],
                                               "data": nested}]}, headers={"X-Model-Version": "v1"})
    assert r16.json()["outputs"] == r32.json()["outputs"]


def test_tritonclient_http_infers_and_reads_metadata(server: RuntimeServer) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url=f"{server.host}:{server.port}")
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("scorer")
    assert client.get_model_metadata("scorer")["inputs"][0]["shape"] == [-1, 64]
    x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    inp = triton.InferInput("features", [4, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    out = triton.InferRequestedOutput("scores", binary_data=False)
    result = client.infer("scorer", [inp], model_version="v1", outputs=[out], headers={"X-User-Id": "t"})
    assert result.get_response()["model_version"] == "v1"
    scores = result.as_numpy("scores")
    assert scores.shape == (4, 32)
    expected = client.infer("scorer", [inp], model_version="v1").as_numpy("scores")
    np.testing.assert_array_equal(scores, expected)
    client.close()


def err(r: httpx.Response) -> str:
    assert r.headers["content-type"] == "application/json"
    return str(r.json()["error"])


def tensor(**over: object) -> dict[str, object]:
    t: dict[str, object] = {"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.1] * 64}
    t.update(over)
    return t


BAD_REQUESTS = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "expected a JSON object"),
    ({"parameters": {}}, "inputs: required"),
    ({"inputs": []}, "inputs: required"),
    ({"inputs": ["x"]}, "inputs[0]: expected an object"),
    ({"inputs": [{"name": "features", "shape": [1, 64], "data": [0.1] * 64}]}, "inputs[0].datatype: required"),
    ({"inputs": [tensor(datatype="BYTES")]}, "inputs[0].datatype: 'BYTES' is not supported"),
    ({"inputs": [tensor(datatype=["FP32"])]}, "inputs[0].datatype: ['FP32'] is not supported"),
    ({"inputs": [tensor(datatype={})]}, "inputs[0].datatype: {} is not supported"),
    ({"inputs": [tensor(datatype="INT32", data=[1] * 64)]}, "INT32 does not match input 'features' of type FP32"),
    ({"inputs": [tensor(shape=[1, -64])]}, "inputs[0].shape: [1, -64] is not a non-empty list"),
    ({"inputs": [tensor(shape="1x64")]}, "inputs[0].shape: '1x64'"),
    ({"inputs": [tensor(shape=[1, 65])]}, "has 64 elements but shape [1, 65] needs 65"),
    ({"inputs": [tensor(shape=[2**64 - 1, 0], data=[])]},
     "inputs[0].shape: [18446744073709551615, 0] is beyond what a tensor can hold"),
    ({"inputs": [tensor(shape=[1, 80], data=[0.1] * 80)]}, "does not match input 'features' shape [-1, 64]"),
    ({"inputs": [tensor(shape=[64], data=[0.1] * 64)]}, "has rank 1"),
    ({"inputs": [tensor(shape=[0, 64], data=[])]}, "inputs[0].shape[0]: batch size 0 is outside 1-1024"),
    ({"inputs": [tensor(shape=[1025, 1], data=[0.1] * 1025)]}, "inputs[0].shape[0]: batch size 1025 is outside 1-1024"),
    ({"inputs": [tensor(name="user")]}, "'user' is not an input of version"),
    ({"inputs": [tensor(), tensor()]}, "input 'features' is given twice"),
    ({"inputs": [tensor(data=["a"] * 64)]}, "cannot be read as FP32"),
    ({"inputs": [tensor(data=[[0.1] * 63, [0.1]])]}, "cannot be read as FP32"),
    ({"inputs": [tensor(data=[None] * 64)]}, "holds null or values outside the FP32 range"),
    ({"inputs": [tensor(data=[1e39] * 64)]}, "holds null or values outside the FP32 range"),
    ({"inputs": [tensor(datatype="INT64", data=[1] * 64)]}, "INT64 does not match input"),
    ({"inputs": [tensor(datatype="INT32", data=[1.5] * 64)]}, "INT32 tensor holds non-integer values"),
    ({"inputs": [tensor(data="0.1")]}, "data: expected a list"),
    ({"inputs": [tensor()], "outputs": [{"name": "nope"}]}, "outputs[0].name: 'nope' is not an output"),
]


@pytest.mark.parametrize(("payload", "message"), BAD_REQUESTS)
def test_bad_requests_get_400_naming_the_field(client: httpx.Client, payload: object, message: str) -> None:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    r = client.post(INFER, content=content, headers={"X-User-Id": "bad", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in err(r)


def test_bad_input_pinned_to_a_version_counts_as_its_client_error_and_logs_no_traceback(
        server: RuntimeServer, client: httpx.Client) -> None:
    """Input the codec once failed on with a 500 (an unhashable datatype, a shape numpy cannot hold)
    counted as a server error of the version it was pinned to: a client could push a healthy
    canary's error rate up and have it rolled back."""
    bad = [tensor(datatype=["FP32"]), tensor(datatype={}), tensor(shape=[2**64 - 1, 0], data=[])]

    def counted(outcome: str) -> float:
        return value(client.get("/metrics").text, "mnn_inference_requests_total", model="scorer", version="v2",
                     outcome=outcome)

    before = {o: counted(o) for o in ("client_error", "server_error")}
    for t in bad:
        r = client.post("/v2/models/scorer/versions/v2/infer", json={"inputs": [t]})
        assert r.status_code == 400, r.text
    assert {o: counted(o) - n for o, n in before.items()} == {"client_error": len(bad), "server_error": 0}
    assert "Traceback" not in server.log()


def test_a_batch_over_the_limit_is_refused(client: httpx.Client) -> None:
    r = client.post(INFER, json={"inputs": [tensor(shape=[1025, 64], data=[0.0] * 1025 * 64)]})
    # 1025 x 64 floats is over this server's 64 KiB body limit: refused before parsing
    assert r.status_code == 413


def test_v1_shaped_requests_to_a_wider_model_get_400_not_a_crash(server: RuntimeServer, client: httpx.Client) -> None:
    r = client.post("/v2/models/scorer/versions/v2/infer", json={"inputs": [tensor(shape=[1, 32], data=[0.0] * 32)]})
    assert r.status_code == 400 and "does not match input" in err(r)
    assert server.alive()


def test_unknown_model_and_version_get_404(client: httpx.Client) -> None:
    assert client.post("/v2/models/other/infer", json=body()).status_code == 404
    r = client.post("/v2/models/scorer/versions/v9/infer", json=body())
    assert r.status_code == 404 and "'v9'" in err(r) and "['v1', 'v2', 'v3']" in err(r)
    assert client.post(INFER, json=body(), headers={"X-Model-Version": "v9"}).status_code == 404


def test_bodies_over_the_limit_get_413_with_or_without_content_length(client: httpx.Client) -> None:
    big = b"{" + b" " * 70_000 + b"}"
    assert client.post(INFER, content=big).status_code == 413

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b" " * 10_000

    r = client.post(INFER, content=chunks())
    assert r.status_code == 413 and "over the limit of 65536 bytes" in err(r)


def test_the_openapi_document_describes_the_infer_body(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v2/models/{model_name}/infer"]["post"]
    schema = op["requestBody"]["content"]["application/json"]["schema"]
    assert schema["required"] == ["inputs"]
    assert "/v2/models/{model_name}/versions/{version}/infer" in doc["paths"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
tensors = st.fixed_dictionaries(
    {},
    optional={
        "name": st.sampled_from(["features", "x", ""]) | st.integers(),
        "datatype": st.sampled_from(["FP32", "FP16", "INT32", "INT64", "UINT8", "BOOL", "FP64", "BYTES", "x"]),
        "shape": st.lists(st.integers(min_value=-2, max_value=70), max_size=3) | json_values,
        "data": st.lists(st.floats(allow_nan=False, width=32) | st.integers(-300, 300), max_size=70) | json_values,
    },
)
bodies = st.fixed_dictionaries(
    {}, optional={"inputs": st.lists(tensors, max_size=2) | json_values, "parameters": json_values,
                  "outputs": json_values, "id": json_values},
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=bodies | json_values)
def test_fuzzed_bodies_never_get_a_5xx(server: RuntimeServer, client: httpx.Client, payload: object) -> None:
    r = client.post(INFER, content=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, (payload, r.text)


def test_the_server_is_still_up_after_the_fuzz_pass(server: RuntimeServer, client: httpx.Client) -> None:
    assert server.alive()
    assert client.post(INFER, json=body()).status_code == 200
