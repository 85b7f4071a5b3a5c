"""One loaded MNN version: load and check it, a pool of clones, and a forward that cannot crash.

Rules this module keeps, each for an MNN behaviour measured with MNN 3.6.1:
- always a runtime manager (``engine.open_runtime``: one per version, from its engine settings):
  without one MNN starts a hidden 4-thread pool (the ``thread_num=`` argument is ignored); a
  process that will fork loads on one thread only (see ``engine``), and a worker loads the
  versions that need more again after the fork (``for_this_process``);
- weights packed at load (``rearrange=True``; otherwise the first forward packs them), which also
  frees the file's unpacked copy, so workers forked afterwards share the packed weights;
- never two concurrent forwards on one module (the same module used from two threads at once
  returns the other thread's output, silently): every call takes its own clone from the pool
  (a clone shares the weights, ~0 extra memory, and takes well under a millisecond);
- inputs are checked against the model's signature before MNN sees them, and always passed as a
  list of Vars (``forward`` segfaults on an ndarray, or on a Var of the wrong shape); the list
  form answers a bad shape with ``[]``: an empty result is an error, not a crash;
- outputs are copied out of MNN's buffers before the Vars go away (``Var.read()`` is a view
  into them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mnn_rollout.contract.config import EngineSpec, VersionSpec

from .codec import TensorSpec
from . import engine
from .engine import EngineInfo, Runtime, default_info, open_runtime
from .errors import BadRequest, InferenceFailed

log = logging.getLogger(__name__)

# Input dtypes MNN's F.const takes correctly (float64 and int64 inputs are silently misread).
_MNN_TO_OIP = {"float": "FP32", "int": "INT32", "uint8": "UINT8"}
_OIP_TO_NUMPY = {"FP32": np.float32, "INT32": np.int32, "UINT8": np.uint8, "FP64": np.float64, "INT64": np.int64}

# Sizes tried for open dimensions other than the batch when no warmup shape is given.
_PROBE_SIZES = (32, 48, 64, 224)
# A loaded module, its inputs, outputs, input formats and the shapes it was warmed up with.
_Loaded = tuple[Any, list[TensorSpec], list[TensorSpec], list[Any], tuple[tuple[int, ...], ...]]


class ModelLoadError(Exception):
    """A version that cannot be served; ``reason`` says which file and why. ``needs_warmup_shapes``:
    the file is fine but leaves input dimensions open that no tried size fits."""

    def __init__(self, reason: str, needs_warmup_shapes: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.needs_warmup_shapes = needs_warmup_shapes


_MODULES: list[tuple[Any, Any]] = []  # (MNN.nn, MNN.expr), imported once: a dotted import costs ~1 µs a request


def _mnn() -> tuple[Any, Any]:
    if not _MODULES:
        import MNN.expr as F
        import MNN.nn as nn

        _MODULES.append((nn, F))
    return _MODULES[0]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _cause(exc: OSError | ValueError) -> str:
    """What went wrong, without repeating the path the message names already."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} ({type(exc).__name__})"
    return f"{type(exc).__name__}: {exc}"


def captured_native_stdout() -> contextlib.AbstractContextManager[list[str]]:
    """Capture what MNN's C++ code prints to fd 1 (it reports missing weight files only there),
    passing it on to stdout as well."""
    return engine.native_output(echo=True)


class LoadedModel:
    """A loaded, checked version with its signature and a pool of clones sharing the weights."""

    def __init__(
        self,
        path: Path,
        module: Any,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        input_formats: Sequence[Any],
        load_seconds: float,
        sha256: str,
        engine: EngineInfo | None = None,
    ) -> None:
        self.path = path
        self.inputs = tuple(inputs)
        self.outputs = tuple(outputs)
        self.load_seconds = load_seconds
        self.sha256 = sha256
        self.engine = engine or default_info()  # what it runs on (and what its spec asked for)
        self._module = module
        self._input_formats = tuple(input_formats)
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self.warm_shapes: tuple[tuple[int, ...], ...] = ()  # the input shapes it ran on at load

    # -- loading -------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path, sha256: str | None = None,
             warmup_shapes: Mapping[str, Sequence[int]] | None = None,
             engine: EngineSpec | None = None, name: str | None = None) -> LoadedModel:
        """Load, verify and warm up one ``.mnn`` file, or raise ModelLoadError with the reason.
        ``warmup_shapes`` gives the shape to warm an input up with when the model leaves
        dimensions other than the batch open (an image model's height and width). ``engine``:
        how MNN runs it (default CPU, one thread); a backend that is missing here, or that cannot
        load the model, falls back to CPU. ``name`` (the version) names its compile cache file."""
        started = time.perf_counter()
        try:
            if not path.is_file():
                raise ModelLoadError(f"model file {str(path)!r} does not exist")
            actual = file_sha256(path)
        except (OSError, ValueError) as exc:  # unreadable (permissions, I/O), or a path no file can have
            raise ModelLoadError(f"model file {str(path)!r} cannot be read: {_cause(exc)}") from None
        if sha256 is not None and actual != sha256:
            raise ModelLoadError(f"model file {str(path)!r} has sha256 {actual}, expected {sha256}")
        stem = f"{name or path.stem}-{actual[:12]}"
        runtime = open_runtime(engine, stem)
        try:
            module, inputs, outputs, formats, warm = cls._load_on(runtime, path, warmup_shapes or {})
        except ModelLoadError as exc:
            if runtime.info.backend == "CPU":
                raise
            runtime = open_runtime(engine, stem, cpu_because=f"it could not be loaded on {runtime.info.backend} "
                                                              f"({exc.reason})")
            module, inputs, outputs, formats, warm = cls._load_on(runtime, path, warmup_shapes or {})
        model = cls(path, module, inputs, outputs, formats, time.perf_counter() - started, actual, runtime.info)
        model.warm_shapes = warm
        return model

    @classmethod
    def _load_on(cls, runtime: Runtime, path: Path, warmup_shapes: Mapping[str, Sequence[int]]) -> _Loaded:
        """Load ``path`` on ``runtime`` and warm it up, its compile cache read before and written
        after (a failed load writes none). An OSError or a ValueError on the way (the cache's path,
        the temporary file MNN's output is read through) fails this version only: ModelLoadError."""
        try:
            runtime.set_cache()
        except (OSError, ValueError) as exc:
            runtime.drop_cache()
            raise ModelLoadError(f"model file {str(path)!r}: its compile cache {runtime.info.cache_file!r} cannot "
                                 f"be opened: {_cause(exc)}") from None
        try:
            loaded = cls._load_module(runtime.manager, path, warmup_shapes)
        except (OSError, ValueError) as exc:
            runtime.drop_cache()
            raise ModelLoadError(f"model file {str(path)!r} cannot be loaded: {_cause(exc)}") from None
        except BaseException:
            runtime.drop_cache()
            raise
        runtime.update_cache()
        return loaded

    @classmethod
    def _load_module(cls, manager: Any, path: Path, warmup_shapes: Mapping[str, Sequence[int]]) -> _Loaded:
        """The module, its inputs, outputs, input formats and warm shapes, or ModelLoadError."""
        nn, _ = _mnn()
        module = None
        # one at a time in the pod: each peaks at ~3.2x the model's size (see engine._load_lock)
        with engine.one_load_at_a_time(), captured_native_stdout() as printed:
            began = time.time()
            try:
                # rearrange: weights are packed at load and the file's copy is let go (measured: a
                # 52 MB fp32 model holds 50 MB instead of 99 MB once run; same speed and outputs)
                module = nn.load_module_from_file(str(path), [], [], runtime_manager=manager, rearrange=True)
            except (SystemError, RuntimeError, ValueError):
                module = None
            if module is not None:
                inputs, formats = cls._read_inputs(module, path)
                outputs, inputs, warm = cls._probe(module, inputs, formats, path, warmup_shapes)
            ended = time.time()
        log.info("model %s: MNN's load ran from %.6f to %.6f (pid %d)", path, began, ended, os.getpid())
        if module is None:
            said = f" (MNN: {'; '.join(printed)})" if printed else ""
            raise ModelLoadError(f"model file {str(path)!r} is not a valid MNN model{said}")
        missing = [line for line in printed if "Can't open file" in line]
        if missing:
            raise ModelLoadError(f"model {str(path)!r} needs a file that cannot be opened: {missing[0]}")
        return module, inputs, outputs, formats, warm

    def for_this_process(self, spec: VersionSpec) -> LoadedModel:
        """In a worker just forked: this version on its own engine. ``self`` (shared with the
        supervisor) unless it was loaded on a fork-safe stand-in (``engine.per_process``); then it
        is loaded again here, or, when the engine it gets here is the stand-in's (a GPU backend
        this node lacks, one thread), shared as it is. A load that fails keeps the stand-in, whatever
        the error: one no handler foresaw (a bug, an MNN error type) is logged with its traceback,
        never raised (it would stop the worker at start, and each worker the supervisor starts again)."""
        if not self.engine.per_process:
            return self
        try:
            runtime = open_runtime(spec.engine, f"{spec.name}-{self.sha256[:12]}")
            if runtime.info.backend == "CPU" and runtime.info.threads == 1:
                return self._on(runtime.info)
            return LoadedModel.load(self.path, self.sha256, spec.warmup_shapes, spec.engine, spec.name)
        except ModelLoadError as exc:
            reason = exc.reason
        except Exception as exc:  # noqa: BLE001 - a bug or an engine error not foreseen keeps the stand-in
            reason = f"{type(exc).__name__}: {exc}, an unexpected error: its traceback is in the runtime's log"
            log.error("version %s could not be loaded again in this worker: %s: %s", spec.name, type(exc).__name__,
                      exc, exc_info=exc)
        return self._on(dataclasses.replace(
            self.engine, per_process=False,
            reason=f"could not be loaded again in this worker ({reason}): serves the supervisor's copy on CPU with "
                   "1 thread"))

    def _on(self, engine: EngineInfo) -> LoadedModel:
        """The same module and weights, described as running on ``engine``."""
        model = LoadedModel(self.path, self._module, self.inputs, self.outputs, self._input_formats,
                            self.load_seconds, self.sha256, engine)
        model.warm_shapes = self.warm_shapes
        return model

    @staticmethod
    def _read_inputs(module: Any, path: Path) -> tuple[list[TensorSpec], list[Any]]:
        info = module.get_info()
        names = list(info.get("inputNames", []))
        variables = list(info.get("inputs", []))
        if not names or len(names) != len(variables):
            raise ModelLoadError(f"model {str(path)!r} declares no usable inputs")
        specs, formats = [], []
        for name, var in zip(names, variables):
            datatype = _MNN_TO_OIP.get(str(var.dtype).rsplit(".", 1)[-1])
            if datatype is None:
                raise ModelLoadError(f"model {str(path)!r} input {name!r} has unsupported dtype {var.dtype}")
            specs.append(TensorSpec(name, datatype, tuple(int(d) for d in var.shape)))
            formats.append(var.data_format)
        return specs, formats

    @classmethod
    def _warm_shapes(cls, inputs: list[TensorSpec], warmup: Mapping[str, Sequence[int]], path: Path,
                     fill: int) -> list[tuple[int, ...]]:
        """Concrete shapes to run the model on: ``warmup`` where given, else the declared shape
        with batch 1 and ``fill`` for every other open dimension."""
        unknown = sorted(set(warmup) - {s.name for s in inputs})
        if unknown:
            raise ModelLoadError(f"warmup_shapes names {unknown}, which are not inputs of {str(path)!r}; "
                                 f"valid: {[s.name for s in inputs]}")
        shapes = []
        for spec in inputs:
            given = warmup.get(spec.name)
            if given is None:
                shapes.append(tuple(1 if (i == 0 and d == -1) else (fill if d == -1 else d)
                                    for i, d in enumerate(spec.shape)))
                continue
            if len(given) != len(spec.shape) or any(w not in (-1, g) for w, g in zip(spec.shape[1:], given[1:])):
                raise ModelLoadError(f"warmup_shapes.{spec.name}: {list(given)} does not fit input {spec.name!r} "
                                     f"of shape {list(spec.shape)} (-1: any size)")
            shapes.append(tuple(int(d) for d in given))
        return shapes

    @classmethod
    def _probe(
        cls, module: Any, inputs: list[TensorSpec], formats: list[Any], path: Path,
        warmup: Mapping[str, Sequence[int]],
    ) -> tuple[list[TensorSpec], list[TensorSpec], tuple[tuple[int, ...], ...]]:
        """Run the model once (this also packs its weights before any fork) and find its outputs.

        MNN reports a dynamic batch dimension as 1, so a second run at batch 2 tells whether
        dimension 0 of the inputs (and which outputs) follow the batch size. Other open
        dimensions (reported as -1) are run at the ``warmup_shapes`` given, else at a few common
        sizes; output dimensions that follow them are reported as -1.
        """
        names = module.get_info().get("outputNames", [])
        open_dims = any(d == -1 for s in inputs for d in s.shape[1:])
        first: list[np.ndarray] = []
        shapes: list[tuple[int, ...]] = []
        for fill in (_PROBE_SIZES if open_dims and not warmup else (_PROBE_SIZES[0],)):
            shapes = cls._warm_shapes(inputs, warmup, path, fill)
            first = cls._try_run(module, [np.zeros(s, _OIP_TO_NUMPY[i.datatype]) for s, i in zip(shapes, inputs)],
                                 formats)
            if first:
                break
        if not first:
            hint = ""
            if open_dims:
                hint = (f"; its inputs leave dimensions open ({ {s.name: list(s.shape) for s in inputs} }): "
                        "give the shape to warm up with in versions[].warmup_shapes, e.g. "
                        f"{ {s.name: [1 if d == -1 else d for d in s.shape] for s in inputs} }")
            raise ModelLoadError(f"model {str(path)!r} produced no output on input shapes "
                                 f"{[list(s) for s in shapes]}{hint}", needs_warmup_shapes=bool(hint))
        outputs = [TensorSpec(n, _numpy_to_oip(a, path), tuple(a.shape)) for n, a in zip(names, first)]
        if open_dims:
            # grow each open dimension alone: an output dimension that changes with one is open too
            # (a size the model cannot run on at all teaches nothing and changes nothing)
            varying: set[tuple[int, int]] = set()
            for k, spec in enumerate(inputs):
                for axis in (a for a, d in enumerate(spec.shape) if a > 0 and d == -1):
                    grown = [tuple(d + 16 if (j == k and a == axis) else d for a, d in enumerate(s))
                             for j, s in enumerate(shapes)]
                    other = cls._try_run(
                        module, [np.zeros(g, _OIP_TO_NUMPY[i.datatype]) for g, i in zip(grown, inputs)], formats)
                    for o, (a, b) in enumerate(zip(first, other)):
                        varying |= {(o, i) for i in range(1, a.ndim) if i >= b.ndim or a.shape[i] != b.shape[i]}
            outputs = [TensorSpec(o.name, o.datatype, tuple(-1 if (n, i) in varying else d
                                                            for i, d in enumerate(o.shape)))
                       for n, o in enumerate(outputs)]
        if all(s[0] == 1 for s in shapes) and all(spec.shape and spec.shape[0] in (1, -1) for spec in inputs):
            batch2 = [np.zeros((2, *s[1:]), _OIP_TO_NUMPY[spec.datatype]) for s, spec in zip(shapes, inputs)]
            second = cls._try_run(module, batch2, formats)
            if second and len(second) == len(first):
                inputs = [TensorSpec(s.name, s.datatype, (-1, *s.shape[1:])) for s in inputs]
                outputs = [
                    TensorSpec(o.name, o.datatype, (-1, *o.shape[1:]))
                    if o.shape and o.shape[0] == 1 and b.shape[:1] == (2,)
                    else o
                    for o, b in zip(outputs, second)
                ]
        return outputs, inputs, tuple(shapes)

    @classmethod
    def _try_run(cls, module: Any, arrays: Sequence[np.ndarray], formats: Sequence[Any]) -> list[np.ndarray]:
        try:
            return cls._run(module, arrays, formats)
        except (ValueError, RuntimeError, SystemError, TypeError):
            return []

    @staticmethod
    def _run(module: Any, arrays: Sequence[np.ndarray], formats: Sequence[Any]) -> list[np.ndarray]:
        _, F = _mnn()
        variables = [
            F.const(arr, list(arr.shape), fmt, _mnn_dtype(F, arr.dtype)) for arr, fmt in zip(arrays, formats)
        ]
        results = module.forward(variables)
        out = []
        for var in results:
            if var.data_format == F.NC4HW4:
                var = F.convert(var, F.NCHW)
            out.append(np.array(var.read(), copy=True))
        return out

    # -- serving -------------------------------------------------------------------------------

    def _acquire(self) -> Any:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._module.clone()

    def _release(self, clone: Any) -> None:
        with self._lock:
            self._free.append(clone)

    @property
    def pool_size(self) -> int:
        return len(self._free)

    def infer(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Forward checked inputs (in ``self.inputs`` order) on a clone no one else is using."""
        clone = self._acquire()
        try:
            outputs = self._run(clone, arrays, self._input_formats)
        finally:
            self._release(clone)
        if len(outputs) != len(self.outputs):
            opened = [i for i, s in enumerate(self.inputs) if any(d == -1 for d in s.shape[1:])]
            if any(arrays[i].shape[1:] != self.warm_shapes[i][1:] for i in opened if i < len(self.warm_shapes)):
                raise BadRequest(
                    f"inputs: model {self.path.name!r} cannot run on input shapes "
                    f"{[list(a.shape) for a in arrays]} (it runs on {[list(s) for s in self.warm_shapes]})")
            raise InferenceFailed(f"model {self.path.name!r} returned no output for the given inputs")
        return outputs


def _numpy_to_oip(arr: np.ndarray, path: Path) -> str:
    for name, dtype in _OIP_TO_NUMPY.items():
        if arr.dtype == dtype:
            return name
    raise ModelLoadError(f"model {str(path)!r} has an output of unsupported dtype {arr.dtype}")


_MNN_DTYPES: dict[np.dtype[Any], Any] = {}


def _mnn_dtype(F: Any, dtype: np.dtype[Any]) -> Any:
    if not _MNN_DTYPES:
        _MNN_DTYPES.update({np.dtype(np.float32): F.float, np.dtype(np.int32): F.int, np.dtype(np.uint8): F.uint8,
                            np.dtype(np.float64): F.double, np.dtype(np.int64): F.int64})
    return _MNN_DTYPES[np.dtype(dtype)]
