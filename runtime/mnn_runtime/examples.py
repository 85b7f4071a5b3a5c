"""Build the example models: a recommendation-style scorer in versions that make rollout scenarios.

Graphs are built as ONNX with ``onnx.helper`` from deterministic weights, then converted to MNN
(measured: a graph written with MNN's ``F.save`` runs ~6x slower than the same graph converted
from ONNX). Versions:

- ``v1``          fp32, 64 user features -> 32 item scores, three dense layers.
- ``v2``          retrained (other weights), int8 weights: a realistic, healthy canary.
- ``v2-breaking`` its input width is 80: clients sending v1-shaped requests get 400s.
- ``v2-slow``     same interface as v1, far wider layers: a latency regression.
- ``large``       (``--size large`` only) the v1 interface with >= 50 MB of fp32 weights.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from .convert import convert
from .model import file_sha256

FEATURES = 64
SCORES = 32


@dataclass(frozen=True)
class ExampleSpec:
    name: str
    layers: tuple[int, ...]  # widths from input to output
    seed: int
    weight_bits: int | None = None
    description: str = ""
    repeat: int = 1  # the last hidden layer is applied this many times (shared weights: compute, not size)


EXAMPLES = (
    ExampleSpec("v1", (FEATURES, 256, 256, SCORES), seed=1, description="baseline fp32 scorer"),
    ExampleSpec("v2", (FEATURES, 256, 256, SCORES), seed=2, weight_bits=8, description="retrained, int8 weights"),
    ExampleSpec("v2-breaking", (80, 256, 256, SCORES), seed=3, description="input width 80: v1 requests fail"),
    ExampleSpec("v2-slow", (FEATURES, 1024, 1024, SCORES), seed=4, repeat=8, description="latency regression"),
)
LARGE = ExampleSpec("large", (FEATURES, 4096, 2048, 2048, SCORES), seed=5, description="~56 MB fp32 weights")


def scorer_onnx(spec: ExampleSpec):  # type: ignore[no-untyped-def]
    """An ONNX scorer: MatMul+Add+Relu per hidden layer, Sigmoid scores; dynamic batch."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(spec.seed)
    nodes, inits = [], []
    current = "features"
    widths = spec.layers
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        b = (rng.standard_normal(fan_out) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"mm{i}"]))
        nodes.append(helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"lin{i}"]))
        last = i == len(widths) - 2
        if not last:
            nodes.append(helper.make_node("Relu", [f"lin{i}"], [f"h{i}"]))
            current = f"h{i}"
            if i == len(widths) - 3:
                for r in range(1, spec.repeat):  # re-apply this square layer (same weights)
                    nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"mm{i}r{r}"]))
                    nodes.append(helper.make_node("Add", [f"mm{i}r{r}", f"b{i}"], [f"lin{i}r{r}"]))
                    nodes.append(helper.make_node("Relu", [f"lin{i}r{r}"], [f"h{i}r{r}"]))
                    current = f"h{i}r{r}"
        else:
            nodes.append(helper.make_node("Sigmoid", [f"lin{i}"], ["scores"]))
    graph = helper.make_graph(
        nodes,
        f"scorer-{spec.name}",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", widths[0]])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", widths[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="mnn-rollout")
    model.ir_version = 8
    return model


def build_example(spec: ExampleSpec, out_dir: Path) -> Path:
    import onnx

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{spec.name}.onnx"
        model = scorer_onnx(spec)
        onnx.checker.check_model(model)
        onnx.save(model, src)
        return convert(src, out_dir / f"{spec.name}.mnn", weight_bits=spec.weight_bits)


def build_examples(out_dir: str | Path, size: str = "small") -> dict[str, str]:
    """Build every example into ``out_dir``; returns {version: sha256}. Writes runtime.yaml,
    SHA256SUMS and examples.json beside the models."""
    out = Path(out_dir)
    specs = list(EXAMPLES) + ([LARGE] if size == "large" else [])
    sums: dict[str, str] = {}
    for spec in specs:
        path = build_example(spec, out)
        sums[spec.name] = file_sha256(path)
    (out / "SHA256SUMS").write_text("".join(f"{sha}  {name}.mnn\n" for name, sha in sums.items()))
    (out / "examples.json").write_text(json.dumps(
        {s.name: {"file": f"{s.name}.mnn", "sha256": sums[s.name], "layers": list(s.layers),
                  "weight_bits": s.weight_bits, "description": s.description} for s in specs},
        indent=2,
    ))
    runtime = {
        "model": "scorer",
        "versions": [{"name": n, "uri": f"{n}.mnn", "sha256": sums[n]} for n in ("v1", "v2")],
        "weights": {"v1": 90, "v2": 10},
        "stable": "v1",
    }
    (out / "runtime.yaml").write_text(yaml.safe_dump(runtime, sort_keys=False))
    return sums


def copy_examples(src: Path, dst: Path) -> None:
    """Copy a built example directory (used by tests to start from a pristine set)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
