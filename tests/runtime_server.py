"""A real ``mnn-rollout serve`` process on a loopback port, for tests: the demo's ``LocalRuntime``
with the test conveniences (full logs in errors, liveness-only start, info logs, drain time for
workers)."""

from __future__ import annotations

from pathlib import Path

from mnn_rollout.local.process import LocalRuntime


class RuntimeServer(LocalRuntime):
    def __init__(self, config: Path, log_path: Path, host: str = "127.0.0.1", wait_ready: bool = True,
                 extra_args: list[str] | None = None) -> None:
        super().__init__(config, log_path, host, extra_args=extra_args,
                         ready_path="/v2/health/ready" if wait_ready else "/v2/health/live",
                         log_level="info", stop_timeout=40.0,  # workers drain for up to 10 s each
                         log_in_errors=True)
