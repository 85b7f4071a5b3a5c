"""Grouping (batching.Grouper): of the requests the event loop reads in one turn, the first runs its
forward at once and the others after the turn, one after another, each alone on its own input; a
request alone in its turn is never held; one that fails or goes away costs only itself."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import generate_latest

from mnn_rollout.contract.config import load_config_file
from mnn_runtime import eager
from mnn_runtime.dataplane import DataPlane, InferResult
from mnn_runtime.errors import InferenceFailed
from mnn_runtime.examples import FEATURES
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.model import LoadedModel
from mnn_runtime.registry import Registry
from tests.runtime.test_metrics import value

pytestmark = pytest.mark.timeout(60)
POISON = -7.0  # a request holding it makes its forward fail, as MNN does when it returns no output


@pytest.fixture(scope="module")
def plane(examples_dir: Path) -> DataPlane:
    metrics = RuntimeMetrics("scorer")
    return DataPlane(Registry(load_config_file(examples_dir / "runtime.yaml"), examples_dir, metrics), metrics)


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[np.ndarray]]:
    """Every forward's input, in order (the real forward runs)."""
    seen: list[np.ndarray] = []
    real = LoadedModel.infer

    def recorded(self: LoadedModel, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        seen.append(np.array(arrays[0]))
        if (arrays[0] == POISON).any():
            raise InferenceFailed("model returned no output for the given inputs")
        return real(self, arrays)

    monkeypatch.setattr(LoadedModel, "infer", recorded)
    yield seen


def features(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((1, FEATURES), dtype=np.float32)


def body(x: np.ndarray) -> bytes:
    return json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": list(x.shape),
                                   "data": x.ravel().tolist()}]}).encode()


def output(result: InferResult) -> np.ndarray:
    out = json.loads(result.body)["outputs"][0]
    return np.array(out["data"], np.float32).reshape(out["shape"])


def read_in_one_turn(plane: DataPlane, forwards: list[np.ndarray], inputs: list[np.ndarray],
                     cancel: int | None = None) -> tuple[list[bool], list[int], list[Any]]:
    """Start one request per input from one callback, as a turn of the loop reading that many
    sockets does (each started as the servers start them: ``eager.start``). Returns whether each
    finished at once, how many forwards had run when the turn's reads were over, and each result
    (None for the request ``cancel``, cancelled before the turn ended)."""
    started: list[tuple[bool, Any]] = []
    in_turn: list[int] = []

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        turn = loop.create_future()

        def read_all() -> None:
            for x in inputs:
                started.append(eager.start(loop, plane.infer("scorer", "v1", body(x), {})))
            in_turn.append(len(forwards))
            if cancel is not None:
                started[cancel][1].cancel()
            turn.set_result(None)

        loop.call_soon(read_all)
        await turn
        results = []
        for i, (done, value) in enumerate(started):
            if done:
                results.append(value)
            elif i == cancel:
                with pytest.raises(asyncio.CancelledError):
                    await value
                results.append(None)
            else:
                results.append(await value)
        return results

    results = asyncio.run(main())
    return [done for done, _ in started], in_turn, results


def test_the_first_request_of_a_turn_runs_at_once_and_the_others_after_it_each_alone(
        plane: DataPlane, forwards: list[np.ndarray], examples_dir: Path) -> None:
    inputs = [features(i) for i in range(6)]
    done, in_turn, results = read_in_one_turn(plane, forwards, inputs)
    assert done == [True, False, False, False, False, False]  # the first answered on the reader's stack
    assert in_turn == [1]  # the others' forwards waited for the end of the turn
    assert len(forwards) == 6 and all(f.shape == (1, FEATURES) for f in forwards)  # each alone: nothing stacked
    for x, seen in zip(inputs, forwards):  # in the order they came
        np.testing.assert_array_equal(seen, x)
    reference = LoadedModel.load(examples_dir / "v1.mnn")
    for x, result in zip(inputs, results):
        assert result.status == 200
        np.testing.assert_array_equal(output(result), reference.infer([x])[0].astype(np.float32))


def test_a_request_alone_in_its_turn_is_never_held(plane: DataPlane, forwards: list[np.ndarray]) -> None:
    async def main() -> list[bool]:
        loop = asyncio.get_running_loop()
        done = []
        for i in range(5):  # c=1: each request in a turn of its own
            finished, result = eager.start(loop, plane.infer("scorer", "v1", body(features(i)), {}))
            done.append(finished and result.status == 200)
            await asyncio.sleep(0)
        return done

    assert asyncio.run(main()) == [True] * 5
    assert len(forwards) == 5


def test_a_forward_that_fails_in_a_group_fails_only_its_own_request(
        plane: DataPlane, forwards: list[np.ndarray]) -> None:
    inputs = [features(i) for i in range(4)]
    inputs[2] = inputs[2].copy()
    inputs[2][0, 3] = POISON
    _, _, results = read_in_one_turn(plane, forwards, inputs)
    assert [r.status for r in results] == [200, 200, 500, 200]
    assert "no output" in json.loads(results[2].body)["error"]
    assert len(forwards) == 4


def test_a_request_cancelled_in_its_turn_is_not_answered_and_the_others_are(
        plane: DataPlane, forwards: list[np.ndarray], examples_dir: Path) -> None:
    inputs = [features(i) for i in range(4)]
    _, in_turn, results = read_in_one_turn(plane, forwards, inputs, cancel=2)
    assert in_turn == [1]
    assert results[2] is None and [r.status for i, r in enumerate(results) if i != 2] == [200, 200, 200]
    reference = LoadedModel.load(examples_dir / "v1.mnn")
    for i in (0, 1, 3):
        np.testing.assert_array_equal(output(results[i]), reference.infer([inputs[i]])[0].astype(np.float32))


def test_a_request_that_went_away_while_it_waited_runs_no_forward(
        plane: DataPlane, forwards: list[np.ndarray]) -> None:
    """Started as Tasks (not eagerly), the requests wait on the grouper before the turn ends: one
    cancelled then never reaches the model."""
    inputs = [features(i) for i in range(4)]

    async def main() -> list[Any]:
        tasks = [asyncio.create_task(plane.infer("scorer", "v1", body(x), {})) for x in inputs]
        await asyncio.sleep(0)  # every task has run its first step: the first answered, the rest waiting
        assert len(forwards) == 1
        tasks[2].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    def counted(outcome: str) -> float:
        text = generate_latest(plane.metrics.registry).decode()
        return value(text, "mnn_inference_requests_total", model="scorer", version="v1", outcome=outcome)

    before = {o: counted(o) for o in ("success", "server_error", "client_error")}
    results = asyncio.run(main())
    assert isinstance(results[2], asyncio.CancelledError)
    assert [r.status for i, r in enumerate(results) if i != 2] == [200, 200, 200]
    assert len(forwards) == 3 and not any(np.array_equal(f, inputs[2]) for f in forwards)
    # the three answered are counted; the one whose client went away is no server error of v1
    assert {o: counted(o) - n for o, n in before.items()} == {"success": 3, "server_error": 0, "client_error": 0}


def test_a_slow_models_grouped_requests_are_answered_as_they_go(
        plane: DataPlane, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards of 5 ms each, 4 requests in one turn: each run of grouped forwards stops after
    GROUP_SECONDS, so a request's answer does not wait for the forwards of those after it."""
    import time

    tasks: list[asyncio.Task[Any]] = []
    answered_before: list[int] = []  # at each forward: how many requests had been answered
    real = LoadedModel.infer

    def slow(self: LoadedModel, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        answered_before.append(sum(t.done() for t in tasks))
        time.sleep(0.005)
        return real(self, arrays)

    monkeypatch.setattr(LoadedModel, "infer", slow)

    async def main() -> list[Any]:
        tasks.extend(asyncio.create_task(plane.infer("scorer", "v1", body(features(i)), {})) for i in range(4))
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [r.status for r in results] == [200] * 4
    # the first at once; then one grouped forward per run (each takes more than GROUP_SECONDS),
    # and every request answered before the next one's forward
    assert answered_before == [0, 1, 2, 3]
