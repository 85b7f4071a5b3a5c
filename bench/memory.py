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
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers import pss_kb, start_mlserver, stop, tree  # noqa: E402

from mnn_rollout.local.process import LocalRuntime  # noqa: E402
from mnn_runtime.examples import build_examples  # noqa: E402

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def warm(url: str, n: int = 400) -> None:
    # fresh connections spread over the workers; both versions run
    for i in range(n):
        r = httpx.post(f"{url}/v2/models/large/versions/{'a' if i % 2 else 'b'}/infer", json=BODY, timeout=30)
        r.raise_for_status()


def measure(pids: list[int]) -> int:
    """Total PSS in kB over these processes and their descendants."""
    time.sleep(1)
    return sum(pss_kb(p) for pid in pids for p in tree(pid))


def pids(servers: list[LocalRuntime]) -> list[int]:
    return [s.proc.pid for s in servers if s.proc is not None]


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
            shared = LocalRuntime(config, root / f"shared-{n}.log", extra_args=["--workers", str(n)], log_level="info",
                                  stop_timeout=40, log_in_errors=True)
            shared.start(timeout=120)
            try:
                warm(shared.url)
                ours = measure(pids([shared]))
            finally:
                shared.stop()
            copies = [LocalRuntime(config, root / f"copy-{n}-{i}.log", log_level="info", log_in_errors=True)
                      for i in range(n)]
            try:
                for s in copies:
                    s.start(timeout=120)
                    warm(s.url, 200)
                theirs = measure(pids(copies))
            finally:
                for s in copies:
                    s.stop()
            pw = 0 if n == 1 else n
            proc: subprocess.Popen[bytes] | None = None
            try:
                proc, url = start_mlserver(root / "large.mnn", pw, root / f"mlserver-{n}.log", name="large",
                                           versions=("a", "b"), timeout=240)
                warm(url)
                mls = measure([proc.pid])
                procs = len(tree(proc.pid))
            finally:
                if proc is not None:
                    stop(proc)
            rows.append((n, ours / 1024, theirs / 1024, mls / 1024))
            print(f"  {n} workers: shared {ours / 1024:.0f} MB, a copy per worker {theirs / 1024:.0f} MB, "
                  f"MLServer parallel_workers={pw} {mls / 1024:.0f} MB ({procs} processes)", flush=True)
    base = rows[0][1]
    print(f"\nweights: 2 versions x {weights_mb / 2:.0f} MB = {weights_mb:.0f} MB")
    print(f"{'workers':>7} {'shared PSS MB':>14} {'copy/worker PSS MB':>19} {'copy / shared':>14} "
          f"{'MLServer PSS MB':>16} {'MLServer / shared':>18} {'per extra worker':>17} {'target':>8}")
    for n, shared_mb, copies_mb, mls_mb in rows:
        extra = (shared_mb - base) / (n - 1) if n > 1 else 0.0
        share = extra / weights_mb * 100
        verdict = "" if n == 1 else ("ok" if share <= 10 else "MISSED")
        print(f"{n:>7} {shared_mb:>14.0f} {copies_mb:>19.0f} {copies_mb / shared_mb:>13.2f}x {mls_mb:>16.0f} "
              f"{mls_mb / shared_mb:>17.2f}x "
              f"{extra:>9.1f} MB {share:>4.1f}% {'<=10% ' + verdict if n > 1 else '':>8}")
    print("MLServer: parallel_workers=0 (in the server process) for 1 worker, parallel_workers=N otherwise "
          "(a front-end process plus N inference workers, each loading both versions)")


if __name__ == "__main__":
    main()
