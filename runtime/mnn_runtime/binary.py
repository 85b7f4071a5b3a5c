"""Triton's binary tensor data extension for the REST API.

A request whose ``Inference-Header-Content-Length`` header is N carries its JSON in the first N
bytes of the body and raw little-endian tensor bytes after it; each input that has
``parameters.binary_data_size`` takes that many bytes, in order. Outputs are returned as raw
bytes when the request asks (``parameters.binary_data_output`` or an output's
``parameters.binary_data``), with the response's JSON length in the same header. Lengths that
lie get 400, never a crash or a hang.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .codec import OIP_DTYPES, count, reshaped
from .errors import BadRequest

HEADER = "inference-header-content-length"
RESPONSE_HEADER = "Inference-Header-Content-Length"


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON part, binary part) of a request body."""
    if header_length is None:
        return body, b""
    n = count(header_length)
    if n is None:
        raise BadRequest(f"{RESPONSE_HEADER}: {header_length[:40]!r} is not a byte count")
    if not 0 < n <= len(body):
        raise BadRequest(f"{RESPONSE_HEADER}: {header_length[:40]} is outside the body of {len(body)} bytes")
    return body[:n], body[n:]


def binary_sizes(raw_inputs: list[Any], binary: bytes) -> list[int | None]:
    """The binary size each input claims; they must add up to exactly the binary part."""
    sizes: list[int | None] = []
    for i, obj in enumerate(raw_inputs):
        params = obj.get("parameters") if isinstance(obj, dict) else None
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            raise BadRequest(f"inputs[{i}].parameters.binary_data_size: {size!r} is not a byte count")
        sizes.append(size)
    claimed = sum(s for s in sizes if s)
    if claimed != len(binary):
        raise BadRequest(f"binary data: inputs claim {claimed} bytes but the body carries {len(binary)}")
    return sizes


# Each datatype as raw little-endian bytes carry it.
_WIRE_DTYPES = {name: dtype.newbyteorder("<") for name, dtype in OIP_DTYPES.items()}


def binary_array(chunk: bytes, datatype: str, shape: tuple[int, ...], where: str) -> np.ndarray:
    dtype = _WIRE_DTYPES[datatype]
    expected = math.prod(shape) * dtype.itemsize  # math.prod: exact, and 3 µs less than np.prod
    if len(chunk) != expected:
        raise BadRequest(f"{where}.parameters.binary_data_size: {len(chunk)} bytes, but shape {list(shape)} of "
                         f"{datatype} needs {expected}")
    arr = reshaped(np.frombuffer(chunk, dtype=dtype), shape, where)
    if dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
        raise BadRequest(f"{where}: holds NaN or infinite values")
    return arr


def wants_binary(request: dict[str, Any]) -> tuple[bool, set[str]]:
    """(all outputs binary?, names of outputs asked for in binary)."""
    params = request.get("parameters")
    every = isinstance(params, dict) and params.get("binary_data_output") is True
    named = set()
    for obj in request.get("outputs") or []:
        p = obj.get("parameters") if isinstance(obj, dict) else None
        if isinstance(p, dict) and p.get("binary_data") is True:
            named.add(obj.get("name"))
    return every, named
