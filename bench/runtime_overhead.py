"""How much the HTTP runtime adds to MNN's own speed.

In one run: a raw in-process MNN forward loop on the example scorer (the limit), then the real
`mnn-rollout serve` over loopback at concurrency 1 and 8, driven by bench/loadgen.py from
another process. Prints requests/s, p50 and p99 for each and the ratios against the raw loop.

    .venv/bin/python bench/runtime_overhead.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import run_load  # noqa: E402

from mnn_rollout.local.process import LocalRuntime  # noqa: E402
from mnn_runtime.examples import FEATURES, build_examples  # noqa: E402
from mnn_runtime.model import LoadedModel  # noqa: E402


def raw_loop(model: Path | LoadedModel, seconds: float) -> tuple[float, float, float, float]:
    """The example scorer's forward in a loop for ``seconds`` (``model`` loaded first when a path):
    calls/s, p50 and p99 ms, and calls per CPU-second of the loop alone (the load not counted)."""
    if isinstance(model, Path):
        model = LoadedModel.load(model)
    x = np.random.default_rng(0).random((1, FEATURES), dtype=np.float32)
    lat = []
    cpu = time.process_time()
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        t = time.perf_counter()
        model.infer([x])
        lat.append(time.perf_counter() - t)
    per_cpu_second = len(lat) / max(time.process_time() - cpu, 1e-9)
    arr = np.array(lat) * 1000
    return len(lat) / seconds, float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), per_cpu_second


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root)
        rows = []
        rps, p50, p99, _ = raw_loop(root / "v1.mnn", args.seconds)
        rows.append(("raw MNN forward loop, in process", 1, rps, p50, p99))
        server = LocalRuntime(root / "runtime.yaml", root / "server.log", log_level="info", log_in_errors=True)
        server.start()
        try:
            rng = np.random.default_rng(1)
            bodies = [json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES],
                                              "data": rng.random(FEATURES).round(6).tolist()}]}).encode()
                      for _ in range(64)]
            keys = [f"user-{i}" for i in range(1000)]
            url = server.url + "/v2/models/scorer/infer"
            run_load(url, bodies, 4, 1.0, keys)  # warm up
            for c in (1, 8):
                res = run_load(url, bodies, c, args.seconds, keys)
                assert set(res.statuses) == {200}, res.statuses
                rows.append((f"mnn-rollout serve, JSON, c={c}", c, res.rps, res.pct(50), res.pct(99)))
        finally:
            server.stop()
    base = rows[0][2]
    print(f"{'what':<36} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'vs raw':>8}")
    for name, _, rps, p50, p99 in rows:
        print(f"{name:<36} {rps:>9.0f} {p50:>8.3f} {p99:>8.3f} {rps / base:>8.3f}")
    print("\nratio = requests/s against the raw in-process loop measured in this run; "
          "1 worker process, load generator on the same 2 cores.")


if __name__ == "__main__":
    main()
