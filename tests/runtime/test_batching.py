"""Dynamic batching: concurrent requests share one forward, results are each request's own, a bad
request fails alone, limits and delays hold, and models that cannot be batched are served alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from mnn_runtime.batching import Batcher, batching_off_reason
from mnn_rollout.contract.config import BatchingSpec, ConfigError, parse_config
from mnn_runtime.dataplane import DataPlane
from mnn_runtime.errors import InferenceFailed
from mnn_runtime.examples import FEATURES
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.model import LoadedModel
from mnn_runtime.registry import Registry


@pytest.fixture(scope="module")
def v1(examples_dir: Path) -> LoadedModel:
    return LoadedModel.load(examples_dir / "v1.mnn")


class Counting:
    """The real model, counting the rows of every forward; ``poison`` rows make a forward fail
    the way MNN does when it returns no output."""

    def __init__(self, model: LoadedModel, poison: float | None = None) -> None:
        self.model = model
        self.inputs, self.outputs = model.inputs, model.outputs
        self.forwards: list[int] = []
        self.poison = poison

    def infer(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        self.forwards.append(int(arrays[0].shape[0]))
        if self.poison is not None and bool((arrays[0] == self.poison).any()):
            raise InferenceFailed("model returned no output for the given inputs")
        return self.model.infer(arrays)


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((n, FEATURES), dtype=np.float32)


def run_concurrently(batcher: Batcher, requests: list[np.ndarray]) -> list[Any]:
    async def main() -> list[Any]:
        return await asyncio.gather(*(batcher.infer([r]) for r in requests), return_exceptions=True)

    return batcher.loop.run_until_complete(main())


def make(model: Any, **spec: Any) -> tuple[Batcher, list[int]]:
    loop = asyncio.new_event_loop()
    observed: list[int] = []
    return Batcher(model, BatchingSpec(**spec), loop, observed.append), observed


def test_concurrent_requests_share_one_forward_and_get_their_own_rows(v1: LoadedModel) -> None:
    model = Counting(v1)
    batcher, observed = make(model, max_batch_size=64)
    requests = [rows(1, i) for i in range(12)] + [rows(3, 100)]
    results = run_concurrently(batcher, requests)
    assert model.forwards == [15] and observed == [15]
    for request, result in zip(requests, results):
        expected = v1.infer([request])
        assert result[0].shape == expected[0].shape
        np.testing.assert_allclose(result[0], expected[0], rtol=1e-5, atol=1e-6)


def test_a_batch_never_exceeds_max_batch_size(v1: LoadedModel) -> None:
    model = Counting(v1)
    batcher, _ = make(model, max_batch_size=16)
    results = run_concurrently(batcher, [rows(1, i) for i in range(40)] + [rows(20, 7)])
    assert not any(isinstance(r, BaseException) for r in results)
    assert sorted(model.forwards) == [8, 16, 16, 20]  # the 20-row request is over the limit: it runs alone
    assert max(f for f in model.forwards if f != 20) <= 16


def test_a_request_that_breaks_the_batch_fails_alone(v1: LoadedModel) -> None:
    model = Counting(v1, poison=-7.0)
    batcher, _ = make(model, max_batch_size=64)
    bad = rows(1, 3)
    bad[0, 5] = -7.0
    requests = [rows(1, 1), rows(1, 2), bad, rows(1, 4)]
    results = run_concurrently(batcher, requests)
    assert isinstance(results[2], InferenceFailed)
    for i in (0, 1, 3):
        np.testing.assert_allclose(results[i][0], v1.infer([requests[i]])[0], rtol=1e-5, atol=1e-6)
    assert model.forwards[0] == 4 and sorted(model.forwards[1:]) == [1, 1, 1, 1]  # the batch, then each alone


def test_requests_of_other_shapes_or_dtypes_form_their_own_batches(v1: LoadedModel) -> None:
    model = Counting(v1)
    batcher, _ = make(model, max_batch_size=64)
    narrow = np.zeros((1, FEATURES - 1), np.float32)

    async def main() -> list[Any]:
        return await asyncio.gather(batcher.infer([rows(1, 1)]), batcher.infer([narrow]), batcher.infer([rows(2, 2)]),
                                    return_exceptions=True)

    results = batcher.loop.run_until_complete(main())
    # the narrow request (which the data plane would have refused) is batched with no one
    assert sorted(model.forwards) == [1, 3]
    assert not isinstance(results[0], BaseException) and not isinstance(results[2], BaseException)


def test_the_queue_delay_holds_the_first_request_for_later_ones(v1: LoadedModel) -> None:
    model = Counting(v1)
    batcher, _ = make(model, max_batch_size=64, max_queue_delay_microseconds=200_000)

    async def late(seed: int, after: float) -> Any:
        await asyncio.sleep(after)
        return await batcher.infer([rows(1, seed)])

    async def main() -> list[Any]:
        return await asyncio.gather(late(1, 0), late(2, 0.02), late(3, 0.05))

    batcher.loop.run_until_complete(main())
    assert model.forwards == [3]
    no_delay, _ = make(Counting(v1), max_batch_size=64)
    batcher = no_delay
    batcher.loop.run_until_complete(main())
    assert batcher.model.forwards == [1, 1, 1]  # type: ignore[attr-defined]


def test_a_full_batch_runs_without_waiting_for_the_delay(v1: LoadedModel) -> None:
    model = Counting(v1)
    batcher, _ = make(model, max_batch_size=4, max_queue_delay_microseconds=1_000_000)

    async def main() -> float:
        started = batcher.loop.time()
        await asyncio.gather(*(batcher.infer([rows(1, i)]) for i in range(4)))
        return batcher.loop.time() - started

    assert batcher.loop.run_until_complete(main()) < 0.5
    assert model.forwards == [4]


def fixed_batch_model(path: Path) -> Path:
    """An ONNX graph whose batch dimension is fixed at 1 (it reshapes to [1, 4]), converted to MNN."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from mnn_runtime.convert import convert

    shape = numpy_helper.from_array(np.array([1, 4], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])], "fixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [shape])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path.with_suffix(".onnx")))
    convert(str(path.with_suffix(".onnx")), str(path))
    return path


def test_a_model_without_a_batch_dimension_is_served_unbatched(tmp_path: Path) -> None:
    path = fixed_batch_model(tmp_path / "fixed.mnn")
    model = LoadedModel.load(path)
    assert batching_off_reason(model) == "tensors ['x', 'y'] have no dynamic batch dimension 0"
    config = parse_config({"model": "m", "versions": [{"name": "v1", "uri": str(path), "batching": {}}]})
    metrics = RuntimeMetrics("m")
    plane = DataPlane(Registry(config, None, metrics), metrics)
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, -2, 3, -4]}]})

    async def main() -> list[Any]:
        return await asyncio.gather(*(plane.infer("m", None, body.encode(), {}) for _ in range(3)))

    results = asyncio.run(main())
    assert [r.status for r in results] == [200, 200, 200]
    assert json.loads(results[0].body)["outputs"][0]["data"] == [1, 0, 3, 0]
    status = plane.model_status("m")["versions"]["v1"]["batching"]
    assert status["active"] is False and "no dynamic batch dimension" in status["reason"]


@pytest.mark.parametrize(
    ("batching", "field"),
    [
        ({"max_batch_size": 1}, "max_batch_size"),
        ({"maxBatchSize": 5000}, "maxBatchSize"),
        ({"max_queue_delay_microseconds": -1}, "max_queue_delay_microseconds"),
        ({"max_queue_delay_microseconds": 2_000_000}, "max_queue_delay_microseconds"),
        ({"max_batch": 8}, "max_batch"),
    ],
)
def test_bad_batching_settings_are_refused_naming_the_field(batching: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"model": "m", "versions": [{"name": "v1", "uri": "v1.mnn", "batching": batching}]})
    assert f"versions.0.batching.{field}" in str(err.value)
    assert str(list(batching.values())[0]) in str(err.value)


def test_both_spellings_are_accepted() -> None:
    for batching in ({"max_batch_size": 8, "max_queue_delay_microseconds": 100},
                     {"maxBatchSize": 8, "maxQueueDelayMicroseconds": 100}):
        config = parse_config({"model": "m", "versions": [{"name": "v1", "uri": "v1.mnn", "batching": batching}]})
        assert config.versions[0].batching == BatchingSpec(max_batch_size=8, max_queue_delay_microseconds=100)


def _histogram(text: str, name: str, version: str) -> tuple[float, float]:
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("version") != version:
                continue
            if sample.name == name + "_count":
                count = sample.value
            elif sample.name == name + "_sum":
                total = sample.value
    return count, total


@pytest.mark.parametrize("workers", [1, 2])
def test_served_requests_are_batched_and_correct(model_dir: Path, start_server: Any, workers: int) -> None:
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    for version in config["versions"]:
        if version["name"] == "v1":
            version["batching"] = {"max_batch_size": 16, "max_queue_delay_microseconds": 2000}
    config["weights"] = {"v1": 100}
    config["versions"] = [v for v in config["versions"] if v["name"] == "v1"]
    (model_dir / "runtime.yaml").write_text(yaml.safe_dump(config))
    server = start_server(model_dir / "runtime.yaml", extra_args=["--workers", str(workers)])
    reference = LoadedModel.load(model_dir / "v1.mnn")
    requests = [rows(1 + i % 3, i) for i in range(96)]

    def send(i: int) -> tuple[int, Any]:
        x = requests[i]
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
        if i == 50:
            body["inputs"][0]["shape"] = [1, FEATURES + 1]  # malformed: refused before it can join a batch
        r = httpx.post(server.url + "/v2/models/scorer/infer", json=body, headers={"X-User-Id": f"u{i}"}, timeout=30)
        return r.status_code, r.json()

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(send, range(len(requests))))
    for i, (status, body) in enumerate(answers):
        if i == 50:
            assert status == 400 and "inputs[0]" in body["error"]
            continue
        assert status == 200, body
        out = np.array(body["outputs"][0]["data"], np.float32).reshape(body["outputs"][0]["shape"])
        np.testing.assert_allclose(out, reference.infer([requests[i]])[0], rtol=1e-5, atol=1e-6)
    count, total = _histogram(httpx.get(server.url + "/metrics").text, "mnn_inference_batch_rows", "v1")
    good_rows = sum(r.shape[0] for i, r in enumerate(requests) if i != 50)
    assert total == good_rows  # every good row went through a batched forward exactly once
    assert count < len(requests) - 1  # and some forwards held more than one request
    status = httpx.get(server.url + "/v2/models/scorer/status").json()["versions"]["v1"]["batching"]
    assert status == {"max_batch_size": 16, "max_queue_delay_microseconds": 2000, "active": True, "reason": None}


class Priced(Counting):
    """The real model, made to take ``price(rows)`` seconds per forward."""

    def __init__(self, model: LoadedModel, price: Any) -> None:
        super().__init__(model)
        self.price = price

    def infer(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        import time

        time.sleep(self.price(int(arrays[0].shape[0])))
        return super().infer(arrays)


def _pairs(batcher: Batcher, rounds: int) -> None:
    for r in range(rounds):
        run_concurrently(batcher, [rows(1, 2 * r), rows(1, 2 * r + 1)])


def test_batches_that_cost_more_than_their_requests_alone_are_run_alone(v1: LoadedModel) -> None:
    # like MNN's converted MatMul: one row is fast, two cost many times as much (ten here: a lone row
    # measured late by a descheduled process, beside two other test processes, still costs less)
    model = Priced(v1, lambda n: 0.002 if n == 1 else 0.020)
    batcher, _ = make(model, max_batch_size=8)
    run_concurrently(batcher, [rows(1, 0)])  # learns a lone row's cost
    _pairs(batcher, 10)
    assert model.forwards[:2] == [1, 2]  # the first pair is tried as a batch, and found slower
    later = model.forwards[2:]
    assert later.count(2) <= 1 and later.count(1) >= 18  # then pairs run alone (one re-check allowed)
    key = (("<f4", (FEATURES,)),)  # costs are kept per input shape (beyond dim 0) and row count
    assert batcher.cost[(key, 2)] > 2 * batcher.cost[(key, 1)]


def test_batches_that_pay_keep_running_as_batches(v1: LoadedModel) -> None:
    # two rows cost little more than one; prices far above a descheduled process's delay (the suite
    # runs three test processes on 2 cores), which the batcher's wall-clock costs would take in
    model = Priced(v1, lambda n: 0.010 if n == 1 else 0.011)
    batcher, _ = make(model, max_batch_size=8)
    run_concurrently(batcher, [rows(1, 0)])
    _pairs(batcher, 10)
    assert model.forwards[1:] == [2] * 10
