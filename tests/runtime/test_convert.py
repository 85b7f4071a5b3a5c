"""ONNX -> MNN conversion: conversions at once in one directory each keep their own weights, and a
source that is no model replaces nothing."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from mnn_runtime.convert import ConversionError, convert
from mnn_runtime.examples import EXAMPLES, FEATURES, scorer_onnx
from mnn_runtime.model import LoadedModel

ROUNDS = 6
# One process converting its source ROUNDS times, in the directory it was started in.
CONVERTING = """
import sys
from pathlib import Path
from mnn_runtime.convert import convert
src, out = Path(sys.argv[1]), Path(sys.argv[2])
for k in range(int(sys.argv[3])):
    convert(src, out / f"{k}.mnn")
"""


def scores(path: Path) -> np.ndarray:
    x = np.random.default_rng(0).random((4, FEATURES), dtype=np.float32)
    return LoadedModel.load(path).infer([x])[0]


def test_conversions_at_once_in_one_directory_each_keep_their_own_weights(tmp_path: Path) -> None:
    """MNNConvert stages weights in a file of a fixed name in its current directory: two
    conversions sharing one (two processes started in the same directory) swapped weights."""
    sources = []
    for seed in (1, 2):
        src = tmp_path / f"seed{seed}.onnx"
        onnx.save(scorer_onnx(dataclasses.replace(EXAMPLES[0], name=f"seed{seed}", seed=seed, layers=(
            FEATURES, 1024, 1024, 32))), src)
        sources.append(src)
    expected = [scores(convert(src, tmp_path / f"alone-{src.stem}.mnn")) for src in sources]
    assert not np.allclose(expected[0], expected[1])  # two different models
    shared = tmp_path / "cwd"
    shared.mkdir()
    outs = [tmp_path / f"out-{src.stem}" for src in sources]
    procs = [subprocess.Popen([sys.executable, "-c", CONVERTING, str(src), str(out), str(ROUNDS)], cwd=shared)
             for src, out in zip(sources, outs)]
    try:
        assert [p.wait(timeout=300) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
    for out, want in zip(outs, expected):
        for k in range(ROUNDS):
            np.testing.assert_array_equal(scores(out / f"{k}.mnn"), want, err_msg=f"{out.name}/{k}.mnn")


def test_a_source_that_is_no_model_replaces_nothing(tmp_path: Path) -> None:
    src = tmp_path / "broken.onnx"
    src.write_bytes(b"not an onnx model")
    dst = tmp_path / "model.mnn"
    dst.write_bytes(b"the good model")
    with pytest.raises(ConversionError, match="produced no model"):
        convert(src, dst)
    assert dst.read_bytes() == b"the good model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.onnx", "model.mnn"]  # no staging left
