"""Dynamic batching on a model whose forward takes >= 1 ms: batching on against off, same run.

The example ``v2-slow`` scorer (64 -> 1024 -> 1024 (x8) -> 32) takes ~3 ms per forward at batch 1
and ~0.7 ms per row at batch 32 on this machine. One ``mnn-rollout serve`` process per setting,
closed loop at concurrency 32 (and 8) from bench/loadgen.py, JSON bodies of one row each.
Target: batching on >= 2x batching off at concurrency 32, with p99 no higher.

    .venv/bin/python bench/batching.py [--seconds 4] [--workers 1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import run_load  # noqa: E402
from throughput import json_bodies  # noqa: E402

from mnn_rollout.local.process import LocalRuntime  # noqa: E402
from mnn_runtime.examples import build_examples  # noqa: E402
from mnn_runtime.model import LoadedModel  # noqa: E402

MODEL = "v2-slow"


def forward_ms(path: Path, batch: int, seconds: float = 1.0) -> float:
    model = LoadedModel.load(path)
    x = [np.random.default_rng(0).random((batch, 64), dtype=np.float32)]
    model.infer(x)
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        model.infer(x)
        n += 1
    return (time.perf_counter() - started) / n * 1000


def write_config(root: Path, batching: dict[str, Any] | None) -> Path:
    version: dict[str, Any] = {"name": MODEL, "uri": f"{MODEL}.mnn"}
    if batching is not None:
        version["batching"] = batching
    path = root / f"batching-{'on' if batching else 'off'}.yaml"
    path.write_text(yaml.safe_dump({"model": "scorer", "versions": [version], "weights": {MODEL: 100}}))
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--delay-us", type=int, default=0, help="max_queue_delay_microseconds")
    args = parser.parse_args()
    rows: list[tuple[str, int, float, float, float, int]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root)
        f1, f32 = forward_ms(root / f"{MODEL}.mnn", 1), forward_ms(root / f"{MODEL}.mnn", 32)
        print(f"{MODEL} forward: {f1:.2f} ms at batch 1, {f32:.2f} ms at batch 32 ({f32 / 32:.3f} ms per row)")
        bodies = json_bodies()
        settings = [("batching off", None),
                    (f"batching on (max {args.max_batch_size}, delay {args.delay_us} us)",
                     {"max_batch_size": args.max_batch_size, "max_queue_delay_microseconds": args.delay_us})]
        for name, batching in settings:
            srv = LocalRuntime(write_config(root, batching), root / f"{name[:12]}.log",
                               extra_args=["--workers", str(args.workers)], log_in_errors=True)
            srv.start()
            try:
                url = srv.url + "/v2/models/scorer/infer"
                run_load(url, bodies, 8, 1.0)
                for c in (8, 32):
                    res = run_load(url, bodies, c, args.seconds, keys=[f"u{i}" for i in range(1000)])
                    failed = sum(n for code, n in res.statuses.items() if code != 200)
                    rows.append((name, c, res.rps, res.pct(50), res.pct(99), failed))
            finally:
                srv.stop()
    print(f"\n{'server (' + str(args.workers) + ' worker(s))':<44} {'conc':>4} {'req/s':>8} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'failed':>6}")
    for name, c, rps, p50, p99, failed in rows:
        print(f"{name:<44} {c:>4} {rps:>8.0f} {p50:>8.2f} {p99:>8.2f} {failed:>6}")
    by = {(n.split(" (")[0], c): (rps, p99) for n, c, rps, _, p99, _ in rows}
    for c in (8, 32):
        (on, on99), (off, off99) = by[("batching on", c)], by[("batching off", c)]
        target = " (target >= 2x, p99 no higher)" if c == 32 else ""
        verdict = "met" if on >= 2 * off and on99 <= off99 else "NOT met"
        print(f"c={c}: batching on / off = {on / off:.2f}x req/s, p99 {on99:.1f} vs {off99:.1f} ms"
              f"{target}{': ' + verdict if c == 32 else ''}")


if __name__ == "__main__":
    main()
