"""The ports through which the ``Reconciler`` touches the world, and their cluster implementation.

The reconcile loop needs a few things besides the pure ``decide()``: read the live object, write
its children (and delete the optional ones it no longer renders), store its status, observe its
pods and read how many the runtime Deployment asks for (metrics are read by the ``Analyzer``'s
providers). In a cluster they are Kubernetes API calls; the local demo implements the same
protocol against a config file and one runtime process (``mnn_rollout.demo.ports``), so both run
the same reconcile code.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol

from . import children
from .kube import FIELD_MANAGER, ApiError, KubeClient
from .observe import Observation, pod_views, scrape



class Ports(Protocol):
    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The live ModelDeployment, or None when it is gone."""

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        """Each child created, updated, unchanged, ``repaired: <fields>`` or ``rejected: <message>``
        (see ``ClusterPorts.write_children``)."""

    def delete_children(self, stubs: Iterable[dict[str, Any]], owner_uid: str) -> dict[str, str]:
        """Delete each child ``stubs`` name that exists and is owned by ``owner_uid``: ``deleted``
        (the others are left alone and not reported)."""

    def runtime_replicas(self, target: children.Target) -> int | None:
        """The runtime Deployment's ``spec.replicas`` now (None: no Deployment yet)."""

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> str | None:
        """Replace the whole status of ``body`` (decided from its resourceVersion); returns the
        object's new resourceVersion."""

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        """The runtime pods of ``target`` and what each has loaded."""

    def published_table(self, target: children.Target) -> tuple[str, ...] | None:
        """The bucket table the routing ConfigMap of ``target`` publishes now (None: none yet)."""


REJECTED = "rejected: "  # a write_children result: the API refused the child as invalid
REPAIRED = "repaired: "  # a write_children result: fields edited by hand were put back
# write_children results: the API server kept other values than the forced apply asked for (another
# actor, such as a mutating admission webhook, undoes the repair), said once; then (KEPT) the child
# is left so, and applied again no sooner than UNDONE_RETRY_SECONDS unless the rendering or those
# values change.
NOT_REPAIRED = "not repaired: "
KEPT = "kept: "
CREATED_AS = " (created)"  # the end of a NOT_REPAIRED result for a child this apply created
# A write_children result: a routing ConfigMap edited while no operator watched (its content no longer
# matches its spec-hash, and this replica remembers no write of its own), kept as found: nothing to put back.
ADOPTED = "adopted: "
UNDONE_RETRY_SECONDS = 60.0
DELETED = "deleted"  # a delete_children result
# The field manager that holds a Deployment's replicas while the operator's lets go of them for an
# HPA (children.replicas_handover).
HANDOVER_MANAGER = f"{FIELD_MANAGER}-handover"


def _older(body: dict[str, Any], held: dict[str, Any] | None) -> bool:
    """Whether ``body`` is an older version of the same object than ``held`` (resourceVersions
    compare as numbers where both are; the API promises no order, etcd-backed servers give one)."""
    if held is None:
        return False
    new, old = (o.get("metadata") or {} for o in (body, held))
    if new.get("uid") != old.get("uid"):
        return False
    try:
        return int(str(new.get("resourceVersion"))) < int(str(old.get("resourceVersion")))
    except (TypeError, ValueError):
        return False


def _values(found: list[tuple[str, Any]]) -> str:
    """Fields and the values they have, as a drift names them: ``spec.x = 'y'; ...``."""
    return "; ".join(f"{path} = {value!r}" for path, value in found)


def _owner(body: dict[str, Any]) -> str:
    """The ModelDeployment a pod or child belongs to (its owner label)."""
    return str(((body.get("metadata") or {}).get("labels") or {}).get(children.OWNER_LABEL, ""))


# Kinds the cache holds: the runtime pods and every kind of child, selected by the owner label.
SYNCED_KINDS = ("Pod", "ConfigMap", "Service", "ServiceAccount", "Deployment", "Role", "RoleBinding",
                "PodDisruptionBudget", "HorizontalPodAutoscaler")
RELIST_GRACE = 5.0  # a kind listed this recently is not listed again for a watch's re-list


class WatchCache:
    """The runtime pods and children the operator's watches delivered (an informer cache), so
    that a reconcile lists no pods and reads no child whose rendering did not change. Filled by
    one list per kind at start (``sync``), then kept current by the watches and by the answers to
    the operator's own writes. Until it is synced, every child is read from the API. A child
    whose spec-hash or rendered fields differ from the rendering is applied (server-side apply
    needs no read and meets no conflict, so a stale entry costs one needless apply at most)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.synced = False
        self._children: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._rendered: dict[tuple[str, str, str], dict[str, Any]] = {}
        # child -> the rendering the API last took from this replica (or it found live, unchanged)
        self._published: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}  # (namespace, owner) -> name -> pod
        self._stamps: dict[tuple[str, str, str], float] = {}  # (namespace, name, kind) -> when last put
        self._listed: dict[str, float] = {}  # kind -> when it was last listed

    def sync(self, kube: KubeClient, namespaces: list[str] | None) -> None:
        """One list of every cached kind (in each namespace, or across all), then ``synced``."""
        for kind in SYNCED_KINDS:
            self.relist(kube, kind, namespaces)
        self.synced = True

    def needs_relist(self, kind: str, grace: float = RELIST_GRACE) -> bool:
        """Whether ``kind`` was last listed more than ``grace`` s ago (then this call counts as a
        list, so that a burst of listing events asks once)."""
        now = time.monotonic()
        with self._lock:
            if not self.synced or now - self._listed.get(kind, 0.0) < grace:
                return False
            self._listed[kind] = now
            return True

    def relist(self, kube: KubeClient, kind: str, namespaces: list[str] | None) -> set[tuple[str, str]]:
        """List ``kind`` and bring the cache in line: put every listed object, and drop those the
        cache held from before the list that the list no longer has (deleted while no watch ran:
        a standby replica's, or a re-list after 410 Gone; a watch re-list reports no deletions).
        Returns the (namespace, owner) of what was dropped."""
        started = time.monotonic()
        with self._lock:
            self._listed[kind] = started
        listed: list[dict[str, Any]] = []
        for namespace in (list(namespaces) if namespaces else [None]):
            for obj in kube.list(kind, namespace, children.OWNER_LABEL):
                obj.setdefault("kind", kind)
                listed.append(obj)
        present = {(*self._key(obj), kind) for obj in listed}
        gone: set[tuple[str, str]] = set()
        with self._lock:
            held = [(key, body) for key, body in self._children.items() if key[2] == kind] if kind != "Pod" else \
                [((ns, name, "Pod"), pod) for (ns, _), pods in self._pods.items() for name, pod in pods.items()]
            for key, body in held:
                if key in present or self._stamps.get(key, 0.0) >= started:
                    continue  # still there, or put by a watch event after the list began
                owner = _owner(body)
                if kind == "Pod":
                    self._pods.get((key[0], owner), {}).pop(key[1], None)
                else:
                    self._children.pop(key, None)
                self._stamps.pop(key, None)
                gone.add((key[0], owner))
        for obj in listed:
            if kind == "Pod":
                self.put_pod(obj)
            else:
                self.put_child(obj)
        return gone

    def put_pod(self, body: dict[str, Any], deleted: bool = False) -> None:
        namespace, name = self._key(body)
        owner = _owner(body)
        with self._lock:
            pods = self._pods.setdefault((namespace, owner), {})
            if deleted:
                pods.pop(name, None)
                self._stamps.pop((namespace, name, "Pod"), None)
            elif not _older(body, pods.get(name)):
                pods[name] = body
                self._stamps[(namespace, name, "Pod")] = time.monotonic()

    def pods(self, namespace: str, owner: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pods.get((namespace, owner), {}).values())

    @staticmethod
    def _key(body: dict[str, Any]) -> tuple[str, str]:
        meta = body.get("metadata") or {}
        return meta.get("namespace", ""), meta.get("name", "")

    @classmethod
    def _child_key(cls, body: dict[str, Any]) -> tuple[str, str, str]:
        return (*cls._key(body), str(body.get("kind")))

    def put_child(self, body: dict[str, Any], deleted: bool = False) -> None:
        """Record a child from the watch or from the answer to a write; an older version than the
        one held (a watch event that arrives after the write's own answer) is ignored."""
        key = self._child_key(body)
        with self._lock:
            if deleted:
                self._children.pop(key, None)
                self._stamps.pop(key, None)
            elif not _older(body, self._children.get(key)):
                self._children[key] = body
                self._stamps[key] = time.monotonic()

    def rendered(self, obj: dict[str, Any]) -> None:
        """Remember what was last rendered for the child ``obj`` names."""
        with self._lock:
            self._rendered[self._child_key(obj)] = obj

    def published(self, obj: dict[str, Any], written: bool = False) -> dict[str, Any] | None:
        """The rendering of the child ``obj`` names that the API last took from this replica (an
        apply it answered, or found live as rendered): with ``written``, ``obj`` becomes it. None
        until then (a restarted operator remembers nothing: it adopts what it finds)."""
        with self._lock:
            if written:
                self._published[self._child_key(obj)] = obj
            return self._published.get(self._child_key(obj))

    def forget_owner(self, namespace: str, owner: str) -> None:
        """Drop what was rendered and published for the children of a deleted ModelDeployment (they go
        by garbage collection): kept, they grew with every name ever deleted."""
        with self._lock:
            for held in (self._rendered, self._published):
                for key in [key for key, obj in held.items() if key[0] == namespace
                            and ((obj.get("metadata") or {}).get("labels") or {}).get(children.OWNER_LABEL) == owner]:
                    del held[key]

    def differs(self, live: dict[str, Any]) -> bool:
        """Whether a watched child is not what the operator last rendered for it (another
        spec-hash, a field edited by hand), or was never rendered by this replica."""
        with self._lock:
            want = self._rendered.get(self._child_key(live))
        return want is None or children.spec_hash(want) != children.spec_hash(live) \
            or bool(children.drift(live, want))

    def live(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The watched child ``obj`` names (None: not seen)."""
        with self._lock:
            return self._children.get(self._child_key(obj))


class ClusterPorts:
    """The ports over the Kubernetes API, skipping the reads the watch cache already answers."""

    def __init__(self, kube: KubeClient, cache: WatchCache | None = None) -> None:
        self.kube = kube
        self.cache = cache or WatchCache()
        # child -> (its rendering, the values the API server kept after the last forced apply, when)
        self._undone: dict[tuple[str, str, str], tuple[str, str, float]] = {}

    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        # Always fresh: a reconcile runs only when something happened, and deciding from the
        # object's current version keeps status writes free of conflicts with kopf's own patches.
        return self.kube.get("ModelDeployment", namespace, name)

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        """Each child ``created``, ``updated``, ``unchanged``, ``repaired: <fields>`` (edited by
        hand, put back), or ``rejected: <the API's message>`` when the API refuses it as invalid
        (422): the others are still written. Writes are server-side applies under the operator's
        field manager, forced: the fields it renders are its own, whoever edited them since; a
        child the watch shows as rendered costs no request. A Deployment whose replicas the
        operator stops rendering (autoscaling) gets them applied under ``HANDOVER_MANAGER`` first,
        so that they stay (``children.replicas_handover``). When the API server answers an apply
        with other values than it asked for, the child is ``not repaired: <field> = <value kept>``
        once, then ``kept: ...`` (see ``UNDONE_RETRY_SECONDS``); so too the apply that creates it
        (``not repaired: ... (created)``). A routing ConfigMap edited while no operator watched (a
        restarted one remembers no write of its own) is ``repaired: <fields>`` when this apply changes
        what it holds, else ``adopted: ...``. A child the synced cache does not hold is applied unread:
        ``created`` when the API answers 201 Created, and when it answers 200 (it was there, its owner
        label removed by hand: the cache lists children by it) ``repaired: metadata.labels[<owner label>]``."""
        written = {}
        for obj in objs:
            edited_unseen = False
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            self.cache.rendered(obj)
            live = self._live(obj)
            same_hash = live is not None and children.spec_hash(live) == children.spec_hash(obj)
            edited = children.drift_values(live, obj) if live is not None and same_hash else []
            ours = self.cache.published(obj)
            if not same_hash and live is not None and children.edited_since(live, ours, FIELD_MANAGER):
                # edited by hand since this replica's write (a routing table put back beside new weights, an
                # old copy re-applied): the fields edited that this apply puts back (the stamp aside)
                applied = {path for path, _ in children.drift_values(live, obj)}
                edited = [(path, value) for path, value in children.drift_values(live, ours or {})
                          if path in applied and children.HASH_ANNOTATION not in path]
            elif not same_hash and live is not None and ours is None and children.edited_unwatched(live):
                # edited while no operator watched: what this apply changes was edited (the stamp aside)
                edited = [(path, value) for path, value in children.drift_values(live, obj)
                          if children.HASH_ANNOTATION not in path]
                edited_unseen = not edited  # nothing this apply changes: kept as found
            child, rendering = WatchCache._child_key(obj), json.dumps(obj, sort_keys=True)
            undone = self._undone.get(child)
            if same_hash and not edited:
                written[key] = "unchanged"  # as rendered: no request
                self._undone.pop(child, None)
                self.cache.published(obj, written=True)
                continue
            if (undone is not None and same_hash and undone[:2] == (rendering, _values(edited))
                    and time.monotonic() - undone[2] < UNDONE_RETRY_SECONDS):
                written[key] = f"{KEPT}{_values(edited)}"  # as the last apply left it: no request
                continue
            try:
                handover = children.replicas_handover(obj, live, FIELD_MANAGER)
                if handover is not None:
                    self.kube.apply(handover, field_manager=HANDOVER_MANAGER)
                result, created = self.kube.apply_created(obj)
            except ApiError as exc:
                if exc.status != 422:
                    raise
                written[key] = f"{REJECTED}{exc.message}"
                continue
            # said only of a child not seen live: ``created`` may also be an ambiguous repeat's 200 (apply_created)
            created = created and live is None
            if live is None and not created and self.cache.synced:
                # there, yet not in the watch cache, which holds the children by their owner label: its label
                # was removed by hand and the cache re-listed since (a watch's 410 Gone, a restart). This apply
                # put the label back; what else was edited is unknown (no read: that would cost a request per
                # child created). Unsynced, ``live`` was read: absent then, another writer created it since.
                edited = [(f"metadata.labels[{children.OWNER_LABEL}]", None)]
            result.setdefault("kind", obj["kind"])
            self.cache.put_child(result)  # written through: the next reconcile sees it before the watch does
            self.cache.published(obj, written=True)
            kept = children.drift_values(result, obj)
            repaired = [path for path, _ in edited if path not in {p for p, _ in kept}]
            said = undone is not None and undone[1] == _values(kept)
            if kept:
                self._undone[child] = (rendering, _values(kept), time.monotonic())
            else:
                self._undone.pop(child, None)
            if kept and not said:
                put_back = f" (put back: {', '.join(repaired)})" if repaired else ""
                written[key] = f"{NOT_REPAIRED}{_values(kept)}{put_back}{CREATED_AS if created else ''}"
            elif repaired:
                written[key] = f"{REPAIRED}{', '.join(repaired)}"
            elif kept and same_hash:
                written[key] = f"{KEPT}{_values(kept)}"
            elif edited_unseen:
                written[key] = f"{ADOPTED}edited while no operator watched (its content no longer matches its " \
                               f"{children.HASH_ANNOTATION}): kept as found"
            else:
                written[key] = "created" if created else "updated"
        return written

    def delete_children(self, stubs: Iterable[dict[str, Any]], owner_uid: str) -> dict[str, str]:
        """Only a child whose ownerReferences name ``owner_uid`` goes: one of the same name that
        someone else made is not the operator's to delete. Once synced, an absent child costs no
        request."""
        deleted = {}
        for obj in stubs:
            live = self._live(obj)
            owners = ((live or {}).get("metadata") or {}).get("ownerReferences") or []
            if not owner_uid or not any(o.get("uid") == owner_uid for o in owners):
                continue
            meta = obj["metadata"]
            self.kube.delete(obj["kind"], meta["namespace"], meta["name"])
            self.cache.put_child(obj, deleted=True)
            deleted[f"{obj['kind']}/{meta['name']}"] = DELETED
        return deleted

    def runtime_replicas(self, target: children.Target) -> int | None:
        stub = {"kind": "Deployment", "metadata": {"namespace": target.namespace, "name": target.runtime}}
        live = self._live(stub)
        if live is None:
            return None
        replicas = (live.get("spec") or {}).get("replicas")
        return 1 if replicas is None else int(replicas)  # absent: the API server's default

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> str | None:
        # PUT, not a merge patch: a merge patch would keep map keys (weights) that were removed;
        # the body's resourceVersion makes a concurrent writer's change a 409, retried later.
        stored = self.kube.replace({**body, "status": status}, subresource="status")
        return (stored.get("metadata") or {}).get("resourceVersion")

    def published_table(self, target: children.Target) -> tuple[str, ...] | None:
        """The table this replica last published while the live one is that edited by hand since (or
        deleted): the next table is evolved from it, and the edit is put back; else the live one (a
        newer write of another operator instance, or after a restart, when nothing is remembered)."""
        stub = {"kind": "ConfigMap", "metadata": {"namespace": target.namespace, "name": target.routing}}
        live, ours = self._live(stub), self.cache.published(stub)
        uid = children.owner_uid(target)
        if ours is not None and (uid or ours["metadata"].get("ownerReferences")) and uid not in {
                o.get("uid") for o in ours["metadata"].get("ownerReferences") or []}:
            ours = None  # another ModelDeployment's of that name (deleted and created again)
        if ours is not None and (live is None or children.edited_since(live, ours, FIELD_MANAGER)):
            return children.published_owners(ours)
        return children.published_owners(live)

    def _live(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The child ``obj`` names as it is now: from the watch cache once synced, else the API."""
        meta = obj["metadata"]
        return self.cache.live(obj) if self.cache.synced else self.kube.get(obj["kind"], meta["namespace"],
                                                                             meta["name"])

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        if self.cache.synced:
            selector = children.selector(target)
            pods = [p for p in self.cache.pods(target.namespace, target.name)
                    if all(((p.get("metadata") or {}).get("labels") or {}).get(k) == v for k, v in selector.items())]
        else:
            pods = self.kube.list("Pod", target.namespace, children.selector_text(target))
        return scrape(pod_views(pods, port), model)
