"""Open Inference Protocol v2 tensors <-> numpy, with the checks that keep bad input away from MNN."""

from __future__ import annotations

import math

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import BadRequest

# OIP datatype -> numpy dtype (BYTES is not a numeric tensor; MNN models take none).
OIP_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_OIP = {dt: name for name, dt in OIP_DTYPES.items()}

# Which request datatypes each model input dtype accepts without losing information.
ACCEPTS: dict[str, tuple[str, ...]] = {
    "FP32": ("FP32", "FP16"),
    "INT32": ("INT32", "INT64", "INT16", "INT8", "UINT16", "UINT8"),
    "UINT8": ("UINT8",),
}


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as the OIP metadata describes it; -1 is a dynamic dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]

    def as_metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def count(text: str) -> int | None:
    """A count a client wrote as text (a header's byte count, a query's number of runs): ASCII
    digits, else None; over 18 digits it is read as 10**18, over every limit here. str.isdigit()
    alone also takes '²' and the other Unicode digits int() refuses, and int() refuses over 4300."""
    if not text.isascii() or not text.isdigit():
        return None
    return int(text) if len(text) <= 18 else 10**18


def _field(obj: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise BadRequest(f"{where}.{key}: required field is missing")
    return obj[key]


def decode_tensor(obj: Any, where: str, binary: bool = False) -> tuple[str, str, tuple[int, ...], Any]:
    """Structural checks of one request tensor: (name, datatype, shape, data); ``binary``
    tensors carry their data after the JSON instead of in ``data``."""
    if not isinstance(obj, dict):
        raise BadRequest(f"{where}: expected an object with name, datatype, shape and data")
    name = _field(obj, "name", where)
    datatype = _field(obj, "datatype", where)
    shape = _field(obj, "shape", where)
    data = None if binary else _field(obj, "data", where)
    if not isinstance(name, str):
        raise BadRequest(f"{where}.name: expected a string, got {name!r}")
    if not isinstance(datatype, str) or datatype not in OIP_DTYPES:
        raise BadRequest(f"{where}.datatype: {datatype!r} is not supported; valid: {sorted(OIP_DTYPES)}")
    if (
        not isinstance(shape, list)
        or not shape
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise BadRequest(f"{where}.shape: {shape!r} is not a non-empty list of non-negative integers")
    return name, datatype, tuple(shape), data


def to_array(data: Any, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    """Numpy array from flat or nested JSON ``data``; the element count must match ``shape``."""
    if not isinstance(data, list):
        raise BadRequest(f"{where}.data: expected a list, got {type(data).__name__}")
    dtype = OIP_DTYPES[datatype]
    try:
        if dtype.kind == "f":
            arr = np.asarray(data, dtype=dtype)
            # JSON has no NaN or Infinity: a non-finite value was a null or out of range.
            if arr.size and not np.isfinite(arr).all():
                raise BadRequest(f"{where}.data: holds null or values outside the {datatype} range")
        else:
            # Infer first so that 1.5 sent as INT32 is refused instead of truncated.
            raw = np.asarray(data)
            if raw.size and raw.dtype.kind not in "iub":
                raise BadRequest(
                    f"{where}.data: {datatype} tensor holds non-integer values (or integers beyond 64 bits)"
                )
            if raw.size and raw.dtype.kind != "b" and dtype.kind != "b":
                info = np.iinfo(dtype)
                if raw.min() < info.min or raw.max() > info.max:
                    raise BadRequest(f"{where}.data: values outside the {datatype} range")
            arr = raw.astype(dtype, copy=False)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(f"{where}.data: cannot be read as {datatype}: {exc}") from None
    expected = math.prod(shape)
    if arr.size != expected:
        raise BadRequest(f"{where}.data: has {arr.size} elements but shape {list(shape)} needs {expected}")
    return reshaped(arr, shape, where)


def reshaped(arr: np.ndarray, shape: tuple[int, ...], where: str) -> np.ndarray:
    """``arr`` (of the element count ``shape`` needs) in ``shape``. A shape with a 0 beside a
    dimension numpy cannot hold ([2**64-1, 0], [0, 2**63-1]) needs no elements, yet is refused."""
    try:
        return arr.reshape(shape)
    except ValueError as exc:
        raise BadRequest(f"{where}.shape: {list(shape)} is beyond what a tensor can hold: {exc}") from None


def check_against_spec(
    arr: np.ndarray, datatype: str, spec: TensorSpec, max_batch: int, where: str
) -> np.ndarray:
    """Refuse anything MNN would crash or silently misread on; cast to the model's dtype."""
    if datatype not in ACCEPTS.get(spec.datatype, (spec.datatype,)):
        valid = ACCEPTS.get(spec.datatype, (spec.datatype,))
        raise BadRequest(
            f"{where}.datatype: {datatype} does not match input {spec.name!r} of type {spec.datatype}; "
            f"valid: {', '.join(valid)}"
        )
    if arr.ndim != len(spec.shape):
        raise BadRequest(
            f"{where}.shape: {list(arr.shape)} has rank {arr.ndim}, input {spec.name!r} "
            f"expects shape {list(spec.shape)} (-1: any size)"
        )
    for axis, (got, want) in enumerate(zip(arr.shape, spec.shape)):
        if want == -1:
            if axis == 0 and not 1 <= got <= max_batch:
                raise BadRequest(f"{where}.shape[0]: batch size {got} is outside 1-{max_batch} (server.max_batch)")
            if got < 1:
                raise BadRequest(f"{where}.shape[{axis}]: {got} must be at least 1")
        elif got != want:
            raise BadRequest(
                f"{where}.shape: {list(arr.shape)} does not match input {spec.name!r} "
                f"shape {list(spec.shape)} (-1: any size)"
            )
    target = OIP_DTYPES[spec.datatype]
    if target.kind in "iu" and arr.dtype != target and arr.size:
        info = np.iinfo(target)
        if arr.min() < info.min or arr.max() > info.max:
            raise BadRequest(f"{where}.data: values outside the {spec.datatype} range of input {spec.name!r}")
    return np.ascontiguousarray(arr, dtype=target)


def encode_output(name: str, arr: np.ndarray) -> dict[str, Any]:
    """One response tensor; ``data`` stays a numpy array for orjson to serialise natively."""
    datatype = NUMPY_TO_OIP.get(arr.dtype)
    if datatype is None:
        raise ValueError(f"output {name!r} has unsupported dtype {arr.dtype}")
    return {"name": name, "datatype": datatype, "shape": list(arr.shape), "data": arr.reshape(-1)}
