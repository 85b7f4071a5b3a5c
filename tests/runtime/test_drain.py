"""SIGTERM drains kept-alive connections without losing a request: each one's next request is
answered (with ``Connection: close``) instead of the connection being closed under the client."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)
BODY = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64],
                               "data": [0.5] * 64}]}).encode()


def request(host: str, user: str) -> bytes:
    return (f"POST /v2/models/scorer/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"X-User-Id: {user}\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY


def answer(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """One HTTP/1.1 response read off ``sock``: its status and headers (the body is read and dropped)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    need = int(headers.get("content-length", "0"))
    while len(rest) < need:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed in the body")
        rest += chunk
    return int(lines[0].split()[1]), headers


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_sigterm_answers_the_next_request_on_every_idle_kept_alive_connection(
        model_dir: Path, tmp_path: Path, workers: int) -> None:
    srv = RuntimeServer(model_dir / "runtime.yaml", log_path=tmp_path / "server.log",
                        extra_args=["--workers", str(workers)])
    srv.start()
    assert srv.proc is not None
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(6)]
    try:
        for i, s in enumerate(socks):  # every connection served once, then left idle
            s.sendall(request(host, f"u{i}"))
            status, headers = answer(s)
            assert status == 200 and headers.get("connection", "").lower() != "close"
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # idle through the start of the drain (plain uvicorn closes them here)
        assert srv.proc.poll() is None, "the runtime exited with connections still open"
        for i, s in enumerate(socks):
            s.sendall(request(host, f"v{i}"))
            status, headers = answer(s)
            assert status == 200, status
            assert headers.get("connection", "").lower() == "close", headers
            assert s.recv(1) == b""  # and the server closed it after that answer
        started = time.monotonic()
        assert srv.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 5, "the drain waited although every connection was closed"
        with pytest.raises(OSError):  # no longer accepting
            socket.create_connection((host, int(port)), timeout=2).close()
    finally:
        for s in socks:
            s.close()
        srv.stop()
