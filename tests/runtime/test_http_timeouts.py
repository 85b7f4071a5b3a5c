"""Slow clients on the REST port (InferProtocol, fastpath.py), over real loopback sockets: a
request's headers must all arrive within ``headers_timeout`` of its first byte, and its body may go
``body_timeout`` without a byte; else it is answered 408 and the connection closed. The gRPC port
bounds the same (grpc_h2: FRAME_TIMEOUT, REQUEST_IDLE_TIMEOUT). Requests that keep coming, however
slowly, and answers that take long are never cut. A request's line and headers are held to
``max_head_bytes`` (64 KiB): beyond, 431 and the connection closed, however they arrive."""

from __future__ import annotations

import json
import select
import time
from collections.abc import Iterator

import pytest

from tests.runtime.test_http_infer import INFER, LIMIT, Conn, Served, infers, req, served, tensor  # noqa: F401

pytestmark = pytest.mark.timeout(60)
TIMEOUT = 0.5  # both bounds, in these tests (30 s and 60 s in `serve`)


@pytest.fixture
def short(served: Served, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:  # noqa: F811
    protocol = served.fast.config.http  # the InferProtocol class `serve` gives uvicorn, read at each timer
    monkeypatch.setattr(protocol, "headers_timeout", TIMEOUT)
    monkeypatch.setattr(protocol, "body_timeout", TIMEOUT)
    yield served


def error_of(body: bytes) -> str:
    return str(json.loads(body)["error"])


HEAD_LIMIT = 64 << 10


def big_head(path: str, header_bytes: int) -> bytes:
    """A whole infer request whose line and headers come to about ``header_bytes``."""
    return req(path, tensor(), ("X-Big", "a" * (header_bytes - 120)))


def send_in_pieces(conn: Conn, data: bytes, piece: int) -> int:
    """Send ``data`` ``piece`` bytes at a time, each given a moment to be read on its own, until the
    server answers, closes or stops reading; the bytes sent by then."""
    sent = 0
    try:
        while sent < len(data) and not select.select([conn.sock], [], [], 0.001)[0]:
            conn.sock.sendall(data[sent:sent + piece])
            sent += piece
    except (BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    return sent


@pytest.mark.parametrize("path", [INFER, INFER + "?x"], ids=["infer-protocol", "asgi"])
@pytest.mark.parametrize("piece", [0, 1024], ids=["one-write", "1-kib-reads"])
def test_a_head_over_64_kib_gets_431_and_one_under_it_is_served(served: Served, path: str, piece: int) -> None:
    """uvicorn and httptools held any head: a 128 MiB header was served, the worker 260 MB larger."""
    before, calls = len(served.errors), len(served.calls)
    for size, status in ((HEAD_LIMIT - 4096, 200), (HEAD_LIMIT + 4096, 431)):
        conn = Conn(served.port)
        try:
            data = big_head(path, size)
            conn.send(data) if not piece else send_in_pieces(conn, data, piece)
            reply = conn.reply()
            assert reply.status == status, reply
            if status == 431:
                assert reply.headers["connection"] == "close" and conn.closed_by_server()
                assert error_of(reply.body) == "the request's line and headers are over the limit of 65536 bytes"
        finally:
            conn.close()
    assert len(served.calls) - calls == (1 if "?" in path else 0)  # the one served; the refused one reached no app
    assert served.errors[before:] == []


def test_an_unfinished_head_is_refused_once_over_the_limit_not_read_on(served: Served) -> None:
    """Headers that never end: connections each holding 32 MiB of them added up."""
    conn = Conn(served.port)
    try:
        sent = send_in_pieces(conn, b"POST " + INFER.encode() + b" HTTP/1.1\r\nX-Big: " + b"a" * (8 << 20), 8192)
        reply = conn.reply()
        assert (reply.status, reply.headers["connection"]) == (431, "close") and conn.closed_by_server()
        assert sent < 1 << 20  # refused after ~64 KiB (and what the socket buffers held meanwhile), not 8 MiB
    finally:
        conn.close()


@pytest.mark.parametrize("whole", [True, False], ids=["complete", "unfinished"])
def test_a_head_over_the_limit_behind_a_slow_answer_closes_the_connection_after_it(
        served: Served, infers: list[str], whole: bool) -> None:  # noqa: F811
    """Pipelined behind an answer under way: not answered in the middle of it, not run, and no more of
    it read; the connection closes once that answer is out."""
    conn = Conn(served.port)
    try:
        conn.send(req(INFER, tensor(), ("x-slow", "1")))
        if whole:
            conn.send(big_head(INFER, HEAD_LIMIT + 4096))
        else:  # refused while it still comes (past the limit in the reads after its first)
            send_in_pieces(conn, big_head(INFER, 1 << 20)[:256 << 10], 4096)
        reply = conn.reply()
        assert (reply.status, reply.headers.get("connection")) == (200, "close")
        assert conn.closed_by_server()
    finally:
        conn.close()
    assert infers == ["scorer/None"]


def test_headers_trickled_a_byte_at_a_time_are_cut_with_408(short: Served) -> None:
    """A slow loris: each byte comes well within any idle bound, but the headers never end."""
    before = len(short.errors)
    conn = Conn(short.port)
    data = req(INFER, tensor())
    start = time.monotonic()
    try:
        for i in range(60):  # a byte every 0.1 s: 6 s at most, 12 times the bound
            conn.sock.sendall(data[i:i + 1])
            if select.select([conn.sock], [], [], 0.1)[0]:
                break
        waited = time.monotonic() - start
        reply = conn.reply()
        assert (reply.status, reply.headers.get("connection")) == (408, "close")
        assert "headers did not all arrive within 0.5 s" in error_of(reply.body)
        assert TIMEOUT * 0.9 <= waited <= TIMEOUT + 2
        assert conn.closed_by_server()
    finally:
        conn.close()
    assert short.errors[before:] == []


@pytest.mark.parametrize("path", [INFER, INFER + "?x"], ids=["infer-protocol", "asgi"])
def test_a_body_that_stops_coming_is_cut_with_408(short: Served, path: str) -> None:
    """Answered by InferProtocol's own cycle, or for an ASGI app waiting for the body (a query
    string sends an infer request through ASGI), which is told the client went away."""
    before, calls = len(short.errors), len(short.calls)
    conn = Conn(short.port)
    start = time.monotonic()
    try:
        reply = conn.send(req(path, tensor())[:-10]).reply()
        waited = time.monotonic() - start
        assert (reply.status, reply.headers.get("connection")) == (408, "close")
        assert error_of(reply.body) == "the request's body had no data for 0.5 s"
        assert TIMEOUT * 0.9 <= waited <= TIMEOUT + 2
        assert conn.closed_by_server()
    finally:
        conn.close()
    assert len(short.calls) - calls == (1 if "?" in path else 0)  # the path it took
    assert short.errors[before:] == []


def test_a_body_that_keeps_coming_slowly_is_not_cut(short: Served) -> None:
    data = req(INFER, tensor())
    head = data.index(b"\r\n\r\n") + 4
    conn = Conn(short.port)
    try:
        conn.send(data[:head])
        step = len(data[head:]) // 8 + 1
        for i in range(head, len(data), step):  # 9 parts, 0.2 s apart: 1.8 s, over 3 times the bound
            time.sleep(0.2)
            conn.send(data[i:i + step])
        assert conn.reply().status == 200
    finally:
        conn.close()


def test_a_new_connection_that_sends_nothing_is_closed_without_an_answer(short: Served) -> None:
    conn = Conn(short.port)
    start = time.monotonic()
    try:
        conn.sock.settimeout(TIMEOUT + 3)
        assert conn.file.read(1) == b""
        assert TIMEOUT * 0.9 <= time.monotonic() - start <= TIMEOUT + 2
    finally:
        conn.close()


def test_a_slow_answer_is_not_cut_and_a_stalled_request_behind_it_closes_the_connection_after_it(
        short: Served, infers: list[str]) -> None:  # noqa: F811
    """The answer takes 0.6 s (more than either bound): the server is busy, not the client. The
    next request's headers, begun and stalled meanwhile, are not answered 408 in the middle of
    the answer before them: the connection closes once that answer is out."""
    conn = Conn(short.port)
    try:
        reply = conn.send(req(INFER, tensor(), ("x-slow", "1")), req(INFER, tensor())[:30]).reply()
        assert (reply.status, reply.headers.get("connection")) == (200, "close")
        assert conn.closed_by_server()
    finally:
        conn.close()
    assert infers == ["scorer/None"]


def test_a_refused_request_whose_body_stops_coming_is_closed_without_a_second_answer(short: Served) -> None:
    """Refused (413) on its declared length before its body came: a stalled body gets no 408."""
    conn = Conn(short.port)
    try:
        reply = conn.send(req(INFER, b"", ("Content-Length", str(LIMIT + 100)), framing=False), b"{" * 10).reply()
        assert reply.status == 413
        assert conn.closed_by_server()
    finally:
        conn.close()


def test_a_head_over_the_limit_behind_queued_requests_stops_the_reading_for_good(
        served: Served, infers: list[str]) -> None:  # noqa: F811
    """Refused while a request queued behind a slow one (through ASGI, slow too) has reading paused:
    the request after the refused one was run and answered ahead of the queued one, and once the
    first answer was out uvicorn resumed reading, and what came next was read (and refused in the
    middle of the queued answer). Reading stays stopped; the connection closes after that answer."""
    conn = Conn(served.port)
    try:
        conn.send(req(INFER, tensor(), ("x-slow", "1")), req(INFER + "?x", tensor(), ("x-slow", "1")),
                  big_head(INFER, HEAD_LIMIT + 4096), req(INFER, tensor(0.25)))
        replies = [conn.reply()]
        send_in_pieces(conn, big_head(INFER, 1 << 20)[:256 << 10], 4096)  # while the queued one is answered
        replies.append(conn.reply())
        assert [(r.status, r.headers.get("connection")) for r in replies] == [(200, None), (200, "close")]
        assert conn.closed_by_server()
    finally:
        conn.close()
    assert infers == ["scorer/None", "scorer/None"]
