"""Dynamic batching: concurrent requests for one version go through one ``forward``; and, for
every version, grouping: requests read together run their forwards one after another.

MNN's ``forward`` holds the GIL (measured: two threads on two clones run no faster than one), so
a thread pool buys no parallelism and costs a thread hop per request; forwards therefore run on
the event loop itself. That makes batching cheap to get right: while one forward runs, new
requests wait in their sockets; when it returns, the loop parses all of them before the next
batch is cut, so even a queue delay of 0 batches the requests that arrived together. A positive
delay holds the first request of a batch that long for more to join.

Rules:
- a batch holds requests whose inputs agree in everything but dimension 0 (dtype and the other
  dimensions); others form batches of their own;
- a request is checked before it joins, so a malformed request fails alone and never reaches a
  batch; if a batched forward fails anyway, each of its requests runs again alone, so only the
  one that cannot run fails;
- a request with ``max_batch_size`` rows or more runs alone at once;
- a batch is only run as one forward when that pays: the batcher keeps the measured time of a
  forward per row count and runs a batch's requests one by one when the batch is known to take
  longer than they would (measured here: MNN's converted ONNX MatMul takes 3 ms for one row and
  15 ms for two to ten; Gemm 1.0 ms and 1.8 ms). One batch in ``_EXPLORE_EVERY`` is run whole
  anyway, so the costs stay current.

Grouping (``Grouper``, always on, batching or not): the first request the loop reads in a turn
runs its forward at once, as it comes; the others read in that same turn wait until the turn is
over and then run theirs one after another, each alone, on its own input, exactly as it would have
(nothing is stacked: the same numbers). Run as they came, each request's parsing, forward and
answer alternated with the next's, and the forward, served between two requests' Python, took
twice its time in a loop (cold caches and branch predictors: bench/RESULTS.md, the fifth pass);
parsed together, forwarded together and answered together, a request cost about a third less CPU
at c=32 (bench/RESULTS.md, the seventh pass). A request alone in its turn (c=1) is not held at all.
The forwards run in runs of at most ``GROUP_SECONDS``: the requests done by then are answered
before the next run starts, so a slow model's requests are answered as they go, not all after the
last one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mnn_rollout.contract.config import BatchingSpec
from .model import LoadedModel

Observe = Callable[[int], None]  # rows in a forward
_EXPLORE_EVERY = 32
_SMOOTHING = 0.2  # weight of the newest measurement in a row count's forward time
GROUP_SECONDS = 0.001  # a run of grouped forwards, after which those done are answered (Grouper)


@dataclass
class _Batch:
    rows: int = 0
    items: list[tuple[Sequence[np.ndarray], int, asyncio.Future[list[np.ndarray]]]] = field(default_factory=list)
    timer: asyncio.Handle | None = None


def batching_off_reason(model: LoadedModel) -> str | None:
    """Why this model cannot be batched (None: it can): every input and output must have a
    dynamic dimension 0 for rows to be stacked and split again."""
    fixed = [s.name for s in (*model.inputs, *model.outputs) if not s.shape or s.shape[0] != -1]
    if fixed:
        return f"tensors {fixed} have no dynamic batch dimension 0"
    return None


class Batcher:
    """Collects one version's requests on one event loop and runs them as batches."""

    def __init__(self, model: LoadedModel, spec: BatchingSpec, loop: asyncio.AbstractEventLoop,
                 observe: Observe | None = None) -> None:
        self.model = model
        self.spec = spec
        self.loop = loop
        self.observe = observe
        self._delay = spec.max_queue_delay_microseconds / 1e6
        self._open: dict[tuple[Any, ...], _Batch] = {}
        self.cost: dict[tuple[Any, int], float] = {}  # (input shapes but dim 0, rows) -> smoothed seconds
        self._batches = 0

    async def infer(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        rows = int(arrays[0].shape[0])
        limit = self.spec.max_batch_size
        key = tuple((a.dtype.str, a.shape[1:]) for a in arrays)
        if rows >= limit:
            return self._forward(arrays, rows, key)
        batch = self._open.get(key)
        if batch is not None and batch.rows + rows > limit:
            self._flush(key, batch)
            batch = None
        if batch is None:
            batch = self._open[key] = _Batch()
            if self._delay > 0:
                batch.timer = self.loop.call_later(self._delay, self._flush, key, batch)
            else:
                batch.timer = self.loop.call_soon(self._flush, key, batch)
        future: asyncio.Future[list[np.ndarray]] = self.loop.create_future()
        batch.items.append((arrays, rows, future))
        batch.rows += rows
        if batch.rows >= limit:
            self._flush(key, batch)
        return await future

    def _forward(self, arrays: Sequence[np.ndarray], rows: int, key: tuple[Any, ...]) -> list[np.ndarray]:
        started = time.perf_counter()
        outputs = self.model.infer(arrays)
        took = time.perf_counter() - started
        known = self.cost.get((key, rows))
        self.cost[(key, rows)] = took if known is None else known + _SMOOTHING * (took - known)
        if self.observe is not None:
            self.observe(rows)
        return outputs

    def _pays(self, key: tuple[Any, ...], items: list[tuple[Sequence[np.ndarray], int, Any]], rows: int) -> bool:
        """Whether one forward of ``rows`` is not known to be slower than the requests alone."""
        self._batches += 1
        whole = self.cost.get((key, rows))
        alone = [self.cost.get((key, n)) for _, n, _ in items]
        if whole is None or None in alone or self._batches % _EXPLORE_EVERY == 0:
            return True
        return whole <= sum(alone)  # type: ignore[arg-type]

    def _flush(self, key: tuple[Any, ...], batch: _Batch) -> None:
        if self._open.get(key) is batch:
            del self._open[key]
        if batch.timer is not None:
            batch.timer.cancel()
            batch.timer = None
        items, batch.items = batch.items, []
        if not items:
            return
        if len(items) == 1 or not self._pays(key, items, batch.rows):
            for item in items:
                self._settle(key, item)
            return
        try:
            stacked = [np.concatenate([item[0][i] for item in items]) for i in range(len(items[0][0]))]
            outputs = self._forward(stacked, batch.rows, key)
            if any(out.shape[:1] != (batch.rows,) for out in outputs):
                raise ValueError("an output does not follow the batch size")
        except Exception:  # noqa: BLE001 - one bad request must not fail the others: run each alone
            for item in items:
                self._settle(key, item)
            return
        start = 0
        for _, rows, future in items:
            if not future.done():
                future.set_result([out[start:start + rows] for out in outputs])
            start += rows

    def _settle(self, key: tuple[Any, ...],
                item: tuple[Sequence[np.ndarray], int, asyncio.Future[list[np.ndarray]]]) -> None:
        arrays, rows, future = item
        if future.done():  # the caller went away
            return
        try:
            future.set_result(self._forward(arrays, rows, key))
        except Exception as exc:  # noqa: BLE001 - delivered to the request's own caller
            future.set_exception(exc)


Timed = tuple[list[np.ndarray], float]  # a forward's outputs, and the seconds it took
_Waiting = tuple[LoadedModel, Sequence[np.ndarray], "asyncio.Future[Timed]"]  # a grouped request's forward


def timed_forward(model: LoadedModel, arrays: Sequence[np.ndarray]) -> Timed:
    started = time.perf_counter()
    outputs = model.infer(arrays)
    return outputs, time.perf_counter() - started


class Grouper:
    """One event loop's requests, grouped by the turn of the loop that read them (see above)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._armed = False  # a request was read in this turn already: the others wait for its end
        self._queue: list[_Waiting] = []

    def now(self) -> bool:
        """True: run this request's forward at once (the first of its turn); False: ``later``."""
        if self._armed:
            return False
        self._armed = True
        self.loop.call_soon(self._turn_over)  # after every callback of this turn's reads
        return True

    def later(self, model: LoadedModel, arrays: Sequence[np.ndarray]) -> asyncio.Future[Timed]:
        """``timed_forward``'s answer, once the turn is over and the ones before it ran."""
        future: asyncio.Future[Timed] = self.loop.create_future()
        self._queue.append((model, arrays, future))
        return future

    def _turn_over(self) -> None:
        self._armed = False
        queue, self._queue = self._queue, []
        self._run(queue, 0)

    def _run(self, queue: list[_Waiting], start: int) -> None:
        """Forward ``queue[start:]`` in order, for at most ``GROUP_SECONDS``; then the rest after
        the answers of those done (their callers resume first: ``call_soon`` keeps the order)."""
        until = time.perf_counter() + GROUP_SECONDS
        for i in range(start, len(queue)):
            model, arrays, future = queue[i]
            if future.done():  # its caller went away (a gRPC call reset, a deadline)
                continue
            if time.perf_counter() > until:
                self.loop.call_soon(self._run, queue, i)
                return
            try:
                future.set_result(timed_forward(model, arrays))
            except Exception as exc:  # noqa: BLE001 - delivered to the request's own caller
                future.set_exception(exc)
            except BaseException:  # never leave the others waiting for good
                self.loop.call_soon(self._run, queue, i + 1)
                raise
