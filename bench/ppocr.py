"""A real-world model: the PP-OCR classifier and recogniser, converted, served and checked.

The ONNX files come from the ``rapidocr-onnxruntime==1.4.4`` wheel (the ``bench`` extra). Each is
converted by ``mnn-rollout convert``, served by its own ``mnn-rollout serve`` process (the runtime
serves one model per process) and sent a deterministic text-like image over HTTP, JSON and Triton
binary bodies. The outputs are compared with onnxruntime's on the same input (max abs difference,
argmax agreement); then requests/s and p99 of onnxruntime's in-process loop (1 thread), the raw MNN
loop (numThread 1) and the server at concurrency 1 and 2. Loopback only, every loop bounded in
time and count.

    .venv/bin/python bench/ppocr.py [--seconds 3] [--workers 1] [--models cls,rec]

Exits 1 when a served output is missing or differs from onnxruntime's by more than --tolerance.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import LoadResult, run_load  # noqa: E402

from mnn_rollout.local.process import LocalRuntime  # noqa: E402

PACKAGE = "rapidocr_onnxruntime"
# name -> (ONNX file in the wheel's models/, input shape N x C x H x W as PP-OCR feeds it)
MODELS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "cls": ("ch_ppocr_mobile_v2.0_cls_infer.onnx", (1, 3, 48, 192)),
    "rec": ("ch_PP-OCRv4_rec_infer.onnx", (1, 3, 48, 320)),
}
MAX_CALLS = 200_000  # bound of every timed loop besides its duration


def model_dir() -> Path:
    """The wheel's models/ directory, found without importing the package (it imports OpenCV)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: the {PACKAGE} package is not installed; it ships the PP-OCR ONNX models. "
                         "Install the bench extra: .venv/bin/pip install -e .[bench]")
    path = Path(next(iter(spec.submodule_search_locations))) / "models"
    missing = [f for f, _ in MODELS.values() if not (path / f).is_file()]
    if missing:
        raise SystemExit(f"error: {path} lacks {missing}; reinstall the bench extra: "
                         ".venv/bin/pip install -e .[bench] (rapidocr-onnxruntime==1.4.4)")
    return path


def text_like_image(height: int, width: int, seed: int) -> np.ndarray:
    """A grey line of dark glyph-like strokes on light noisy paper, normalised as PP-OCR does:
    (x / 255 - 0.5) / 0.5, NCHW float32, batch 1."""
    rng = np.random.default_rng(seed)
    ink = np.zeros((height, width))
    top, bottom = height // 5, height - height // 5
    x = 4
    while x < width - 12:
        w = int(rng.integers(7, 15))
        for _ in range(int(rng.integers(1, 4))):  # vertical strokes
            sx = x + int(rng.integers(0, w - 2))
            y0 = top + int(rng.integers(0, 6))
            ink[y0:bottom - int(rng.integers(0, 6)), sx:sx + 2] = 1
        for _ in range(int(rng.integers(0, 3))):  # horizontal strokes
            sy = top + int(rng.integers(0, bottom - top - 2))
            ink[sy:sy + 2, x:x + w] = 1
        x += w + int(rng.integers(2, 5)) + (int(rng.integers(6, 12)) if rng.random() < 0.15 else 0)
    soft = (ink + np.roll(ink, 1, 0) + np.roll(ink, 1, 1) + np.roll(ink, -1, 1)) / 4  # anti-aliased edges
    grey = 232 - 190 * np.clip(soft * 1.6, 0, 1) + rng.normal(0, 5, (height, width))
    rgb = np.stack([grey + 3, grey, grey - 4])  # a slight tint: the three channels differ
    pixels = np.clip(rgb, 0, 255).round().astype(np.uint8)
    return (((pixels / 255.0 - 0.5) / 0.5).astype(np.float32))[None]


# -- the reference and the raw loops ------------------------------------------------------------


@dataclass
class Timing:
    calls: int
    seconds: float
    latencies: list[float] = field(default_factory=list)

    @property
    def rps(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1000) if self.latencies else float("nan")


def timed_loop(fn: Callable[[], Any], seconds: float) -> Timing:
    fn()
    lat: list[float] = []
    started = time.perf_counter()
    stop_at = started + seconds
    while time.perf_counter() < stop_at and len(lat) < MAX_CALLS:
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)
    return Timing(len(lat), time.perf_counter() - started, lat)


def onnxruntime_call(path: Path, x: np.ndarray) -> Callable[[], np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return lambda: sess.run(None, {name: x})[0]


def mnn_call(path: Path, x: np.ndarray) -> Callable[[], np.ndarray]:
    """The raw MNN forward the runtime makes (model.py): numThread 1, a list of Vars, a copy out."""
    import MNN.expr as F
    import MNN.nn as nn

    rt = nn.create_runtime_manager(({"backend": "CPU", "numThread": 1},))
    module = nn.load_module_from_file(str(path), [], [], runtime_manager=rt)
    shape = list(x.shape)

    def call() -> np.ndarray:
        out = module.forward([F.const(x, shape, F.NCHW, F.float)])
        if not out:
            raise RuntimeError(f"MNN returned no output for {path.name} on shape {shape}")
        var = out[0]
        if var.data_format == F.NC4HW4:
            var = F.convert(var, F.NCHW)
        return np.array(var.read(), copy=True)

    return call


# -- conversion and serving ---------------------------------------------------------------------


def convert(src: Path, dst: Path, problems: list[str]) -> bool:
    """``mnn-rollout convert SRC DST``; on failure records the problem and returns False."""
    proc = subprocess.run([sys.executable, "-m", "mnn_rollout.cli", "convert", str(src), str(dst)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0 and dst.is_file():
        return True
    problems.append(f"`mnn-rollout convert {src.name}` exited {proc.returncode}: {_error_line(proc.stderr)}")
    return False


def _error_line(text: str) -> str:
    """The exception line, and where in the project's code it was raised."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return "(nothing printed)"
    frames = [m for ln in lines if (m := re.match(r'File ".*/(mnn_runtime/[^"]+)", line (\d+), in (\w+)', ln))]
    return lines[-1] + (f" (raised in {frames[-1][1]}:{frames[-1][2]}, {frames[-1][3]})" if frames else "")


def json_body(name: str, x: np.ndarray) -> bytes:
    """A JSON V2 body whose numbers parse back to exactly the float32 values of ``x``."""
    head = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape), "data": [0]}]})
    flat = x.reshape(-1)
    values, index = np.unique(flat, return_inverse=True)
    text = [np.format_float_positional(v, unique=True, trim="-") for v in values]  # shortest float32 reprs
    data = ",".join(text[i] for i in index)
    body = head.replace('"data": [0]', f'"data": [{data}]').encode()
    sent = np.asarray(json.loads(body)["inputs"][0]["data"], dtype=np.float32)
    assert np.array_equal(sent, flat), "the JSON numbers do not parse back to the input"
    return body


def binary_body(name: str, x: np.ndarray) -> tuple[bytes, int]:
    head = json.dumps({"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return head + np.ascontiguousarray(x, dtype="<f4").tobytes(), len(head)


def decode_json_response(resp: httpx.Response) -> np.ndarray:
    out = resp.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def decode_binary_response(resp: httpx.Response) -> np.ndarray:
    n = int(resp.headers["Inference-Header-Content-Length"])
    out = json.loads(resp.content[:n])["outputs"][0]
    size = out["parameters"]["binary_data_size"]
    return np.frombuffer(resp.content[n:n + size], dtype="<f4").reshape(out["shape"])


def run_binary(url: str, body: bytes, head_len: int, c: int, seconds: float) -> LoadResult:
    return run_load(url, [body], c, seconds, max_requests=MAX_CALLS,
                    headers={"Inference-Header-Content-Length": str(head_len)})


# -- one model ----------------------------------------------------------------------------------


@dataclass
class Report:
    accuracy: list[tuple[str, str, float, str]] = field(default_factory=list)  # model, path, max diff, argmax
    speed: list[tuple[str, str, int, float, float, float]] = field(default_factory=list)  # ..., c, rps, p50, p99
    problems: list[str] = field(default_factory=list)
    failed: bool = False


def argmax_agreement(kind: str, ref: np.ndarray, got: np.ndarray) -> str:
    if kind == "cls":
        a, b = int(ref.reshape(-1).argmax()), int(got.reshape(-1).argmax())
        return f"class {b} (onnxruntime {a}): {'same' if a == b else 'DIFFERENT'}"
    a, b = ref[0].argmax(-1), got[0].argmax(-1)
    same = int((a == b).sum())
    chars = [int(c) for i, c in enumerate(a) if c != 0 and (i == 0 or c != a[i - 1])]  # CTC: drop blanks, repeats
    return f"{same}/{len(a)} timesteps same ({len(chars)} decoded symbols){'' if same == len(a) else ' DIFFERENT'}"


def bench_model(kind: str, src: Path, shape: tuple[int, ...], work: Path, args: argparse.Namespace,
                report: Report) -> None:
    x = text_like_image(shape[2], shape[3], seed=7 if kind == "cls" else 11)
    print(f"\n== {kind}: {src.name} ({src.stat().st_size / 1e6:.2f} MB), input {list(x.shape)} ==", flush=True)
    ort_call = onnxruntime_call(src, x)
    ref = ort_call()
    print(f"onnxruntime output {list(ref.shape)}", flush=True)

    dst = work / f"{kind}.mnn"
    converted = convert(src, dst, report.problems)
    if not converted:
        print(f"mnn-rollout convert failed: {report.problems[-1]}", flush=True)
        report.failed = True
        return
    mnn = mnn_call(dst, x)
    got = mnn()
    report.accuracy.append((kind, "raw MNN, in process", float(np.abs(got - ref).max()),
                            argmax_agreement(kind, ref, got)))

    ort_t = timed_loop(ort_call, args.seconds)
    report.speed.append((kind, "onnxruntime, in process, 1 thread", 1, ort_t.rps, ort_t.pct(50), ort_t.pct(99)))
    mnn_t = timed_loop(mnn, args.seconds)
    report.speed.append((kind, "raw MNN, in process, numThread 1", 1, mnn_t.rps, mnn_t.pct(50), mnn_t.pct(99)))

    model = f"ppocr-{kind}"
    config = work / f"{kind}.yaml"
    # the models leave height and width open: warm them up at the shape they will serve
    config.write_text(f"model: {model}\nversions:\n  - name: v1\n    uri: {dst.name}\n"
                      f"    warmup_shapes: {{x: {list(x.shape)}}}\n")
    srv = LocalRuntime(config, work / f"{kind}.log", extra_args=["--workers", str(args.workers)])
    try:
        srv.start(timeout=60)
    except RuntimeError:
        msg = f"`mnn-rollout serve` with {dst.name} did not become ready: {_error_line(srv.log())}"
        report.problems.append(msg)
        report.failed = True
        print(msg, flush=True)
        srv.stop()
        return
    try:
        meta = httpx.get(f"{srv.url}/v2/models/{model}", timeout=10).json()
        print(f"metadata: inputs {meta.get('inputs')} outputs {meta.get('outputs')}", flush=True)
        name = meta["inputs"][0]["name"]
        url = f"{srv.url}/v2/models/{model}/infer"
        jb = json_body(name, x)
        bb, head_len = binary_body(name, x)
        with httpx.Client(timeout=60) as client:
            for path, body, headers, decode in (
                ("served, JSON", jb, {"Content-Type": "application/json"}, decode_json_response),
                ("served, binary", bb, {"Inference-Header-Content-Length": str(head_len)}, decode_binary_response),
            ):
                resp = client.post(url, content=body, headers=headers)
                if resp.status_code != 200:
                    msg = f"{model} {path}: HTTP {resp.status_code}: {resp.text[:300]}"
                    report.problems.append(msg)
                    report.failed = True
                    print(msg, flush=True)
                    continue
                out = decode(resp)
                diff = float(np.abs(out - ref).max()) if out.shape == ref.shape else float("inf")
                if not diff <= args.tolerance:
                    report.failed = True
                report.accuracy.append((kind, path, diff, argmax_agreement(kind, ref, out)))
        run_load(url, [jb], 1, min(1.0, args.seconds))  # warm up the connection path
        workers = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
        for c in (1, 2):
            res = run_load(url, [jb], c, args.seconds, max_requests=MAX_CALLS)
            _check_statuses(res, f"{model} JSON c={c}", report)
            report.speed.append((kind, f"mnn-rollout serve, JSON, {workers}", c, res.rps, res.pct(50), res.pct(99)))
        for c in (1, 2):
            res = run_binary(url, bb, head_len, c, args.seconds)
            _check_statuses(res, f"{model} binary c={c}", report)
            report.speed.append((kind, f"mnn-rollout serve, binary, {workers}", c, res.rps, res.pct(50), res.pct(99)))
    finally:
        srv.stop()


def _check_statuses(res: LoadResult, what: str, report: Report) -> None:
    bad = {s: n for s, n in res.statuses.items() if s != 200}
    if bad:
        report.problems.append(f"{what}: non-200 answers {bad}")
        report.failed = True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each timed loop (default 3)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest accepted max abs difference from onnxruntime (default 1e-4)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes of each server (default 1: one core, like the in-process loops)")
    parser.add_argument("--models", default="cls,rec", help="comma-separated subset of cls,rec")
    args = parser.parse_args()
    kinds = [k.strip() for k in args.models.split(",") if k.strip()]
    if not kinds or any(k not in MODELS for k in kinds):
        parser.error(f"--models {args.models!r}: valid names are {sorted(MODELS)}")
    src_dir = model_dir()
    report = Report()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ppocr-") as tmp:
        for kind in kinds:
            file, shape = MODELS[kind]
            bench_model(kind, src_dir / file, shape, Path(tmp), args, report)

    print(f"\naccuracy against onnxruntime (same input; tolerance {args.tolerance:g}):")
    print(f"{'model':<5} {'path':<22} {'max abs diff':>12}  argmax")
    for kind, path, diff, agree in report.accuracy:
        print(f"{kind:<5} {path:<22} {diff:>12.2e}  {agree}")
    print(f"\nthroughput, batch 1, {args.seconds:g} s per row (served: the load generator shares the cores):")
    print(f"{'model':<5} {'path':<40} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'/ onnxruntime':>13}")
    base = {k: rps for k, p, _, rps, _, _ in report.speed if p.startswith("onnxruntime")}
    for kind, path, c, rps, p50, p99 in report.speed:
        print(f"{kind:<5} {path:<40} {c:>4} {rps:>8.1f} {p50:>8.2f} {p99:>8.2f} {rps / base[kind]:>12.2f}x")
    if report.problems:
        print("\nproblems:")
        for p in report.problems:
            print(f"  - {p}")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
