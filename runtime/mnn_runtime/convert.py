"""ONNX -> MNN conversion through MNN's C entry point.

Never the ``mnnconvert`` console script or ``MNN.tools.mnnconvert``: those pip-install a logging
SDK and send usage telemetry (seen with MNN 3.6.1). ``_tools.mnnconvert`` returns True even when
it fails, so success is judged by the output file, which is written beside the destination and
renamed into place only when it loads: a failed conversion never replaces a good model.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path


log = logging.getLogger(__name__)
CONVERT_TIMEOUT = 1800  # seconds: a large model converts in seconds to minutes


class ConversionError(Exception):
    """The source could not be converted; the message says which file and why."""


# MNNConvert stages a model's weights in ``.__convert_external_data.bin`` in its current directory,
# then reads them back: two conversions in one directory at once (two ``mnn-rollout convert`` in a
# CI job, two test processes) swapped weights, and each produced a model that loads and answers,
# with the other's weights. So each conversion runs in a process of its own, in a directory of its
# own; its chatter on fd 1/2 is captured there, not by redirecting this process's.
_CONVERTER = "import sys, _tools; _tools.mnnconvert(sys.argv[1:])"  # MNN's C entry point: sends nothing


def _run_converter(args: list[str]) -> str:
    """Run MNNConvert (paths in ``args`` absolute) in a process and directory of its own; returns
    what it printed."""
    with tempfile.TemporaryDirectory(prefix="mnnconvert-") as cwd:
        if not sys.executable:
            raise ConversionError("no Python interpreter to run the converter in (sys.executable is empty)")
        try:
            done = subprocess.run([sys.executable, "-c", _CONVERTER, *args], cwd=cwd, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=CONVERT_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise ConversionError(f"the converter did not finish within {CONVERT_TIMEOUT} s") from None
        except OSError as exc:
            raise ConversionError(f"cannot start the converter ({sys.executable}): {exc}") from None
        printed = done.stdout.decode(errors="replace")
        if done.returncode != 0:  # a crash (a signal) or an error: no model, the tail says why
            printed += f"\nMNNConvert exited with {done.returncode}"
        return printed


def convert(src: str | Path, dst: str | Path, weight_bits: int | None = None) -> Path:
    """Convert ``src`` (ONNX) into ``dst`` (MNN); ``weight_bits=8`` stores int8 weights."""
    src, dst = Path(src).absolute(), Path(dst).absolute()  # the converter runs in a directory of its own
    if not src.is_file():
        raise ConversionError(f"source {str(src)!r} does not exist or is not a file")
    if weight_bits is not None and weight_bits not in (2, 3, 4, 5, 6, 7, 8):
        raise ConversionError(f"--weight-bits {weight_bits} is not valid; valid: 2-8")
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.unlink()
    args = ["MNNConvert", "-f", "ONNX", "--modelFile", str(src), "--MNNModel", str(tmp), "--bizCode", "mnn-rollout"]
    if weight_bits is not None:
        args += ["--weightQuantBits", str(weight_bits)]
    try:
        printed = _run_converter(args)
        if not tmp.is_file() or tmp.stat().st_size == 0 or "Converted Success" not in printed:
            tail = " | ".join(line.strip() for line in printed.splitlines()[-5:] if line.strip())
            raise ConversionError(
                f"converting {str(src)!r} produced no model; is it an ONNX file? converter said: {tail or 'nothing'}"
            )
        _check_loads(tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def _check_loads(path: Path) -> None:
    from .model import LoadedModel, ModelLoadError

    try:
        LoadedModel.load(path)
    except ModelLoadError as exc:
        if exc.needs_warmup_shapes:  # a good file: serving it needs the shape to warm up with
            log.warning("converted; to serve it, give versions[].warmup_shapes: %s", exc.reason)
            return
        raise ConversionError(f"converted model does not load: {exc.reason}") from None
