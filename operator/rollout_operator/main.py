"""kopf registrations and startup settings only; every handler delegates to ``Reconciler``."""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import kopf

from .children import GROUP
from .analyzer import next_due
from .reconcile import Outcome, Reconciler
from .spec import SpecError, parse_spec
from .status import RolloutStatus

VERSION = "v1alpha1"
PLURAL = "modeldeployments"
log = logging.getLogger(__name__)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # kopf's own log lines as Events: warnings and errors only
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    settings.execution.max_workers = 32
    # A replica that dies without saying goodbye blocks the standby for this long: keep it short.
    settings.peering.lifetime = int(memo.get("peering_lifetime", 15))


def _post(body: Any, outcome: Outcome) -> None:
    for event in outcome.events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


@kopf.on.create(GROUP, VERSION, PLURAL, backoff=1)
@kopf.on.update(GROUP, VERSION, PLURAL, backoff=1)
@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=1)
def reconcile(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Spec or annotations changed (or the operator started): reconcile now."""
    reconciler: Reconciler = memo.reconciler
    outcome = reconciler.reconcile(dict(body))
    if outcome is not None:
        _post(body, outcome)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5, backoff=1)
def observe(*, stopped: kopf.DaemonStopped, name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """Level-based loop: re-read the object, observe pods and metrics, reconcile; sleep until the
    next analysis is due or the resync period passes."""
    reconciler: Reconciler = memo.reconciler
    assert namespace is not None  # ModelDeployments are namespaced
    while not stopped:
        started = time.monotonic()
        live = None
        try:
            live = reconciler.ports.read(namespace, name)
            if live is None:
                return
            if not live.get("metadata", {}).get("deletionTimestamp"):
                outcome = reconciler.reconcile(live)
                for event in outcome.events if outcome else []:
                    kopf.event(kopf.Body(cast(kopf.RawBody, live)), type=event.type, reason=event.reason,
                               message=event.message)
        except Exception:  # keep observing; the next pass retries
            log.exception("reconcile of %s/%s failed; retrying", namespace, name)
        stopped.wait(_sleep(reconciler, live, memo.resync_seconds, time.monotonic() - started))


def _sleep(reconciler: Reconciler, live: dict[str, Any] | None, resync: float, spent: float) -> float:
    """Until the next analysis is due, or the resync period, whichever comes first."""
    wait = resync - spent
    if live is not None:
        try:
            due = next_due(parse_spec(live.get("spec")), RolloutStatus.from_dict(live.get("status")))
        except SpecError:
            due = None
        if due is not None:
            wait = min(wait, due - reconciler.clock())
    return max(0.05, wait)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(*, name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """Children go by garbage collection (owner references); only drop our metric series."""
    memo.reconciler.metrics.forget(namespace or "", name)
