"""A real ``mnn-rollout serve`` process on a loopback port, for tests and benchmarks: the demo's
``LocalRuntime`` with the test conveniences (full logs in errors, liveness-only start, drain time
for workers)."""

from __future__ import annotations

from pathlib import Path

from mnn_rollout.local.net import free_port
from mnn_rollout.local.process import LocalRuntime

__all__ = ["RuntimeServer", "free_port"]


class RuntimeServer(LocalRuntime):
    def __init__(self, config: Path, log_path: Path, host: str = "127.0.0.1", wait_ready: bool = True,
                 extra_args: list[str] | None = None) -> None:
        super().__init__(config, log_path, host, extra_args=extra_args,
                         ready_path="/v2/health/ready" if wait_ready else "/v2/health/live",
                         log_level="info", stop_timeout=40.0)  # workers drain for up to 10 s each

    def start(self, timeout: float = 60) -> None:
        try:
            super().start(timeout)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
