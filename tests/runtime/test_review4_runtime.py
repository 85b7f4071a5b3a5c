"""The supervisor, its workers and their profiling children (fourth review)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.runtime.test_profile import TOKEN
from tests.runtime.test_review3_profile import gone
from tests.runtime.test_workers import all_serving, children
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(180)
SLOW = "/v2/models/scorer/versions/slow/profile"


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, examples_dir: Path) -> Iterator[RuntimeServer]:
    """Two workers serving v1 beside v2-slow warmed up at batch 2048 (~0.4 s a forward), profiling on."""
    root = tmp_path_factory.mktemp("review4")
    for name in ("v1", "v2-slow"):
        shutil.copy(examples_dir / f"{name}.mnn", root / f"{name}.mnn")
    config = {"model": "scorer", "weights": {"v1": 100, "slow": 0},
              "versions": [{"name": "v1", "uri": "v1.mnn"},
                           {"name": "slow", "uri": "v2-slow.mnn", "warmupShapes": {"features": [2048, 64]}}]}
    (root / "runtime.yaml").write_text(yaml.safe_dump(config))
    (root / "token").write_text(TOKEN + "\n")
    srv = RuntimeServer(root / "runtime.yaml", log_path=root / "server.log",
                        extra_args=["--admin-token-file", str(root / "token"), "--workers", "2"])
    srv.start()
    try:
        all_serving(srv, root / "server.log")
        yield srv
    finally:
        srv.stop()


def request(path: str, close: bool = False, token: bool = False) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + (f"Authorization: Bearer {TOKEN}\r\n" if token else "")
            + ("Connection: close\r\n" if close else "") + "\r\n").encode()


def a_workers_profiling_child(server: RuntimeServer) -> int:
    """The pid of the profiling child of one of the server's workers, once there is one."""
    assert server.proc is not None
    deadline = time.monotonic() + 20
    while True:
        for worker in children(server.proc.pid):
            for pid in children(worker):
                try:
                    if b"mnn_runtime.profile" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return pid
                except OSError:
                    pass
        assert time.monotonic() < deadline, "no profiling child process:\n" + server.log()
        time.sleep(0.02)


def test_a_connection_a_worker_closes_while_it_profiles_is_closed(workers: RuntimeServer) -> None:
    """A worker's connections come from the supervisor as SCM_RIGHTS, received without
    close-on-exec: its profiling child (``python -m mnn_runtime.profile``) inherited every
    connection the worker held, so one the worker closed (``Connection: close``, an idle keep-alive)
    stayed open to its client until the profile ended (up to ``timeout``, 600 s)."""
    held = [socket.create_connection((workers.host, workers.port), timeout=5) for _ in range(4)]
    try:
        for sock in held:  # dealt to both workers in turn, kept alive
            sock.sendall(request("/v2/health/live"))
            answer = b""
            while not answer.endswith(b'{"live":true}'):  # the whole answer: the next one starts clean
                answer += sock.recv(4096)
            assert answer.startswith(b"HTTP/1.1 200"), answer
        with socket.create_connection((workers.host, workers.port)) as profiling:
            profiling.sendall(request(SLOW + "?runs=1000&timeout=600", token=True))
            child = a_workers_profiling_child(workers)
            fds = sorted(os.readlink(fd) for fd in Path(f"/proc/{child}/fd").iterdir())
            for sock in held:
                sock.sendall(request("/v2/health/live", close=True))
                answer = b""
                try:
                    while chunk := sock.recv(4096):
                        answer += chunk
                except TimeoutError:
                    pytest.fail(f"a closed connection stays open while profiling: {answer!r}; "
                                f"the child {child} holds {fds}")
                assert answer.startswith(b"HTTP/1.1 200"), answer
        deadline = time.monotonic() + 10
        while not gone(child):  # its client left
            assert time.monotonic() < deadline, f"profiling child {child} still runs"
            time.sleep(0.02)
    finally:
        for sock in held:
            sock.close()
