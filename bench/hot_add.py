"""Faults and changes under load with ``serve --workers N``: a version added while serving, and a
worker killed with SIGKILL.

1. Hot add: the server serves v1; under a closed-loop load (keyed requests, keep-alive
   connections that reconnect when a response says ``Connection: close``, as HTTP clients do) the
   config gains the ~56 MB ``large`` example at weight 10. Reported: failed requests (target 0),
   p99 before / during / after the change, how long until every worker was replaced, and the PSS
   the new version added over the whole process tree with N workers against one process (its
   size in memory): shared, N workers should add about one copy, not N.
2. SIGKILL: one worker is killed under the same load. Reported: requests that failed (at most
   those the worker held: one per connection it served), and the pod's request counter in
   /metrics before and after (it must never go back).

    .venv/bin/python bench/hot_add.py [--workers 2] [--seconds 12]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from peers import pss_kb, requests_total, tree  # noqa: E402
from throughput import json_bodies  # noqa: E402

from mnn_rollout.local.net import write_atomic  # noqa: E402
from mnn_rollout.local.process import LocalRuntime  # noqa: E402
from mnn_rollout.local.traffic import Sample, Traffic  # noqa: E402
from mnn_runtime.examples import build_examples  # noqa: E402

CONNECTIONS = 8


def load(url: str, seconds: float) -> Traffic:
    """The closed loop under which the changes happen: unpaced, 8 keep-alive connections that
    reconnect on ``Connection: close``, 64 JSON bodies each with its own key."""
    return Traffic(url, bodies=json_bodies(), keys=[f"user-{i}" for i in range(64)], rate=None,
                   connections=CONNECTIONS, max_seconds=seconds, retry_pause=0).start()


def warm(url: str, requests: int, version: str | None = None) -> None:
    """``requests`` requests, each on a fresh connection (spread over the workers)."""
    Traffic(url, bodies=json_bodies(1), users=0, rate=None, connections=1, keep_alive=False,
            max_requests=requests, max_seconds=60, headers={"X-Model-Version": version} if version else None).run()


def p99(samples: list[Sample]) -> float:
    lat = [s.latency for s in samples if s.status == 200]
    return float(np.percentile(lat, 99) * 1000) if lat else float("nan")


def sent_in(samples: list[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.sent < end]


def children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def runtime(config: Path, log: Path, workers: int) -> LocalRuntime:
    return LocalRuntime(config, log, extra_args=["--workers", str(workers)], log_level="info", stop_timeout=40,
                        log_in_errors=True)


def total_pss_mb(pid: int) -> float:
    return sum(pss_kb(p) for p in tree(pid)) / 1024


def write(path: Path, config: dict[str, Any]) -> None:
    write_atomic(path, yaml.safe_dump(config))


def hot_add(root: Path, workers: int, seconds: float) -> dict[str, Any]:
    config_path = root / f"hot-{workers}.yaml"
    config: dict[str, Any] = {"model": "scorer", "versions": [{"name": "v1", "uri": "v1.mnn"}], "weights": {"v1": 100}}
    write(config_path, config)
    srv = runtime(config_path, root / f"hot-{workers}.log", workers)
    srv.start()
    try:
        assert srv.proc is not None
        warm(srv.url, 200)  # every worker serves and settles before measuring
        time.sleep(1.0)
        pss_before = total_pss_mb(srv.proc.pid)
        before = children(srv.proc.pid)
        traffic = load(srv.url, seconds)
        time.sleep(seconds / 3)
        changed_at = time.monotonic()
        config["versions"].append({"name": "large", "uri": "large.mnn"})
        config["weights"] = {"v1": 90, "large": 10}
        write(config_path, config)
        replaced_at = None
        while traffic.running:
            now = children(srv.proc.pid)
            if replaced_at is None and workers > 1 and now and before.isdisjoint(now) and len(now) == workers:
                replaced_at = time.monotonic()
            if replaced_at is None and workers == 1:
                status = httpx.get(srv.url + "/v2/models/scorer/status").json()
                if status["versions"].get("large", {}).get("ready"):
                    replaced_at = time.monotonic()
            time.sleep(0.05)
        traffic.stop()
        time.sleep(1.0)
        warm(srv.url, 200, version="large")  # the new workers have served both versions
        pss_after = total_pss_mb(srv.proc.pid)
        samples = traffic.samples()
        start = min((s.sent for s in samples), default=changed_at)
        done = replaced_at or time.monotonic()
        served_large = sum(1 for s in samples if s.status == 200 and s.sent > done)
        return {
            "workers": workers,
            "requests": len(samples),
            "failed": sum(1 for s in samples if s.status != 200),
            "reconnects": traffic.reconnects,
            "p99_before": p99(sent_in(samples, start, changed_at)),
            "p99_during": p99(sent_in(samples, changed_at, done + 0.5)),
            "p99_after": p99(sent_in(samples, done + 0.5, time.monotonic())),
            "change_s": done - changed_at,
            "pss_added_mb": pss_after - pss_before,
            "served_after": served_large,
        }
    finally:
        srv.stop()


def sigkill(root: Path, workers: int, seconds: float) -> dict[str, Any]:
    config_path = root / "kill.yaml"
    write(config_path, {"model": "scorer", "versions": [{"name": "v1", "uri": "v1.mnn"}], "weights": {"v1": 100}})
    srv = runtime(config_path, root / "kill.log", workers)
    srv.start()
    try:
        assert srv.proc is not None
        traffic = load(srv.url, seconds)
        time.sleep(seconds / 3)
        total_before = requests_total(srv.url)
        victim = sorted(children(srv.proc.pid))[0]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        totals = [total_before]
        replaced = None
        while traffic.running:
            now = children(srv.proc.pid)
            if replaced is None and victim not in now and len(now) == workers:
                replaced = time.monotonic() - killed_at
            totals.append(requests_total(srv.url))
            time.sleep(0.1)
        traffic.stop()
        totals.append(requests_total(srv.url))
        samples = traffic.samples()
        errors_by_connection = Counter(s.conn for s in samples if s.status == 0)
        return {
            "requests": len(samples),
            "failed": sum(1 for s in samples if s.status != 200),
            "replaced_s": replaced,
            "counter_monotonic": all(b >= a for a, b in zip(totals, totals[1:])),
            "counter_before": total_before,
            "counter_after": totals[-1],
            "connections_hit": len(errors_by_connection),
            "max_errors_per_connection": max(errors_by_connection.values(), default=0),
        }
    finally:
        srv.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=12.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root, size="large")
        single = hot_add(root, 1, args.seconds)
        shared = hot_add(root, args.workers, args.seconds)
        killed = sigkill(root, args.workers, args.seconds)
    print("\n1. a ~56 MB version added under load (8 keep-alive connections, closed loop)")
    print(f"{'workers':>7} {'requests':>8} {'failed':>6} {'reconnects':>10} {'p99 before':>10} {'p99 during':>10} "
          f"{'p99 after':>9} {'change s':>8} {'PSS added MB':>12}")
    for r in (single, shared):
        print(f"{r['workers']:>7} {r['requests']:>8} {r['failed']:>6} {r['reconnects']:>10} {r['p99_before']:>10.2f} "
              f"{r['p99_during']:>10.2f} {r['p99_after']:>9.2f} {r['change_s']:>8.2f} {r['pss_added_mb']:>12.1f}")
    w = args.workers
    print(f"failed requests with {w} workers: {shared['failed']} (target 0)")
    print(f"PSS added by the version: {shared['pss_added_mb']:.0f} MB with {w} workers against "
          f"{single['pss_added_mb']:.0f} MB in one process = {shared['pss_added_mb'] / single['pss_added_mb']:.2f}x "
          f"(a copy per worker: {w:.2f}x)")
    print("\n2. one worker killed with SIGKILL under load")
    print(f"requests {killed['requests']}, failed {killed['failed']}: on {killed['connections_hit']} of {CONNECTIONS} "
          "connections "
          f"(the ones the killed worker held), at most {killed['max_errors_per_connection']} per connection (its "
          f"request in flight); replaced after {killed['replaced_s']:.2f} s; /metrics requests_total "
          f"{killed['counter_before']:.0f} -> {killed['counter_after']:.0f}, never went back: "
          f"{killed['counter_monotonic']}")


if __name__ == "__main__":
    main()
