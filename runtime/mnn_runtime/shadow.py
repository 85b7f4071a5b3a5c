"""Shadow traffic: a share of the requests stable answers also runs on another version, off the
request's path, and the two answers are compared (runtime config ``shadow``).

The user gets stable's answer as usual. Afterwards the request's checked inputs and stable's
outputs go into a bounded queue (``QUEUE_SIZE`` per process); when it is full the request is
dropped and counted, never waited for. One thread per process takes them out, runs the shadow
version's forward (on a clone of its own: ``LoadedModel.infer`` is thread-safe) and counts the
outcome, the forward time, argmax agreement and absolute differences (``metrics.ShadowMetrics``).
Nothing a shadow run does reaches the user: a forward that raises, inputs or outputs that do not
fit stable's, are counted as errors.

MNN's ``forward`` holds the GIL (measured with MNN 3.6.1: a thread running a 4 ms forward in a
loop held it for 62% of the time, in stretches of ~10 ms). A busy shadow thread would therefore
slow the event loop down, so it keeps to a duty cycle (``Shadow.pause``): up to ``MAX_SHARE`` of
the worker's time while its jobs are short (no longer than ``SHORT_JOB`` or than stable's own
forward on the request), less in proportion as they get longer. A request that arrives while a
shadow forward runs waits for it, so how often a long one may run is what bounds stable's tail
latency; a version whose forward is slow gets fewer jobs run, and more dropped, instead of more of
the worker's time. (MNN's session API releases the GIL, but each session copies the weights: it
would cost a copy of the shadow version per worker. Not done here.)

Which requests: each routed request (not a pinned one) that stable answered is drawn at random
with probability ``percent``. A per-user draw through the routing hash was not chosen: no user
sees the shadow, so stickiness buys nothing, and a draw per user would make the sample a fixed set
of users whose share of requests is not ``percent`` (a few heavy users dominate it) and that
overlaps the buckets the canary takes next.

The shadow version must already be loaded: a version unloaded while idle (or being loaded by the
supervisor for the next workers) is skipped, never loaded here; one that failed to load counts
as an error. The registry keeps the shadow version loaded (the idle unloader leaves it alone) and
loads it when a config names it.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mnn_rollout.contract.config import RuntimeConfig

from .codec import NUMPY_TO_OIP, TensorSpec, check_against_spec
from .errors import BadRequest
from .metrics import ShadowMetrics
from .model import LoadedModel
from .registry import FAILED, READY, Registry, Snapshot

log = logging.getLogger(__name__)

QUEUE_SIZE = 64  # jobs waiting per process; beyond it a request is dropped (and counted), not queued
QUEUE_BYTES = 64 * 1024**2  # ... and the tensors they hold (64 images of 1x3x640x640 would be 315 MB)
MAX_SHARE = 0.1  # of a worker's time its shadow thread may take with jobs no longer than SHORT_JOB ...
SHORT_JOB = 0.0005  # ... or than stable's forward on that request; a job k times longer gets 1/k of it
_NO_LIMIT = 1 << 30  # the batch size stable accepted is the one to check


def setting(config: RuntimeConfig) -> dict[str, Any] | None:
    """What a process shadows under ``config``, as ``/status`` reports it (and a worker tells the
    supervisor): ``{"version": V, "percent": N}``, or None. The operator compares it with the shadow
    step it wrote: the table's digest leaves the shadow out, and its weights do not change."""
    shadow = config.shadow
    return None if shadow is None else {"version": shadow.version, "percent": shadow.percent}


class ShadowError(Exception):
    """A shadow run that could not be compared; ``reason`` is its metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class Comparison:
    """How a shadow's outputs differ from stable's on one request."""

    rows: int  # rows of class-like outputs (float, last dimension > 1)
    agreeing: int  # of those, rows with the same argmax over the last axis
    diff_sum: float  # sum of |shadow - stable| over every element of every output
    diff_count: int  # elements compared
    diff_max: float  # the largest of them


@dataclass(frozen=True)
class Job:
    """One request to run in the shadow: stable's checked inputs and its outputs."""

    version: str  # the shadow version
    inputs: tuple[TensorSpec, ...]  # stable's input signature, in the order of ``arrays``
    arrays: Sequence[np.ndarray]
    outputs: tuple[TensorSpec, ...]  # stable's output signature, in the order of ``results``
    results: Sequence[np.ndarray]
    stable_seconds: float | None  # stable's forward time on it (None: run in a batch)
    nbytes: int = 0  # what its tensors hold


def fit_inputs(model: LoadedModel, job: Job) -> list[np.ndarray]:
    """Stable's inputs in the shadow model's order, checked against its signature (MNN crashes on
    a tensor of the wrong shape); ShadowError ``mismatch`` when they do not fit."""
    given = {spec.name: arr for spec, arr in zip(job.inputs, job.arrays)}
    fitted = []
    for spec in model.inputs:
        arr = given.get(spec.name)
        if arr is None:
            raise ShadowError("mismatch", f"input {spec.name!r} of {job.version!r} is not one of stable's: "
                                          f"{sorted(given)}")
        try:
            fitted.append(check_against_spec(arr, NUMPY_TO_OIP[arr.dtype], spec, _NO_LIMIT, f"inputs.{spec.name}"))
        except BadRequest as exc:
            raise ShadowError("mismatch", exc.message) from None
    return fitted


def compare(stable: Sequence[TensorSpec], expected: Sequence[np.ndarray],
            shadow: Sequence[TensorSpec], got: Sequence[np.ndarray]) -> Comparison:
    """Compare outputs by name: argmax per row where they are class-like, absolute differences
    everywhere. ShadowError ``mismatch`` when names or shapes differ, ``nonfinite`` when one side
    has NaN or infinity where the other has something else."""
    a = {spec.name: arr for spec, arr in zip(stable, expected)}
    b = {spec.name: arr for spec, arr in zip(shadow, got)}
    if set(a) != set(b):
        raise ShadowError("mismatch", f"outputs differ: stable has {sorted(a)}, the shadow {sorted(b)}")
    rows = agreeing = count = 0
    total = top = 0.0
    for name in sorted(a):
        x, y = a[name], b[name]
        if x.shape != y.shape:
            raise ShadowError("mismatch", f"output {name!r} has shape {list(y.shape)}, stable's {list(x.shape)}")
        x64, y64 = x.astype(np.float64, copy=False), y.astype(np.float64, copy=False)
        with np.errstate(invalid="ignore"):
            diff = np.abs(x64 - y64)
            diff[(x64 == y64) | (np.isnan(x64) & np.isnan(y64))] = 0.0  # inf == inf, NaN where stable had NaN
        if not np.isfinite(diff).all():
            raise ShadowError("nonfinite", f"output {name!r} has NaN or infinity where the other version has not")
        if diff.size:
            total += float(diff.sum())
            top = max(top, float(diff.max()))
            count += diff.size
        if x.dtype.kind == "f" and y.dtype.kind == "f" and x.ndim >= 2 and x.shape[-1] > 1:
            last = x.shape[-1]
            rows += x.size // last
            agreeing += int((x.reshape(-1, last).argmax(-1) == y.reshape(-1, last).argmax(-1)).sum())
    return Comparison(rows, agreeing, total, count, top)


class Shadow:
    """Offers requests to the shadow version and runs them on a thread of this process."""

    def __init__(self, registry: Registry, metrics: ShadowMetrics, queue_size: int = QUEUE_SIZE,
                 max_share: float = MAX_SHARE, draw: Callable[[], float] = random.random,
                 queue_bytes: int = QUEUE_BYTES) -> None:
        self.registry = registry
        self.metrics = metrics
        self.queue_size, self.queue_bytes = queue_size, queue_bytes
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self.max_share = max_share
        self._draw = draw  # random.random is reseeded in every forked worker: each draws its own
        self._pid = 0  # the process the queue and thread below belong to (a fork starts its own)
        self._queue: queue.Queue[Job | None] = queue.Queue(queue_size)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._logged: set[tuple[str, str]] = set()

    def offer(self, snap: Snapshot, version: str, pinned: bool, model: LoadedModel,
              arrays: Sequence[np.ndarray], outputs: Sequence[np.ndarray], stable_seconds: float | None) -> bool:
        """After stable answered a request: queue it for the shadow version when the config has
        one and the draw says so; a full queue drops it. Returns whether it was queued; never
        raises and never waits."""
        shadow = snap.config.shadow
        if shadow is None or pinned or version != snap.config.stable_version:
            return False
        if shadow.percent < 100 and self._draw() * 100 >= shadow.percent:
            return False
        try:
            jobs = self._queue_here()
            size = sum(a.nbytes for a in arrays) + sum(o.nbytes for o in outputs)
            with self._bytes_lock:
                room = self._queued_bytes + size <= self.queue_bytes
                if room:
                    self._queued_bytes += size
            if room:
                try:
                    jobs.put_nowait(Job(shadow.version, model.inputs, arrays, model.outputs, outputs,
                                        stable_seconds, size))
                    return True
                except queue.Full:
                    self._taken(size)
            self.metrics.count(shadow.version, "dropped")
        except Exception:  # noqa: BLE001 - the user's answer is ready: a bug here must not cost it
            log.exception("shadow: a request could not be queued")
        return False

    def run(self, job: Job) -> str:
        """Run one job on this thread and count it; returns its outcome."""
        snap = self.registry.snapshot
        state = snap.versions.get(job.version)
        if snap.config.shadow_version != job.version:  # the config moved on while it waited: not run
            state = None
        elif state is not None and state.state == FAILED:
            return self._error(job.version, ShadowError("not_loaded", f"not loaded: {state.reason}"))
        if state is None or state.state != READY or state.model is None:  # offloaded, pending, no longer shadow
            self.metrics.count(job.version, "skipped")
            return "skipped"
        model = state.model
        try:
            inputs = fit_inputs(model, job)
            started = time.perf_counter()
            try:
                results = model.infer(inputs)
            except BadRequest as exc:  # a shape the model cannot run on
                raise ShadowError("mismatch", exc.message) from None
            except Exception as exc:  # noqa: BLE001 - counted, never raised
                raise ShadowError("failed", f"{type(exc).__name__}: {exc}") from None
            self.metrics.timed(job.version, time.perf_counter() - started, job.stable_seconds)
            found = compare(job.outputs, job.results, model.outputs, results)
        except ShadowError as exc:
            return self._error(job.version, exc)
        self.metrics.compared(job.version, found.rows, found.agreeing, found.diff_sum, found.diff_count,
                              found.diff_max)
        return "compared"

    def close(self) -> None:
        """Stop this process's shadow thread (jobs still queued are let go)."""
        thread = self._thread
        if thread is None or self._pid != os.getpid():
            return
        self._thread = None
        self._stop.set()
        try:
            self._queue.put_nowait(None)  # wakes a thread waiting for a job
        except queue.Full:  # it is busy: it sees the stop after this job
            pass
        thread.join(timeout=2)

    def pause(self, took: float, stable_seconds: float | None) -> float:
        """How long the shadow thread rests after a job that took ``took`` s: long enough to keep to
        ``max_share`` of the time, scaled down by how much longer the job was than ``SHORT_JOB`` or
        stable's forward (a 4 ms job after a 0.03 ms stable forward: 1.1%, a rest of ~0.4 s)."""
        short = max(SHORT_JOB, stable_seconds or 0.0)
        share = self.max_share * min(1.0, short / took) if took > 0 else self.max_share
        return took * (1 / share - 1)

    def _error(self, version: str, exc: ShadowError) -> str:
        self.metrics.count(version, "error", exc.reason)
        if (version, exc.reason) not in self._logged:  # once per version and reason: the metrics count the rest
            self._logged.add((version, exc.reason))
            log.warning("shadow version %s: %s (%s); further ones are only counted", version, exc, exc.reason)
        return "error"

    def _taken(self, size: int) -> None:
        with self._bytes_lock:
            self._queued_bytes -= size

    def _queue_here(self) -> queue.Queue[Job | None]:
        if self._pid != os.getpid():  # first use in this process: a forked worker has no thread yet
            self._pid = os.getpid()
            self._queue = queue.Queue(self.queue_size)
            self._queued_bytes, self._bytes_lock = 0, threading.Lock()
            self._logged = set()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._consume, args=(self._queue, self._stop), name="shadow",
                                            daemon=True)
            self._thread.start()
        return self._queue

    def _consume(self, jobs: queue.Queue[Job | None], stop: threading.Event) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            self._taken(job.nbytes)
            # this thread's CPU time: what it held the GIL for, without its waits for it (the event
            # loop's turns in between) or for a core
            started = time.thread_time()
            try:
                self.run(job)
            except Exception:  # noqa: BLE001 - a bug costs one comparison, never the thread
                log.exception("shadow: a comparison failed unexpectedly")
            if stop.wait(self.pause(time.thread_time() - started, job.stable_seconds)):
                return
