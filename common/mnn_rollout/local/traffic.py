"""The traffic generator: many users against one OIP v2 endpoint, bounded in count and time,
loopback targets only. Used by the demo, the tests and the benchmarks."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from urllib.parse import urlparse

import numpy as np

from .net import require_loopback


@dataclass(frozen=True)
class VersionStats:
    requests: int
    errors: int
    rate: float  # requests/s over the window
    p99: float | None  # seconds, client side, successful and failed requests alike

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class Traffic:
    """Many users, a few keep-alive connections, closed loop, paced to ``rate`` requests/s in total.

    Bounded in time (``max_seconds``) and count (``max_requests``); loopback targets only. Each
    response is counted under the version its ``X-Model-Version`` header names (``unrouted`` when
    there is none, ``unreachable`` when the connection failed).
    """

    def __init__(self, url: str, model: str, users: int = 2000, rate: float = 300.0, connections: int = 4,
                 max_seconds: float = 180.0, max_requests: int | None = None, header: str = "X-User-Id",
                 features: int = 64, seed: int = 7) -> None:
        u = urlparse(url)
        self.host, self.port = require_loopback(u.hostname or ""), int(u.port or 80)
        self.rate, self.connections, self.max_seconds = rate, connections, max_seconds
        self.max_requests = max_requests if max_requests is not None else int(rate * max_seconds) + connections
        rng = np.random.default_rng(seed)
        vectors = rng.random((min(users, 256), features), dtype=np.float32)
        self._requests = []
        for user in range(users):
            body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, features],
                                           "data": [round(float(x), 5) for x in vectors[user % len(vectors)]]}]}
                              ).encode()
            head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{header}: user-{user}\r\n\r\n")
            self._requests.append(head.encode() + body)
        self._order = rng.integers(0, users, size=50_000)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, str, bool, float]] = deque(maxlen=max(1000, int(rate * 20)))
        self._latencies: dict[str, list[float]] = {}
        self.totals: dict[str, list[int]] = {}  # version -> [requests, errors]
        self._user_version: dict[int, tuple[float, str]] = {}  # user -> (sent at, version) of the latest send
        self.moves: Counter[tuple[str, str]] = Counter()  # (from, to) -> users who moved between versions
        self.users = users
        self.sent = 0
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _record(self, user: int, sent_at: float, version: str, ok: bool, seconds: float) -> None:
        with self._lock:
            if version not in ("unreachable", "unrouted"):
                before = self._user_version.get(user)
                if before is None or before[0] < sent_at:  # by send time: responses may overtake
                    self._user_version[user] = (sent_at, version)
                    if before is not None and before[1] != version:
                        self.moves[(before[1], version)] += 1
            self._recent.append((time.monotonic(), version, ok, seconds))
            total = self.totals.setdefault(version, [0, 0])
            total[0] += 1
            total[1] += 0 if ok else 1
            self._latencies.setdefault(version, []).append(seconds)

    async def _main(self) -> None:
        self.started_at = time.monotonic()
        stop_at = self.started_at + self.max_seconds
        pace = {"next": time.monotonic()}

        async def worker() -> None:
            conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
            try:
                while not self._stop.is_set() and time.monotonic() < stop_at and self.sent < self.max_requests:
                    now = time.monotonic()
                    pace["next"] = max(pace["next"], now - 0.5)  # never burst to catch up after a stall
                    due, pace["next"] = pace["next"], pace["next"] + 1.0 / self.rate
                    if due > now:
                        await asyncio.sleep(due - now)
                    user = int(self._order[self.sent % len(self._order)])
                    self.sent += 1
                    started = time.perf_counter()
                    try:
                        if conn is None:
                            conn = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 5)
                        conn[1].write(self._requests[user])
                        status, version = await asyncio.wait_for(_read_response(conn[0]), 10)
                    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                            ValueError):
                        if conn is not None:
                            conn[1].close()
                        conn = None
                        self._record(user, started, "unreachable", False, time.perf_counter() - started)
                        await asyncio.sleep(0.2)
                        continue
                    self._record(user, started, version or "unrouted", status < 400, time.perf_counter() - started)
            finally:
                if conn is not None:
                    conn[1].close()

        await asyncio.gather(*(worker() for _ in range(self.connections)))

    def window(self, seconds: float = 2.0) -> dict[str, VersionStats]:
        """Per-version stats over the last ``seconds`` (less if traffic started more recently)."""
        now = time.monotonic()
        span = max(1e-3, min(seconds, now - (self.started_at or now)))
        with self._lock:
            recent = [r for r in self._recent if r[0] >= now - span]
        out: dict[str, VersionStats] = {}
        for version in sorted({r[1] for r in recent}):
            mine = [r for r in recent if r[1] == version]
            out[version] = VersionStats(len(mine), sum(1 for r in mine if not r[2]), len(mine) / span,
                                        _p99([r[3] for r in mine]))
        return out

    def summary(self) -> dict[str, VersionStats]:
        """Per-version stats over the whole run."""
        seconds = max(1e-3, time.monotonic() - (self.started_at or time.monotonic()))
        with self._lock:
            return {v: VersionStats(n, e, n / seconds, _p99(self._latencies.get(v, [])))
                    for v, (n, e) in sorted(self.totals.items())}


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, str | None]:
    head = await reader.readuntil(b"\r\n\r\n")
    status, length, version = int(head[9:12]), 0, None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"x-model-version":
            version = value.strip().decode()
    if length:
        await reader.readexactly(length)
    return status, version
