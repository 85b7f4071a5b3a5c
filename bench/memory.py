"""Memory with several workers: one copy of the weights, however many workers.

Two versions of the large example model (~56 MB of fp32 weights each) served by
`mnn-rollout serve --workers N` for N = 1, 2, 4, against the copy-per-worker design of other
Python model servers (MLServer's parallel workers, TorchServe, BentoML), reproduced in the same
run as N independent single-worker servers. Total PSS (proportional set size, from
/proc/PID/smaps_rollup) over every process, after each worker has served requests.
Target: each extra worker adds at most 10% of the weights' size.

    .venv/bin/python bench/memory.py [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mnn_runtime.examples import build_examples  # noqa: E402
from tests.runtime_server import RuntimeServer  # noqa: E402

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def pss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def tree(pid: int) -> list[int]:
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid] + [p for k in kids for p in tree(int(k))]


def warm(url: str, n: int = 400) -> None:
    # fresh connections spread over the workers; both versions run
    for i in range(n):
        httpx.post(f"{url}/v2/models/large/versions/{'a' if i % 2 else 'b'}/infer", json=BODY, timeout=30)


def measure(servers: list[RuntimeServer]) -> int:
    time.sleep(1)
    return sum(pss_kb(p) for s in servers for p in tree(s.proc.pid))  # type: ignore[union-attr]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="1,2,4")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root, size="large")
        weights_mb = (root / "large.mnn").stat().st_size * 2 / 1e6
        config = root / "large.yaml"
        config.write_text(yaml.safe_dump({"model": "large", "versions": [{"name": "a", "uri": "large.mnn"},
                                                                          {"name": "b", "uri": "large.mnn"}]}))
        rows = []
        for n in counts:
            shared = RuntimeServer(config, root / f"shared-{n}.log", extra_args=["--workers", str(n)])
            shared.start(timeout=120)
            try:
                warm(shared.url)
                ours = measure([shared])
            finally:
                shared.stop()
            copies = [RuntimeServer(config, root / f"copy-{n}-{i}.log") for i in range(n)]
            try:
                for s in copies:
                    s.start(timeout=120)
                    warm(s.url, 200)
                theirs = measure(copies)
            finally:
                for s in copies:
                    s.stop()
            rows.append((n, ours / 1024, theirs / 1024))
            print(f"  {n} workers: shared {ours / 1024:.0f} MB, a copy per worker {theirs / 1024:.0f} MB", flush=True)
    base = rows[0][1]
    print(f"\nweights: 2 versions x {weights_mb / 2:.0f} MB = {weights_mb:.0f} MB")
    print(f"{'workers':>7} {'shared PSS MB':>14} {'copy/worker PSS MB':>19} {'copy / shared':>14} "
          f"{'per extra worker':>17} {'target':>8}")
    for n, ours, theirs in rows:
        extra = (ours - base) / (n - 1) if n > 1 else 0.0
        share = extra / weights_mb * 100
        verdict = "" if n == 1 else ("ok" if share <= 10 else "MISSED")
        print(f"{n:>7} {ours:>14.0f} {theirs:>19.0f} {theirs / ours:>13.2f}x {extra:>9.1f} MB {share:>4.1f}% "
              f"{'<=10% ' + verdict if n > 1 else '':>8}")


if __name__ == "__main__":
    main()
