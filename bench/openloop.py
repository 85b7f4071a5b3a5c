"""Latency at fixed request rates (open loop, free of coordinated omission), REST and gRPC.

Request ``k`` is due at ``start + k / rate`` whatever happened to the others, and its latency
counts from that due time: a server (or a generator) that stalls shows in the latency of every
request that waited behind the stall, instead of those requests being sent late and timed short.

One schedule (``_Schedule``) serves both clients: it hands request ``k`` to the client at its due
time, notes how late that was, and records each answer's latency (from the due time) and outcome.
A client only sends request ``k`` on one of its connections and reports when it is answered:

- REST: ``http_open_loop`` below, a lean HTTP/1.1 client (prebuilt requests, keep-alive, one
  request in flight per connection; a request due while every connection is busy waits for the
  first one free, its latency still counted from its due time). The shared traffic generator's
  open loop (``mnn_rollout.local.traffic``, ``traffic_open_loop``) measures the same thing but
  costs more per request: on this 2-core machine it fell seconds behind at 4,000 req/s;
- gRPC: ``grpc_open_loop`` below, a minimal HTTP/2 client on asyncio (prebuilt frames, HPACK
  from the runtime's decoder) that sends each unary call at its due time on one of a few
  connections, any number of calls in flight on each. h2load's fixed rate (``--rps``, per
  client) was measured and not used: its calls leave in bursts on each client's timer, up to 10 ms
  off a uniform schedule at 5,000 calls/s (bench/RESULTS.md, eighth pass).

Both report (``OpenLoop``) sent / answered / failed, p50, p99, p99.9 and the generator's worst lag
(how late a request left after its due time: when it nears the latencies, the generator, not the
server, was the limit). Loopback targets only, bounded in count and time.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlparse

import numpy as np

from mnn_rollout.local.net import require_loopback
from mnn_rollout.local.traffic import Traffic
from mnn_runtime import grpc_h2 as h2
from mnn_runtime import hpack

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


@dataclass
class OpenLoop:
    rate: float  # asked, requests/s
    seconds: float
    sent: int
    answered: int  # with success (HTTP 2xx; gRPC status 0)
    failed: int  # answered with an error, or not at all before the end
    p50: float  # ms, over every answered request (failed ones included: they count as late too)
    p99: float
    p999: float
    max_lag: float  # ms: the latest a request left after its due time

    @property
    def achieved(self) -> float:
        return self.answered / self.seconds


def _open_loop(rate: float, seconds: float, latencies: Sequence[float], sent: int, ok: int, failed: int,
               max_lag: float) -> OpenLoop:
    arr = np.asarray(latencies, dtype=float) * 1000 if len(latencies) else np.array([float("nan")])
    p50, p99, p999 = np.percentile(arr, [50, 99, 99.9])
    return OpenLoop(rate, seconds, sent, ok, failed, float(p50), float(p99), float(p999), max_lag * 1000)


class _Schedule:
    """The fixed-rate schedule of both clients, and its record.

    ``run(send, ...)`` calls ``send(k, due)`` for request ``k`` as soon as ``due = start + k / rate``
    has come (never earlier, never skipped), keeping the worst lateness; ``send`` returns whether an
    answer is awaited (False: nowhere to send it, it simply fails). The client calls
    ``answered(due, ok)`` when one comes: its latency counts from ``due``. Requests unanswered
    ``drain`` s after the last was due fail; so do those answered without success.
    """

    def __init__(self, rate: float, seconds: float) -> None:
        self.rate, self.seconds = rate, seconds
        self.latencies: list[float] = []  # s, of every answer (successful or not)
        self.ok = 0
        self.waiting = 0  # handed to the client and not answered yet

    def answered(self, due: float, ok: bool) -> None:
        self.latencies.append(time.perf_counter() - due)
        self.ok += ok
        self.waiting -= 1

    async def run(self, send: Callable[[int, float], bool], conns: Sequence[_Conn], drain: float) -> OpenLoop:
        rate, total = self.rate, int(self.rate * self.seconds)
        start = time.perf_counter() + 0.01
        max_lag, k = 0.0, 0
        while k < total:
            now = time.perf_counter()
            while k < total and start + k / rate <= now:
                due = start + k / rate
                max_lag = max(max_lag, now - due)
                self.waiting += send(k, due)
                k += 1
            if k < total:
                await asyncio.sleep(max(0.0, start + k / rate - time.perf_counter()))
        deadline = time.perf_counter() + drain
        while self.waiting and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        for conn in conns:
            if conn.transport is not None:
                conn.transport.close()
        return _open_loop(rate, self.seconds, self.latencies, total, self.ok, total - self.ok, max_lag)


class _Conn(asyncio.Protocol):
    """One connection of a client: its transport, and whether the peer has gone."""

    transport: asyncio.Transport | None = None
    lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


C = TypeVar("C", bound=_Conn)


async def _connect(factory: Callable[[], C], host: str, port: int, connections: int) -> list[C]:
    loop = asyncio.get_running_loop()
    return [(await loop.create_connection(factory, host, port))[1] for _ in range(connections)]


class _HttpConn(_Conn):
    """One keep-alive HTTP/1.1 connection of the REST client."""

    def __init__(self, pool: _HttpPool) -> None:
        self.pool = pool
        self.buffer = b""
        self.due = 0.0  # of the request in flight; 0: none

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.due:
            self.pool.finish(self, 0)

    def send(self, request: bytes, due: float) -> None:
        self.due = due
        assert self.transport is not None
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        head_end = self.buffer.find(b"\r\n\r\n")
        if head_end < 0:
            return
        head = self.buffer[:head_end].lower()
        at = head.find(b"content-length:")
        length = int(head[at + 15:head.find(b"\r\n", at) if head.find(b"\r\n", at) > 0 else None]) if at >= 0 else 0
        if len(self.buffer) - head_end - 4 < length:
            return
        status = int(self.buffer[9:12])
        self.buffer = self.buffer[head_end + 4 + length:]
        self.pool.finish(self, status)


class _HttpPool:
    """The REST client's connections, one request in flight on each: a request due while every one
    is busy waits (``backlog``) for the first one free."""

    def __init__(self, schedule: _Schedule, requests: list[bytes]) -> None:
        self.schedule, self.requests = schedule, requests
        self.free: list[_HttpConn] = []
        self.backlog: deque[tuple[bytes, float]] = deque()

    def send(self, k: int, due: float) -> bool:
        request = self.requests[k % len(self.requests)]
        while self.free:
            conn = self.free.pop()
            if not conn.lost:
                conn.send(request, due)
                return True
        self.backlog.append((request, due))
        return True

    def finish(self, conn: _HttpConn, status: int) -> None:
        """``conn``'s request was answered with HTTP ``status`` (0: its connection was lost)."""
        self.schedule.answered(conn.due, 200 <= status < 300)
        conn.due = 0.0
        if conn.lost:
            return
        if self.backlog:
            conn.send(*self.backlog.popleft())
        else:
            self.free.append(conn)


async def _http_open_loop(host: str, port: int, requests: list[bytes], rate: float, seconds: float,
                          connections: int, drain: float) -> OpenLoop:
    schedule = _Schedule(rate, seconds)
    pool = _HttpPool(schedule, requests)
    pool.free = await _connect(lambda: _HttpConn(pool), host, port, connections)
    return await schedule.run(pool.send, list(pool.free), drain)


def http_open_loop(url: str, bodies: list[bytes], rate: float, seconds: float, keys: list[str],
                   connections: int = 64, drain: float = 5.0) -> OpenLoop:
    """POST ``bodies`` (JSON) to ``url`` at ``rate`` requests/s for ``seconds``, X-User-Id rotated
    over ``keys``; requests unanswered ``drain`` s after the last was due count as failed."""
    u = urlparse(url)
    host, port = u.hostname or "", u.port or 80
    require_loopback(host)
    n = max(len(bodies), len(keys))
    requests = [(f"POST {u.path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(bodies[i % len(bodies)])}\r\n"
                 + (f"X-User-Id: {keys[i % len(keys)]}\r\n" if keys else "") + "\r\n").encode()
                + bodies[i % len(bodies)] for i in range(n)]
    return asyncio.run(_http_open_loop(host, port, requests, rate, seconds, connections, drain))


def traffic_open_loop(url: str, bodies: list[bytes], rate: float, seconds: float, keys: list[str],
                      connections: int = 64) -> OpenLoop:
    """The same with the shared traffic generator's open loop (heavier per request)."""
    traffic = Traffic(url, bodies=bodies, keys=keys, rate=rate, open_loop=True, connections=connections,
                      max_seconds=seconds, max_requests=int(rate * seconds) + 1, retry_pause=0).run()
    samples = traffic.samples()
    ok = sum(1 for s in samples if 200 <= s.status < 300)
    due = int(rate * seconds)  # those never sent (the generator fell behind for good) failed too
    return _open_loop(rate, seconds, [s.latency for s in samples], len(samples), ok, max(due, len(samples)) - ok,
                      traffic.max_lag)


class _H2Conn(_Conn):
    """One HTTP/2 connection of the gRPC client: calls out, their trailers' grpc-status back."""

    def __init__(self, schedule: _Schedule) -> None:
        self.schedule = schedule
        self.due: dict[int, float] = {}  # stream id -> due time of its call, until answered
        self.decoder = hpack.Decoder()
        self.buffer = bytearray()
        self.next_stream = 1
        self.unacked = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        transport.write(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 0x4, 1 << 24))  # type: ignore[attr-defined]
                        + h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 30) - 65535)))

    def send(self, block: bytes, message: bytes, due: float) -> None:
        sid = self.next_stream
        self.next_stream += 2
        self.due[sid] = due
        assert self.transport is not None
        self.transport.write(h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block)
                             + h2.frame(h2.DATA, h2.END_STREAM, sid, message))

    def data_received(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 9:
            hi, lo, kind, flags, sid = struct.unpack_from(">BHBBI", buf, pos)
            length = hi << 16 | lo
            if end - pos - 9 < length:
                break
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            self._frame(kind, flags, sid & 0x7FFFFFFF, payload)
        del buf[:pos]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        assert self.transport is not None
        if kind == h2.SETTINGS and not flags & h2.ACK:
            self.transport.write(h2.frame(h2.SETTINGS, h2.ACK, 0))
        elif kind == h2.PING and not flags & h2.ACK:
            self.transport.write(h2.frame(h2.PING, h2.ACK, 0, payload))
        elif kind == h2.DATA:
            self.unacked += len(payload)
            if self.unacked > 1 << 20:
                self.transport.write(h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", self.unacked)))
                self.unacked = 0
        elif kind == h2.HEADERS:
            start = 1 if flags & h2.PADDED else 0
            start += 5 if flags & h2.PRIORITY_FLAG else 0
            end = len(payload) - (payload[0] if flags & h2.PADDED else 0)
            headers = dict(self.decoder.decode(payload[start:end]))  # every block: the table follows
            if flags & h2.END_STREAM:
                self._finish(sid, int(headers.get("grpc-status", "2")))
        elif kind == h2.RST_STREAM:
            self._finish(sid, 1)
        elif kind == h2.GOAWAY:
            self.lost = True

    def _finish(self, sid: int, status: int) -> None:
        due = self.due.pop(sid, None)
        if due is not None:
            self.schedule.answered(due, status == 0)


async def _grpc_open_loop(host: str, port: int, message: bytes, rate: float, seconds: float,
                          metadata: Mapping[str, str], connections: int, drain: float) -> OpenLoop:
    schedule = _Schedule(rate, seconds)
    conns = await _connect(lambda: _H2Conn(schedule), host, port, connections)
    await asyncio.sleep(0.05)  # SETTINGS exchanged
    block = (b"\x83\x86" + hpack.encode_indexed_name(4, GRPC_INFER) + hpack.encode_indexed_name(1, f"{host}:{port}")
             + hpack.encode_indexed_name(31, "application/grpc") + hpack.encode_literal("te", "trailers")
             + b"".join(hpack.encode_literal(k, v) for k, v in metadata.items()))
    framed = struct.pack(">BI", 0, len(message)) + message

    def send(k: int, due: float) -> bool:
        conn = conns[k % connections]  # in turn, any number of calls in flight on each
        if conn.lost:
            return False
        conn.send(block, framed, due)
        return True

    return await schedule.run(send, conns, drain)


def grpc_open_loop(target: str, message: bytes, rate: float, seconds: float,
                   metadata: Mapping[str, str] | None = None, connections: int = 8, drain: float = 5.0) -> OpenLoop:
    """Unary ModelInfer calls of the serialized ``message`` to ``target`` (host:port) at ``rate``
    calls/s for ``seconds`` over ``connections`` HTTP/2 connections; calls still unanswered
    ``drain`` s after the last was due count as failed."""
    host, _, port = target.rpartition(":")
    require_loopback(host)
    return asyncio.run(_grpc_open_loop(host, int(port), message, rate, seconds, metadata or {}, connections, drain))


def format_row(name: str, res: OpenLoop) -> str:
    flag = f"  FAILED {res.failed}" if res.failed else ""
    lag = f"  (generator up to {res.max_lag:.1f} ms late)" if res.max_lag > 1.0 else ""
    return (f"{name:<40} {res.rate:>7.0f} {res.achieved:>8.0f} {res.p50:>8.2f} {res.p99:>8.2f} {res.p999:>8.2f}"
            f"{flag}{lag}")


HEADER = f"{'server':<40} {'rate':>7} {'answered':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>8}"
