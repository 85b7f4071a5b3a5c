"""
Deletion semantics of the store (mixed into :class:`store.Store`): finalizers and
``deletionTimestamp``, namespace termination, CRD removal, and the garbage collector.

Propagation as kube-apiserver 1.30 and the garbage collector of kube-controller-manager do it: a DELETE
turns its policy into the ``orphan`` or ``foregroundDeletion`` finalizer (generic registry store.go,
deletionFinalizersForGarbageCollection and updateForGracefulDeletionAndFinalizers; the policy from
``propagationPolicy``/``orphanDependents``, else from those finalizers already set, else the kind's default:
Background, Orphan for core/v1 ReplicationControllers, none for Events), so such an object stays, marked
and answered as itself. The collector (shortly after, asynchronously) then either strips the dependents'
references to it and removes ``orphan`` (attemptToOrphan), or deletes its dependents (in Foreground the
ones that have dependents themselves; a dependent with another live owner only loses its reference) and
removes ``foregroundDeletion`` once no dependent with ``blockOwnerDeletion`` remains
(processDeletingDependentsItem). Background: dependents go after the owner is gone; dependents whose
owners never existed are collected too.
"""
import copy
from typing import TYPE_CHECKING, Any

from .errors import ApiError
from .resources import ResourceDef

if TYPE_CHECKING:
    from .store import Key, Store
    _Base = Store
else:
    _Base = object

CRDS = ('apiextensions.k8s.io', 'customresourcedefinitions')
NAMESPACES = ('', 'namespaces')
PODS = ('', 'pods')
ORPHAN, FOREGROUND = 'orphan', 'foregroundDeletion'  # the garbage collector's finalizers (metav1)
# DefaultGarbageCollectionPolicy of the registry strategies: Unsupported (no GC finalizers) for Events
# (pkg/registry/core/event), OrphanDependents for core/v1 ReplicationControllers (back compatibility); every
# other kind, custom resources too, deletes its dependents (Background).
GC_UNSUPPORTED = {('', 'events'), ('events.k8s.io', 'events')}
ORPHAN_BY_DEFAULT = {('', 'replicationcontrollers')}
GC_DELAY = 0.1  # seconds between a write and the garbage collector's reaction to it
MERGE = 'application/merge-patch+json'


class Lifecycle(_Base):

    def _rd_for(self, key: 'Key') -> ResourceDef:
        defs = self.registry.versions_of(key[0], key[1])
        if not defs:
            raise RuntimeError(f'no resource definition for {key}')
        from .resources import version_priority
        return sorted(defs, key=lambda rd: version_priority(rd.version))[0]

    def _blockers(self, rd: ResourceDef, obj: dict[str, Any]) -> list[str]:
        blockers = list(obj['metadata'].get('finalizers') or [])
        if (rd.group, rd.plural) == NAMESPACES:
            blockers += list((obj.get('spec') or {}).get('finalizers') or [])
        return blockers

    def delete(self, rd: ResourceDef, namespace: str | None, name: str, options: dict[str, Any] | None = None,
               dry_run: bool = False) -> tuple[int, dict[str, Any]]:
        options = options or {}
        # ValidateDeleteOptions, before the object is looked up
        policy = options.get('propagationPolicy') or None
        if policy is not None and policy not in ('Background', 'Foreground', 'Orphan'):
            raise ApiError.invalid('DeleteOptions', '', [('propagationPolicy', f'Unsupported value: "{policy}"')])
        if policy is not None and options.get('orphanDependents') is not None:
            raise ApiError.invalid('DeleteOptions', '', [('propagationPolicy', f'Invalid value: "{policy}":'
                                                          ' orphanDependents and deletionPropagation cannot be'
                                                          ' both set')])
        obj = self.find(rd, namespace, name)
        meta = obj['metadata']
        pre = options.get('preconditions') or {}
        if pre.get('uid') and pre['uid'] != meta['uid']:
            raise ApiError.conflict(rd.group_resource, name, f'Precondition failed: UID in precondition: {pre["uid"]},'
                                                             f' UID in object meta: {meta["uid"]}')
        if pre.get('resourceVersion') and pre['resourceVersion'] != meta['resourceVersion']:
            raise ApiError.conflict(rd.group_resource, name,
                                    f'Precondition failed: ResourceVersion in precondition: {pre["resourceVersion"]},'
                                    f' ResourceVersion in object meta: {meta["resourceVersion"]}')
        if (rd.group, rd.plural) == NAMESPACES and name in ('default', 'kube-system', 'kube-public'):
            raise ApiError(403, 'Forbidden', f'namespaces "{name}" is forbidden: this namespace may not be deleted')
        key = self.key(rd, namespace, name)
        # Like the API server's delete handler: 200 even when the object stays (finalizers, a
        # namespace terminating), 202 only then and when the client set orphanDependents=false.
        held = 202 if options.get('orphanDependents') is False else 200
        if meta.get('deletionTimestamp') and meta.get('deletionGracePeriodSeconds'):
            return held, self.render(rd, obj)  # a graceful deletion pending: the options change nothing
        marked = copy.deepcopy(obj)
        finalizers = self._gc_finalizers(rd, meta, options)
        if finalizers:
            marked['metadata']['finalizers'] = finalizers
        else:
            marked['metadata'].pop('finalizers', None)
        if not self._blockers(rd, marked):
            return 200, self.render(rd, obj if dry_run else self._finalize(key))
        if not meta.get('deletionTimestamp'):
            marked['metadata']['deletionTimestamp'] = self._now()
            if (rd.group, rd.plural) != NAMESPACES:  # the namespace store's own Delete sets the timestamp alone
                marked['metadata']['deletionGracePeriodSeconds'] = self._grace_period(rd, obj, options)
            if marked['metadata'].get('generation'):
                marked['metadata']['generation'] += 1
            if (rd.group, rd.plural) == NAMESPACES:
                marked['status'] = {**(obj.get('status') or {}), 'phase': 'Terminating'}
        if dry_run or marked == obj:  # already deleting, finalizers unchanged: no write
            return held, self.render(rd, marked)
        marked['metadata']['resourceVersion'] = self._next_rv()
        self.objects[key] = marked
        self._emit('MODIFIED', rd, marked, obj)
        self._gc_soon(key)
        if (rd.group, rd.plural) == NAMESPACES and not meta.get('deletionTimestamp'):
            self._terminate_namespace(name)
            marked = self.objects.get(key, marked)
        return held, self.render(rd, marked)

    @staticmethod
    def _gc_finalizers(rd: ResourceDef, meta: dict[str, Any], options: dict[str, Any]) -> list[str]:
        """The finalizers after a DELETE with ``options`` (deletionFinalizersForGarbageCollection with
        shouldOrphanDependents and shouldDeleteDependents): the object's own, and ``orphan`` or
        ``foregroundDeletion`` as the options, else the GC finalizer already set, else the kind's default say."""
        finalizers = list(meta.get('finalizers') or [])
        if (rd.group, rd.plural) in GC_UNSUPPORTED:
            return finalizers
        policy = options.get('propagationPolicy')
        if options.get('orphanDependents') is not None:
            policy = 'Orphan' if options['orphanDependents'] else 'Background'
        if policy is None:
            held = next((f for f in finalizers if f in (ORPHAN, FOREGROUND)), None)
            policy = {ORPHAN: 'Orphan', FOREGROUND: 'Foreground'}.get(held or '', None) or \
                ('Orphan' if (rd.group, rd.plural) in ORPHAN_BY_DEFAULT else 'Background')
        wanted = [f for f in finalizers if f not in (ORPHAN, FOREGROUND)] + \
            {'Orphan': [ORPHAN], 'Foreground': [FOREGROUND]}.get(policy, [])
        return finalizers if set(wanted) == set(finalizers) else wanted

    @staticmethod
    def _grace_period(rd: ResourceDef, obj: dict[str, Any], options: dict[str, Any]) -> int:
        """deletionGracePeriodSeconds of an object the DELETE only marks. Only pods delete gracefully
        (rest.BeforeDelete with the pod strategy's CheckGracefulDelete: the option, else the pod's
        terminationGracePeriodSeconds; 0 if unscheduled or finished; negative means 1); any other kind is
        marked by the generic store's markAsDeleting, which sets 0 whatever the options say."""
        if (rd.group, rd.plural) != PODS:
            return 0
        spec, given = obj.get('spec') or {}, options.get('gracePeriodSeconds')
        if given is None:  # SetDefaults_PodSpec stores 30 where a pod gives none
            given = 30 if spec.get('terminationGracePeriodSeconds') is None else spec['terminationGracePeriodSeconds']
        period = int(given)
        if not spec.get('nodeName') or (obj.get('status') or {}).get('phase') in ('Succeeded', 'Failed'):
            return 0
        return 1 if period < 0 else period

    def _now(self) -> str:
        from .store import now_iso
        return now_iso()

    def _finalize(self, key: 'Key') -> dict[str, Any]:
        """Remove the object for good: DELETED event, CRD cleanup, GC of dependents, namespace end."""
        rd = self._rd_for(key)
        obj = self.objects.pop(key)
        obj['metadata']['resourceVersion'] = self._next_rv()
        self._emit('DELETED', rd, obj)
        if key[:2] == CRDS:
            group = (obj.get('spec') or {}).get('group')
            plural = ((obj.get('spec') or {}).get('names') or {}).get('plural')
            for ckey in [k for k, _ in self.objects.of(group, plural)]:
                self._finalize(ckey)
            self.registry.unregister_crd(obj)
        self._collect_dependents(obj['metadata']['uid'])
        self._wake_owners(obj['metadata'])
        if key[2]:
            self._maybe_end_namespace(key[2])
        return obj

    def _collect_dependents(self, uid: str) -> None:
        """The owner ``uid`` is gone: its dependents go, or lose the reference while another owner lives."""
        for dkey in self.objects.owned_by(uid):
            dep = self.objects.get(dkey)
            if dep is None:
                continue
            remaining = [ref for ref in dep['metadata'].get('ownerReferences') or [] if ref.get('uid') != uid]
            if remaining and self._owners_exist(dkey, remaining):
                self._drop_owner_refs(dkey, {uid})
            elif not dep['metadata'].get('deletionTimestamp'):
                self.delete(self._rd_for(dkey), dkey[2] or None, dkey[3], {'propagationPolicy': 'Background'})

    def _drop_owner_refs(self, key: 'Key', uids: set[str]) -> None:
        refs = self.objects[key]['metadata'].get('ownerReferences') or []
        remaining = [ref for ref in refs if ref.get('uid') not in uids]
        self.patch(self._rd_for(key), key[2] or None, key[3], MERGE,
                   {'metadata': {'ownerReferences': remaining or None}})

    def _gc_soon(self, key: 'Key') -> None:
        """The garbage collector looks at an object being deleted with a GC finalizer (at once without a server)."""
        if self.schedule is None:
            self._process_deleting(key)
        else:
            self.schedule(GC_DELAY, lambda: self._process_deleting(key))

    def _wake_owners(self, *metas: dict[str, Any]) -> None:
        """A dependent went or its references changed: its owners waiting for their dependents look again."""
        uids = {ref.get('uid') for meta in metas for ref in meta.get('ownerReferences') or [] if isinstance(ref, dict)}
        for uid in uids:
            okey = self.objects.key_of_uid(uid) if isinstance(uid, str) else None
            owner = self.objects.get(okey) if okey is not None else None
            if owner is not None and owner['metadata'].get('deletionTimestamp') and \
                    FOREGROUND in (owner['metadata'].get('finalizers') or []):
                self._gc_soon(okey)  # type: ignore[arg-type]

    def _process_deleting(self, key: 'Key') -> None:
        """The collector's work on an owner being deleted with ``orphan`` (strip the dependents' references
        to it, then the finalizer: attemptToOrphan) or ``foregroundDeletion`` (attemptToDeleteItem on each
        dependent, then processDeletingDependentsItem: the finalizer goes once no dependent with
        ``blockOwnerDeletion`` is left)."""
        obj = self.objects.get(key)
        if obj is None or not obj['metadata'].get('deletionTimestamp'):
            return
        finalizers = obj['metadata'].get('finalizers') or []
        uid = obj['metadata']['uid']

        def dependents() -> list['Key']:
            return [d for d in self.objects.owned_by(uid) if self._owners_exist(d, [{'uid': uid}])]
        if ORPHAN in finalizers:
            for dkey in dependents():
                self._drop_owner_refs(dkey, {uid})
            self._remove_finalizer(key, ORPHAN)
            return
        if FOREGROUND not in finalizers:
            return
        for dkey in dependents():
            dep = self.objects.get(dkey)
            if dep is None or dep['metadata'].get('deletionTimestamp'):
                continue  # being deleted: its own deletion runs its course
            others = [ref for ref in dep['metadata'].get('ownerReferences') or [] if ref.get('uid') != uid]
            solid = [ref for ref in others if self._owners_exist(dkey, [ref]) and not self._waits(ref.get('uid'))]
            if solid:
                self._drop_owner_refs(dkey, {ref.get('uid') for ref in others if ref not in solid} | {uid})
                continue
            own = dep['metadata'].get('finalizers') or []
            policy = 'Foreground' if self.objects.owned_by(dep['metadata']['uid']) or FOREGROUND in own else \
                'Orphan' if ORPHAN in own else 'Background'
            self.delete(self._rd_for(dkey), dkey[2] or None, dkey[3], {'propagationPolicy': policy})
        blocking = [d for d in dependents() if any(ref.get('uid') == uid and ref.get('blockOwnerDeletion')
                                                   for ref in self.objects[d]['metadata'].get('ownerReferences') or [])]
        if not blocking and key in self.objects:
            self._remove_finalizer(key, FOREGROUND)

    def _waits(self, uid: Any) -> bool:
        """Whether the owner ``uid`` is being deleted in the foreground (waitingForDependentsDeletion)."""
        okey = self.objects.key_of_uid(uid) if isinstance(uid, str) else None
        meta = self.objects[okey]['metadata'] if okey is not None else {}
        return bool(meta.get('deletionTimestamp')) and FOREGROUND in (meta.get('finalizers') or [])

    def _remove_finalizer(self, key: 'Key', finalizer: str) -> None:
        meta = self.objects[key]['metadata']
        remaining = [f for f in meta.get('finalizers') or [] if f != finalizer]
        self.patch(self._rd_for(key), key[2] or None, key[3], MERGE,
                   {'metadata': {'finalizers': remaining or None, 'resourceVersion': meta['resourceVersion']}})

    def _owners_exist(self, key: 'Key', refs: list[dict[str, Any]]) -> bool:
        uids = {ref.get('uid') for ref in refs}
        owners = [self.objects.key_of_uid(uid) for uid in uids if isinstance(uid, str)]
        return any(k is not None and (not k[2] or not key[2] or k[2] == key[2]) for k in owners)

    def _collect_orphan(self, key: 'Key') -> None:
        """The GC's view of dangling owner references (run shortly after a write, asynchronously)."""
        obj = self.objects.get(key)
        if obj is None or obj['metadata'].get('deletionTimestamp'):
            return
        refs = obj['metadata'].get('ownerReferences') or []
        alive = [ref for ref in refs if self._owners_exist(key, [ref])]
        rd = self._rd_for(key)
        if refs and not alive:
            self.delete(rd, key[2] or None, key[3], {'propagationPolicy': 'Background'})
        elif len(alive) < len(refs):
            self.patch(rd, key[2] or None, key[3], MERGE, {'metadata': {'ownerReferences': alive}})

    def _terminate_namespace(self, namespace: str) -> None:
        for key in self.objects.in_namespace(namespace):
            obj = self.objects.get(key)
            if obj is not None and not obj['metadata'].get('deletionTimestamp'):
                self.delete(self._rd_for(key), namespace, key[3], {'propagationPolicy': 'Background'})
        self._maybe_end_namespace(namespace)

    def _maybe_end_namespace(self, namespace: str) -> None:
        nskey = ('', 'namespaces', '', namespace)
        ns = self.objects.get(nskey)
        if ns is None or not ns['metadata'].get('deletionTimestamp'):
            return
        if self.objects.in_namespace(namespace):
            return
        rd = self._rd_for(nskey)
        if (ns.get('spec') or {}).get('finalizers'):
            # The namespace controller's part: content is gone, release the "kubernetes" finalizer.
            self.update(rd, None, namespace, {**ns, 'spec': {**ns['spec'], 'finalizers': []}}, subresource=None)
            # NB: update() finalizes the namespace if no metadata.finalizers remain.
