"""The supervisor, its workers and their profiling children (fourth review)."""

from __future__ import annotations

import os
import resource
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from mnn_rollout.local.net import wait_for, write_atomic
from mnn_runtime.dataplane import WORKERS_DIFFER

from tests.runtime.test_profile import TOKEN
from tests.runtime.test_review3_profile import SLOW, gone, profiling_child, slow_beside_v1
from tests.runtime.test_workers import all_serving, children, two_workers
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory, examples_dir: Path) -> Iterator[RuntimeServer]:
    """Two workers serving v1 beside v2-slow warmed up at batch 2048 (~0.4 s a forward), profiling on."""
    root = tmp_path_factory.mktemp("review4")
    with slow_beside_v1(root, examples_dir, "--workers", "2") as srv:
        all_serving(srv, root / "server.log")
        yield srv


def request(path: str, close: bool = False, token: bool = False) -> bytes:
    return (f"GET {path} HTTP/1.1\r\nHost: x\r\n" + (f"Authorization: Bearer {TOKEN}\r\n" if token else "")
            + ("Connection: close\r\n" if close else "") + "\r\n").encode()


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
            child = profiling_child(workers)
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


def test_a_large_config_a_worker_out_of_descriptors_lost_reaches_it_later(model_dir: Path, tmp_path: Path) -> None:
    """A config over one channel message travels as a memfd; a worker at its limit of open files
    gets the message without it (MSG_CTRUNC): "a config from the supervisor was lost", and nothing
    sent it again, so that worker routed by the old weights for ever (the pod's /status
    workers-differ) once it had descriptors again. Now it asks again, once a second, until it has it."""
    padded = "./" * 1000 + "v1.mnn"  # the same small file, under a long uri: ~310 KB of YAML
    versions = [{"name": "v1", "uri": "v1.mnn"}] + [{"name": f"x{i}", "uri": padded} for i in range(150)]
    config = {"model": "scorer", "stable": "v1", "weights": {"v1": 100}, "versions": versions}
    path = model_dir / "big.yaml"
    write_atomic(path, yaml.safe_dump(config))
    with two_workers(path, tmp_path / "server.log") as server:
        assert server.proc is not None
        worker = children(server.proc.pid)[0]
        limit = len(os.listdir(f"/proc/{worker}/fd")) + 2
        soft, hard = resource.prlimit(worker, resource.RLIMIT_NOFILE)
        resource.prlimit(worker, resource.RLIMIT_NOFILE, (limit, hard))
        held = []
        try:
            while True:  # connections kept alive until one is dropped: the worker is out of descriptors
                assert len(held) < 100, server.log()
                sock = socket.create_connection((server.host, server.port), timeout=5)
                held.append(sock)
                sock.sendall(request("/v2/health/live"))
                try:
                    if not sock.recv(4096):
                        break
                except ConnectionResetError:
                    break
            # the client's end closes inside the worker's recvmsg (the kernel drops the descriptor
            # that did not fit), a moment before the worker logs it
            wait_for(lambda: "a connection from the supervisor was dropped" in server.log(), 20,
                     "the worker logs the connection it dropped")
            config["weights"] = {"v1": 60, "x7": 40}
            write_atomic(path, yaml.safe_dump(config))
            deadline = time.monotonic() + 20
            while "a config from the supervisor was lost" not in server.log():
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.05)
        finally:
            for sock in held:
                sock.close()
        resource.prlimit(worker, resource.RLIMIT_NOFILE, (soft, hard))  # descriptors again
        wanted = {"v1": 60, "x7": 40, **{f"x{i}": 0 for i in range(150) if i != 7}}
        deadline = time.monotonic() + 20
        while True:
            status = httpx.get(server.url + "/v2/models/scorer/status", timeout=10).json()
            if status["table_digest"] != WORKERS_DIFFER and status["weights"] == wanted:
                break
            assert time.monotonic() < deadline, f"{status['table_digest']} {status.get('lagging_workers')}"
            time.sleep(0.2)
