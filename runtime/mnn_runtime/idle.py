"""Unload the versions nobody uses (``server.idle_unload_seconds``), in the process that loads.

A version that has been at weight 0, neither the stable nor the shadow one, for that long, and
answered no request and had none in flight meanwhile, is unloaded (the clock starts when it can
first be unloaded: a canary dropped to weight 0 is not unloaded at once for having been quiet
before). Its weights are freed (with ``--workers``, the supervisor and every worker let go, so
the pages they shared go too). It loads again on its next pinned request (that request waits for
the load) or before a config gives it weight (load before swap, as for any new version). Use is read from the request metrics, which every worker writes, so the
supervisor sees the pinned requests its workers answer without any message.

MNN has no file-backed weights to fall back on here: ``RuntimeManager.set_external`` points at a
``.mnn.weight`` file that MNN reads with fread, not mmap (measured, see FACTS), so an idle
version's weights are either in memory or not loaded at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .registry import READY, Registry

log = logging.getLogger(__name__)

Offload = Callable[[list[str], str], object]


class IdleUnloader:
    """Checks every ``period`` seconds which versions have been idle long enough, and hands them
    to ``offload(names, reason)``."""

    def __init__(self, registry: Registry, offload: Offload | None = None, period: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.offload: Offload = offload or registry.offload
        self.period, self.clock = period, clock
        self._seen: dict[str, tuple[float, float]] = {}
        self._since: dict[str, float] = {}  # when each version was last seen used, loaded or held (weight...)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> list[str]:
        """One check; returns the versions handed to ``offload``."""
        now = self.clock()
        snap = self.registry.snapshot
        activity = self.registry.metrics.activity()
        held = (snap.config.stable_version, snap.config.shadow_version)
        for name, state in snap.versions.items():
            seen = activity.get(name, (0.0, 0.0))
            # used, or not one that can be unloaded (loading, with weight, stable, shadow): its clock starts afresh
            if (seen != self._seen.get(name) or seen[1] > 0 or state.state != READY or snap.weights.get(name)
                    or name in held or name not in self._since):
                self._seen[name], self._since[name] = seen, now
        for gone in set(self._since) - set(snap.versions):
            self._since.pop(gone, None)
            self._seen.pop(gone, None)
        idle = snap.config.server.idle_unload_seconds
        if not idle:
            return []
        due = sorted(name for name, state in snap.versions.items()
                     if state.state == READY and not snap.weights.get(name)
                     and name not in (snap.config.stable_version, snap.config.shadow_version)
                     and now - self._since[name] >= idle)
        if due:  # offered again next time if it could not be done now (a config being applied)
            self.offload(due, f"no request for {idle:g} s at weight 0: unloaded; loads again on its next "
                              "request or before it gains weight")
        return due

    def start(self) -> IdleUnloader:
        self._thread = threading.Thread(target=self._run, name="idle-unloader", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - a failed check must not end the checks
                log.exception("idle check failed")
