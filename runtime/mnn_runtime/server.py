"""Process wiring: read the config, load every version, then serve and follow config changes.

Loading happens here, once, before the HTTP server starts and with no MNN thread pool, so that
worker processes forked later share the loaded weights copy-on-write.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from .config import RuntimeConfig, parse_config_text
from .config_source import ConfigApplier, FileConfigSource
from .dataplane import DataPlane
from .metrics import RuntimeMetrics
from .registry import Registry
from .rest import create_app

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """A loaded runtime: everything a front end needs, plus the config follower."""

    config: RuntimeConfig
    registry: Registry
    metrics: RuntimeMetrics
    dataplane: DataPlane
    app: FastAPI
    source: FileConfigSource

    def close(self) -> None:
        self.source.stop()
        self.dataplane.executor.shutdown(wait=False, cancel_futures=True)


def build_runtime(config_path: Path, poll_interval: float = 0.2) -> Runtime:
    """Load the config file and every version in it; raises ConfigError on an invalid file."""
    text = config_path.read_text()
    config = parse_config_text(text)
    metrics = RuntimeMetrics(config.model)
    registry = Registry(config, config_path.parent, metrics)
    for name, state in registry.snapshot.versions.items():
        if not state.ready:
            log.error("version %s is not serving: %s", name, state.reason)

    def on_result(result: str, reason: str | None) -> None:
        metrics.config_reloads.labels(config.model, result).inc()

    applier = ConfigApplier(registry.apply, on_result)
    source = FileConfigSource(config_path, applier, interval=poll_interval)
    source.prime(text)
    dataplane = DataPlane(registry, metrics, config.server.threads)
    app = create_app(dataplane, metrics)
    return Runtime(config, registry, metrics, dataplane, app, source)


def serve(config_path: Path, host: str, port: int, log_level: str = "info") -> None:
    """Run the runtime until SIGINT/SIGTERM; uvicorn drains in-flight requests on shutdown."""
    runtime = build_runtime(config_path)
    runtime.source.start()
    server = uvicorn.Server(
        uvicorn.Config(
            runtime.app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            timeout_graceful_shutdown=10,
        )
    )
    # uvicorn drains, restores the previous handlers and re-raises the signal it caught; a
    # handler that ignores it lets a graceful SIGTERM end with exit code 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        runtime.close()
