"""
The object store: the semantics of writes (create / update / patch / status / delete), a global
resourceVersion counter, a bounded event history for resumable watches, finalizers, namespace
termination and garbage collection. Every operation is synchronous (no ``await`` inside), so it is
atomic on the event loop: a watch registered in the same step as a list can never miss an event.
"""
from __future__ import annotations

import base64
import collections
import copy
import dataclasses
import datetime
import json
import random
import uuid
from typing import Any, Callable

from . import defaults, patching, quantity, schema, validation
from .index import Key, Objects
from .errors import ApiError
from .lifecycle import Lifecycle
from .resources import Registry, ResourceDef

INITIAL_NAMESPACES = ('default', 'kube-system', 'kube-public', 'kube-node-lease')
DEFAULT_MANAGER = 'emulator'  # the field manager of writes made inside the emulator (GC, namespace controller)
FIELD_VALIDATIONS = ('Ignore', 'Warn', 'Strict')
_META_KEYS = {'name', 'generateName', 'namespace', 'uid', 'resourceVersion', 'generation', 'creationTimestamp',
              'deletionTimestamp', 'deletionGracePeriodSeconds', 'labels', 'annotations', 'ownerReferences',
              'finalizers', 'managedFields', 'selfLink'}


@dataclasses.dataclass(frozen=True)
class Event:
    rv: int
    group: str
    plural: str
    type: str  # ADDED / MODIFIED / DELETED
    object: dict[str, Any]
    old: dict[str, Any] | None = None  # the previous state, for MODIFIED (selector transitions)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')


class Store(Lifecycle):
    def __init__(self, registry: Registry, history_size: int = 10000) -> None:
        self.registry = registry
        self.rv = 0
        self.objects = Objects()
        self.history: collections.deque[Event] = collections.deque(maxlen=max(1, history_size))
        self.compacted_rv = 0  # watches from an older resourceVersion get 410 Gone
        self.listeners: dict[tuple[str, str], set[Callable[[Event], None]]] = {}  # by (group, plural)
        self.closed = False  # set at shutdown: open watches end
        self.watch_epoch = 0  # raised to cut every open watch stream (a dropped connection)
        self.schedule: Callable[[float, Callable[[], None]], None] | None = None  # set by the server
        # Of the API write being served (begin_write/end_write; every write is synchronous): its
        # fieldValidation, and the Warning headers of its answer.
        self.field_validation = 'Warn'
        self.warnings: list[str] = []
        for name in INITIAL_NAMESPACES:
            self.create(self.rd('', 'v1', 'namespaces'), None, {'metadata': {'name': name}})

    # --- helpers ---------------------------------------------------------------------------------

    def rd(self, group: str, version: str, plural: str) -> ResourceDef:
        rd = self.registry.get(group, version, plural)
        if rd is None:
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        return rd

    @staticmethod
    def key(rd: ResourceDef, namespace: str | None, name: str) -> Key:
        return (rd.group, rd.plural, (namespace or '') if rd.namespaced else '', name)

    def render(self, rd: ResourceDef, obj: dict[str, Any]) -> dict[str, Any]:
        """A copy as served for this resource version (apiVersion/kind first)."""
        body = {'apiVersion': rd.api_version, 'kind': rd.kind}
        body.update({k: copy.deepcopy(v) for k, v in obj.items() if k not in ('apiVersion', 'kind')})
        return body

    def _emit(self, etype: str, rd: ResourceDef, obj: dict[str, Any], old: dict[str, Any] | None = None) -> None:
        if len(self.history) == self.history.maxlen:
            self.compacted_rv = self.history[0].rv
        event = Event(int(obj['metadata']['resourceVersion']), rd.group, rd.plural, etype, copy.deepcopy(obj),
                      copy.deepcopy(old) if old is not None else None)
        self.history.append(event)
        for listener in list(self.listeners.get((rd.group, rd.plural), ())):
            listener(event)

    def compact(self) -> None:
        """Forget the event history, like an etcd compaction: older watches then get 410 Gone."""
        self.compacted_rv = self.rv
        self.history.clear()

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def find(self, rd: ResourceDef, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.objects.get(self.key(rd, namespace, name))
        if obj is None:
            raise ApiError.not_found(rd.group_resource, name)
        return obj

    def get(self, rd: ResourceDef, namespace: str | None, name: str) -> dict[str, Any]:
        return self.render(rd, self.find(rd, namespace, name))

    def list(self, rd: ResourceDef, namespace: str | None,
             match: Callable[[dict[str, Any]], bool] = lambda o: True) -> list[dict[str, Any]]:
        return [self.render(rd, obj) for _, obj in self.objects.of(rd.group, rd.plural, namespace) if match(obj)]

    # --- validation ------------------------------------------------------------------------------

    def begin_write(self, field_validation: str | None, options: str) -> None:
        """An API write starts: ``field_validation`` as the request asks (None: Warn, the default)."""
        if field_validation and field_validation not in FIELD_VALIDATIONS:
            raise ApiError.invalid(f'{options}.meta.k8s.io', '', [('fieldValidation', (
                f'Unsupported value: "{field_validation}": supported values: "", "Ignore", "Strict", "Warn"'))])
        self.field_validation, self.warnings = field_validation or 'Warn', []

    def end_write(self) -> list[str]:
        """The Warning headers of the write that ends (each ``299 - "<text>"``)."""
        warnings, self.field_validation, self.warnings = self.warnings, 'Warn', []
        return [f'299 - {json.dumps(w)}' for w in dict.fromkeys(warnings)]

    def _check_unknown(self, rd: ResourceDef, obj: dict[str, Any], operation: str) -> None:
        """Unknown fields of a built-in kind in a write, as a real server (1.30) handles them: an
        apply fails (500, like the server's typed conversion of the applied configuration, whatever
        fieldValidation); otherwise they are dropped (``_prepare``) with a warning each (Warn),
        silently (Ignore), or the write is refused (Strict: 400 for a create or update, 422 naming
        ``patch`` for a patch)."""
        if rd.custom:
            return
        body = {**obj, 'apiVersion': rd.api_version, 'kind': rd.kind}
        found = schema.unknown_fields(body)
        if not found:
            return
        if operation == 'apply':
            meta = obj.get('metadata') or {}
            name = '/'.join(filter(None, (meta.get('namespace'), meta.get('name'))))
            errors = [f'{schema.typed_path(body, p, patching.item_selector)}: field not declared in schema'
                      for p in found]
            text = errors[0] if len(errors) == 1 else 'errors:\n' + '\n'.join(f'  {e}' for e in errors)
            raise ApiError(500, 'InternalError', f'failed to create typed patch object ({name}; '
                                                 f'{rd.group}/{rd.version}, Kind={rd.kind}): {text}')
        fields = [f'unknown field "{schema.json_path(p)}"' for p in found]
        if self.field_validation == 'Warn':
            self.warnings += fields
        elif self.field_validation == 'Strict' and operation == 'patch':
            raise ApiError.invalid('', '', [('patch', f'Invalid value: {json.dumps(json.dumps(obj))}: strict '
                                                      f'decoding error: {", ".join(fields)}')])
        elif self.field_validation == 'Strict':
            raise ApiError.bad_request(f'{rd.kind} in version "{rd.version}" cannot be handled as a {rd.kind}: '
                                       f'strict decoding error: {", ".join(fields)}')

    def _validate_meta(self, rd: ResourceDef, obj: dict[str, Any], old: dict[str, Any] | None = None) -> None:
        meta = obj['metadata']
        name = meta.get('name', '')
        rule = {('', 'namespaces'): 'label', ('', 'services'): 'dns1035'}.get((rd.group, rd.plural), 'subdomain')
        causes = validation.meta(obj, rule)
        for key, value in (meta.get('annotations') or {}).items():
            if not isinstance(value, str):
                raise ApiError.bad_request(f'annotation {key!r} must be a string')
        if rd.custom:
            causes += schema.validate(obj, rd.schema, old)
        else:
            causes += schema.validate_builtin(obj)
            if not causes:  # the kind's own rules run on an object its schema accepts
                causes += validation.validate(obj, old)
        if causes:
            raise ApiError.invalid(rd.kind_group, name, causes)

    def _prepare(self, rd: ResourceDef, obj: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
        obj['apiVersion'], obj['kind'] = rd.api_version, rd.kind
        obj['metadata'] = {k: v for k, v in obj['metadata'].items() if k in _META_KEYS and v is not None}
        obj['metadata'].pop('managedFields', None)
        obj['metadata'].pop('selfLink', None)
        if rd.custom:
            obj = schema.prune_and_default(obj, rd.schema)
        else:  # decoded and stored as the server does: unknown fields dropped, defaults, 1024Mi is 1Gi
            schema.unknown_fields(obj, prune=True)
            defaults.apply(obj)
            quantity.canonicalize(obj)
        if (rd.group, rd.plural) == ('', 'services') and isinstance(obj.get('spec'), dict):
            self._allocate_service(obj, old)
        self._validate_meta(rd, obj, old)
        return obj

    def _allocate_service(self, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """The Service registry's allocation of addresses and node ports, before validation as on a
        real server (its beginCreate/beginUpdate hooks run before the strategy's validation)."""
        meta = obj['metadata']
        others = [o for key, o in self.objects.of('', 'services')
                  if (key[2], key[3]) != (meta.get('namespace'), meta.get('name'))]
        specs = [o.get('spec') or {} for o in others]
        ips = {str(s.get('clusterIP')) for s in specs}
        ports = set().union(*map(defaults.node_ports, specs))
        causes = defaults.service_addresses(obj['spec'], (old or {}).get('spec'), ips, ports)
        if causes:
            raise ApiError.invalid('Service', meta.get('name', ''), causes)

    # --- create ----------------------------------------------------------------------------------

    def create(self, rd: ResourceDef, namespace: str | None, body: Any, dry_run: bool = False,
               manager: str = DEFAULT_MANAGER, applied: dict[patching.Path, Any] | None = None) -> dict[str, Any]:
        """POST; ``manager`` owns every field (an Update), or, for a server-side apply that creates the
        object, the ``applied`` field set (an Apply)."""
        if not isinstance(body, dict):
            raise ApiError.bad_request('the request body must be a JSON object')
        obj = copy.deepcopy(body)
        self._check_type(rd, obj)
        if applied is None:
            self._check_unknown(rd, obj, 'create')
        meta = obj.setdefault('metadata', {})
        if not isinstance(meta, dict):
            raise ApiError.bad_request('metadata must be an object')
        if meta.get('resourceVersion'):
            raise ApiError(500, 'InternalError', 'resourceVersion should not be set on objects to be created')
        if rd.namespaced:
            if not namespace:
                raise ApiError.method_not_allowed()
            if meta.get('namespace') and meta['namespace'] != namespace:
                raise ApiError.bad_request('the namespace of the provided object does not match the namespace'
                                           ' sent on the request')
            meta['namespace'] = namespace
            self._check_namespace(namespace, rd)
        else:
            meta.pop('namespace', None)
        if not meta.get('name'):
            if not meta.get('generateName'):
                raise ApiError.invalid(rd.kind_group, '', [('metadata.name', 'Required value: name or generateName'
                                                                              ' is required')])
            alphabet = 'bcdfghjklmnpqrstvwxz2456789'
            meta['name'] = meta['generateName'] + ''.join(random.choices(alphabet, k=5))
        for field in ('deletionTimestamp', 'deletionGracePeriodSeconds', 'generation', 'uid', 'creationTimestamp'):
            meta.pop(field, None)
        if 'status' in rd.subresources:
            obj.pop('status', None)
        obj = self._prepare(rd, obj)
        meta = obj['metadata']
        key = self.key(rd, namespace, meta['name'])
        if key in self.objects:
            raise ApiError.already_exists(rd.group_resource, meta['name'])
        self._admit(rd, obj, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now_iso(), generation=1)
        if applied is not None:
            managed = self._managed_after_apply(rd, {'metadata': {}}, obj, None, manager, applied, [])
        else:
            managed = self._managed_after_update(rd, {'metadata': {}}, obj, None, manager, None)
        if managed:
            meta['managedFields'] = managed
        if dry_run:
            return self.render(rd, obj)
        meta['resourceVersion'] = self._next_rv()
        self.objects[key] = obj
        self._emit('ADDED', rd, obj)
        self._after_write(rd, obj, None)
        return self.render(rd, obj)

    @staticmethod
    def _check_url_identity(rd: ResourceDef, meta: dict[str, Any], namespace: str | None, name: str) -> None:
        """The body's name and namespace, when given, are the ones on the URL (as a server checks)."""
        if meta.get('name') and meta['name'] != name:
            raise ApiError.bad_request(f'the name of the object ({meta["name"]}) does not match the name on the'
                                       f' URL ({name})')
        if rd.namespaced and meta.get('namespace') and meta['namespace'] != namespace:
            raise ApiError.bad_request('the namespace of the provided object does not match the namespace sent'
                                       ' on the request')

    def _check_type(self, rd: ResourceDef, obj: dict[str, Any]) -> None:
        if obj.get('apiVersion') and obj['apiVersion'] != rd.api_version:
            raise ApiError.bad_request(f'the API version in the data ({obj["apiVersion"]}) does not match the'
                                       f' expected API version ({rd.api_version})')
        if obj.get('kind') and obj['kind'] != rd.kind:
            raise ApiError.bad_request(f'the kind in the data ({obj["kind"]}) does not match the expected kind'
                                       f' ({rd.kind})')

    def _check_namespace(self, namespace: str, rd: ResourceDef) -> None:
        ns = self.objects.get(('', 'namespaces', '', namespace))
        if ns is None:
            raise ApiError.not_found('namespaces', namespace)
        if ns['metadata'].get('deletionTimestamp'):
            raise ApiError(403, 'Forbidden', f'{rd.group_resource} is forbidden: unable to create new content in'
                                             f' namespace {namespace} because it is being terminated')

    def _admit(self, rd: ResourceDef, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        """Built-in defaulting of special kinds (before the object is stored)."""
        if (rd.group, rd.plural) == ('', 'namespaces'):
            obj.setdefault('spec', {}).setdefault('finalizers', ['kubernetes'])
            phase = 'Terminating' if obj['metadata'].get('deletionTimestamp') else 'Active'
            obj['status'] = {**(obj.get('status') or {}), 'phase': phase}
        if (rd.group, rd.plural) == ('apiextensions.k8s.io', 'customresourcedefinitions'):
            self._admit_crd(obj)
        if (rd.group, rd.plural) == ('', 'secrets'):
            if not obj.get('type'):
                obj['type'] = 'Opaque'
            # stringData is write-only: merged over data (base64), never stored or returned
            string_data = obj.pop('stringData', None)
            if string_data is not None:
                if not isinstance(string_data, dict) or not all(isinstance(v, str) for v in string_data.values()):
                    raise ApiError.bad_request('stringData must be an object of strings')
                obj['data'] = {**(obj.get('data') or {}),
                               **{k: base64.b64encode(v.encode()).decode() for k, v in string_data.items()}}
            bad = validation.config_keys(obj, ('data',))
            if bad:
                raise ApiError.invalid('Secret', obj['metadata'].get('name', ''), bad)

    def _admit_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get('spec') or {}
        names = spec.get('names') or {}
        expected = f'{names.get("plural")}.{spec.get("group")}'
        if crd['metadata']['name'] != expected:
            raise ApiError.invalid('CustomResourceDefinition.apiextensions.k8s.io', crd['metadata']['name'], [
                ('metadata.name', f'Invalid value: "{crd["metadata"]["name"]}": must be spec.names.plural+"."+'
                                  f'spec.group')])
        if not names.get('kind') or not spec.get('versions'):
            raise ApiError.invalid('CustomResourceDefinition.apiextensions.k8s.io', crd['metadata']['name'], [
                ('spec', 'Required value: spec.names.kind and spec.versions are required')])
        accepted = dict(names)
        accepted.setdefault('singular', names['kind'].lower())
        accepted.setdefault('listKind', names['kind'] + 'List')
        ts = now_iso()
        storage = [v['name'] for v in spec['versions'] if v.get('storage')]
        crd['status'] = {
            'acceptedNames': accepted,
            'conditions': [
                {'type': 'NamesAccepted', 'status': 'True', 'reason': 'NoConflicts', 'message': 'no conflicts found',
                 'lastTransitionTime': ts},
                {'type': 'Established', 'status': 'True', 'reason': 'InitialNamesAccepted',
                 'message': 'the initial names have been accepted', 'lastTransitionTime': ts},
            ],
            'storedVersions': sorted(set(((crd.get('status') or {}).get('storedVersions') or []) + storage)),
        }

    def _after_write(self, rd: ResourceDef, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        if (rd.group, rd.plural) == ('apiextensions.k8s.io', 'customresourcedefinitions'):
            if not obj['metadata'].get('deletionTimestamp'):
                self.registry.register_crd(obj)
        if obj['metadata'].get('ownerReferences') and self.schedule is not None:
            key = self.key(rd, obj['metadata'].get('namespace'), obj['metadata']['name'])
            self.schedule(0.2, lambda: self._collect_orphan(key))
        if obj['metadata'].get('ownerReferences') or (old or {}).get('metadata', {}).get('ownerReferences'):
            self._wake_owners(obj['metadata'], *([old['metadata']] if old else []))

    # --- update / patch --------------------------------------------------------------------------

    def update(self, rd: ResourceDef, namespace: str | None, name: str, body: Any,
               subresource: str | None = None, dry_run: bool = False,
               manager: str = DEFAULT_MANAGER) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError.bad_request('the request body must be a JSON object')
        old = self.find(rd, namespace, name)
        self._check_type(rd, body)
        meta = body.get('metadata') or {}
        self._check_url_identity(rd, meta, namespace, name)
        if rd.custom and not meta.get('resourceVersion'):  # custom resources allow no unconditional PUT
            raise ApiError.invalid(rd.kind_group, name, [('metadata.resourceVersion',
                                                          'Invalid value: 0x0: must be specified for an update')])
        self._check_unknown(rd, body, 'update')
        return self._replace(rd, old, copy.deepcopy(body), subresource, dry_run, manager)

    def patch(self, rd: ResourceDef, namespace: str | None, name: str, content_type: str, patch: Any,
              subresource: str | None = None, dry_run: bool = False,
              manager: str = DEFAULT_MANAGER) -> dict[str, Any]:
        patching.check_content_type(content_type, custom=rd.custom)
        old = self.find(rd, namespace, name)
        patched = patching.apply_patch(content_type, self.render(rd, old), patch, custom=rd.custom)
        meta = patched.setdefault('metadata', {}) if isinstance(patched.get('metadata'), dict) else None
        if meta is None:
            raise ApiError.bad_request('metadata must be an object')
        if not meta.get('resourceVersion'):
            meta['resourceVersion'] = old['metadata']['resourceVersion']
        self._check_type(rd, patched)
        self._check_unknown(rd, patched, 'patch')
        return self._replace(rd, old, patched, subresource, dry_run, manager)

    def _replace(self, rd: ResourceDef, old: dict[str, Any], new: dict[str, Any], subresource: str | None,
                 dry_run: bool, manager: str = DEFAULT_MANAGER,
                 manage: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None) -> dict[str, Any]:
        """Store ``new`` over ``old``. managedFields: ``manage(new)`` (server-side apply), else
        ``manager`` owns what this write changes (an Update)."""
        old_meta = old['metadata']
        name = old_meta['name']
        new_meta = new.get('metadata')
        if not isinstance(new_meta, dict):
            new_meta = new['metadata'] = {}
        requested = new_meta.get('managedFields')  # set by the client: taken over (see _managed_after_update)
        if new_meta.get('resourceVersion') and new_meta['resourceVersion'] != old_meta['resourceVersion']:
            raise ApiError.conflict(rd.group_resource, name)
        if new_meta.get('uid') and new_meta['uid'] != old_meta['uid']:
            raise ApiError.conflict(rd.group_resource, name, f'Precondition failed: UID in precondition:'
                                                             f' {new_meta["uid"]}, UID in object meta: {old_meta["uid"]}')
        if subresource == 'status':
            status = new.get('status')
            new = copy.deepcopy(old)
            new.pop('status', None)
            if status is not None:
                new['status'] = status
        elif subresource:
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        else:
            if 'status' in rd.subresources:
                new.pop('status', None)
                if 'status' in old:
                    new['status'] = copy.deepcopy(old['status'])
            for field in ('name', 'namespace', 'uid', 'creationTimestamp', 'deletionTimestamp',
                          'deletionGracePeriodSeconds', 'generation'):
                if field in old_meta:
                    new_meta[field] = old_meta[field]
                else:
                    new_meta.pop(field, None)
            if old_meta.get('deletionTimestamp'):
                added = set(new_meta.get('finalizers') or []) - set(old_meta.get('finalizers') or [])
                if added:
                    raise ApiError(422, 'Forbidden', f'{rd.group_resource} "{name}" is forbidden: no new finalizers'
                                                     f' can be added if the object is being deleted, found new'
                                                     f' finalizers {sorted(added)}')
        new['metadata']['resourceVersion'] = old_meta['resourceVersion']
        new = self._prepare(rd, new, old)
        self._admit(rd, new, old)
        if self._spec_changed(rd, old, new):
            new['metadata']['generation'] = old_meta.get('generation', 1) + 1
        managed = manage(new) if manage is not None else \
            self._managed_after_update(rd, old, new, subresource, manager, requested)
        if managed:
            new['metadata']['managedFields'] = managed
        if new == old:
            return self.render(rd, old)  # a no-op write: no new resourceVersion, no watch event
        if dry_run:
            return self.render(rd, new)
        key = self.key(rd, old_meta.get('namespace'), name)
        if new['metadata'].get('deletionTimestamp') and not self._blockers(rd, new):
            # The write that empties the finalizers of a deleting object is not stored: the object
            # is deleted (one DELETED event, the last stored object) and the answer is the object
            # as written, at the resourceVersion it had (kube-apiserver's Store.Update, errEmptiedFinalizers).
            self._finalize(key)
            return self.render(rd, new)
        new['metadata']['resourceVersion'] = self._next_rv()
        self.objects[key] = new
        self._emit('MODIFIED', rd, new, old)
        self._after_write(rd, new, old)
        return self.render(rd, new)

    @staticmethod
    def _spec_changed(rd: ResourceDef, old: dict[str, Any], new: dict[str, Any]) -> bool:
        skip = {'metadata', 'apiVersion', 'kind'}
        if not rd.custom or 'status' in rd.subresources:
            skip.add('status')
        pick = lambda obj: {k: v for k, v in obj.items() if k not in skip}  # noqa: E731
        return pick(old) != pick(new)

    # --- server-side apply and managedFields -----------------------------------------------------

    @staticmethod
    def _scope(rd: ResourceDef, subresource: str | None) -> str:
        if subresource == 'status':
            return 'status'
        return 'main' if 'status' in rd.subresources else 'all'

    def apply(self, rd: ResourceDef, namespace: str | None, name: str, body: Any, manager: str,
              force: bool = False, subresource: str | None = None,
              dry_run: bool = False) -> tuple[int, dict[str, Any]]:
        """Server-side apply (PATCH application/apply-patch+yaml): create the object if absent;
        else merge the applied configuration in, failing with 409 on fields another manager owns
        with a different value (unless ``force``: then they change owner), and remove the fields
        this manager applied before and no longer does, unless another manager owns them too.
        Returns (HTTP status, object)."""
        if not manager:
            raise ApiError.invalid('PatchOptions.meta.k8s.io', '', [
                ('fieldManager', 'Required value: is required for apply patch')])
        if not isinstance(body, dict):
            raise ApiError.bad_request('the request body must be a YAML or JSON object')
        if not body.get('apiVersion') or not body.get('kind'):
            raise ApiError.bad_request(f'invalid object type: {body.get("apiVersion") or "/"}, '
                                       f'Kind={body.get("kind") or ""}: apiVersion and kind must be set')
        self._check_type(rd, body)
        meta = body.get('metadata')
        if not isinstance(meta, dict):
            raise ApiError.bad_request('metadata must be an object')
        self._check_url_identity(rd, meta, namespace, name)
        applied = _without_nulls(body)
        self._check_unknown(rd, {**applied, 'metadata': {**meta, 'name': name, 'namespace': namespace}}, 'apply')
        if not rd.custom:
            quantity.canonicalize(applied)  # owned and compared as stored
        scope = self._scope(rd, subresource)
        if scope == 'main':
            applied.pop('status', None)  # reset by the main resource, like a real server
        elif scope == 'status':
            applied = {'metadata': applied['metadata'],
                       **({'status': applied['status']} if 'status' in applied else {})}
        mine = patching.field_set(patching.ownable(applied, scope), rd.custom)
        old = self.objects.get(self.key(rd, namespace, name))
        if old is None:
            if subresource:
                raise ApiError.not_found(rd.group_resource, name)
            applied['metadata'] = {**applied['metadata'], 'name': name}
            applied['metadata'].pop('resourceVersion', None)
            return 201, self.create(rd, namespace, applied, dry_run, manager=manager, applied=mine)
        live = self.render(rd, old)
        live_fields = patching.field_set(patching.ownable(live, scope), rd.custom)
        entries = _entries(old)
        ident = (manager, 'Apply', subresource or '')
        previous = next((paths for entry, paths in entries if _ident(entry) == ident), set())
        conflicts = []
        for entry, paths in entries:
            if _ident(entry) == ident:
                continue
            for path in sorted(paths & set(mine)):
                if path[-1] != patching.ITEM and not path[-1].startswith('v:') and path in live_fields \
                        and live_fields[path] != mine[path]:
                    conflicts.append((entry, path))
        if conflicts and not force:
            raise _conflict_error(conflicts)
        for entry, path in conflicts:  # force: the applier takes them over
            next(paths for e, paths in entries if e is entry).discard(path)
        others = set().union(*(paths for entry, paths in entries if _ident(entry) != ident))
        merged = patching.apply_merge(live, applied, rd.custom)
        stale = previous - set(mine) - others
        for path in sorted(stale, key=lambda p: (p[-1] != patching.ITEM, -len(p))):  # whole items first
            if path[-1] == patching.ITEM and any(p[:len(path) - 1] == path[:-1] for p in others):
                continue  # another manager still owns part of this list item
            patching.remove_path(merged, path)
        return 200, self._replace(
            rd, old, merged, subresource, dry_run,
            manage=lambda new: self._managed_after_apply(rd, old, new, subresource, manager, mine, entries))

    def _managed_after_apply(self, rd: ResourceDef, old: dict[str, Any], new: dict[str, Any],
                             subresource: str | None, manager: str, mine: dict[patching.Path, Any],
                             entries: list[tuple[dict[str, Any], set[patching.Path]]]) -> list[dict[str, Any]]:
        scope = self._scope(rd, subresource)
        new_fields = patching.field_set(patching.ownable(new, scope), rd.custom)
        gone = set(patching.field_set(patching.ownable(old, scope), rd.custom)) - set(new_fields)
        ident = (manager, 'Apply', subresource or '')
        out = [(e, paths - gone) for e, paths in entries if _ident(e) != ident]
        mine_entry = next((e for e, _ in entries if _ident(e) == ident),
                          _new_entry(rd, manager, 'Apply', subresource))
        out.append((mine_entry, {p for p in mine if p in new_fields}))  # pruned fields are not owned
        return _render_entries(rd, out, _entries(old))

    def _managed_after_update(self, rd: ResourceDef, old: dict[str, Any], new: dict[str, Any],
                              subresource: str | None, manager: str, requested: Any) -> list[dict[str, Any]]:
        """An Update: ``manager`` takes every field this write set or changed (from whoever owned
        it); fields the write removed leave every set. managedFields sent by the client replace
        the stored ones when they differ (a single empty entry clears them), as on a real server."""
        base = _entries(old)
        if isinstance(requested, list) and requested and requested != old['metadata'].get('managedFields'):
            if requested == [{}]:
                return []
            base = _entries({'metadata': {'managedFields': requested}})
        scope = self._scope(rd, subresource)
        old_fields = patching.field_set(patching.ownable(old, scope), rd.custom)
        new_fields = patching.field_set(patching.ownable(new, scope), rd.custom)
        changed = {p for p, v in new_fields.items() if p not in old_fields or old_fields[p] != v}
        gone = set(old_fields) - set(new_fields)
        ident = (manager, 'Update', subresource or '')
        out = [(e, paths - gone - (set() if _ident(e) == ident else changed)) for e, paths in base]
        if changed and not any(_ident(e) == ident for e, _ in out):
            out.append((_new_entry(rd, manager, 'Update', subresource), set()))
        out = [(e, paths | changed) if _ident(e) == ident else (e, paths) for e, paths in out]
        return _render_entries(rd, out, _entries(old))


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return copy.deepcopy(value)


def _ident(entry: dict[str, Any]) -> tuple[str, str, str]:
    return entry.get('manager', ''), entry.get('operation', ''), entry.get('subresource', '')


def _entries(obj: dict[str, Any]) -> list[tuple[dict[str, Any], set[patching.Path]]]:
    """The managedFields entries of a stored object, each with its parsed field set."""
    out = []
    for entry in obj.get('metadata', {}).get('managedFields') or []:
        if isinstance(entry, dict) and entry.get('manager') and entry.get('operation') in ('Apply', 'Update'):
            out.append((copy.deepcopy(entry), patching.from_fields_v1(entry.get('fieldsV1'))))
    return out


def _new_entry(rd: ResourceDef, manager: str, operation: str, subresource: str | None) -> dict[str, Any]:
    entry = {'manager': manager, 'operation': operation, 'apiVersion': rd.api_version, 'time': '',
             'fieldsType': 'FieldsV1', 'fieldsV1': {}}
    if subresource:
        entry['subresource'] = subresource
    return entry


def _render_entries(rd: ResourceDef, entries: list[tuple[dict[str, Any], set[patching.Path]]],
                    before: list[tuple[dict[str, Any], set[patching.Path]]]) -> list[dict[str, Any]]:
    """managedFields for the entries that still own something; ``time`` moves only for those
    whose field set changed (so a no-op write stays a no-op)."""
    previous = {_ident(e): paths for e, paths in before}
    out = []
    for entry, paths in entries:
        if not paths:
            continue
        entry = dict(entry, fieldsV1=patching.to_fields_v1(paths), fieldsType='FieldsV1')
        if previous.get(_ident(entry)) != paths or not entry.get('time'):
            entry['time'] = now_iso()
            entry['apiVersion'] = rd.api_version
        out.append(entry)
    return out


def _conflict_error(conflicts: list[tuple[dict[str, Any], patching.Path]]) -> ApiError:
    """409 as a real API server words it: Apply failed with 1 conflict: conflict with "m" using v1: .data.a"""
    by_manager: dict[tuple[str, str], list[str]] = {}
    for entry, path in conflicts:
        by_manager.setdefault((entry['manager'], entry.get('apiVersion', '')), []).append(patching.describe(path))
    parts = []
    for (manager, version), paths in by_manager.items():
        using = f' using {version}' if version else ''
        if len(paths) == 1:
            parts.append(f'conflict with "{manager}"{using}: {paths[0]}')
        else:
            parts.append(f'conflicts with "{manager}"{using}:\n' + '\n'.join(f'- {p}' for p in paths))
    n = len(conflicts)
    causes = [{'reason': 'FieldManagerConflict', 'field': patching.describe(path),
               'message': f'conflict with "{entry["manager"]}"'
                          + (f' using {entry["apiVersion"]}' if entry.get('apiVersion') else '')}
              for entry, path in conflicts]
    return ApiError(409, 'Conflict', f'Apply failed with {n} conflict{"s" if n > 1 else ""}: ' + '\n'.join(parts),
                    {'causes': causes})
