"""InferProtocol (fastpath.py) over real loopback sockets: plain infer requests are answered without
ASGI and as the ASGI path answers them (an ``http="httptools"`` server on the same runtime, same
loop); keep-alive, pipelining, chunked bodies, escaped URLs, Expect, draining, batching and clients
that go away keep working."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
import uvloop
import yaml

from mnn_rollout.local.net import free_port
from mnn_runtime import fastpath
from mnn_runtime.fastpath import InferFastPath
from mnn_runtime.feedback import version_in
from mnn_runtime.server import Runtime, _Server, _uvicorn_config, build_runtime

pytestmark = pytest.mark.timeout(60)
HOST = "127.0.0.1"
LIMIT = 4096  # server.max_body_bytes
INFER = "/v2/models/scorer/infer"
BATCHED = "/v2/models/scorer/versions/vb/infer"  # v1's model, batched with a 20 ms queue delay


def tensor(value: float = 0.5, width: int = 64, **extra: Any) -> bytes:
    return json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, width],
                                   "data": [value] * width}], **extra}).encode()


def req(path: str = INFER, body: bytes = b"", *headers: tuple[str, str], method: str = "POST",
        http: str = "1.1", framing: bool = True) -> bytes:
    """One request's bytes; ``framing``: add its Content-Length (else ``headers`` frame it)."""
    lines = [f"{method} {path} HTTP/{http}", f"Host: {HOST}", "X-User-Id: u1", *(f"{k}: {v}" for k, v in headers)]
    if framing:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunks(body: bytes, size: int) -> list[bytes]:
    return [b"%x\r\n%s\r\n" % (len(body[i:i + size]), body[i:i + size]) for i in range(0, len(body), size)]


def binary_request() -> bytes:
    head = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64],
                                   "parameters": {"binary_data_size": 256}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return req(INFER, head + np.linspace(0, 1, 64, dtype=np.float32).tobytes(),
               ("Inference-Header-Content-Length", str(len(head))))


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def answer(self) -> tuple[Any, ...]:
        """What both paths must agree on: all but the date and a made (random) id."""
        split = self.headers.get("inference-header-content-length")
        cut = int(split) if split else len(self.body)
        doc = json.loads(self.body[:cut])
        if isinstance(doc.get("id"), str) and version_in(doc["id"]) is not None:
            assert version_in(doc.pop("id")) == doc["model_version"]
        return (self.status, self.headers.get("x-model-version"), self.headers.get("content-type"),
                split is not None, self.headers.get("connection"), doc, self.body[cut:])


class Conn:
    """A raw HTTP/1.1 client connection: writes bytes, reads responses (buffered: pipelining)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=5)
        self.file = self.sock.makefile("rb")

    def send(self, *data: bytes) -> Conn:
        self.sock.sendall(b"".join(data))
        return self

    def reply(self) -> Reply:
        line = self.file.readline()
        if not line:
            raise ConnectionError("closed by the server before a response")
        headers = {}
        for _ in range(100):
            field = self.file.readline().decode("latin-1")
            if field in ("\r\n", ""):
                break
            name, _, value = field.partition(":")
            headers[name.strip().lower()] = value.strip()
        return Reply(int(line.split()[1]), headers, self.file.read(int(headers.get("content-length", "0"))))

    def closed_by_server(self) -> bool:
        self.sock.settimeout(2)
        try:
            return self.file.read(1) == b""
        except (ConnectionResetError, TimeoutError) as exc:
            return isinstance(exc, ConnectionResetError)

    def close(self) -> None:
        self.file.close()
        self.sock.close()

    def replies(self, data: list[bytes]) -> list[Reply]:
        """Replies to ``data``, sent at once: pipelined."""
        return [self.send(*data).reply()] + [self.reply() for _ in data[1:]]


def exchange(port: int, *rounds: tuple[bytes, ...]) -> list[Reply]:
    """Send each round's bytes on one connection, reading a reply after each."""
    conn = Conn(port)
    try:
        return [conn.send(*data).reply() for data in rounds]
    finally:
        conn.close()


def ask(port: int, *data: bytes) -> Reply:
    return exchange(port, data)[0]


@dataclass
class Served:
    runtime: Runtime
    fast: _Server  # InferProtocol, as `serve` runs it
    slow: uvicorn.Server  # uvicorn's httptools protocol: every request through ASGI
    thread: threading.Thread
    calls: list[str]  # http requests given to the ASGI app (InferFastPath.__call__), either server
    from_tasks: list[int]  # _InferCycles answered when the Task carrying them on finished
    errors: list[str]  # warnings and errors logged, and exceptions the loop caught

    port = property(lambda self: self.fast.config.port)
    slow_port = property(lambda self: self.slow.config.port)

    def asgi_calls(self, action: Callable[[], Any]) -> tuple[int, Any]:
        """How many requests reached the ASGI app while ``action`` ran, and what it returned."""
        before = len(self.calls)
        result = action()
        return len(self.calls) - before, result


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, examples_dir: Path) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("http_infer")
    config = yaml.safe_load((examples_dir / "runtime.yaml").read_text())
    for v in config["versions"]:
        v["uri"] = str(examples_dir / v["uri"])
    config["versions"].append({"name": "vb", "uri": str(examples_dir / "v1.mnn"),
                               "batching": {"max_batch_size": 64, "max_queue_delay_microseconds": 20000}})
    config["server"] = {"max_body_bytes": LIMIT}
    (root / "runtime.yaml").write_text(yaml.safe_dump(config))
    runtime = build_runtime(root / "runtime.yaml")
    fast_config = _uvicorn_config(runtime, HOST, free_port(), "warning")
    assert isinstance(fast_config.http, type) and issubclass(fast_config.http, fastpath.InferProtocol)
    slow_config = _uvicorn_config(runtime, HOST, free_port(), "warning")
    slow_config.http = "httptools"
    calls: list[str] = []
    from_tasks: list[int] = []
    errors: list[str] = []
    call, finished = InferFastPath.__call__, fastpath._InferCycle.finished

    async def counted_call(self: InferFastPath, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            calls.append(f"{scope['method']} {scope['path']}")
        await call(self, scope, receive, send)

    def counted_finished(self: Any, task: Any) -> None:
        from_tasks.append(1)
        finished(self, task)

    fast, slow = _Server(fast_config, runtime.app, None, None), uvicorn.Server(slow_config)

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, context: errors.append(f"loop: {context}"))
        await asyncio.gather(fast.serve(), slow.serve())

    def run() -> None:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())

    handler, loggers = logging.Handler(logging.WARNING), [logging.getLogger(), logging.getLogger("uvicorn")]
    handler.emit = lambda record: errors.append(f"{record.name}: {record.getMessage()} {record.exc_info or ''}")  # type: ignore[method-assign]
    thread = threading.Thread(target=run, daemon=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InferFastPath, "__call__", counted_call)
        patch.setattr(fastpath._InferCycle, "finished", counted_finished)
        for logger in loggers:
            logger.addHandler(handler)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while not (fast.started and slow.started):
                assert thread.is_alive() and time.monotonic() < deadline, "the servers did not start"
                time.sleep(0.01)
            yield Served(runtime, fast, slow, thread, calls, from_tasks, errors)
        finally:
            fast.should_exit = slow.should_exit = True
            thread.join(20)
            for logger in loggers:
                logger.removeHandler(handler)
            runtime.close()
    assert not thread.is_alive(), "the servers did not stop"


@pytest.fixture
def infers(served: Served, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths DataPlane.infer is called for; one with an `x-slow` header first waits 0.6 s (as
    a version loading again, or a long batch delay, would)."""
    called: list[str] = []
    infer = served.runtime.dataplane.infer

    async def spied(model: str, version: str | None, body: bytes, headers: Any, **more: Any) -> Any:
        called.append(f"{model}/{version}")
        if headers.get("x-slow"):
            await asyncio.sleep(0.6)
        return await infer(model, version, body, headers, **more)

    monkeypatch.setattr(served.runtime.dataplane, "infer", spied)
    return called


CASES = {  # name: (request, status, x-model-version)
    "good": (req(INFER, tensor()), 200, "v1"),
    "wrong-shape": (req(INFER, tensor(width=65)), 400, "v1"),
    "bad-json": (req(INFER, b"{not json"), 400, "v1"),  # routed by X-User-Id alone
    "empty-body": (req(INFER), 400, "v1"),
    "unknown-model": (req("/v2/models/nope/infer", tensor()), 404, None),
    "unknown-version": (req("/v2/models/scorer/versions/v9/infer", tensor()), 404, None),
    "pinned-in-url": (req("/v2/models/scorer/versions/v2/infer", tensor()), 200, "v2"),
    "pinned-by-header": (req(INFER, tensor(), ("x-model-version", "v2")), 200, "v2"),
    "binary": (binary_request(), 200, "v1"),
}


@pytest.mark.parametrize("case", CASES)
def test_plain_infer_requests_skip_asgi_and_answer_as_the_asgi_path_does(served: Served, case: str) -> None:
    data, status, version = CASES[case]
    calls, fast = served.asgi_calls(lambda: ask(served.port, data))
    assert calls == 0 and fast.answer() == ask(served.slow_port, data).answer()
    assert (fast.status, fast.headers.get("x-model-version")) == (status, version), fast
    assert ("inference-header-content-length" in fast.headers) == (case == "binary")
    assert {"date", "server", "content-length"} <= fast.headers.keys()


def test_other_routes_still_go_through_asgi(served: Served) -> None:
    calls, reply = served.asgi_calls(lambda: ask(served.port, req("/v2/models/scorer", method="GET", framing=False)))
    assert calls == 1 and reply.status == 200 and json.loads(reply.body)["name"] == "scorer"


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_413_and_the_kept_alive_connection_stays_usable(
        served: Served, infers: list[str], chunked: bool) -> None:
    big = tensor(extra="x" * LIMIT)
    if chunked:  # the 413 comes mid-body: the client sends it to its end all the same
        rounds = [(req(INFER, b"", ("Transfer-Encoding", "chunked"), framing=False), *chunks(big, 1000), b"0\r\n\r\n")]
        message = f"body is over the limit of {LIMIT} bytes"
    else:
        rounds = [(req(INFER, big),)]
        message = f"body of {len(big)} bytes is over the limit of {LIMIT} bytes"
    rounds.append((req(INFER, tensor()),))
    calls, fast = served.asgi_calls(lambda: exchange(served.port, *rounds))
    assert calls == 0 and [r.answer() for r in fast] == [r.answer() for r in exchange(served.slow_port, *rounds)]
    assert [r.status for r in fast] == [413, 200] and json.loads(fast[0].body) == {"error": message}
    assert len(infers) == 2  # the request after it, on each server: the refused one is never run


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_is_gathered_across_reads(served: Served, chunked: bool) -> None:
    body = tensor(0.25)
    framing = ("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(len(body)))
    pieces = chunks(body, 100) + [b"0\r\n\r\n"] if chunked else [body[i:i + 100] for i in range(0, len(body), 100)]
    conn = Conn(served.port).send(req(INFER, b"", framing, framing=False))
    for piece in pieces[:-1]:  # a read each on the server
        conn.send(piece)
        time.sleep(0.002)
    calls, fast = served.asgi_calls(lambda: conn.send(pieces[-1]).reply())
    conn.close()
    assert calls == 0 and fast.status == 200 and fast.answer() == ask(served.slow_port, req(INFER, body)).answer()


def test_keep_alive_serves_request_after_request_on_one_connection(served: Served) -> None:
    calls, replies = served.asgi_calls(lambda: exchange(served.port, *[(req(INFER, tensor(i / 8)),) for i in range(8)]))
    assert calls == 0 and [(r.status, r.headers.get("connection")) for r in replies] == [(200, None)] * 8
    assert len({r.body for r in replies}) == 8


@pytest.mark.parametrize(("http", "headers"), [("1.0", ()), ("1.0", (("Connection", "keep-alive"),)),
                                               ("1.1", (("Connection", "close"),))],
                         ids=["http-1.0", "http-1.0-keep-alive", "connection-close"])
def test_a_request_not_kept_alive_gets_connection_close_and_the_socket_is_closed(
        served: Served, http: str, headers: tuple[tuple[str, str], ...]) -> None:
    for port in (served.port, served.slow_port):  # the ASGI path (uvicorn's rules) alike
        conn = Conn(port)
        calls, reply = served.asgi_calls(lambda: conn.send(req(INFER, tensor(), *headers, http=http)).reply())
        assert (reply.status, reply.headers.get("connection"), conn.closed_by_server()) == (200, "close", True)
        assert calls == (port != served.port)
        conn.close()


def test_pipelined_requests_are_answered_in_order(served: Served) -> None:
    conn = Conn(served.port)
    calls, replies = served.asgi_calls(lambda: conn.replies([req(INFER, tensor(i / 4, id=f"p{i}")) for i in range(4)]))
    assert calls == 0 and [json.loads(r.body)["id"] for r in replies] == ["p0", "p1", "p2", "p3"]
    # behind one answered by a Task (a batch waits 20 ms): queued, through ASGI; an ASGI route between
    mixed = [req(INFER, tensor(id="m0")), req(BATCHED, tensor(id="m1")), req(INFER, tensor(id="m2")),
             req("/v2/models/scorer", method="GET", framing=False), req(BATCHED, tensor(id="m4"))]
    calls, got = served.asgi_calls(lambda: [json.loads(r.body) for r in conn.replies(mixed)])
    conn.close()
    assert [g.get("id", g.get("name")) for g in got] == ["m0", "m1", "m2", "scorer", "m4"] and calls == 3


def test_requests_read_in_one_turn_on_two_connections_are_grouped(served: Served) -> None:
    """Two kept-alive connections whose next requests the loop reads in one turn: the first is
    answered at once, the second after the turn (batching.Grouper: its Task answers it). Each
    connection served a request before, in reads of their own, which must not count."""
    a, b = Conn(served.port), Conn(served.port)
    assert a.send(req(INFER, tensor(0.1))).reply().status == b.send(req(INFER, tensor(0.2))).reply().status == 200
    loop = served.fast._loop
    assert loop is not None
    before = len(served.from_tasks)
    loop.call_soon_threadsafe(time.sleep, 0.3)  # the loop is held: both requests wait in their sockets
    time.sleep(0.05)
    a.send(req(INFER, tensor(0.3)))
    b.send(req(INFER, tensor(0.4)))
    replies = [a.reply(), b.reply()]
    a.close()
    b.close()
    assert [r.status for r in replies] == [200, 200]
    assert len(served.from_tasks) - before == 1


@pytest.mark.parametrize(("path", "plain"), [
    ("/v2/models/sc%6Frer/infer", INFER), (INFER + "?x=1", INFER),
    ("/v2/models/scorer/versions/v%32/infer", "/v2/models/scorer/versions/v2/infer"),
    ("/v2/models/scorer?x=/infer", None)])  # the model's metadata route, which takes no POST
def test_escaped_or_query_urls_go_through_asgi_and_answer_alike(served: Served, path: str, plain: str | None) -> None:
    calls, reply = served.asgi_calls(lambda: ask(served.port, req(path, tensor())))
    slow = ask(served.slow_port, req(path, tensor()))
    assert calls == 1 and (reply.status, reply.headers.get("x-model-version")) == (slow.status, slow.headers.get(
        "x-model-version")) and (reply.status == 405 if plain is None else reply.status == 200)
    if plain is not None:
        assert reply.answer() == ask(served.port, req(plain, tensor())).answer() == slow.answer()


def test_expect_100_continue_goes_through_asgi(served: Served) -> None:
    body, conn = tensor(), Conn(served.port)
    head = req(INFER, b"", ("Expect", "100-continue"), ("Content-Length", str(len(body))), framing=False)
    calls, interim = served.asgi_calls(lambda: conn.send(head).reply())
    reply = conn.send(body).reply()
    conn.close()
    assert calls == 1 and interim.status == 100 and reply.status == 200
    assert reply.answer() == ask(served.port, req(INFER, body)).answer()


def test_draining_closes_a_kept_alive_connection_after_its_next_answer(served: Served) -> None:
    conn = Conn(served.port)
    first = conn.send(req(INFER, tensor())).reply()
    served.runtime.app.draining = True
    try:
        calls, second = served.asgi_calls(lambda: conn.send(req(INFER, tensor())).reply())
        closed = conn.closed_by_server()
    finally:
        served.runtime.app.draining = False
        conn.close()
    assert first.status == 200 and "connection" not in first.headers
    assert calls == 0 and (second.status, second.headers.get("connection"), closed) == (200, "close", True)


def test_draining_runs_nothing_pipelined_behind_the_closing_answer(served: Served, monkeypatch: pytest.MonkeyPatch,
                                                                   ) -> None:
    """Found in review: the answer closes the connection in the middle of the read; the requests
    behind it in the same read must not run (uvicorn's path runs none either)."""
    called: list[str] = []
    infer = served.runtime.dataplane.infer

    async def spied(model: str, version: str | None, body: bytes, headers: Any, *more: Any, **named: Any) -> Any:
        called.append(json.loads(body).get("id"))
        return await infer(model, version, body, headers, *more, **named)

    monkeypatch.setattr(served.runtime.dataplane, "infer", spied)
    served.runtime.app.draining = True
    conn = Conn(served.port)
    try:
        conn.send(*[req(INFER, tensor(i / 4, id=f"d{i}")) for i in range(4)])
        first = conn.reply()
        closed = conn.closed_by_server()
    finally:
        served.runtime.app.draining = False
        conn.close()
    assert (first.status, first.headers.get("connection"), closed) == (200, "close", True)
    assert called == ["d0"]


def test_a_batched_version_answers_concurrent_requests_from_tasks(served: Served) -> None:
    count, started = 12, len(served.from_tasks)
    data = [req(BATCHED, tensor(i / count, id=f"b{i}")) for i in range(count)]
    with ThreadPoolExecutor(count) as pool:
        calls, fast = served.asgi_calls(lambda: list(pool.map(lambda d: ask(served.port, d), data)))
    assert calls == 0 and len(served.from_tasks) - started == count
    for got, alone in zip(fast, [ask(served.slow_port, d) for d in data]):
        (*head, doc, _), (*want, wanted, _) = got.answer(), alone.answer()
        values, expected = (np.array(d["outputs"][0].pop("data"), np.float32) for d in (doc, wanted))
        assert (head, doc) == (want, wanted) and head[0] == 200  # a batched forward may differ in the last bits:
        np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-6)
    assert [json.loads(r.body)["id"] for r in fast] == [f"b{i}" for i in range(count)]


def test_a_request_waiting_in_a_task_is_one_uvicorn_waits_for_at_shutdown(served: Served, infers: list[str]) -> None:
    conn = Conn(served.port).send(req(INFER, tensor(), ("x-slow", "1")))
    deadline = time.monotonic() + 2
    while not served.fast.server_state.tasks and time.monotonic() < deadline:
        time.sleep(0.005)
    tracked = len(served.fast.server_state.tasks)
    reply = conn.reply()
    conn.close()
    assert (tracked, reply.status, infers) == (1, 200, ["scorer/None"])


@pytest.mark.parametrize("how", ["answered-at-once", "answered-by-a-task", "mid-body"])
def test_a_client_gone_before_its_answer_leaves_the_server_serving(served: Served, how: str) -> None:
    before = len(served.errors)
    data = req(BATCHED if how == "answered-by-a-task" else INFER, tensor())
    for _ in range(5):
        sock = socket.create_connection((HOST, served.port), timeout=5)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset, at once
        sock.sendall(data[:-10] if how == "mid-body" else data)
        sock.close()
    assert ask(served.port, data).status == 200
    deadline = time.monotonic() + 2  # (an ASGI task is discarded from them just after it answers)
    while served.fast.server_state.tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.errors[before:] == [] and served.thread.is_alive() and not served.fast.server_state.tasks


ON_BOTH = ["asgi", "infer-protocol"]


@pytest.mark.parametrize("server", ON_BOTH)
@pytest.mark.parametrize("second", ["infer", "asgi-route"])
def test_a_slow_request_pipelined_behind_an_answer_is_not_cut_by_the_keep_alive_timeout(
        served: Served, infers: list[str], monkeypatch: pytest.MonkeyPatch, server: str, second: str) -> None:
    """An answer written in data_received arms uvicorn's keep-alive timer (on_response_complete);
    the next request in the same read must disarm it, or the timer closes the connection under
    that request timeout_keep_alive (5 s in `serve`) later (a bug this test found)."""
    target = served.fast if server == "infer-protocol" else served.slow
    monkeypatch.setattr(target.config, "timeout_keep_alive", 0.3)  # read by each new connection
    conn = Conn(target.config.port)
    try:
        path = INFER + ("?x" if second == "asgi-route" else "")
        assert [r.status for r in conn.replies([req(INFER, tensor()), req(path, tensor(), ("x-slow", "1"))])] == [200] * 2
    finally:
        conn.close()


@pytest.mark.parametrize("server", ON_BOTH)
def test_an_idle_connection_is_closed_after_the_keep_alive_timeout_and_a_busy_one_is_not(
        served: Served, monkeypatch: pytest.MonkeyPatch, server: str) -> None:
    """InferProtocol keeps one keep-alive timer per connection instead of one per request: the
    rule stays uvicorn's. Requests closer together than the timeout keep the connection (the timer
    armed by the first answer fires meanwhile and must wait for the rest); once idle for the
    timeout after the last answer, it is closed; a request under way is never cut."""
    target = served.fast if server == "infer-protocol" else served.slow
    timeout = 0.6
    monkeypatch.setattr(target.config, "timeout_keep_alive", timeout)  # read by each new connection
    conn = Conn(target.config.port)
    try:
        for _ in range(5):  # 5 x 0.25 s: past the first timer's due time, never idle for the timeout
            assert conn.send(req(INFER, tensor())).reply().status == 200
            time.sleep(timeout * 0.4)
        assert conn.send(req(INFER, tensor())).reply().status == 200
        answered = time.monotonic()
        # a request whose body comes slowly, longer than the timeout: not cut
        body = tensor()
        conn.send(req(INFER, body)[:-10])
        time.sleep(timeout * 1.5)
        assert conn.send(req(INFER, body)[-10:]).reply().status == 200
        answered = time.monotonic()
        conn.sock.settimeout(timeout * 4)
        assert conn.file.read(1) == b""  # closed by the server, once idle for the timeout
        assert timeout * 0.9 <= time.monotonic() - answered <= timeout * 3
    finally:
        conn.close()


@pytest.mark.parametrize("server", ON_BOTH)
def test_a_connection_the_client_closes_leaves_no_keep_alive_timer(served: Served, server: str) -> None:
    """The one timer per connection is cancelled when the connection goes, not left to fire
    (connections that come and go would pile timers up for the whole timeout)."""
    target = served.fast if server == "infer-protocol" else served.slow
    before = set(target.server_state.connections)
    conn = Conn(target.config.port)
    assert conn.send(req(INFER, tensor())).reply().status == 200
    (protocol,) = set(target.server_state.connections) - before
    assert protocol.timeout_keep_alive_task is not None  # armed by the answer
    conn.close()
    deadline = time.monotonic() + 5
    while protocol in target.server_state.connections and time.monotonic() < deadline:  # connection_lost ran
        time.sleep(0.01)
    assert protocol not in target.server_state.connections
    assert protocol.timeout_keep_alive_task is None


@pytest.mark.parametrize("server", ON_BOTH)
def test_a_client_that_reads_nothing_cannot_make_the_server_buffer_without_bound(served: Served, server: str) -> None:
    """A client pipelining requests without reading their answers must not make the worker hold
    them all in memory: uvicorn's path stops reading and waits to write, and the lean path hands
    requests to it while writing is paused (before, it wrote every answer: a bug this test found)."""
    target = served.fast if server == "infer-protocol" else served.slow
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(2)
    sock.connect((HOST, target.config.port))
    try:
        deadline = time.monotonic() + 2
        while not target.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        for protocol in list(target.server_state.connections):  # kernel buffers as small on every host
            protocol.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
        with contextlib.suppress(TimeoutError):  # once every buffer on the way is full
            for _ in range(80):  # 4,000 requests, ~2 MB
                sock.sendall(req(INFER, tensor()) * 50)
        held, before, deadline = 0, -1, time.monotonic() + 8
        while held != before and time.monotonic() < deadline:  # until the server is done with what it read
            time.sleep(0.3)
            before, held = held, max(p.transport.get_write_buffer_size() for p in list(target.server_state.connections))
        assert held < 1 << 20, f"{held} bytes of answers held for a client that reads none"
    finally:
        sock.close()


def test_a_uvicorn_without_what_infer_protocol_relies_on_gets_the_asgi_path(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = InferFastPath(None, None)  # type: ignore[arg-type]
    made = fastpath.protocol_for(fast)
    assert isinstance(made, type) and made.fast is fast  # type: ignore[attr-defined]
    monkeypatch.setattr(fastpath, "_UVICORN_NAMES", (*fastpath._UVICORN_NAMES, "a_renamed_attribute"))
    assert fastpath.protocol_for(fast) == "httptools"
