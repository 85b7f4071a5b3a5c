"""Every request runs on its own clone of the loaded module (one module used by two threads at
once answers with the other's output); a clone shares the weights. Proven here on the ~52 MB
example: 8 clones, each run once, add under 5% of the weights' size to the process; the same
measurement with independent loads instead of clones adds about the weights' size per copy, so it
would catch clones that copied the weights. Measured in a fresh subprocess (RSS and PSS from
/proc/self/smaps_rollup), away from whatever this test process holds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CLONES = 8
MEASURE = r"""
import json, sys
from pathlib import Path

import numpy as np

from mnn_runtime.model import LoadedModel


def memory() -> dict[str, int]:
    with open("/proc/self/smaps_rollup") as fh:
        fields = {line.split()[0].rstrip(":"): int(line.split()[1]) * 1024 for line in fh if line.split()[1].isdigit()}
    return {"rss": fields["Rss"], "pss": fields["Pss"]}


path, copies, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
x = np.ones((1, 64), np.float32)
model = LoadedModel.load(path)
model.infer([x])  # its first clone (and its buffers) exist before the measurement
before = memory()
if how == "clones":  # what serving does: a clone per concurrent request, from the pool, each run
    taken = [model._acquire() for _ in range(copies + 1)]  # the first clone again, and ``copies`` new ones
    outputs = [LoadedModel._run(clone, [x], model._input_formats) for clone in taken]
    for clone in taken:
        model._release(clone)
    held = model.pool_size
else:  # the control: independent loads of the same file, each run
    others = [LoadedModel.load(path) for _ in range(copies)]
    outputs = [other.infer([x]) for other in others]
    held = len(others)
after = memory()
assert all(np.allclose(o[0], outputs[0][0]) for o in outputs)
print(json.dumps({"rss": after["rss"] - before["rss"], "pss": after["pss"] - before["pss"], "held": held}))
"""


@pytest.fixture(scope="module")
def large_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mnn_runtime.examples import LARGE, build_example

    return build_example(LARGE, tmp_path_factory.mktemp("large"))


def added_memory(path: Path, copies: int, how: str) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(copies), how], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.timeout(240)
def test_clones_of_the_large_model_add_under_5_percent_of_its_weights(large_model: Path) -> None:
    weights = large_model.stat().st_size  # fp32 weights: the file is almost all weights
    assert weights > 50e6
    added = added_memory(large_model, CLONES, "clones")
    assert added["held"] == CLONES + 1  # the pool holds them all (and the first one)
    assert added["rss"] < 0.05 * weights and added["pss"] < 0.05 * weights, (added, weights)


@pytest.mark.timeout(240)
def test_the_measurement_sees_copies_of_the_weights(large_model: Path) -> None:
    """The control: two independent loads add about the weights' size each, so clones that
    copied the weights would fail the test above."""
    weights = large_model.stat().st_size
    added = added_memory(large_model, 2, "loads")
    assert added["rss"] > 2 * 0.8 * weights and added["pss"] > 2 * 0.8 * weights, (added, weights)
