"""The ports through which the ``Reconciler`` touches the world, and their cluster implementation.

The reconcile loop needs four things besides the pure ``decide()``: read the live object, write
its children, store its status and observe its pods (metrics are read by the ``Analyzer``'s
providers). In a cluster they are Kubernetes API calls; the local demo implements the same
protocol against a config file and one runtime process (``mnn_rollout.demo.ports``), so both run
the same reconcile code.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Protocol

from . import children
from .kube import ApiError, KubeClient
from .observe import Observation, pod_views, scrape



class Ports(Protocol):
    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The live ModelDeployment, or None when it is gone."""

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        """Create or update each rendered child; ``Kind/name`` -> created, updated or unchanged."""

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        """Replace the whole status of ``body`` (decided from its resourceVersion)."""

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        """The runtime pods of ``target`` and what each has loaded."""


REJECTED = "rejected: "  # a write_children result: the API refused the child as invalid

# Kinds the cache holds: the runtime pods and every kind of child, selected by the owner label.
SYNCED_KINDS = ("Pod", "ConfigMap", "Service", "ServiceAccount", "Deployment", "Role", "RoleBinding")


class WatchCache:
    """The runtime pods and children the operator's watches delivered (an informer cache), so
    that a reconcile lists no pods and reads no child whose rendering did not change. Filled by
    one list per kind at start (``sync``), then kept current by the watches. Until it is synced
    every read goes to the API; a child the cache holds with another hash, or none, is written
    through ``KubeClient.ensure``, which reads it first (a stale entry costs a 409 and a retry)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.synced = False
        self._children: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._rendered: dict[tuple[str, str, str], str] = {}
        self._pods: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (namespace, owner) -> name -> pod

    def sync(self, kube: KubeClient, namespaces: list[str] | None) -> None:
        """One list of every cached kind (in each namespace, or across all), then ``synced``."""
        selector = children.OWNER_LABEL
        for kind in SYNCED_KINDS:
            scopes: list[str | None] = list(namespaces) if namespaces else [None]
            for namespace in scopes:
                for obj in kube.list(kind, namespace, selector):
                    obj.setdefault("kind", kind)
                    if kind == "Pod":
                        self.put_pod(obj)
                    else:
                        self.put_child(obj)
        self.synced = True

    def put_pod(self, body: dict[str, Any], deleted: bool = False) -> None:
        namespace, name = self._key(body)
        owner = ((body.get("metadata") or {}).get("labels") or {}).get(children.OWNER_LABEL, "")
        with self._lock:
            pods = self._pods.setdefault((namespace, owner), {})
            if deleted:
                pods.pop(name, None)
            else:
                pods[name] = body

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pods.get((namespace, owner), {}).values())

    def has_child(self, obj: dict[str, Any]) -> bool:
        with self._lock:
            return self._child_key(obj) in self._children

    @staticmethod
    def _key(body: dict[str, Any]) -> tuple[str, str]:
        meta = body.get("metadata") or {}
        return meta.get("namespace", ""), meta.get("name", "")

    @classmethod
    def _child_key(cls, body: dict[str, Any]) -> tuple[str, str, str]:
        return (*cls._key(body), str(body.get("kind")))

    def put_child(self, body: dict[str, Any], deleted: bool = False) -> None:
        key = self._child_key(body)
        with self._lock:
            if deleted:
                self._children.pop(key, None)
            else:
                self._children[key] = body

    def rendered(self, obj: dict[str, Any]) -> None:
        """Remember the spec-hash last rendered for the child ``obj`` names."""
        with self._lock:
            self._rendered[self._child_key(obj)] = children.spec_hash(obj) or ""

    def differs(self, live: dict[str, Any]) -> bool:
        """Whether a watched child is not what the operator last rendered for it (or unknown)."""
        with self._lock:
            want = self._rendered.get(self._child_key(live))
        return want is None or want != children.spec_hash(live)

    def child_hash(self, obj: dict[str, Any]) -> str | None:
        """The spec-hash annotation of the watched child ``obj`` names (None: not seen)."""
        with self._lock:
            live = self._children.get(self._child_key(obj))
        return None if live is None else children.spec_hash(live)


class ClusterPorts:
    """The ports over the Kubernetes API, skipping the reads the watch cache already answers."""

    def __init__(self, kube: KubeClient, cache: WatchCache | None = None) -> None:
        self.kube = kube
        self.cache = cache or WatchCache()

    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        # Always fresh: a reconcile runs only when something happened, and deciding from the
        # object's current version keeps status writes free of conflicts with kopf's own patches.
        return self.kube.get("ModelDeployment", namespace, name)

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        """Each child created, updated, unchanged, or ``rejected: <the API's message>`` when the API
        refuses it as invalid (422): the others are still written."""
        written = {}
        for obj in objs:
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            self.cache.rendered(obj)
            try:
                if self.cache.child_hash(obj) == children.spec_hash(obj):
                    written[key] = "unchanged"  # the watch shows it as rendered: no request
                elif self.cache.synced and not self.cache.has_child(obj):
                    written[key] = self._create(obj)
                else:
                    written[key] = self.kube.ensure(obj)
            except ApiError as exc:
                if exc.status != 422:
                    raise
                written[key] = f"{REJECTED}{exc.message}"
        return written

    def _create(self, obj: dict[str, Any]) -> str:
        """A child the synced cache has never seen: create it without reading it first."""
        try:
            self.kube.create(obj)
            return "created"
        except ApiError as exc:
            if exc.status != 409:
                raise
            return self.kube.ensure(obj)  # it exists after all (the watch had not told yet)

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        # PUT, not a merge patch: a merge patch would keep map keys (weights) that were removed;
        # the body's resourceVersion makes a concurrent writer's change a 409, retried later.
        self.kube.replace({**body, "status": status}, subresource="status")

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        if self.cache.synced:
            selector = children.selector(target)
            pods = [p for p in self.cache.pods(target.namespace, target.name)
                    if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
        else:
            pods = self.kube.list("Pod", target.namespace, children.selector_text(target))
        return scrape(pod_views(pods, port), model)
