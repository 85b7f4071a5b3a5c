"""kopf registrations and startup settings only; the work is in ``WakeUps`` and ``Reconciler``.

One async daemon per ModelDeployment (an asyncio task, no thread) runs the object's loop in
``wakeups.WakeUps``; the watch handlers below only wake it. Reconciles run on a bounded pool.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import kopf

from .children import GROUP, OWNER_LABEL, child_name
from .ports import ClusterPorts
from .rollout import Event
from .wakeups import WakeUps

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
    # Only the delete handler runs on kopf's executor; reconciles have their own bounded pool.
    settings.execution.max_workers = 4
    # A replica that dies without saying goodbye blocks the standby for this long: keep it short.
    settings.peering.lifetime = int(memo.get("peering_lifetime", 15))


@kopf.on.startup()
def sync_cache(memo: kopf.Memo, **_: Any) -> None:
    """Fill the watch cache with one list per kind before the watches start (WaitForCacheSync)."""
    ports = memo.wakeups.reconciler.ports
    if isinstance(ports, ClusterPorts):
        ports.cache.sync(ports.kube, memo.get("namespaces"))
        log.info("watch cache synced: runtime pods and children of every ModelDeployment")


def post_events(body: dict[str, Any], events: list[Event]) -> None:
    """The Events of one reconcile, on the object (kopf posts them from its own loop)."""
    for event in events:
        kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=event.type, reason=event.reason, message=event.message)


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5, backoff=1)
async def observe(*, stopped: kopf.DaemonStopped, name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """The object's reconcile loop: at start, on wake-ups, and when a timer of its rollout is due."""
    wakeups: WakeUps = memo.wakeups
    assert namespace is not None  # ModelDeployments are namespaced
    await wakeups.run(namespace, name, stopped)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def modeldeployment_changed(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:  # noqa: A002
    """Spec, annotations (actions, alerts) or deletion changed: wake the object's loop."""
    memo.wakeups.on_modeldeployment(dict(body), type)


@kopf.on.event("", "v1", "pods", labels={OWNER_LABEL: kopf.PRESENT})
async def runtime_pod_changed(body: kopf.Body, type: str | None, labels: kopf.Labels, memo: Any,  # noqa: A002
                              **_: Any) -> None:
    """A runtime pod started, became (un)ready, moved or went: wake its ModelDeployment's loop."""
    memo.wakeups.on_pod(type, dict(body), labels[OWNER_LABEL])


async def _child_changed(body: kopf.Body, type: str | None, labels: kopf.Labels, memo: Any,  # noqa: A002
                         **_: Any) -> None:
    if labels.get(OWNER_LABEL) is None and not _may_be_child(body):
        return
    memo.wakeups.on_child(type, dict(body), labels.get(OWNER_LABEL))


def _may_be_child(body: kopf.Body) -> bool:
    """Whether an object without the owner label may still be a child: none of the ModelDeployments
    its ownerReferences name (if any) gives a child of its kind its name. A user's object owned by a
    ModelDeployment only to be garbage-collected with it is not watched (cached, it woke its owner at
    each change, and every re-list, which lists by the label, reported it deleted while unwatched)."""
    names = [str(ref.get("name")) for ref in body.metadata.get("ownerReferences") or []
             if ref.get("kind") == "ModelDeployment" and str(ref.get("apiVersion", "")).startswith(f"{GROUP}/")]
    kind = str(body.get("kind"))
    return not names or any(child_name(kind, owner) == body.metadata.name for owner in names)


# Children edited or deleted by hand wake their owner, whose reconcile puts them back. No label filter:
# kopf's filters are its own (its watches take every object of the kind), and one on the owner label
# hid every later edit of a child whose label was removed by hand (the cache kept the labelled copy).
for _group, _version, _plural in (("", "v1", "configmaps"), ("", "v1", "services"), ("", "v1", "serviceaccounts"),
                                  ("apps", "v1", "deployments"), ("policy", "v1", "poddisruptionbudgets"),
                                  ("autoscaling", "v2", "horizontalpodautoscalers"),
                                  ("rbac.authorization.k8s.io", "v1", "roles"),
                                  ("rbac.authorization.k8s.io", "v1", "rolebindings")):
    kopf.on.event(_group, _version, _plural, id=f"child-{_plural}")(_child_changed)


@kopf.on.cleanup()
async def exiting(memo: kopf.Memo, **_: Any) -> None:  # async: on the loop, whose Events exit() sets
    """The daemons' loops have seen the exit already (the first one stopped with OPERATOR_EXITING);
    this covers an exit with none running: no reconcile or API request after it."""
    memo.wakeups.exit()


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(*, name: str, namespace: str | None, memo: Any, **_: Any) -> None:
    """Children go by garbage collection (owner references); only drop our metric series and what the
    cache remembers of the children's renderings."""
    memo.wakeups.reconciler.metrics.forget(namespace or "", name)
    if memo.wakeups.cache is not None:
        memo.wakeups.cache.forget_owner(namespace or "", name)
