"""The versions of the model being served, and the routing over the ones that can serve.

A new config is applied as one atomic swap of an immutable snapshot, after every new version has
been loaded: load before unload, so one good copy is always there. A version whose file fails to
load is marked failed with the reason and takes no traffic (its buckets are served by the stable
version); if a changed file fails to load, the version keeps serving its previous file.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mnn_rollout.contract.config import RuntimeConfig, VersionSpec
from .errors import VersionNotFound, VersionNotReady
from . import engine
from .metrics import RuntimeMetrics, resident_bytes
from .model import LoadedModel, ModelLoadError
from .sources import local_file, prune
from mnn_rollout.contract.routing import RoutingTable, table_digest

log = logging.getLogger(__name__)

READY, FAILED, PENDING, OFFLOADED = "ready", "failed", "pending", "offloaded"
_DIGEST = re.compile(r"has sha256 ([0-9a-f]{64}), expected")  # LoadedModel.load's reason for another file
PENDING_REASON = "being loaded by the supervisor process; the worker that replaces this one serves it"


@dataclass(frozen=True)
class VersionState:
    """One version as the registry sees it; ``model`` is None only when it never loaded."""

    spec: VersionSpec
    state: str
    model: LoadedModel | None = None
    reason: str | None = None
    memory_bytes: int | None = None  # resident memory its load added to the process that loaded it
    sha256: str | None = None  # offloaded (or failed to load again): the digest of the file it had loaded
    # offloaded: the metadata of the model it had loaded (inputs, outputs, engine), which it serves again
    metadata: dict[str, Any] | None = None

    @property
    def ready(self) -> bool:
        return self.model is not None

    @property
    def on_demand(self) -> bool:
        """Unloaded while serving, it loads again for its next request: as available to a client
        as a loaded one (readiness, metadata). A version that failed to load (again) is not."""
        return self.state == OFFLOADED and self.metadata is not None


@dataclass(frozen=True)
class Snapshot:
    """Everything a request needs, read once per request; replaced whole, never mutated."""

    config: RuntimeConfig
    versions: dict[str, VersionState]
    table: RoutingTable  # what requests are routed by: ``base`` with unloaded versions sent to a fallback
    weights: dict[str, int] = field(default_factory=dict)
    base: RoutingTable | None = None  # the table as published or evolved, the next one's starting point

    def version(self, name: str) -> VersionState:
        state = self.versions.get(name)
        if state is None:
            raise VersionNotFound(
                f"version {name!r} of model {self.config.model!r} does not exist; "
                f"valid: {sorted(self.versions)}"
            )
        if state.model is None:
            raise VersionNotReady(f"version {name!r} is not ready: {state.reason}")
        return state

    @functools.cached_property
    def table_digest(self) -> str:
        """The digest of the table requests are routed by, as published (or evolved here, then encoded)."""
        published = self.config.routing.table
        return table_digest(published if published is not None else (self.base or self.table).encode())

    @property
    def ready(self) -> bool:
        """Every version that should take traffic is loaded (or, in a worker, being loaded for it
        by the supervisor: a replacement worker is moments away)."""
        return all(self.versions[name].ready or self.versions[name].state == PENDING
                   for name, w in self.weights.items() if w > 0)


def next_table(config: RuntimeConfig, previous: RoutingTable | None) -> RoutingTable:
    """The table ``config`` publishes (the operator's), else the ``previous`` one evolved to its
    weights (file-config mode: users move only between versions whose weight changed)."""
    weights = config.effective_weights()
    if config.routing.table is not None:
        return RoutingTable.published(config.salt, weights, config.routing.table)
    before = previous if previous is not None and previous.salt == config.salt else None
    return RoutingTable.build(config.salt, weights, config.stable_version, before)


def same_file(a: VersionSpec, b: VersionSpec) -> bool:
    """Whether two specs name the same loaded model (file, digest, warm-up shapes and engine)."""
    return a.uri == b.uri and a.sha256 == b.sha256 and a.warmup_shapes == b.warmup_shapes and a.engine == b.engine


def max_threads(config: RuntimeConfig) -> int:
    return max(v.engine.threads if v.engine else 1 for v in config.versions)


class Registry:
    """Holds the current snapshot; ``apply`` loads what is new and swaps the snapshot."""

    def __init__(self, config: RuntimeConfig, base_dir: Path | None, metrics: RuntimeMetrics) -> None:
        self.base_dir = base_dir
        self.metrics = metrics
        self.load_new = True  # False in the workers of `serve --workers N`: the supervisor loads
        self._apply_lock = threading.Lock()
        self._reload_lock = threading.Lock()
        self._reloading: dict[str, Future[VersionState | None]] = {}
        self.on_reload: Callable[[str], None] | None = None  # a worker tells its supervisor
        # told the versions just unloaded, to let go of what they keep of them (the data plane's batchers)
        self.on_offload: list[Callable[[list[str]], None]] = []
        self.snapshot = self._build(config, {})

    def apply(self, config: RuntimeConfig) -> Snapshot:
        """Make ``config`` current: load new or changed versions first, then swap."""
        with self._apply_lock:
            self.snapshot = self._build(config, self.snapshot.versions)
            if self.load_new:  # the process that downloads: the cache keeps what this config uses
                prune([*config.versions, *(v.spec for v in self.snapshot.versions.values())])
            return self.snapshot

    def offload(self, names: Iterable[str], reason: str, wait: bool = True) -> list[str]:
        """Unload the named versions that are loaded, have weight 0 and are not stable; returns
        those it unloaded. Their memory goes once no request holds them (and, with workers, once
        every process has let go). ``wait=False``: unload nothing when a config is being applied."""
        if not self._apply_lock.acquire(blocking=wait):
            return []
        try:
            snap = self.snapshot
            done = [n for n in names if n in snap.versions and snap.versions[n].state == READY
                    and not snap.weights.get(n) and n not in (snap.config.stable_version, snap.config.shadow_version)]
            if done:
                versions = dict(snap.versions)
                for name in done:
                    old = versions[name]
                    assert old.model is not None
                    versions[name] = VersionState(old.spec, OFFLOADED, None, reason, None, old.model.sha256,
                                                  model_metadata(old.model))
                    self.metrics.set_version_state(name, 0, False, None, offloaded=True)
                self.snapshot = dataclasses.replace(snap, versions=versions)
                log.info("versions %s offloaded: %s", ", ".join(done), reason)
                for let_go in self.on_offload:
                    let_go(done)
            return done
        finally:
            self._apply_lock.release()

    def reload(self, name: str) -> Future[VersionState | None]:
        """Load an offloaded version again, once however many ask, on a thread; the future gives
        its state then (None: no longer listed). The future runs from the start, so it cannot be
        cancelled: a request that gives up (a gRPC deadline) leaves the load to the others waiting."""
        with self._reload_lock:
            future = self._reloading.get(name)
            if future is None:
                future = self._reloading[name] = Future()
                future.set_running_or_notify_cancel()
                threading.Thread(target=self._reload, args=(name, future), name=f"reload-{name}", daemon=True).start()
            return future

    def reload_now(self, names: Iterable[str]) -> list[str]:
        """Load the named offloaded versions again here and now; returns those that loaded. The
        load runs outside ``_apply_lock`` (a worker applies configs and offloads on its event loop:
        it must never wait for a load); the lock is taken for the swap alone, which is skipped when
        meanwhile the version was removed, loaded, or given another file."""
        loaded = []
        for name in names:
            old = self.snapshot.versions.get(name)
            if old is None or old.state != OFFLOADED:
                continue
            # The file it had loaded, not whatever is there now: a version never changes model
            # without a config (a config naming the file again, or a sha256, accepts a new one).
            kept = old.sha256 if old.spec.sha256 is None else None
            state = self._load(old.spec if kept is None else old.spec.model_copy(update={"sha256": kept}), None)
            changed = _DIGEST.search(state.reason or "") if kept is not None and not state.ready else None
            if changed is not None and kept is not None:
                state = VersionState(old.spec, FAILED, None,
                                     f"model file {old.spec.uri} changed on disk since it was loaded (sha256 "
                                     f"{kept}, now {changed[1]}): not loaded again; a config naming the file again "
                                     "(or its sha256) accepts the new file", sha256=kept)
                log.error("version %s: %s", old.spec.name, state.reason)
            with self._apply_lock:
                snap = self.snapshot
                now = snap.versions.get(name)
                # Still unloaded, or (in a worker) given weight meanwhile and listed pending the
                # supervisor's load of this same file: it serves from this copy.
                if (now is None or not same_file(now.spec, old.spec) or now.model is not None
                        or not (now.state == OFFLOADED or (now.state == PENDING and state.ready))):
                    continue
                versions = {**snap.versions, name: dataclasses.replace(state, spec=now.spec)}
                table = _routed(snap.config, versions, snap.weights, snap.base or snap.table)
                self.snapshot = dataclasses.replace(snap, versions=versions, table=table)
                self.metrics.set_version_state(name, snap.weights.get(name, 0), state.ready,
                                               state.model.load_seconds if state.model else None, state.memory_bytes)
            if state.ready:
                loaded.append(name)
        return loaded

    def _reload(self, name: str, future: Future[VersionState | None]) -> None:
        try:
            self.reload_now([name])
            state = self.snapshot.versions.get(name)
            if state is not None and state.ready and self.on_reload is not None:
                self.on_reload(name)
            if not future.done():
                future.set_result(state)
        except BaseException as exc:  # noqa: BLE001 - the waiting requests get it, the thread ends
            if not future.done():
                future.set_exception(exc)
        finally:
            with self._reload_lock:
                self._reloading.pop(name, None)

    def _build(self, config: RuntimeConfig, previous: dict[str, VersionState]) -> Snapshot:
        versions: dict[str, VersionState] = {}
        weights = config.effective_weights()
        if self.load_new:
            engine.reserve_threads(max_threads(config))  # MNN's pool is sized once: for the most first
        for spec in config.versions:
            old = previous.get(spec.name)
            if (old is not None and old.state == OFFLOADED and same_file(old.spec, spec) and not weights[spec.name]
                    and spec.name not in (config.stable_version, config.shadow_version)):  # shadow: loaded here
                versions[spec.name] = dataclasses.replace(old, spec=spec)  # stays unloaded until asked for
            elif (old is not None and old.state == FAILED and old.sha256 and not self.load_new
                  and same_file(old.spec, spec) and not weights[spec.name]
                  and spec.name not in (config.stable_version, config.shadow_version)):
                # A worker whose load again found the file changed: unloaded as the supervisor
                # still holds it (the supervisor loads it, should a config give it weight)
                versions[spec.name] = dataclasses.replace(old, spec=spec, state=OFFLOADED)  # metadata: None
            elif old is not None and same_file(old.spec, spec) and old.ready:
                # The file it serves (a failed or pending new file reverted): keep the loaded model,
                # take the rest of the spec (batching) as given, and it is ready again.
                versions[spec.name] = dataclasses.replace(old, spec=spec, state=READY, reason=None)
            elif not self.load_new:
                if old is not None and old.model is not None:
                    versions[spec.name] = VersionState(old.spec, PENDING, old.model,
                                                       f"new file {spec.uri} {PENDING_REASON}; still serving "
                                                       f"{old.spec.uri}", old.memory_bytes)
                else:
                    versions[spec.name] = VersionState(spec, PENDING, None, PENDING_REASON)
            else:
                versions[spec.name] = self._load(spec, old)
        current = getattr(self, "snapshot", None)  # None while the first snapshot is built
        base = next_table(config, current.base if current is not None else None)
        table = _routed(config, versions, weights, base)
        for name, state in versions.items():
            self.metrics.set_version_state(
                name, weights[name], state.ready, state.model.load_seconds if state.model else None,
                state.memory_bytes, offloaded=state.state == OFFLOADED,
            )
        for name in set(previous) - set(versions):
            self.metrics.forget_version(name)
        if config.shadow is not None:
            self.metrics.shadow.touch(config.shadow.version)
        return Snapshot(config=config, versions=versions, table=table, weights=weights, base=base)

    def _load(self, spec: VersionSpec, old: VersionState | None) -> VersionState:
        import MNN.nn  # noqa: F401 - imported before measuring: the engine's ~18 MB are not this version's

        try:
            # a remote file: from the cache, downloaded first if need be (never by a worker)
            path = local_file(spec, self.base_dir, download=self.load_new)
            before = resident_bytes()  # after the download: its buffers are not this version's
            model = LoadedModel.load(path, spec.sha256, spec.warmup_shapes, spec.engine, spec.name)
        except ModelLoadError as exc:
            return _failed(spec, old, exc.reason)
        except Exception as exc:  # noqa: BLE001 - a bug or an engine error not foreseen fails this version only
            return _failed(spec, old, f"model file {spec.uri} could not be loaded: {type(exc).__name__}: {exc} "
                                      f"(an unexpected error: its traceback is in the runtime's log)", exc)
        after = resident_bytes()
        memory = max(0, after - before) if before is not None and after is not None else None
        log.info("version %s loaded from %s in %.3f s (%s MB resident added)", spec.name, path, model.load_seconds,
                 f"{memory / 1e6:.1f}" if memory is not None else "?")
        return VersionState(spec, READY, model, memory_bytes=memory)

    def load_per_process(self) -> None:
        """In a worker just forked: load again, each on its own engine, the versions the supervisor
        loaded on a fork-safe stand-in (threads > 1, a GPU backend: see ``engine``); the others
        stay shared with the supervisor."""
        engine.fork_parent(False)
        with self._apply_lock:
            snap = self.snapshot
            engine.reserve_threads(max_threads(snap.config))
            versions = dict(snap.versions)
            for name, state in snap.versions.items():
                if state.model is None or not state.model.engine.per_process:
                    continue
                before = resident_bytes()
                model = state.model.for_this_process(state.spec)
                after = resident_bytes()
                memory = state.memory_bytes if model is state.model or before is None or after is None \
                    else max(0, after - before)
                versions[name] = dataclasses.replace(state, model=model, memory_bytes=memory)
                self.metrics.set_version_state(name, snap.weights.get(name, 0), True, model.load_seconds, memory)
                log.info("version %s in this worker: %s", name, model.engine.as_parameters())
            self.snapshot = dataclasses.replace(snap, versions=versions)


def model_metadata(model: LoadedModel) -> dict[str, Any]:
    """What the metadata endpoints say of a loaded model, kept when it is unloaded."""
    return {"inputs": [s.as_metadata() for s in model.inputs], "outputs": [s.as_metadata() for s in model.outputs],
            "sha256": model.sha256, "engine": model.engine.as_parameters()}


def _failed(spec: VersionSpec, old: VersionState | None, reason: str,
            unexpected: Exception | None = None) -> VersionState:
    """``spec`` failed to load for ``reason``, logged once (with the traceback of an ``unexpected``
    error). A bad file never replaces a good one: a version that was serving keeps its previous file."""
    if old is not None and old.ready:
        reason = f"new file {spec.uri} not loaded, still serving {old.spec.uri}: {reason}"
        log.error("version %s: %s", spec.name, reason, exc_info=unexpected)
        return VersionState(old.spec, FAILED, old.model, reason, old.memory_bytes)
    log.error("version %s failed to load: %s", spec.name, reason, exc_info=unexpected)
    return VersionState(spec, FAILED, None, reason)


def _routed(config: RuntimeConfig, versions: dict[str, VersionState], weights: dict[str, int],
            base: RoutingTable) -> RoutingTable:
    """What requests are routed by: ``base`` with the buckets of versions that cannot serve given
    to the fallback (stable, else the heaviest ready version)."""
    unavailable = {name for name, v in versions.items() if not v.ready}
    ready = [name for name, v in versions.items() if v.ready]
    if not unavailable or not ready:
        return base
    fallback = config.stable_version if versions[config.stable_version].ready else max(ready, key=lambda n: weights[n])
    return base.without(unavailable, fallback)
