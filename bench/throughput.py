"""Requests/s and p99 of the runtime against the raw MNN loop and a plain FastAPI + pydantic app.

All in one run, one load generator (bench/loadgen.py, another process on the same 2 cores),
the example scorer, batch 1, closed loop at concurrency 1, 8 and 32: mnn-rollout JSON and binary
bodies with 1 and N workers; the plain FastAPI app with the same worker counts (one model copy
per worker, as FACTS.md measured it). MLServer is not run here (it needs its own environment).

    .venv/bin/python bench/throughput.py [--seconds 4] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import run_load  # noqa: E402
from runtime_overhead import raw_loop  # noqa: E402

from mnn_runtime.examples import FEATURES, build_examples  # noqa: E402
from tests.runtime_server import RuntimeServer, free_port  # noqa: E402


def json_bodies(n: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    return [json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES],
                                    "data": rng.random(FEATURES).round(6).tolist()}]}).encode() for _ in range(n)]


def binary_bodies(n: int = 64) -> tuple[list[bytes], int]:
    rng = np.random.default_rng(1)
    head = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES],
                                   "parameters": {"binary_data_size": FEATURES * 4}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return [head + rng.random(FEATURES, dtype=np.float32).tobytes() for _ in range(n)], len(head)


def start_fastapi(model: Path, workers: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = dict(os.environ, MODEL=str(model), PYTHONPATH=str(ROOT / "bench"))
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "baselines.plain_fastapi:app", "--host", "127.0.0.1",
                             "--port", str(port), "--workers", str(workers), "--log-level", "warning"],
                            env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/docs", timeout=1).status_code == 200:
                time.sleep(1.0 if workers > 1 else 0.2)
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("plain FastAPI app did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    rows: list[tuple[str, int, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root)
        rps, _, p99 = raw_loop(root / "v1.mnn", args.seconds)
        rows.append(("raw MNN forward loop, in process", 1, rps, p99))
        jb = json_bodies()
        bb, head_len = binary_bodies()
        for workers in sorted({1, args.workers}):
            srv = RuntimeServer(root / "runtime.yaml", root / f"ours-{workers}.log",
                                extra_args=["--workers", str(workers), "--log-level", "warning"])
            srv.start()
            try:
                url = srv.url + "/v2/models/scorer/infer"
                run_load(url, jb, 8, 1.0)
                for c in (1, 8, 32):
                    res = run_load(url, jb, c, args.seconds, keys=[f"u{i}" for i in range(1000)])
                    rows.append((f"mnn-rollout JSON, {workers} worker(s)", c, res.rps, res.pct(99)))
                for c in (1, 8, 32):
                    res = run_binary(url, bb, head_len, c, args.seconds)
                    rows.append((f"mnn-rollout binary, {workers} worker(s)", c, res.rps, res.pct(99)))
            finally:
                srv.stop()
            proc, url = start_fastapi(root / "v1.mnn", workers, root / f"fastapi-{workers}.log")
            try:
                run_load(url + "/v2/models/scorer/infer", jb, 8, 1.0)
                for c in (1, 8, 32):
                    res = run_load(url + "/v2/models/scorer/infer", jb, c, args.seconds)
                    rows.append((f"plain FastAPI + pydantic, {workers} worker(s)", c, res.rps, res.pct(99)))
            finally:
                proc.terminate()
                proc.wait(timeout=20)
    print(f"\n{'server':<44} {'conc':>4} {'req/s':>9} {'p99 ms':>8}")
    for name, c, rps, p99 in rows:
        print(f"{name:<44} {c:>4} {rps:>9.0f} {p99:>8.2f}")
    table = {(n, c): r for n, c, r, _ in rows}
    w = args.workers
    print("\nratios at concurrency 32:")
    for workers in sorted({1, w}):
        ours = table[(f"mnn-rollout JSON, {workers} worker(s)", 32)]
        plain = table[(f"plain FastAPI + pydantic, {workers} worker(s)", 32)]
        print(f"  mnn-rollout JSON / plain FastAPI, {workers} worker(s): {ours / plain:.2f}x (target >= 2x)")
    if w > 1:
        one, many = table[("mnn-rollout JSON, 1 worker(s)", 32)], table[(f"mnn-rollout JSON, {w} worker(s)", 32)]
        print(f"  mnn-rollout {w} workers / 1 worker: {many / one:.2f}x (target >= 1.7x)")


def run_binary(url: str, bodies: list[bytes], head_len: int, c: int, seconds: float):  # type: ignore[no-untyped-def]
    import asyncio

    from loadgen import _run, build_request

    reqs = []
    for i, body in enumerate(bodies):
        host, port, raw = build_request(url, body, {"Inference-Header-Content-Length": str(head_len),
                                                     "X-User-Id": f"u{i}"})
        reqs.append(raw)
    return asyncio.run(_run(host, port, reqs, c, seconds, 2_000_000))


if __name__ == "__main__":
    main()
