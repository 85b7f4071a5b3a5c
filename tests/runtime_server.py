"""A real ``mnn-rollout serve`` process on a loopback port, for tests: the demo's ``LocalRuntime``
with the test conveniences (full logs in errors, liveness-only start, info logs, drain time for
workers, a feedback token)."""

from __future__ import annotations

from pathlib import Path

from mnn_rollout.local.process import LocalRuntime


# The feedback token every test runtime takes (feedback is disabled without one).
FEEDBACK_TOKEN = "test-feedback-token"
FEEDBACK_AUTH = {"Authorization": f"Bearer {FEEDBACK_TOKEN}"}


class RuntimeServer(LocalRuntime):
    def __init__(self, config: Path, log_path: Path, host: str = "127.0.0.1", wait_ready: bool = True,
                 extra_args: list[str] | None = None) -> None:
        own = any(a.startswith("--feedback-token-file") for a in extra_args or [])
        super().__init__(config, log_path, host, extra_args=extra_args,
                         ready_path="/v2/health/ready" if wait_ready else "/v2/health/live",
                         log_level="info", stop_timeout=40.0,  # workers drain for up to 10 s each
                         log_in_errors=True, feedback_token=None if own else FEEDBACK_TOKEN)
