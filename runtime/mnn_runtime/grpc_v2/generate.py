"""Regenerate the Python code of ``grpc_predict_v2.proto`` (run by hand, never at serving time).

    python -m venv /tmp/gen && /tmp/gen/bin/pip install 'grpcio-tools==1.76.0'
    /tmp/gen/bin/python runtime/mnn_runtime/grpc_v2/generate.py

grpcio-tools 1.76 bundles protoc for protobuf 6.31.1: the generated code then needs
``protobuf>=6.31.1`` (6.x and 7.x both load it) and ``grpcio>=1.76``. Newer tools raise both floors.

Two edits follow protoc:

- ``_pb2_grpc.py`` imports its ``_pb2`` relatively (protoc writes a top-level import).
- ``_pb2.py`` builds its descriptors in a private pool instead of protobuf's default one: a client
  library in the same process (``tritonclient.grpc``) registers the very same ``inference.*``
  symbols from its own file, and two files defining one symbol in one pool fail to load.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "grpc_predict_v2.proto"
STEM = PROTO.removesuffix(".proto")

DEFAULT_POOL = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
PRIVATE_POOL = (
    "# mnn-rollout: a private pool, so that another copy of the inference.* protocol (tritonclient)\n"
    "# can be loaded in the same process.\n"
    "_POOL = _descriptor_pool.DescriptorPool()\n"
    "DESCRIPTOR = _POOL.AddSerializedFile("
)


def _replace_once(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise SystemExit(f"{where}: expected exactly one {old!r}; protoc's output changed")
    return text.replace(old, new)


def main() -> int:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{HERE}", f"--python_out={HERE}", f"--pyi_out={HERE}",
         f"--grpc_python_out={HERE}", str(HERE / PROTO)],
        check=True,
    )
    pb2 = HERE / f"{STEM}_pb2.py"
    pb2.write_text(_replace_once(pb2.read_text(), DEFAULT_POOL, PRIVATE_POOL, pb2.name))
    stub = HERE / f"{STEM}_pb2_grpc.py"
    stub.write_text(_replace_once(stub.read_text(), f"import {STEM}_pb2 as", f"from . import {STEM}_pb2 as",
                                  stub.name))
    print(f"wrote {pb2}, {pb2.with_suffix('.pyi')}, {stub}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
