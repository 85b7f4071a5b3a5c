"""
Deletion semantics of the store (mixed into :class:`store.Store`): finalizers and
``deletionTimestamp``, namespace termination, CRD removal, and the garbage collector
(owner references: Background and Foreground both delete dependents after the owner is gone,
Orphan strips the references; dependents whose owners never existed are collected too).
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
        policy = options.get('propagationPolicy') or ('Orphan' if options.get('orphanDependents') else 'Background')
        if policy not in ('Background', 'Foreground', 'Orphan'):
            raise ApiError.invalid('DeleteOptions', '', [('propagationPolicy', f'Unsupported value: "{policy}"')])
        if dry_run:
            return 200, self.render(rd, obj)
        key = self.key(rd, namespace, name)
        # Like the API server's delete handler: 200 even when the object stays (finalizers, a
        # namespace terminating), 202 only then and when the client set orphanDependents=false.
        held = 202 if options.get('orphanDependents') is False else 200
        if meta.get('deletionTimestamp'):
            return held, self.render(rd, obj)
        if self._blockers(rd, obj):
            old, obj = obj, copy.deepcopy(obj)
            obj['metadata']['deletionTimestamp'] = self._now()
            if (rd.group, rd.plural) != NAMESPACES:  # the namespace store's own Delete sets the timestamp alone
                obj['metadata']['deletionGracePeriodSeconds'] = self._grace_period(rd, obj, options)
            if obj['metadata'].get('generation'):
                obj['metadata']['generation'] += 1
            if (rd.group, rd.plural) == NAMESPACES:
                obj['status'] = {**(obj.get('status') or {}), 'phase': 'Terminating'}
            obj['metadata']['resourceVersion'] = self._next_rv()
            self.objects[key] = obj
            self.policies[key] = policy
            self._emit('MODIFIED', rd, obj, old)
            if (rd.group, rd.plural) == NAMESPACES:
                self._terminate_namespace(name)
                obj = self.objects.get(key, obj)
            return held, self.render(rd, obj)
        final = self._finalize(key, policy)
        return 200, self.render(rd, final)

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

    def _finalize(self, key: 'Key', policy: str | None = None) -> dict[str, Any]:
        """Remove the object for good: DELETED event, CRD cleanup, GC of dependents, namespace end."""
        rd = self._rd_for(key)
        policy = policy or self.policies.pop(key, 'Background')
        self.policies.pop(key, None)
        obj = self.objects.pop(key)
        obj['metadata']['resourceVersion'] = self._next_rv()
        self._emit('DELETED', rd, obj)
        if key[:2] == CRDS:
            group = (obj.get('spec') or {}).get('group')
            plural = ((obj.get('spec') or {}).get('names') or {}).get('plural')
            for ckey in [k for k, _ in self.objects.of(group, plural)]:
                self._finalize(ckey, 'Background')
            self.registry.unregister_crd(obj)
        self._collect_dependents(obj['metadata']['uid'], policy)
        if key[2]:
            self._maybe_end_namespace(key[2])
        return obj

    def _collect_dependents(self, uid: str, policy: str) -> None:
        for dkey in self.objects.owned_by(uid):
            dep = self.objects.get(dkey)
            if dep is None:
                continue
            refs = dep['metadata'].get('ownerReferences') or []
            drd = self._rd_for(dkey)
            remaining = [ref for ref in refs if ref.get('uid') != uid]
            if policy == 'Orphan' or (remaining and self._owners_exist(dkey, remaining)):
                patch = {'metadata': {'ownerReferences': remaining or None}}
                self.patch(drd, dkey[2] or None, dkey[3], 'application/merge-patch+json', patch)
            elif not dep['metadata'].get('deletionTimestamp'):
                self.delete(drd, dkey[2] or None, dkey[3], {'propagationPolicy': 'Background'})

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
            self.patch(rd, key[2] or None, key[3], 'application/merge-patch+json',
                       {'metadata': {'ownerReferences': alive}})

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
