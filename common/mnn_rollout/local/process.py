"""``mnn-rollout serve`` as a child process on a loopback port: for the demo, the tests and the
benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .net import free_port, require_loopback


def stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name: index 0 is field 3 (the state)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (its own, not its children's)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


class LocalRuntime:
    """``mnn-rollout serve --config FILE`` as a child process on a loopback port."""

    def __init__(self, config: Path, log_path: Path, host: str = "127.0.0.1", port: int | None = None,
                 extra_args: list[str] | None = None, ready_path: str = "/v2/health/ready",
                 log_level: str = "warning", stop_timeout: float = 20.0, log_in_errors: bool = False,
                 feedback_token: str | None = None) -> None:
        self.config, self.log_path, self.host = config, log_path, require_loopback(host)
        self.port = port or free_port(host)
        self.extra_args = list(extra_args or [])
        self.feedback_token = feedback_token  # the feedback endpoint's bearer token; None: feedback disabled
        if feedback_token is not None:
            token_file = log_path.with_name(log_path.name + ".feedback-token")
            token_file.touch(mode=0o600)
            token_file.write_text(feedback_token)
            self.extra_args += ["--feedback-token-file", str(token_file)]
        if not any(a == "--workers" or a.startswith("--workers=") for a in self.extra_args):
            # one process unless asked: the demo and the tests run several runtimes on one machine
            self.extra_args += ["--workers", "1"]
        self.ready_path, self.log_level, self.stop_timeout = ready_path, log_level, stop_timeout
        self.log_in_errors = log_in_errors  # a start error carries the whole log, not only its path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60) -> None:
        try:
            self._start(timeout)
        except RuntimeError as exc:
            if not self.log_in_errors:
                raise
            raise RuntimeError(f"{exc}:\n{self.log()}") from None

    def _start(self, timeout: float) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mnn_rollout.cli", "serve", "--config", str(self.config), "--host",
                 self.host, "--port", str(self.port), "--log-level", self.log_level, *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the runtime exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the runtime was not ready within {timeout:g} s; see {self.log_path}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
