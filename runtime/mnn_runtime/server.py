"""Process wiring: read the config, load every version, then serve and follow config changes.

Loading happens here, once, before the HTTP server starts and with no MNN thread pool, so that
worker processes forked later share the loaded weights copy-on-write.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import uvicorn

from .config import ConfigError, RuntimeConfig, parse_config_text
from .config_source import ConfigApplier, ConfigMapSource, FileConfigSource
from .dataplane import DataPlane
from .kube import KubeAPI, KubeError
from .metrics import RuntimeMetrics
from .registry import Registry
from .fastpath import InferFastPath
from .rest import create_app

log = logging.getLogger(__name__)


class Source(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def prime(self, text: str) -> None: ...
    def follow(self, applier: ConfigApplier) -> Source: ...


@dataclass
class Runtime:
    """A loaded runtime: everything a front end needs, plus the config follower."""

    config: RuntimeConfig
    registry: Registry
    metrics: RuntimeMetrics
    dataplane: DataPlane
    app: Any  # the ASGI app: the infer fast path in front of FastAPI
    source: Source

    def close(self) -> None:
        self.source.stop()


def _applier(metrics: RuntimeMetrics, registry: Registry, model: str) -> ConfigApplier:
    def on_result(result: str, reason: str | None) -> None:
        metrics.config_reloads.labels(model, result).inc()

    return ConfigApplier(registry.apply, on_result)


def _assemble(text: str, base_dir: Path | None, make_source: Callable[[ConfigApplier], Source]) -> Runtime:
    config = parse_config_text(text)
    metrics = RuntimeMetrics(config.model)
    registry = Registry(config, base_dir, metrics)
    for name, state in registry.snapshot.versions.items():
        if not state.ready:
            log.error("version %s is not serving: %s", name, state.reason)
    source = make_source(_applier(metrics, registry, config.model))
    source.prime(text)
    dataplane = DataPlane(registry, metrics)
    return Runtime(config, registry, metrics, dataplane, InferFastPath(create_app(dataplane, metrics), dataplane), source)


def build_runtime(config_path: Path, poll_interval: float = 0.2) -> Runtime:
    """Load a config file and every version in it; raises ConfigError on an invalid file."""
    text = config_path.read_text()
    return _assemble(text, config_path.parent,
                     lambda applier: FileConfigSource(config_path, applier, interval=poll_interval))


def build_runtime_from_configmap(ref: str, api: KubeAPI | None = None, wait: float = 120) -> Runtime:
    """Load the config held in ConfigMap ``NAMESPACE/NAME``, retrying while it does not exist yet."""
    namespace, _, name = ref.partition("/")
    if not namespace or not name:
        raise ConfigError(f"--configmap {ref!r}: expected NAMESPACE/NAME")
    api = api or KubeAPI.from_environment()
    holder: list[ConfigMapSource] = []

    def make(applier: ConfigApplier) -> ConfigMapSource:
        holder[0].applier = applier
        return holder[0]

    probe = ConfigMapSource(api, namespace, name, ConfigApplier(lambda _: None))
    holder.append(probe)
    deadline = time.monotonic() + wait
    while True:
        try:
            text = probe.fetch()
            break
        except (KubeError, OSError) as exc:
            if time.monotonic() > deadline:
                raise ConfigError(f"configmap {ref}: cannot be read: {exc}") from None
            log.warning("configmap %s not readable yet (%s); retrying", ref, exc)
            time.sleep(1)
    return _assemble(text, None, make)


def serve_workers(build: Callable[[], Runtime], host: str, port: int, workers: int,
                  log_level: str = "info", grpc_port: int | None = None) -> int:
    """Load once in this process, then fork ``workers`` processes sharing the weights. This
    process follows the config too: a new or changed version is loaded here, once, and the workers
    are replaced one by one (see workers.Supervisor)."""
    from .workers import Supervisor, bind, enable_multiprocess_metrics

    metrics_dir = enable_multiprocess_metrics()
    runtime = build()  # models loaded and warmed before the fork: shared copy-on-write
    sock = bind(host, port)
    log.info("serving on %s:%s with %d workers", host, port, workers)

    def serve_one(s: Any, ready_fd: int) -> None:
        runtime.registry.load_new = False  # a worker never loads: the supervisor does, once
        serve(runtime, host, port, log_level, sock=s, grpc_port=grpc_port, ready_fd=ready_fd)

    def apply(config: RuntimeConfig) -> bool:
        """Apply in the supervisor; True when a version's model changed (the workers must be replaced)."""
        before = {name: (v.state, id(v.model)) for name, v in runtime.registry.snapshot.versions.items()}
        after = runtime.registry.apply(config).versions
        return any(before.get(name) != (v.state, id(v.model)) for name, v in after.items())

    supervisor = Supervisor(workers, sock, serve_one, metrics_dir, apply=apply)
    follower = runtime.source.follow(ConfigApplier(supervisor.offer))
    follower.start()
    try:
        return supervisor.run()
    finally:
        follower.stop()


class _Server(uvicorn.Server):
    """uvicorn, plus what a worker of ``serve --workers`` needs: it reports when it serves, and
    SIGUSR2 retires it: it stops accepting, answers the next request on each kept-alive
    connection with ``Connection: close`` (the client reconnects, to another worker), and shuts
    down once those connections are gone (or after ``retire_grace`` seconds)."""

    def __init__(self, config: uvicorn.Config, app: Any, ready_fd: int | None, retire_grace: float = 5.0) -> None:
        super().__init__(config)
        self.app = app
        self.ready_fd = ready_fd
        self.retire_grace = retire_grace

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.ready_fd is None or self.should_exit:
            return
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, self.retire)
        os.write(self.ready_fd, b"r")
        os.close(self.ready_fd)
        self.ready_fd = None

    def retire(self) -> None:
        if getattr(self.app, "draining", None) is True:
            return
        self.app.draining = True
        for server in self.servers:
            server.close()
        asyncio.get_running_loop().create_task(self._retire())

    async def _retire(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retire_grace
        while self.server_state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True


def serve(runtime: Runtime, host: str, port: int, log_level: str = "info", sock: Any = None,
          grpc_port: int | None = None, ready_fd: int | None = None) -> None:
    """Run the runtime until SIGINT/SIGTERM; uvicorn drains in-flight requests on shutdown. With
    ``sock`` (a worker), serve that already-bound socket and write a byte to ``ready_fd`` once
    serving. With ``grpc_port``, OIP v2 gRPC is served on the same event loop (every worker binds
    that port: SO_REUSEPORT)."""
    runtime.source.start()
    config = uvicorn.Config(
        runtime.app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
    )
    server = _Server(config, runtime.app, ready_fd)
    # uvicorn drains, restores the previous handlers and re-raises the signal it caught; a
    # handler that ignores it lets a graceful SIGTERM end with exit code 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        # A worker serves the parent's socket as a socket object: uvicorn's `fd=` would wrap it as
        # AF_UNIX and lose TCP_NODELAY (40 ms per keep-alive request).
        sockets = [sock] if sock is not None else None
        if grpc_port is None:
            server.run(sockets=sockets)
        else:
            from .grpc_server import run_with_uvicorn  # gRPC starts in the worker, after the fork

            run_with_uvicorn(server, runtime.dataplane, host, grpc_port, sockets, reuse_port=sock is not None)
    finally:
        runtime.close()
