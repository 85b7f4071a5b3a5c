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
import asyncio
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
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

from mnn_runtime.examples import build_examples  # noqa: E402
from tests.runtime_server import RuntimeServer  # noqa: E402

INFER = "/v2/models/scorer/infer"


@dataclass
class Record:
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (start, latency s, status; 0 = error)
    reconnects: int = 0
    errors_by_connection: dict[int, int] = field(default_factory=dict)

    def window(self, start: float, end: float) -> list[tuple[float, float, int]]:
        return [s for s in self.samples if start <= s[0] < end]


def p99(samples: list[tuple[float, float, int]]) -> float:
    lat = [s[1] for s in samples if s[2] == 200]
    return float(np.percentile(lat, 99) * 1000) if lat else float("nan")


async def _connection(host: str, port: int, requests: list[bytes], offset: int, stop_at: float, record: Record) -> None:
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    n = offset
    while time.perf_counter() < stop_at:
        if writer is None:
            reader, writer = await asyncio.open_connection(host, port)
        assert reader is not None
        started = time.perf_counter()
        status, close = 0, True
        try:
            writer.write(requests[n % len(requests)])
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length, close = 0, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
                elif name.lower() == b"connection" and value.strip().lower() == b"close":
                    close = True
            await reader.readexactly(length)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            status, close = 0, True
            record.errors_by_connection[offset] = record.errors_by_connection.get(offset, 0) + 1
        record.samples.append((started, time.perf_counter() - started, status))
        if close:
            writer.close()
            writer = None
            record.reconnects += 1
        n += 7
    if writer is not None:
        writer.close()


def load(url: str, seconds: float, concurrency: int = 8) -> tuple[threading.Thread, Record]:
    u = httpx.URL(url)
    assert u.host.startswith("127."), "loopback targets only"
    requests = []
    for i, body in enumerate(json_bodies()):
        head = (f"POST {INFER} HTTP/1.1\r\nHost: {u.host}:{u.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nX-User-Id: user-{i}\r\n\r\n")
        requests.append(head.encode() + body)
    record = Record()
    stop_at = time.perf_counter() + seconds

    async def main() -> None:
        await asyncio.gather(*(_connection(u.host, int(u.port or 80), requests, i, stop_at, record)
                               for i in range(concurrency)))

    thread = threading.Thread(target=lambda: asyncio.run(main()))
    thread.start()
    return thread, record


def children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


def total_pss_mb(pid: int) -> float:
    return sum(pss_kb(p) for p in tree(pid)) / 1024


def write(path: Path, config: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(config))
    tmp.replace(path)


def hot_add(root: Path, workers: int, seconds: float) -> dict[str, Any]:
    config_path = root / f"hot-{workers}.yaml"
    config: dict[str, Any] = {"model": "scorer", "versions": [{"name": "v1", "uri": "v1.mnn"}], "weights": {"v1": 100}}
    write(config_path, config)
    srv = RuntimeServer(config_path, root / f"hot-{workers}.log", extra_args=["--workers", str(workers),
                                                                                 "--log-level", "info"])
    srv.start()
    try:
        assert srv.proc is not None
        for _ in range(200):  # every worker serves and settles before measuring
            httpx.post(srv.url + INFER, content=json_bodies(1)[0], headers={"content-type": "application/json"})
        time.sleep(1.0)
        pss_before = total_pss_mb(srv.proc.pid)
        before = children(srv.proc.pid)
        thread, record = load(srv.url, seconds)
        time.sleep(seconds / 3)
        changed_at = time.perf_counter()
        config["versions"].append({"name": "large", "uri": "large.mnn"})
        config["weights"] = {"v1": 90, "large": 10}
        write(config_path, config)
        replaced_at = None
        while thread.is_alive():
            now = children(srv.proc.pid)
            if replaced_at is None and workers > 1 and now and before.isdisjoint(now) and len(now) == workers:
                replaced_at = time.perf_counter()
            if replaced_at is None and workers == 1:
                status = httpx.get(srv.url + "/v2/models/scorer/status").json()
                if status["versions"].get("large", {}).get("ready"):
                    replaced_at = time.perf_counter()
            time.sleep(0.05)
        thread.join()
        time.sleep(1.0)
        for _ in range(200):  # the new workers have served both versions
            httpx.post(srv.url + INFER, content=json_bodies(1)[0], headers={"content-type": "application/json",
                                                                          "x-model-version": "large"})
        pss_after = total_pss_mb(srv.proc.pid)
        start = record.samples[0][0] if record.samples else changed_at
        done = replaced_at or time.perf_counter()
        served_large = sum(1 for s in record.samples if s[2] == 200 and s[0] > done)
        return {
            "workers": workers,
            "requests": len(record.samples),
            "failed": sum(1 for s in record.samples if s[2] != 200),
            "reconnects": record.reconnects,
            "p99_before": p99(record.window(start, changed_at)),
            "p99_during": p99(record.window(changed_at, done + 0.5)),
            "p99_after": p99(record.window(done + 0.5, time.perf_counter())),
            "change_s": done - changed_at,
            "pss_added_mb": pss_after - pss_before,
            "served_after": served_large,
        }
    finally:
        srv.stop()


def sigkill(root: Path, workers: int, seconds: float) -> dict[str, Any]:
    config_path = root / "kill.yaml"
    write(config_path, {"model": "scorer", "versions": [{"name": "v1", "uri": "v1.mnn"}], "weights": {"v1": 100}})
    srv = RuntimeServer(config_path, root / "kill.log", extra_args=["--workers", str(workers), "--log-level", "info"])
    srv.start()
    try:
        assert srv.proc is not None
        thread, record = load(srv.url, seconds)
        time.sleep(seconds / 3)
        total_before = requests_total(srv.url)
        victim = sorted(children(srv.proc.pid))[0]
        killed_at = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        totals = [total_before]
        replaced = None
        while thread.is_alive():
            now = children(srv.proc.pid)
            if replaced is None and victim not in now and len(now) == workers:
                replaced = time.perf_counter() - killed_at
            totals.append(requests_total(srv.url))
            time.sleep(0.1)
        thread.join()
        totals.append(requests_total(srv.url))
        return {
            "requests": len(record.samples),
            "failed": sum(1 for s in record.samples if s[2] != 200),
            "replaced_s": replaced,
            "counter_monotonic": all(b >= a for a, b in zip(totals, totals[1:])),
            "counter_before": total_before,
            "counter_after": totals[-1],
            "connections_hit": len(record.errors_by_connection),
            "max_errors_per_connection": max(record.errors_by_connection.values(), default=0),
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
    print(f"requests {killed['requests']}, failed {killed['failed']}: on {killed['connections_hit']} of 8 connections "
          f"(the ones the killed worker held), at most {killed['max_errors_per_connection']} per connection (its "
          f"request in flight); replaced after {killed['replaced_s']:.2f} s; /metrics requests_total "
          f"{killed['counter_before']:.0f} -> {killed['counter_after']:.0f}, never went back: "
          f"{killed['counter_monotonic']}")


if __name__ == "__main__":
    main()
