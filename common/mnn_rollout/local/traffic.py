"""The traffic generator: many users against OIP v2 endpoints, bounded in count and time, loopback
targets only. The one used by the demo, the tests and the benchmarks.

Three ways to send, all over keep-alive HTTP/1.1 connections (raw asyncio streams: cheaper per
request than a Python HTTP client library):

- paced closed loop (``rate`` requests/s in total, the default): each of ``connections`` loops
  sends its next request when its last one was answered and the shared pace allows; after a stall
  it never bursts to catch up. Latency counts from the actual send.
- unpaced closed loop (``rate=None``): each connection sends the next request as soon as the last
  one was answered, as fast as the server goes.
- open loop at a fixed rate (``open_loop=True``, as wrk2 does): request ``k`` is due at
  ``start + k / rate``, the due times dealt to the connections in turn; a connection sends each
  request at its due time, or at once when its previous answer came later than that, and its
  latency counts from the DUE time. A server that stalls shows in the latency of every request
  that waited behind the stall, instead of those requests being sent late and timed short
  (coordinated omission).

Every answer (and every failure) is kept as a :class:`Sample`: when it was sent (due), when it
ended, its HTTP status (0: no answer), the version its ``X-Model-Version`` header names, its user
and its connection. Counts, percentiles and failure times are read from those.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlparse

import numpy as np

from .net import require_loopback

UNREACHABLE = "unreachable"  # the version of a request that got no answer
UNROUTED = "unrouted"  # the version of an answer without an X-Model-Version header
IDLE_REUSE_SECONDS = 2.0  # a kept-alive connection idle longer is not reused (the server may close it)

Endpoint = tuple[str, int]
Targets = str | Callable[[], Iterable[Any]]


class Sample(NamedTuple):
    """One request. Times are ``time.monotonic()`` seconds."""

    sent: float  # when it was sent; in the open loop, when it was due
    done: float  # when its answer (or its failure) came
    status: int  # HTTP status; 0 when there was no answer (connection refused or reset, timeout)
    version: str  # X-Model-Version of the answer; UNROUTED without one, UNREACHABLE without an answer
    user: int  # index of its request (user key and body)
    conn: int  # the connection slot that sent it (0 .. connections - 1)

    @property
    def latency(self) -> float:
        return self.done - self.sent

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 400


@dataclass(frozen=True)
class VersionStats:
    requests: int
    errors: int
    rate: float  # requests/s over the window
    p99: float | None  # seconds, client side, successful and failed requests alike
    p50: float | None = None
    p999: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class Traffic:
    """Many users sending inference requests; see the module docstring for the three modes.

    ``url``: the runtime's base URL (its path, if any, is the path requests go to), or a callable
    returning the endpoints to spread requests over, asked before each request (base URLs,
    ``(host, port)`` pairs, or objects with ``ip`` and ``port`` like a Service's ready pods).
    Requests go to the endpoints in turn, one kept-alive connection per endpoint and slot; a
    ``Connection: close`` answer closes it and the next request opens another.

    Requests: ``users`` keys ``user-0`` .. (or ``keys``) sent in the ``header``, each with a body:
    ``bodies`` in turn, or by default a JSON ``features`` vector per user; users in a seeded
    random order. ``headers`` go on every request (``{"X-Model-Version": "v2"}`` pins a version).
    With ``keep_alive=False`` every request opens its own connection.

    Bounded in time (``max_seconds``) and count (``max_requests``); loopback targets only. A
    request without an answer within ``timeout`` s, or whose connection failed, counts as status
    0 and pauses its loop ``retry_pause`` s (not in the open loop, which keeps its schedule).
    ``on_answer(version, body)`` is called with every successful answer (users who act on it:
    ``mnn_rollout.local.outcomes``).
    """

    def __init__(self, url: Targets, model: str = "scorer", users: int = 2000, rate: float | None = 300.0,
                 connections: int = 4, max_seconds: float = 180.0, max_requests: int | None = None,
                 header: str = "X-User-Id", features: int = 64, seed: int = 7, *,
                 keys: Sequence[str] | None = None, bodies: Sequence[bytes] | None = None,
                 headers: Mapping[str, str] | None = None, path: str | None = None, open_loop: bool = False,
                 keep_alive: bool = True, timeout: float = 10.0, connect_timeout: float = 5.0,
                 retry_pause: float = 0.2, on_answer: Callable[[str, bytes], None] | None = None) -> None:
        if open_loop and not rate:
            raise ValueError("the open loop needs a rate")
        if isinstance(url, str):
            u = urlparse(url)
            self._static: list[Endpoint] | None = [(require_loopback(u.hostname or ""), int(u.port or 80))]
            self._source: Callable[[], Iterable[Any]] | None = None
            url_path = u.path if u.path not in ("", "/") else None
        else:
            self._static, self._source, url_path = None, url, None
        self.path = path or url_path or f"/v2/models/{model}/infer"
        self.rate, self.connections, self.max_seconds = rate, connections, max_seconds
        self.open_loop, self.keep_alive = open_loop, keep_alive
        self.on_answer = on_answer
        self.timeout, self.connect_timeout, self.retry_pause = timeout, connect_timeout, retry_pause
        if max_requests is None:
            max_requests = int(rate * max_seconds) + connections if rate else 1_000_000
        self.max_requests = max_requests
        rng = np.random.default_rng(seed)
        self.keys = list(keys) if keys is not None else [f"user-{i}" for i in range(users)]
        if bodies is None:
            vectors = rng.random((min(max(len(self.keys), 1), 256), features), dtype=np.float32)
            bodies = [json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, features],
                                              "data": [round(float(x), 5) for x in v]}]}).encode() for v in vectors]
        self._bodies = list(bodies)
        self._header, self._headers = header, dict(headers or {})
        self._n = max(len(self._bodies), len(self.keys), 1)
        self._order: list[int] = rng.integers(0, self._n, size=50_000).tolist() if self._n > 1 else [0]
        self._built: dict[Endpoint, list[bytes]] = {}
        self._loopback: set[str] = set()
        self._lock = threading.Lock()
        # (sent, done, status, version, user, conn) of every request, in the order they ended (a
        # Sample when read: a plain tuple is cheaper to make per request)
        self._samples: list[tuple[float, float, int, str, int, int]] = []
        self._failures: list[tuple[float, float, int, str, int, int]] = []
        self._inflight: list[tuple[float, asyncio.StreamWriter] | None] = []  # per slot: (deadline, connection)
        self._track_moves = bool(self.keys)
        self._statuses: Counter[int] = Counter()
        self.totals: dict[str, list[int]] = {}  # version -> [requests, errors]
        self._user_version: dict[int, tuple[float, str]] = {}  # user -> (sent at, version) of the latest send
        self.moves: Counter[tuple[str, str]] = Counter()  # (from, to) -> users who moved between versions
        self.users = len(self.keys)
        self.sent = 0
        self.reconnects = 0  # kept-alive connections closed by the server or by a failure on them
        self.max_lag = 0.0  # open loop: the longest a request was sent after its due time (s)
        self.error: BaseException | None = None  # what stopped the generator, or what the target list last raised
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self._next = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- running ---------------------------------------------------------------------------------

    def start(self) -> Traffic:
        """Send from a background thread until stopped or bounded."""
        self._thread = threading.Thread(target=self._run_thread, name="traffic", daemon=True)
        self._thread.start()
        return self

    def run(self) -> Traffic:
        """Send in this thread until bounded (``max_seconds``, ``max_requests``)."""
        asyncio.run(self._main())
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(10.0, self.timeout + 2))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def elapsed(self) -> float:
        """Seconds sent so far (the whole run once it ended)."""
        if self.started_at is None:
            return 0.0
        return (self.ended_at or time.monotonic()) - self.started_at

    def __enter__(self) -> Traffic:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _run_thread(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - kept for the caller to see
            self.error = exc

    async def _main(self) -> None:
        self.started_at = self._next = time.monotonic()
        stop_at = self.started_at + self.max_seconds
        self._inflight = [None] * self.connections
        watchdog = asyncio.create_task(self._watchdog())
        try:
            await asyncio.gather(*(self._loop(slot, stop_at) for slot in range(self.connections)))
        finally:
            watchdog.cancel()
            self.ended_at = time.monotonic()

    async def _watchdog(self) -> None:
        """Aborts the connection of a request unanswered for ``timeout`` s (cheaper than a timer per request)."""
        while True:
            await asyncio.sleep(min(0.5, self.timeout / 4))
            now = time.monotonic()
            for waiting in self._inflight:
                if waiting is not None and waiting[0] < now:
                    waiting[1].transport.abort()  # the read ends at once: counted as no answer

    async def _sleep_until(self, when: float) -> None:
        while not self._stop.is_set() and (left := when - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))

    def _endpoints(self) -> list[Endpoint]:
        if self._static is not None:
            return self._static
        assert self._source is not None
        try:
            found = [_endpoint(t) for t in self._source()]
        except Exception as exc:  # noqa: BLE001 - e.g. the pod list was being rebuilt: ask again later
            self.error = exc
            return []
        for host, _ in found:
            if host not in self._loopback:
                self._loopback.add(require_loopback(host))
        return found

    def _build(self, endpoint: Endpoint) -> list[bytes]:
        """Every request (one per user) as bytes for this endpoint."""
        fixed = "".join(f"{k}: {v}\r\n" for k, v in self._headers.items())
        if not self.keep_alive:
            fixed += "Connection: close\r\n"
        built = []
        for i in range(self._n):
            body = self._bodies[i % len(self._bodies)]
            key = f"{self._header}: {self.keys[i % len(self.keys)]}\r\n" if self.keys else ""
            head = (f"POST {self.path} HTTP/1.1\r\nHost: {endpoint[0]}:{endpoint[1]}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{fixed}{key}\r\n")
            built.append(head.encode() + body)
        self._built[endpoint] = built
        return built

    async def _loop(self, slot: int, stop_at: float) -> None:
        rate, open_loop, keep_alive, timeout = self.rate, self.open_loop, self.keep_alive, self.timeout
        order, inflight, monotonic, stopped = self._order, self._inflight, time.monotonic, self._stop.is_set
        conns: dict[Endpoint, tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = {}
        k = 0  # open loop: this slot's k-th request is due at start + (k * connections + slot) / rate
        due = 0.0
        try:
            while not stopped() and self.sent < self.max_requests:
                now = monotonic()
                if open_loop:
                    assert rate and self.started_at is not None
                    due = self.started_at + (k * self.connections + slot) / rate
                    k += 1
                    if due >= stop_at:
                        break
                    if due > now:
                        await self._sleep_until(due)
                        if stopped():
                            break
                elif now >= stop_at:
                    break
                elif rate:
                    self._next = max(self._next, now - 0.5)  # never burst to catch up after a stall
                    due, self._next = self._next, self._next + 1.0 / rate
                    if due > now:
                        await self._sleep_until(due)
                        if stopped():
                            break
                endpoints = self._static or self._endpoints()
                if not endpoints:
                    await self._sleep_until(monotonic() + 0.1)
                    continue
                index = self.sent
                self.sent = index + 1
                endpoint = endpoints[index % len(endpoints)]
                user = order[index % len(order)]
                built = self._built.get(endpoint) or self._build(endpoint)
                started = monotonic()
                if open_loop:
                    self.max_lag = max(self.max_lag, started - due)
                    started = due
                conn = conns.pop(endpoint, None)
                if conn is not None and (conn[0].at_eof() or started - conn[2] > IDLE_REUSE_SECONDS):
                    conn[1].close()
                    conn = None
                reused = conn is not None
                try:
                    if conn is None:
                        async with asyncio.timeout(self.connect_timeout):
                            reader, writer = await asyncio.open_connection(*endpoint)
                        conn = (reader, writer, 0.0)
                    inflight[slot] = (started + timeout, conn[1])
                    conn[1].write(built[user])
                    status, version, close, body = await _read_response(conn[0])
                except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                    inflight[slot] = None
                    if conn is not None:
                        conn[1].close()
                    self.reconnects += reused
                    self._record((started, monotonic(), 0, UNREACHABLE, user, slot))
                    if self.retry_pause and not open_loop:
                        await self._sleep_until(monotonic() + self.retry_pause)
                    continue
                inflight[slot] = None
                done = monotonic()
                self._record((started, done, status, version or UNROUTED, user, slot))
                if self.on_answer is not None and 200 <= status < 300 and version:
                    self.on_answer(version, body)
                if close or not keep_alive:
                    conn[1].close()
                    self.reconnects += keep_alive
                else:
                    conns[endpoint] = (conn[0], conn[1], done)
        finally:
            for _, writer, _ in conns.values():
                writer.close()

    def _record(self, s: tuple[float, float, int, str, int, int]) -> None:
        sent, _, status, version, user, _ = s
        with self._lock:
            if status and self._track_moves and version != UNROUTED:
                before = self._user_version.get(user)
                if before is None or before[0] < sent:  # by send time: responses may overtake
                    self._user_version[user] = (sent, version)
                    if before is not None and before[1] != version:
                        self.moves[(before[1], version)] += 1
            self._samples.append(s)
            self._statuses[status] += 1
            total = self.totals.get(version)
            if total is None:
                total = self.totals[version] = [0, 0]
            total[0] += 1
            if not 200 <= status < 400:
                total[1] += 1
                self._failures.append(s)

    # -- reading ---------------------------------------------------------------------------------

    def samples(self, since: float | None = None) -> list[Sample]:
        """Every request that ended at or after ``since`` (all of them by default), in end order."""
        with self._lock:
            raw = self._samples[_first_done(self._samples, since):]
        return [Sample._make(s) for s in raw]

    def counts(self, since: float | None = None) -> Counter[tuple[str, int]]:
        """(version, status) -> requests that ended at or after ``since``."""
        return Counter((s.version, s.status) for s in self.samples(since))

    def statuses(self, since: float | None = None) -> Counter[int]:
        """status -> requests (0: no answer) that ended at or after ``since``."""
        if since is None:
            with self._lock:
                return Counter(self._statuses)
        return Counter(s.status for s in self.samples(since))

    def versions(self, since: float | None = None) -> Counter[str]:
        """version -> requests that ended at or after ``since``."""
        return Counter(s.version for s in self.samples(since))

    def failures(self, since: float | None = None) -> list[Sample]:
        """The failed requests (no answer, or status >= 400) that ended at or after ``since``."""
        with self._lock:
            raw = self._failures[_first_done(self._failures, since):]
        return [Sample._make(s) for s in raw]

    def first_failure(self, since: float) -> Sample | None:
        """The first failed request that ended at or after ``since``: the failure's onset as a client saw it."""
        failed = self.failures(since)
        return failed[0] if failed else None

    def percentiles(self, qs: Sequence[float] = (50, 99, 99.9), since: float | None = None, until: float | None = None,
                    version: str | None = None, ok_only: bool = False) -> dict[float, float]:
        """Latency percentiles in seconds (NaN without requests) of the requests SENT in
        [``since``, ``until``), of one version and/or successful only if asked."""
        lat = [s.latency for s in self.samples()
               if (since is None or s.sent >= since) and (until is None or s.sent < until)
               and (version is None or s.version == version) and (not ok_only or s.ok)]
        if not lat:
            return {q: float("nan") for q in qs}
        return dict(zip(qs, (float(v) for v in np.percentile(lat, list(qs)))))

    def window(self, seconds: float = 2.0) -> dict[str, VersionStats]:
        """Per-version stats over the last ``seconds`` (less if traffic started more recently)."""
        now = time.monotonic()
        span = max(1e-3, min(seconds, now - (self.started_at or now)))
        return _stats(self.samples(now - span), span)

    def summary(self) -> dict[str, VersionStats]:
        """Per-version stats over the whole run."""
        return _stats(self.samples(), max(1e-3, self.elapsed))


def _stats(samples: list[Sample], seconds: float) -> dict[str, VersionStats]:
    by: dict[str, list[Sample]] = {}
    for s in samples:
        by.setdefault(s.version, []).append(s)
    out = {}
    for version in sorted(by):
        mine = by[version]
        p50, p99, p999 = np.percentile([s.latency for s in mine], [50, 99, 99.9])
        out[version] = VersionStats(len(mine), sum(1 for s in mine if not s.ok), len(mine) / seconds,
                                    float(p99), float(p50), float(p999))
    return out


def _first_done(samples: list[tuple[float, float, int, str, int, int]], since: float | None) -> int:
    """Index of the first sample that ended at or after ``since`` (samples are in end order)."""
    if since is None:
        return 0
    return bisect.bisect_left(samples, since, key=lambda s: s[1])


def _endpoint(target: Any) -> Endpoint:
    if isinstance(target, str):
        u = urlparse(target)
        return u.hostname or "", int(u.port or 80)
    if isinstance(target, tuple):
        return str(target[0]), int(target[1])
    return str(target.ip), int(target.port)


def _header(head: bytes, lower: bytes, needle: bytes) -> bytes | None:
    """The value of the header whose ``b"\\r\\nname:"`` is ``needle`` (``lower``: the lowercased head)."""
    at = lower.find(needle)
    if at < 0:
        return None
    start = at + len(needle)
    return head[start:head.find(b"\r\n", start)].strip()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, str | None, bool, bytes]:
    """(status, X-Model-Version or None, whether the server closes the connection, the body when it
    has a Content-Length) of one answer."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, lower = int(head[9:12]), head.lower()
    close = head.startswith(b"HTTP/1.0") or lower.find(b"\r\nconnection: close\r\n") >= 0
    version = _header(head, lower, b"\r\nx-model-version:") if lower.find(b"\r\nx-model-version:") >= 0 else None
    body = b""
    at = lower.find(b"\r\ncontent-length:")
    if at >= 0:
        length = int(head[at + 17:head.find(b"\r\n", at + 17)])
        if length:
            body = await reader.readexactly(length)
    elif (_header(lower, lower, b"\r\ntransfer-encoding:") or b"").endswith(b"chunked"):
        while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            await reader.readexactly(size + 2)
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
    elif status >= 200 and status not in (204, 304):
        await reader.read()  # the body runs to the end of the connection
        close = True
    return status, version.decode() if version is not None else None, close, body
