"""Models that leave dimensions other than the batch open (PP-OCR's classifier and recogniser take
[N, 3, H, W]): they convert, load (warmed up at a guessed or a configured shape), serve, report
their open dimensions as -1, and a shape the model cannot run on is the client's 400."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from mnn_rollout.contract.config import ConfigError, parse_config
from mnn_runtime.convert import convert
from mnn_runtime.model import LoadedModel, ModelLoadError


def dynamic_hw_onnx(height: int | str = "H") -> onnx.ModelProto:
    """Conv + pooling heads: a class score [N, 4] and a per-column sequence [N, W]. With ``height``
    fixed, a Reshape makes every other height fail (as PP-OCR's recogniser needs H = 48)."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        helper.make_node("Flatten", ["g"], ["cls"]),
        helper.make_node("ReduceMean", ["r"], ["seq"], axes=[1, 2], keepdims=0),
    ]
    inits = [w]
    if isinstance(height, int):  # [N, 4, H, W] -> [N, 4 * height, W]: only this height fits
        inits.append(numpy_helper.from_array(np.array([0, 4 * height, -1], np.int64), "s"))
        nodes.insert(2, helper.make_node("Reshape", ["r", "s"], ["flat"]))
        nodes[-1] = helper.make_node("ReduceMean", ["flat"], ["seq"], axes=[1], keepdims=0)
    graph = helper.make_graph(
        nodes, "dyn_hw",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, "H", "W"])],
        [helper.make_tensor_value_info("cls", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("seq", TensorProto.FLOAT, ["N", "W"])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def build(tmp_path: Path, height: int | str = "H") -> tuple[Path, onnx.ModelProto]:
    proto = dynamic_hw_onnx(height)
    onnx.save(proto, tmp_path / "dyn.onnx")
    return convert(tmp_path / "dyn.onnx", tmp_path / "dyn.mnn"), proto


def test_a_model_with_open_height_and_width_loads_and_matches_onnx(tmp_path: Path) -> None:
    path, proto = build(tmp_path)
    model = LoadedModel.load(path)
    assert model.inputs[0].shape == (-1, 3, -1, -1)
    assert [o.shape for o in model.outputs] == [(-1, 4), (-1, -1)]
    for shape in ((1, 3, 48, 200), (2, 3, 32, 77)):
        x = np.random.default_rng(1).uniform(-1, 1, shape).astype(np.float32)
        for ref, got in zip(ReferenceEvaluator(proto).run(None, {"x": x}), model.infer([x])):
            assert ref.shape == got.shape
            assert np.abs(ref - got).max() < 1e-4


def test_a_model_that_runs_on_one_height_only_is_found_or_told_its_warmup_shape(tmp_path: Path) -> None:
    path, _ = build(tmp_path, height=48)  # 48 is among the sizes tried
    model = LoadedModel.load(path)
    assert model.warm_shapes[0][2] == 48
    path, _ = build(tmp_path, height=40)  # 40 is not: the reason says how to fix it
    with pytest.raises(ModelLoadError) as err:
        LoadedModel.load(path)
    assert "warmup_shapes" in err.value.reason and "'x': [1, 3, 1, 1]" in err.value.reason
    model = LoadedModel.load(path, warmup_shapes={"x": [1, 3, 40, 100]})
    assert model.warm_shapes == ((1, 3, 40, 100),)
    with pytest.raises(ModelLoadError, match=r"warmup_shapes.x: \[1, 4, 40, 100\] does not fit"):
        LoadedModel.load(path, warmup_shapes={"x": [1, 4, 40, 100]})
    with pytest.raises(ModelLoadError, match=r"warmup_shapes names \['y'\]"):
        LoadedModel.load(path, warmup_shapes={"y": [1, 3, 40, 100]})


def test_bad_warmup_shapes_in_the_config_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"versions.0.warmupShapes: .*'x' is \[1, 0\]"):
        parse_config({"model": "m", "versions": [{"name": "v1", "uri": "a.mnn", "warmupShapes": {"x": [1, 0]}}]})


def test_served_with_open_dimensions_and_a_wrong_height_is_a_400(tmp_path: Path, start_server: Any) -> None:
    path, proto = build(tmp_path, height=40)
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump({"model": "ocr", "versions": [
        {"name": "v1", "uri": path.name, "warmup_shapes": {"x": [1, 3, 40, 64]}}]}))
    server = start_server(config)
    meta = httpx.get(server.url + "/v2/models/ocr").json()
    assert meta["inputs"][0]["shape"] == [-1, 3, -1, -1]
    x = np.random.default_rng(2).uniform(-1, 1, (1, 3, 40, 1500)).astype(np.float32)  # wider than max_batch
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = httpx.post(server.url + "/v2/models/ocr/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    seq = next(o for o in r.json()["outputs"] if o["name"] == "seq")
    expected = ReferenceEvaluator(proto).run(None, {"x": x})[1]
    assert seq["shape"] == [1, 1500]
    assert np.abs(np.array(seq["data"], np.float32) - expected.ravel()).max() < 1e-4
    bad = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3, 41, 100], "data": [0.5] * 12300}]}
    r = httpx.post(server.url + "/v2/models/ocr/infer", json=bad, timeout=30)  # a height the model cannot take
    assert r.status_code == 400 and "cannot run on input shapes [[1, 3, 41, 100]]" in r.json()["error"]
    assert httpx.get(server.url + "/v2/health/ready").status_code == 200  # the worker is fine
