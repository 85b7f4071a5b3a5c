"""A real ``mnn-rollout serve`` process on a loopback port, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RuntimeServer:
    def __init__(self, config: Path, log_path: Path, host: str = "127.0.0.1", wait_ready: bool = True,
                 extra_args: list[str] | None = None) -> None:
        self.config = config
        self.extra_args = extra_args or []
        self.log_path = log_path
        self.host = host
        self.port = free_port(host)
        self.wait_ready = wait_ready
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60) -> None:
        log = self.log_path.open("ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mnn_runtime.cli", "serve", "--config", str(self.config),
             "--host", self.host, "--port", str(self.port), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        )
        path = "/v2/health/ready" if self.wait_ready else "/v2/health/live"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not up within {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)  # workers drain for up to 10 s each
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
