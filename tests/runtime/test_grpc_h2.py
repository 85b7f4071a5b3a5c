"""The HTTP/2 transport of the gRPC front end (grpc_h2, hpack) against a raw HTTP/2 client on
loopback: the protocol cases grpcio's clients rarely exercise (flow control, resets, deadlines,
oversized and compressed messages, draining). OIP behaviour over gRPC is in test_grpc.py."""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from mnn_runtime import grpc_h2 as h2
from mnn_runtime import hpack

HOST = "127.0.0.1"


def test_hpack_decodes_the_rfc_examples_with_and_without_huffman() -> None:
    for blocks in (  # RFC 7541 C.3 (literal strings) and C.4 (Huffman), three requests on one table each
        ["828684410f7777772e6578616d706c652e636f6d", "828684be58086e6f2d6361636865",
         "828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565"],
        ["828684418cf1e3c2e5f23a6ba0ab90f4ff", "828684be5886a8eb10649cbf",
         "828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"],
    ):
        decoder = hpack.Decoder()
        got = [decoder.decode(bytes.fromhex(b)) for b in blocks]
        assert got[1][-1] == ("cache-control", "no-cache")
        assert got[2] == [(":method", "GET"), (":scheme", "https"), (":path", "/index.html"),
                          (":authority", "www.example.com"), ("custom-key", "custom-value")]
        assert decoder.size == 164  # the table as the RFC shows it after the third request


def test_hpack_refuses_bad_padding_and_unknown_indexes() -> None:
    with pytest.raises(hpack.HPACKError):
        hpack.huffman_decode(b"\x00")  # eight 0 bits: not a prefix of EOS
    with pytest.raises(hpack.HPACKError):
        hpack.Decoder().decode(b"\xff\x10")  # index 62 + 16: beyond an empty dynamic table


class Client:
    """A blocking HTTP/2 client: frames out, frames in (with HPACK-decoded header blocks)."""

    def __init__(self, port: int, window: int = 1 << 20) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=5)
        self.decoder = hpack.Decoder()
        self.buffer = b""
        self.sock.sendall(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 0x4, window)))
        self.next_stream = 1

    def call(self, path: str, message: bytes, extra: dict[str, str] | None = None, end: bool = True,
             prefix: bytes | None = None) -> int:
        sid, self.next_stream = self.next_stream, self.next_stream + 2
        block = (b"\x83\x86" + hpack.encode_indexed_name(4, path) + hpack.encode_indexed_name(31, "application/grpc")
                 + b"".join(hpack.encode_literal(k, v) for k, v in (extra or {}).items()))
        body = (prefix if prefix is not None else struct.pack(">BI", 0, len(message))) + message
        self.sock.sendall(h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block)
                          + h2.frame(h2.DATA, h2.END_STREAM if end else 0, sid, body))
        return sid

    def frame(self) -> tuple[int, int, int, bytes]:
        while len(self.buffer) < 9 or len(self.buffer) < 9 + int.from_bytes(self.buffer[:3], "big"):
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buffer += chunk
        n = int.from_bytes(self.buffer[:3], "big")
        kind, flags, sid = self.buffer[3], self.buffer[4], int.from_bytes(self.buffer[5:9], "big")
        payload, self.buffer = self.buffer[9:9 + n], self.buffer[9 + n:]
        return kind, flags, sid, payload

    def answer(self, sid: int) -> tuple[dict[str, str], bytes, list[int]]:
        """(the last header block of stream ``sid``, its DATA, every frame type seen meanwhile)."""
        headers: dict[str, str] = {}
        data, kinds = b"", []
        while True:
            kind, flags, stream, payload = self.frame()
            kinds.append(kind)
            if kind == h2.HEADERS:
                decoded = dict(self.decoder.decode(payload))
                if stream == sid:
                    headers = decoded
            if stream == sid and kind == h2.DATA:
                data += payload
            if stream == sid and kind in (h2.HEADERS, h2.DATA) and flags & h2.END_STREAM:
                return headers, data, kinds


@pytest.fixture()
def server() -> Iterator[tuple[h2.GrpcServer, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def echo(message: bytes, metadata: dict[str, str]) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        return message * int(metadata.get("x-repeat", "1")), (("x-echoed", "yes"),)

    async def slow(message: bytes, metadata: dict[str, str]) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        await asyncio.sleep(float(metadata.get("x-sleep", "0.3")))
        return b"done", ()

    async def keys(message: bytes, metadata: dict[str, str]) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        seen = ",".join(sorted(metadata)).encode()
        metadata.clear()  # the handler's own dict: the next call with the same header block is not affected
        return seen, ()

    async def start() -> h2.GrpcServer:
        srv = h2.GrpcServer({"/t.S/Echo": echo, "/t.S/Slow": slow, "/t.S/Keys": keys}, lambda: 1000)
        await srv.bind(HOST, 0)
        return srv

    srv = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield srv, loop
    asyncio.run_coroutine_threadsafe(srv.stop(0), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_a_unary_call_answers_headers_message_and_trailers(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    c = Client(server[0].bound_port)
    headers, data, _ = c.answer(c.call("/t.S/Echo", b"hello"))
    assert headers["grpc-status"] == "0" and headers["x-echoed"] == "yes"
    assert data == struct.pack(">BI", 0, 5) + b"hello"
    headers, _, _ = c.answer(c.call("/t.S/Nope", b""))
    assert headers["grpc-status"] == str(h2.UNIMPLEMENTED)


def test_handlers_get_text_metadata_of_their_own(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    c = Client(server[0].bound_port)
    extra = {"x-user-id": "u1", "x-trace-bin": "AAEC", "grpc-timeout": "5S"}
    for _ in range(3):  # the same header block each time: split once, each call its own dict
        headers, data, _ = c.answer(c.call("/t.S/Keys", b"", extra))
        assert headers["grpc-status"] == "0"
        assert data[5:] == b"content-type,grpc-timeout,x-user-id"  # binary metadata (-bin) left out


def test_a_message_over_the_limit_is_refused_from_its_prefix_alone(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    c = Client(server[0].bound_port)
    sid = c.call("/t.S/Echo", b"", end=False, prefix=struct.pack(">BI", 0, 5000))  # only the prefix is sent
    headers, _, kinds = c.answer(sid)
    assert headers["grpc-status"] == str(h2.RESOURCE_EXHAUSTED)
    assert headers["grpc-message"] == "body of 5000 bytes is over the limit of 1000 bytes"
    assert c.frame()[0] == h2.RST_STREAM  # tells the client to stop sending
    assert c.answer(c.call("/t.S/Echo", b"ok"))[0]["grpc-status"] == "0"  # the connection goes on


def test_an_answer_of_more_than_64_kb_goes_in_one_frame_to_a_peer_that_takes_it(
        server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    """A DATA frame's length has 24 bits: an answer of 70,005 bytes (over 16) in one frame, to a
    peer whose SETTINGS_MAX_FRAME_SIZE and windows allow it."""
    c = Client(server[0].bound_port, window=1 << 20)
    c.sock.sendall(h2.frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 0x5, 1 << 20))
                   + h2.frame(h2.WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    headers, data, kinds = c.answer(c.call("/t.S/Echo", b"y" * 100, {"x-repeat": "700"}))
    assert headers["grpc-status"] == "0"
    assert data == struct.pack(">BI", 0, 70000) + b"y" * 70000
    assert kinds.count(h2.DATA) == 1


def test_an_answer_larger_than_the_client_window_waits_for_window_updates(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    c = Client(server[0].bound_port, window=100)
    sid = c.call("/t.S/Echo", b"x" * 100, {"x-repeat": "5"})  # 505 bytes of DATA against a 100-byte window
    got = b""
    while len(got) < 100:
        kind, _, stream, payload = c.frame()
        got += payload if (kind, stream) == (h2.DATA, sid) else b""
    assert len(got) == 100
    c.sock.sendall(h2.frame(h2.WINDOW_UPDATE, 0, sid, struct.pack(">I", 1000)))
    headers, data, _ = c.answer(sid)
    assert len(got + data) == 505 and headers["grpc-status"] == "0"


def test_ping_reset_deadline_and_gzip(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    c = Client(server[0].bound_port)
    c.sock.sendall(h2.frame(h2.PING, 0, 0, b"12345678"))
    while (f := c.frame())[0] != h2.PING:
        pass
    assert f[1] & h2.ACK and f[3] == b"12345678"
    slow = c.call("/t.S/Slow", b"", {"x-sleep": "5"})
    c.sock.sendall(h2.frame(h2.RST_STREAM, 0, slow, struct.pack(">I", h2.CANCEL)))  # cancelled: no answer
    late = c.call("/t.S/Slow", b"", {"x-sleep": "5", "grpc-timeout": "100m"})
    headers, _, _ = c.answer(late)
    assert headers["grpc-status"] == str(h2.DEADLINE_EXCEEDED)
    packed = gzip.compress(b"squeezed")
    headers, data, _ = c.answer(c.call("/t.S/Echo", packed, {"grpc-encoding": "gzip"},
                                       prefix=struct.pack(">BI", 1, len(packed))))
    assert headers["grpc-status"] == "0" and data[5:] == b"squeezed"


def test_stop_sends_goaway_and_lets_a_running_call_finish(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    srv, loop = server
    c = Client(srv.bound_port)
    sid = c.call("/t.S/Slow", b"", {"x-sleep": "0.3"})
    c.answer(c.call("/t.S/Echo", b"warm"))  # the slow call is running now
    stopping = asyncio.run_coroutine_threadsafe(srv.stop(5), loop)
    headers, data, kinds = c.answer(sid)
    assert h2.GOAWAY in kinds and headers["grpc-status"] == "0" and data[5:] == b"done"
    stopping.result(10)
    with pytest.raises((ConnectionError, OSError)):
        c.frame()  # closed once its call was answered


def test_an_adopted_connection_is_served_and_drain_sends_goaway_and_refuses_more(
        server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    """serve --workers: a worker serves the gRPC connections its supervisor accepted; retiring it
    (drain) sends GOAWAY at once and lets the running call finish; one handed over later is sent
    GOAWAY before any call (its client retries elsewhere) and closed."""
    srv, loop = server
    listener = socket.create_server((HOST, 0))

    def handed_over() -> Client:
        client = Client.__new__(Client)  # a Client on a connection accepted here, not by the server
        sock = socket.create_connection(listener.getsockname(), timeout=5)
        accepted, _ = listener.accept()
        accepted.setblocking(False)  # served as a worker serves one its supervisor handed over
        asyncio.run_coroutine_threadsafe(loop.connect_accepted_socket(srv.connection, accepted), loop).result(5)
        client.sock, client.decoder, client.buffer, client.next_stream = sock, hpack.Decoder(), b"", 1
        sock.sendall(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b""))
        return client

    c = handed_over()
    headers, data, _ = c.answer(c.call("/t.S/Echo", b"adopted"))
    assert headers["grpc-status"] == "0" and data[5:] == b"adopted"
    sid = c.call("/t.S/Slow", b"", {"x-sleep": "1.0"})
    c.answer(c.call("/t.S/Echo", b"warm"))  # the slow call is running now
    loop.call_soon_threadsafe(srv.drain)
    headers, data, kinds = c.answer(sid)
    assert h2.GOAWAY in kinds and headers["grpc-status"] == "0" and data[5:] == b"done"
    with pytest.raises((ConnectionError, OSError)):
        c.frame()  # closed once its call was answered
    late = handed_over()
    kinds = []
    with pytest.raises((ConnectionError, OSError)):
        while True:
            kind, _, _, payload = late.frame()
            kinds.append(kind)
            if kind == h2.GOAWAY:
                assert struct.unpack(">II", payload[:8]) == (0, h2.NO_ERROR)  # no call of its was taken
    assert h2.GOAWAY in kinds
    listener.close()


def test_a_bad_preface_closes_the_connection(server: tuple[h2.GrpcServer, asyncio.AbstractEventLoop]) -> None:
    sock = socket.create_connection((HOST, server[0].bound_port), timeout=5)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    got = b""
    while chunk := sock.recv(4096):
        got += chunk
    assert got[3] == h2.SETTINGS and h2.GOAWAY in {got[i + 3] for i in range(0, len(got) - 9)}


# -- fuzz: whatever a peer sends, the connection answers or closes; nothing escapes ----------------

class _FakeTransport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed or True  # writes after close are dropped by the protocol itself
        self.out += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _fuzz_frames() -> Any:  # a hypothesis strategy of list[bytes] (hypothesis is imported lazily)
    from hypothesis import strategies as st

    one = st.builds(lambda kind, flags, sid, payload: h2.frame(kind, flags, sid, payload),
                    st.integers(0, 12), st.integers(0, 255),
                    st.one_of(st.integers(0, 9), st.integers(0, 2**31 - 1)), st.binary(max_size=300))
    headers = st.builds(lambda sid, path, extra, flags: h2.frame(
        h2.HEADERS, flags, sid, b"\x83\x86" + hpack.encode_indexed_name(4, path)
        + hpack.encode_indexed_name(31, "application/grpc") + extra),
        st.integers(0, 9), st.sampled_from(["/inference.GRPCInferenceService/ModelInfer", "/x", ""]),
        st.binary(max_size=40), st.sampled_from([h2.END_HEADERS, h2.END_HEADERS | h2.END_STREAM, 0, h2.PADDED]))
    data = st.builds(lambda sid, body, flags: h2.frame(h2.DATA, flags, sid, body),
                     st.integers(0, 9), st.binary(max_size=64), st.sampled_from([0, h2.END_STREAM, h2.PADDED]))
    return st.lists(st.one_of(one, headers, data, st.binary(max_size=30)), max_size=25)


def test_no_sequence_of_frames_raises_out_of_the_connection() -> None:
    """Random and half-valid frames (any type, flags, stream, payload; HEADERS with junk fields;
    DATA on unknown streams; raw bytes) after the preface: ``data_received`` never raises, and a
    connection it closed stays closed."""
    from hypothesis import HealthCheck, given, settings

    async def handler(message: bytes, metadata: dict[str, str]) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        return b"", ()

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_fuzz_frames())
    def run(chunks: list[bytes]) -> None:
        async def main() -> None:
            server = h2.GrpcServer({"/inference.GRPCInferenceService/ModelInfer": handler}, lambda: 1 << 20)
            conn = h2.H2Connection(server)
            transport = _FakeTransport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            conn.data_received(h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b""))
            for chunk in chunks:
                conn.data_received(chunk)
                if transport.closed:
                    assert conn.closed
            await asyncio.sleep(0)  # let any call that started run
            conn.connection_lost(None)

        asyncio.run(main())

    run()


def test_frames_split_anywhere_between_reads_are_read_as_when_whole() -> None:
    """The preface and frames cut at every point (one byte a read, a frame head cut, a read ending
    mid-payload, many frames a read): the same answers, byte for byte, as the stream read whole."""
    import random

    async def echo(message: bytes, metadata: dict[str, str]) -> tuple[bytes, tuple[tuple[str, str], ...]]:
        return message + metadata.get("x-user-id", "").encode(), (("x-echoed", "yes"),)

    block = (b"\x83\x86" + hpack.encode_indexed_name(4, "/t.S/Echo") + hpack.encode_indexed_name(31, "application/grpc"))
    stream = h2.PREFACE + h2.frame(h2.SETTINGS, 0, 0, b"")
    for sid in (1, 3, 5):
        extra = hpack.encode_literal("x-user-id", f"user-{sid}")
        stream += (h2.frame(h2.HEADERS, h2.END_HEADERS, sid, block + extra)
                   + h2.frame(h2.DATA, h2.END_STREAM, sid, struct.pack(">BI", 0, 3 * sid) + b"m" * (3 * sid)))

    def answers(cuts: list[int]) -> bytes:
        async def main() -> bytes:
            conn = h2.H2Connection(h2.GrpcServer({"/t.S/Echo": echo}, lambda: 1 << 20))
            transport = _FakeTransport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            for a, b in zip([0, *cuts], [*cuts, len(stream)]):
                conn.data_received(stream[a:b])
            assert not conn.buffer and not transport.closed
            conn.connection_lost(None)
            return bytes(transport.out)
        return asyncio.run(main())

    whole = answers([])
    assert whole.count(b"x-echoed") == 3 and b"mmmuser-1" in whole and b"m" * 15 + b"user-5" in whole
    rng = random.Random(7)
    splits = [list(range(1, len(stream))), [10, 24, 30, 33]]
    splits += [sorted(rng.sample(range(1, len(stream)), k)) for k in (2, 5, 20, 60) for _ in range(5)]
    for cuts in splits:
        assert answers(cuts) == whole, cuts
