"""A small closed-loop HTTP/1.1 load generator (keep-alive, raw asyncio streams).

Cheaper per request than any Python HTTP client library, so that on a 2-core machine the
generator takes as little CPU from the server as possible. Loopback targets only.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import numpy as np


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1000) if self.latencies else float("nan")


def build_request(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[str, int, bytes]:
    u = urlparse(url)
    assert u.hostname is not None and u.hostname.startswith("127."), "loopback targets only"
    lines = [f"POST {u.path} HTTP/1.1", f"Host: {u.hostname}:{u.port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return u.hostname, int(u.port or 80), ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    if length:
        await reader.readexactly(length)
    return status


async def _run(host: str, port: int, requests: list[bytes], concurrency: int, duration: float,
               max_requests: int) -> LoadResult:
    result = LoadResult(concurrency, duration)
    stop_at = time.perf_counter() + duration
    sent = 0

    async def worker(i: int) -> None:
        nonlocal sent
        reader, writer = await asyncio.open_connection(host, port)
        n = i
        while time.perf_counter() < stop_at and sent < max_requests:
            sent += 1
            started = time.perf_counter()
            writer.write(requests[n % len(requests)])
            status = await _read_response(reader)
            result.latencies.append(time.perf_counter() - started)
            result.statuses[status] = result.statuses.get(status, 0) + 1
            n += concurrency
        writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    result.seconds = time.perf_counter() - started
    return result


def run_load(url: str, bodies: list[bytes], concurrency: int, duration: float, keys: list[str] | None = None,
             max_requests: int = 2_000_000) -> LoadResult:
    """Closed loop: ``concurrency`` connections each send the next request when the last returns."""
    requests = []
    for i, body in enumerate(bodies):
        headers = {"X-User-Id": keys[i % len(keys)]} if keys else None
        host, port, raw = build_request(url, body, headers)
        requests.append(raw)
    return asyncio.run(_run(host, port, requests, concurrency, duration, max_requests))
