"""When each ModelDeployment is reconciled: on its own events, its pods' events, and on timers only
while something is in flight. No thread is held per object.

Each object has one asyncio task (a kopf daemon) that sleeps until it is woken or its next due
time passes, then runs ``Reconciler.reconcile`` on a bounded thread pool shared by every object.
It is woken by a change of the object's generation, annotations (actions, alerts) or deletion,
by a change of its runtime pods' phase, readiness or address, and by a change to one of its
children (a hand edit or deletion, which the reconcile repairs); its own status writes do not
wake it. An idle object (no canary in flight, every routed version loaded, no pending action) has
no timer at all: it costs nothing but its share of the watches.

On operator exit kopf stops the daemons one after another (a stopper task each); the first one
told ``OPERATOR_EXITING`` ends every loop at once (``WakeUps.exit``): no reconcile starts after
that, queued ones are dropped, and the API client makes no further request, so one that was
running is cut at its next request (its state is in the object's status, as after a crash).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import kopf

from .analyzer import analysing, next_due
from .children import GROUP, OWNER_LABEL
from .kube import ApiError
from .ports import WatchCache
from .reconcile import ACTION_ANNOTATION, ALERT_ANNOTATION, Reconciler, guard_spec
from .rollout import Event
from .spec import ModelDeploymentSpec, SpecError, parse_spec
from .status import Phase, RolloutStatus, condition

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, name)

# Phases whose next step depends on time or on state only the pods' HTTP endpoints show.
TIMED = (Phase.PROGRESSING, Phase.PROMOTING)
REJECTED_RETRY_SECONDS = 10.0  # a child the API refused is tried again this often (a policy may change)


def md_signature(body: dict[str, Any]) -> tuple[Any, ...]:
    """What of a ModelDeployment, when it changes, calls for a reconcile: its spec (generation),
    the action and alert annotations, deletion. Not its status, nor kopf's own bookkeeping."""
    meta = body.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    return (meta.get("uid"), meta.get("generation"), annotations.get(ACTION_ANNOTATION),
            annotations.get(ALERT_ANNOTATION), bool(meta.get("deletionTimestamp")))


def pod_signature(body: dict[str, Any]) -> tuple[Any, ...]:
    """What of a runtime pod the reconcile looks at: phase, readiness, address, restarts, deletion."""
    meta, status = body.get("metadata") or {}, body.get("status") or {}
    ready = next((c.get("status") for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    restarts = tuple(c.get("restartCount") for c in status.get("containerStatuses") or [])
    return (status.get("phase"), ready, status.get("podIP"), restarts, bool(meta.get("deletionTimestamp")))


def child_signature(body: dict[str, Any]) -> tuple[Any, ...]:
    """A child's content as the operator renders it: everything but status and bookkeeping. Its
    ownerReferences too: one removed by hand (garbage collection would no longer take the child) is
    drift, put back by the reconcile this wakes."""
    meta = body.get("metadata") or {}
    content = {k: v for k, v in body.items() if k not in ("metadata", "status")}
    owners = tuple(sorted(repr(sorted(o.items())) for o in meta.get("ownerReferences") or []))
    return (repr(sorted(content.items())), tuple(sorted((meta.get("labels") or {}).items())),
            tuple(sorted((meta.get("annotations") or {}).items())), owners, bool(meta.get("deletionTimestamp")))


def next_wake(spec: ModelDeploymentSpec, status: RolloutStatus, pods: int, resync: float,
              now: float) -> float | None:
    """Seconds until the object must be looked at again without an event; None: only on events."""
    # a paused canary with users is still checked (analysing): woken when its next check is due
    due = next_due(spec, status) if status.phase == Phase.PROGRESSING or analysing(spec, status) else None
    polling = status.phase in TIMED or bool(status.pending_action)
    # A version loading inside running pods changes no Kubernetes object: poll while one is.
    loading = pods > 0 and any(not v.get("ready") for v in status.versions)
    if status.phase == Phase.PROMOTING and status.promoted_at is not None:
        due = status.promoted_at + spec.strategy.scale_down_delay_seconds
    rejected = (condition(status, "ChildRejected") or {}).get("status") == "True"
    # new weights confirmed by the pods only at a later look: poll until they are (they apply within a second)
    loading = loading or (pods > 0 and (condition(status, "WeightsServed") or {}).get("status") == "False")
    if not (polling or loading or rejected):
        return None if due is None else max(0.0, due - now)
    wait = resync if (polling or loading) else max(resync, REJECTED_RETRY_SECONDS)
    if due is not None:
        wait = min(wait, due - now)
    if rejected:  # nothing can be written until the API takes the child: no sooner than the retry, even
        wait = max(wait, REJECTED_RETRY_SECONDS)  # with a check due (one not recorded is due at once, again)
    return max(0.0, wait)


class WakeUps:
    """The per-object tasks, the wake-up signals and the shared reconcile pool."""

    def __init__(self, reconciler: Reconciler, post: Callable[[dict[str, Any], list[Event]], None],
                 workers: int = 16, resync_seconds: float = 2.0, clock: Callable[[], float] = time.time,
                 namespaces: list[str] | None = None) -> None:
        self.reconciler = reconciler
        self.namespaces = namespaces
        self.post = post  # Events of one reconcile, posted on the object
        self.cache: WatchCache | None = getattr(reconciler.ports, "cache", None)
        self.resync = resync_seconds
        self.clock = clock
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reconcile")
        self._events: dict[Key, asyncio.Event] = {}
        self._seen: dict[Key, tuple[Any, ...]] = {}
        self._pods: dict[tuple[str, str], tuple[Any, ...]] = {}  # (namespace, pod) -> signature
        self._children: dict[tuple[str, str], tuple[Any, ...]] = {}  # (namespace, Kind/name) -> signature
        self.exiting = False  # the operator is exiting: nothing more is reconciled or written

    def wake(self, key: Key) -> None:
        event = self._events.get(key)
        if event is not None:
            event.set()

    def on_modeldeployment(self, body: dict[str, Any], event_type: str | None = None) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        signature = md_signature(body)
        if self._seen.get(key) != signature:
            self._seen[key] = signature
            self.wake(key)

    def on_pod(self, event_type: str | None, body: dict[str, Any], owner: str) -> None:
        meta = body.get("metadata") or {}
        pod = (meta.get("namespace", ""), meta.get("name", ""))
        if self.cache is not None:
            self.cache.put_pod(body, deleted=event_type == "DELETED")
            if event_type is None:
                self._relist("Pod")
        if _changed(self._pods, pod, None if event_type == "DELETED" else pod_signature(body)):
            self.wake((pod[0], owner))

    def on_child(self, event_type: str | None, body: dict[str, Any], owner: str | None) -> None:
        """A child changed: wake its owner when it was deleted or is not what the owner last
        rendered (the operator's own writes, and a Deployment's status counts, wake nothing).
        ``owner`` is its owner label; without it (removed by hand, or an object that is no child),
        the owner is the ModelDeployment its ownerReferences name, or the one the cached copy's
        label named: a child stripped of its label is still watched, so its later edits are seen."""
        meta = body.get("metadata") or {}
        child = (meta.get("namespace", ""), f"{body.get('kind')}/{meta.get('name', '')}")
        owner = owner or _owner_of(body, self.cache)
        if not owner:
            return  # not a child of any ModelDeployment
        deleted = event_type == "DELETED"
        if self.cache is not None:
            self.cache.put_child(body, deleted=deleted)
            if event_type is None:
                self._relist(str(body.get("kind")))
            if not deleted and not self.cache.differs(body):
                self._children[child] = child_signature(body)
                return
        if _changed(self._children, child, None if deleted else child_signature(body)):
            self.wake((child[0], owner))

    def _relist(self, kind: str) -> None:
        """A listing event (type None): the watch of ``kind`` started over (operator start,
        resuming after a peering pause, 410 Gone) and reports no deletions from the gap. List the
        kind once (off the loop) so the cache drops what is gone, and wake the owners of it."""
        cache, kube = self.cache, getattr(self.reconciler.ports, "kube", None)
        if self.exiting or cache is None or kube is None or not cache.needs_relist(kind):
            return
        loop = asyncio.get_running_loop()

        def relist() -> None:
            try:
                gone = cache.relist(kube, kind, self.namespaces)
            except Exception:  # the next listing event asks again
                log.exception("re-list of %s failed", kind)
                return
            if gone:
                log.info("re-list of %s: %d owner(s) had objects deleted while unwatched", kind, len(gone))
            for key in gone:
                loop.call_soon_threadsafe(self.wake, key)

        loop.run_in_executor(self.pool, relist)

    async def run(self, namespace: str, name: str, stopped: Any) -> None:
        """The object's loop: reconcile, then sleep until woken, due, or stopped. Stopped by the
        operator's exit, it returns at once, even from a reconcile in progress (that is cut at its
        next request, or dropped if it had not started); stopped otherwise (a peering pause), after
        the reconcile in progress."""
        if self.exiting:
            return
        key = (namespace, name)
        event = self._events.setdefault(key, asyncio.Event())
        loop = asyncio.get_running_loop()
        stop: asyncio.Future[Any] = asyncio.ensure_future(self._until_stopped(stopped))
        try:
            while not stopped and not self.exiting:
                event.clear()
                # kopf's context (where kopf.event posts) goes along into the pool's thread
                context = contextvars.copy_context()
                try:
                    reconcile: asyncio.Future[Any] = loop.run_in_executor(
                        self.pool, context.run, self._once, namespace, name)
                except RuntimeError:  # the pool is shut: the operator is exiting
                    return
                await asyncio.wait([reconcile, stop], return_when=asyncio.FIRST_COMPLETED)
                if not reconcile.done():
                    if not self.exiting:
                        # a peering pause (or this daemon alone stopped): the running reconcile ends
                        # first, so that a daemon resumed later never reconciles the object beside it
                        await asyncio.wait([reconcile])
                        return
                    reconcile.cancel()  # drops it if still queued; a running one is cut at its next request
                    return
                delay = reconcile.result()
                if delay is False:
                    return  # the object is gone
                woken = asyncio.ensure_future(event.wait())
                await asyncio.wait({woken, stop}, timeout=None if delay is None else float(delay),
                                   return_when=asyncio.FIRST_COMPLETED)
                woken.cancel()
        finally:
            stop.cancel()
            self._events.pop(key, None)
            self._seen.pop(key, None)

    async def _until_stopped(self, stopped: Any) -> None:
        await stopped.wait()
        reason = getattr(stopped, "reason", None)
        if reason is not None and kopf.DaemonStoppingReason.OPERATOR_EXITING in reason:
            self.exit()

    def exit(self) -> None:
        """The operator is exiting: end every object's loop now rather than as kopf reaches it,
        start no reconcile, drop the queued ones, and let the API client make no more requests
        (a reconcile running in a thread is cut at its next one). Not for a peering pause."""
        if self.exiting:
            return
        self.exiting = True
        log.info("operator exiting: %d object loops end, no further reconcile or API request", len(self._events))
        kube = getattr(self.reconciler.ports, "kube", None)
        if kube is not None and hasattr(kube, "stop"):
            kube.stop()
        for event in list(self._events.values()):
            event.set()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _once(self, namespace: str, name: str) -> float | None | bool:
        """One reconcile (in the pool); the next wake-up delay, None for events only, False when gone."""
        if self.exiting:
            return False
        try:
            live = self.reconciler.ports.read(namespace, name)
            if live is None:
                return False
            if live.get("metadata", {}).get("deletionTimestamp"):
                return None
            outcome = self.reconciler.reconcile(live, fresh=True)  # just read: one GET per reconcile
            if outcome is None:
                return False
            if outcome.events:
                self.post(live, outcome.events)
            if outcome.conflict:
                log.info("status of %s/%s was decided from an older version; again shortly", namespace, name)
                return 0.2
            status = outcome.status
            if status.phase == Phase.INVALID_SPEC:  # a canary held under the last valid spec keeps its timers
                guard = guard_spec(status)
                if guard is None:
                    return None  # an invalid spec waits for the user's next edit
                spec, status = guard, replace(status, phase=status.phase_in_effect or Phase.PAUSED)
            else:
                spec = parse_spec(live.get("spec"))
            pods = max((int(v.get("pods", 0)) for v in status.versions), default=0)
            return next_wake(spec, status, pods, self.resync, self.clock())
        except SpecError:
            return None  # an invalid spec waits for the user's next edit
        except ApiError as exc:
            if self.exiting:
                log.info("reconcile of %s/%s cut short: the operator is exiting (%s)", namespace, name, exc)
                return False
            if exc.status == 409:  # a child written by someone else in between
                log.info("reconcile of %s/%s met a conflict; again shortly", namespace, name)
                return 0.2
            log.exception("reconcile of %s/%s failed; retrying in %g s", namespace, name, self.resync)
            return self.resync
        except Exception:  # keep the object's loop alive; the next pass retries
            if self.exiting:
                log.info("reconcile of %s/%s cut short: the operator is exiting", namespace, name, exc_info=True)
                return False
            log.exception("reconcile of %s/%s failed; retrying in %g s", namespace, name, self.resync)
            return self.resync

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _owner_of(body: dict[str, Any], cache: WatchCache | None) -> str | None:
    """The ModelDeployment an object without the owner label belongs to: the controller named in
    its ownerReferences, else the owner label of the copy the cache holds (both removed by hand)."""
    meta = body.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "ModelDeployment" and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/"):
            return str(ref.get("name") or "") or None
    held = cache.live(body) if cache is not None else None
    return str(((held or {}).get("metadata") or {}).get("labels", {}).get(OWNER_LABEL) or "") or None


def _changed(seen: dict[Any, tuple[Any, ...]], key: Any, signature: tuple[Any, ...] | None) -> bool:
    """Record ``key``'s signature (None: it is gone); whether it differs from the one seen before."""
    if seen.get(key) == signature:
        return False
    if signature is None:
        seen.pop(key, None)
    else:
        seen[key] = signature
    return True
