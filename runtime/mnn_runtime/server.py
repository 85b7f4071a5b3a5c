"""Process wiring: read the config, load every version, then serve and follow config changes.

Loading happens here, once, before the HTTP server starts and with no MNN thread pool, so that
worker processes forked later share the loaded weights copy-on-write.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import uvicorn

from mnn_rollout.contract.config import (DRAIN_CONNECTIONS_SECONDS, DRAIN_IN_FLIGHT_SECONDS, ConfigError, RuntimeConfig,
                                         dump_config, parse_config_text)
from mnn_rollout.contract.routing import table_digest
from .config_source import ConfigApplier, ConfigMapSource, FileConfigSource
from . import engine
from .dataplane import DataPlane
from .kube import KubeAPI, KubeError
from .metrics import RuntimeMetrics
from .registry import FAILED, PENDING, Registry, next_table, same_file
from .shadow import setting as shadow_setting
from .fastpath import InferFastPath, protocol_for
from .idle import IdleUnloader
from .workers_channel import (AGAIN_MESSAGE, ALIVE_MESSAGE, ALIVE_SECONDS, CONFIG_MESSAGE, CONNECTION,
                              GRPC_CONNECTION, MAX_CONFIG_BYTES, OFFLOAD_MESSAGE, RELOAD_MESSAGE, config_text,
                              receive, routing_of, send_message)
from .profile import Profiler
from .rest import create_app

if TYPE_CHECKING:
    from .grpc_h2 import GrpcServer

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
    profiler: Profiler  # the admin endpoint's: stopped when the server shuts down

    def close(self) -> None:
        self.source.stop()
        self.dataplane.shadow.close()


def _applier(metrics: RuntimeMetrics, apply: Callable[[RuntimeConfig], object], model: str) -> ConfigApplier:
    def on_result(result: str, reason: str | None) -> None:
        metrics.config_reloads.labels(model, result).inc()

    return ConfigApplier(apply, on_result)


def _assemble(text: str, base_dir: Path | None, make_source: Callable[[ConfigApplier], Source],
              admin_token: str | None = None, feedback_token: str | None = None) -> Runtime:
    config = parse_config_text(text)
    metrics = RuntimeMetrics(config.model)
    registry = Registry(config, base_dir, metrics)
    for name, state in registry.snapshot.versions.items():
        if not state.ready:
            log.error("version %s is not serving: %s", name, state.reason)
    source = make_source(_applier(metrics, registry.apply, config.model))
    source.prime(text)
    dataplane = DataPlane(registry, metrics)
    profiler = Profiler()
    app = create_app(dataplane, metrics, admin_token, feedback_token, profiler)
    return Runtime(config, registry, metrics, dataplane, InferFastPath(app, dataplane), source, profiler)


def build_runtime(config_path: Path, poll_interval: float = 0.2, admin_token: str | None = None,
                  feedback_token: str | None = None) -> Runtime:
    """Load a config file and every version in it; raises ConfigError on an invalid file.
    ``admin_token`` enables the admin endpoints (profiling) for requests that carry it."""
    text = config_path.read_text()
    return _assemble(text, config_path.parent,
                     lambda applier: FileConfigSource(config_path, applier, interval=poll_interval), admin_token,
                     feedback_token)


def build_runtime_from_configmap(ref: str, api: KubeAPI | None = None, wait: float = 120,
                                 admin_token: str | None = None, feedback_token: str | None = None) -> Runtime:
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
    return _assemble(text, None, make, admin_token, feedback_token)


OPEN_FILES_CEILING = 1 << 20  # what containerd and CRI-O gave containers for years; more only slows fd walks


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (at most
    ``OPEN_FILES_CEILING``), as Go's runtime does since 1.19 and nginx's worker_rlimit_nofile: each
    connection is a descriptor, and containerd 2.0 starts containers at 1024 soft (524288 hard), so
    a worker stopped taking connections at ~1,000 clients. Workers inherit it. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = OPEN_FILES_CEILING if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_CEILING)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:  # a sandbox that refuses it: serve within the limit we have
            log.warning("open files limit left at %d: %s", soft, exc)
            return soft, soft
        log.info("open files limit raised from %d to %d", soft, want)
        return soft, want
    return soft, soft


def serve_workers(build: Callable[[], Runtime], host: str, port: int, workers: int,
                  log_level: str = "info", grpc_port: int | None = None) -> int:
    """Load once in this process, then fork ``workers`` processes sharing the weights. Only this
    process follows the config (one watch per pod, not per worker): it sends every valid change to
    the workers at once (new weights apply there within milliseconds), then loads a new or changed
    version here, once, and replaces the workers one by one (see workers.Supervisor)."""
    from .workers import Supervisor
    from .workers_channel import bind
    from .workers_metrics import enable_multiprocess_metrics

    metrics_dir = enable_multiprocess_metrics()
    engine.fork_parent(True)  # no MNN thread pool or GPU here: a worker forked after one would hang
    runtime = build()  # models loaded and warmed before the fork: shared copy-on-write
    sock = bind(host, port)
    grpc_sock = None
    if grpc_port is not None:  # its connections are dealt out too
        try:
            grpc_sock = bind(host, grpc_port)
        except OSError as exc:
            raise OSError(f"gRPC: cannot bind {host}:{grpc_port}: {exc}") from None
    log.info("serving on %s:%s with %d workers", host, port, workers)
    if grpc_sock is not None:
        log.info("serving OIP v2 gRPC on %s:%s with %d workers", host, grpc_sock.getsockname()[1], workers)

    def serve_one(channel: Any, ready_fd: int) -> None:
        runtime.registry.load_new = False  # a worker never loads: the supervisor does, once
        runtime.registry.load_per_process()  # ... but versions with threads > 1 or a GPU: here, on their engine
        serve(runtime, host, port, log_level, channel=channel, grpc_port=grpc_port, ready_fd=ready_fd)

    published = [runtime.registry.snapshot.base]

    def offer(config: RuntimeConfig) -> None:
        # Without a published table the supervisor evolves it and sends it along: every worker
        # (a replacement forked later, one that missed a change) then serves the same table.
        table = published[0] = next_table(config, published[0])
        if config.routing.table is None:
            config = config.model_copy(update={"routing": config.routing.model_copy(update={"table": table.encode()})})
        assert config.routing.table is not None
        supervisor.offer(config, dump_config(config).encode(), table_digest(config.routing.table),
                         shadow_setting(config))

    def apply(config: RuntimeConfig) -> bool:
        """Apply in the supervisor; True when the workers must be replaced: a version was added,
        its file changed (the workers list it as pending until then) or its model did."""
        before = {name: (v.state, id(v.model)) for name, v in runtime.registry.snapshot.versions.items()}
        asked = {v.name: v for v in runtime.registry.snapshot.config.versions}
        after = runtime.registry.apply(config).versions
        return (any(v.name not in asked or not same_file(asked[v.name], v) for v in config.versions)
                or any(before.get(name) != (v.state, id(v.model)) for name, v in after.items()))

    # What every worker would import or build when it starts is done here, once, so that it is
    # shared too (measured: an idle worker's private memory went from 9.9 to 6.9 MB).
    _uvicorn_config(runtime, host, port, log_level).load()
    import uvloop  # noqa: F401 - imported, not started: each worker makes its own loop
    def reload(names: list[str]) -> bool:
        """Load again the versions a worker loaded again for a request; True: replace the workers
        (so that they share this copy instead of their own)."""
        return bool(runtime.registry.reload_now(names))

    supervisor = Supervisor(workers, sock, serve_one, metrics_dir, apply=apply, reload=reload, grpc_sock=grpc_sock,
                            target=runtime.registry.snapshot.table_digest,
                            target_shadow=shadow_setting(runtime.registry.snapshot.config))
    runtime.dataplane.pod_routing = supervisor.routing.read  # each worker's /status: what the whole pod routes by

    def offload(names: list[str], reason: str) -> None:
        def unload() -> None:  # on the supervisor's thread, which forks: never during a fork
            done = runtime.registry.offload(names, reason, wait=False)  # a loading config: next time
            if done:
                supervisor.broadcast(OFFLOAD_MESSAGE + f"{','.join(done)}\n{reason}".encode())

        supervisor.call_in_loop(unload)

    unloader = IdleUnloader(runtime.registry, offload).start()

    def counted(result: str, reason: str | None) -> None:  # on the supervisor's thread: see call_in_loop
        supervisor.call_in_loop(lambda: runtime.metrics.config_reloads.labels(runtime.config.model, result).inc())

    follower = runtime.source.follow(ConfigApplier(offer, counted))
    follower.start()
    try:
        return supervisor.run()
    finally:
        unloader.stop()
        follower.stop()


class _Server(uvicorn.Server):
    """uvicorn, plus what a worker of ``serve --workers`` needs: connections arrive as file
    descriptors over ``channel`` from the supervisor (which accepts them and deals them out, so
    every worker gets its share); it reports when it serves; and SIGUSR2 retires it: it takes no
    more connections, answers the next request on each kept-alive one with ``Connection: close``
    (the client reconnects, to another worker) and shuts down once they are gone (or after
    ``retire_grace`` seconds).

    SIGTERM (a pod being deleted, after its preStop delay) drains the same way, worker or not.
    uvicorn alone would close every idle kept-alive connection at once, and a client sending its
    next request on one at that moment loses it. Answering each connection's next request with
    ``Connection: close`` and closing it then loses none; a connection left idle until the end of
    ``retire_grace`` is closed as uvicorn closes any idle one past its keep-alive timeout. A running
    profile (minutes, at most) is stopped at once: its request answers 503. A second SIGTERM
    changes nothing; SIGINT still stops at once as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, app: Any, channel: socket.socket | None, ready_fd: int | None,
                 on_config: Callable[[bytes], object] | None = None,
                 retire_grace: float = DRAIN_CONNECTIONS_SECONDS) -> None:
        super().__init__(config)
        self.app = app
        self.channel = channel
        self.on_config = on_config
        self.on_offload: Callable[[list[str], str], object] | None = None  # versions the supervisor unloaded
        self.routing: Callable[[], bytes] | None = None  # what it routes by, told to the supervisor
        self.ready_fd = ready_fd
        self.retire_grace = retire_grace
        self.grpc: GrpcServer | None = None  # serve --grpc-port: its connections come over ``channel`` too
        self.profiler: Profiler | None = None  # a running profile is stopped at once when it shuts down
        self._loop: asyncio.AbstractEventLoop | None = None
        self._config_lost = False  # a config came without its file (no descriptor left): asked again

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGTERM and self._loop is not None and not self.should_exit:
            if not getattr(self.app, "draining", False):
                self._loop.call_soon_threadsafe(self.retire)
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup([] if self.channel is not None else sockets)
        if self.should_exit:
            return
        loop = self._loop = asyncio.get_running_loop()
        if self.channel is not None:
            self.channel.setblocking(False)
            loop.add_reader(self.channel.fileno(), self._receive)
        if self.ready_fd is not None:
            loop.add_signal_handler(signal.SIGUSR2, self.retire)
            if self.channel is not None:  # what it routes by reaches the supervisor before it counts as serving
                self._alive()
            os.write(self.ready_fd, b"r")
            os.close(self.ready_fd)
            self.ready_fd = None

    def _alive(self) -> None:
        """Tell the supervisor this worker's loop runs, now and every ALIVE_SECONDS (a loop stuck
        in a forward says nothing: the supervisor then replaces this worker)."""
        assert self._loop is not None and self.channel is not None
        self._tell()
        if self._config_lost:  # once a second at most: while it has no descriptor, it loses it again
            self._config_lost = not send_message(os.getpid(), self.channel, AGAIN_MESSAGE, quiet=True)
        self._loop.call_later(ALIVE_SECONDS, self._alive)

    def _tell(self) -> None:
        """Tell the supervisor this worker's loop runs and what it routes by (the pod's /status
        reports a table only once every worker says it routes by it)."""
        assert self.channel is not None
        routing = self.routing() if self.routing is not None else b""
        send_message(os.getpid(), self.channel, ALIVE_MESSAGE + routing, quiet=True)

    def _protocol(self) -> asyncio.Protocol:
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state)

    def _receive(self) -> None:
        """Take what the supervisor sent: connections (serve each like an accepted one) and
        configs (apply them)."""
        assert self.channel is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, fds, flags = receive(self.channel)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.error("the channel from the supervisor broke: %s", exc)
                data, fds, flags = b"", [], 0
            if data.startswith(CONFIG_MESSAGE):
                text = config_text(data, fds)  # in the message, or in the file sent with it
                if flags & socket.MSG_TRUNC:
                    log.error("a config from the supervisor was over %d bytes and is ignored", MAX_CONFIG_BYTES)
                elif flags & socket.MSG_CTRUNC:
                    log.error("a config from the supervisor was lost: no file descriptor left; asking again")
                    self._config_lost = True
                elif self.on_config is not None and text is not None:
                    self._config_lost = False  # this one is newer than any lost before it
                    self.on_config(text)
                    self._tell()  # at once: the pod's status waits for every worker's word
                continue
            if not fds and data.startswith(OFFLOAD_MESSAGE):
                names, _, reason = data[len(OFFLOAD_MESSAGE):].decode().partition("\n")
                if self.on_offload is not None:
                    self.on_offload(names.split(","), reason)
                continue
            if not data and not fds:  # the supervisor is gone: finish what we hold, then exit
                loop.remove_reader(self.channel.fileno())
                log.error("the supervisor is gone; this worker drains and exits")
                if self.profiler is not None:
                    self.profiler.stop()
                self.should_exit = True
                return
            if flags & socket.MSG_CTRUNC:  # out of file descriptors: that connection is lost, not us
                log.error("a connection from the supervisor was dropped: no file descriptor left")
            protocol: Callable[[], asyncio.Protocol] | None = self._protocol if data == CONNECTION else None
            if data == GRPC_CONNECTION and self.grpc is not None:
                protocol = self.grpc.connection
            for fd in fds:
                conn = socket.socket(fileno=fd)
                if protocol is None:  # a gRPC one with no gRPC server here, or what no one sends
                    log.warning("a connection from the supervisor tagged %r was closed: nothing here serves it", data)
                    conn.close()
                    continue
                conn.setblocking(False)
                task = loop.create_task(loop.connect_accepted_socket(protocol, conn))
                task.add_done_callback(_drop_failed_connection)

    def retire(self) -> None:
        if getattr(self.app, "draining", None) is True:
            return
        self.app.draining = True
        loop = asyncio.get_running_loop()
        if self.profiler is not None:  # it could run for minutes: the drain would wait for it, then cancel it
            self.profiler.stop()
        if self.grpc is not None:  # gRPC clients move to another worker once their running calls end
            self.grpc.drain()
        if self.channel is not None:
            self._receive()  # connections dealt before the supervisor knew: served, and told to go
            loop.remove_reader(self.channel.fileno())
        for server in self.servers:  # a process that accepts its own connections stops accepting
            server.close()
        loop.create_task(self._retire())

    async def _retire(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.retire_grace
        while self.server_state.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        self.should_exit = True


def _drop_failed_connection(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("a handed-over connection could not be served: %s", task.exception())


def _uvicorn_config(runtime: Runtime, host: str, port: int, log_level: str) -> uvicorn.Config:
    # No WebSocket support: nothing here speaks it, and its import would cost every worker.
    return uvicorn.Config(runtime.app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_keep_alive=DRAIN_CONNECTIONS_SECONDS,
                          timeout_graceful_shutdown=DRAIN_IN_FLIGHT_SECONDS, ws="none", loop="uvloop",
                          http=protocol_for(runtime.app))


def serve(runtime: Runtime, host: str, port: int, log_level: str = "info", channel: socket.socket | None = None,
          grpc_port: int | None = None, ready_fd: int | None = None) -> None:
    """Run the runtime until SIGINT/SIGTERM; uvicorn drains in-flight requests on shutdown. With
    ``channel`` (a worker), serve the connections the supervisor sends over it and write a byte
    to ``ready_fd`` once serving. With ``grpc_port``, OIP v2 gRPC is served on the same event loop
    (a worker's gRPC connections, too, come from the supervisor over ``channel``)."""
    on_config = None
    unloader = None
    if channel is None:
        runtime.source.start()
        unloader = IdleUnloader(runtime.registry).start()
    else:  # a worker: configs come from the supervisor; it counts them, the worker applies them
        applier = ConfigApplier(runtime.registry.apply)
        on_config = lambda text: applier.offer(text.decode(), "the supervisor")  # noqa: E731
        # a version it loaded again for a request: the supervisor loads it too, for the next workers
        def reloaded(name: str) -> None:
            send_message(os.getpid(), channel, RELOAD_MESSAGE + name.encode())

        runtime.registry.on_reload = reloaded
    config = _uvicorn_config(runtime, host, port, log_level)
    server = _Server(config, runtime.app, channel, ready_fd, on_config)
    if channel is not None:
        def routing() -> bytes:
            snap = runtime.registry.snapshot
            return routing_of(snap.table_digest, snap.weights,
                              [name for name, v in snap.versions.items() if v.state not in (PENDING, FAILED)],
                              shadow_setting(snap.config))

        server.routing = routing
    server.on_offload = runtime.registry.offload
    server.profiler = runtime.profiler
    # uvicorn drains, restores the previous handlers and re-raises the signal it caught; a
    # handler that ignores it lets a graceful SIGTERM end with exit code 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        if grpc_port is None:
            server.run()
        else:
            from .grpc_server import run_with_uvicorn  # gRPC starts in the worker, after the fork

            def started(grpc: GrpcServer) -> None:
                server.grpc = grpc

            run_with_uvicorn(server, runtime.dataplane, host, None if channel is not None else grpc_port, started)
    finally:
        if unloader is not None:
            unloader.stop()
        runtime.close()
