"""
A Kubernetes API server emulator for tests: kopf, the kubernetes Python client and real kubectl
work against it. Run it with ``python -m testbed.k8s.emulator --host 127.0.0.1 --port 0 [--crd FILE]``;
it prints ``READY <url>`` when serving.

Built on kmock 0.8: :class:`Emulator` subclasses ``kmock.KubernetesEmulator`` and keeps kmock's
handler/server plumbing (``kmock.Server``), its request log (iterate ``emu`` or ``len(emu)``; also
served at ``GET/DELETE /_emulator/requests``), its DSL for injecting reactions (``emu['patch', ...] << 500``
takes priority over the emulation) and its bundled discovery data of the built-in resources.
Replaced, because they could not be fixed by small overrides:

* request parsing - kmock's path parser crashes on ``/api/v1/namespaces`` and cannot tell a
  Namespace object (``/api/v1/namespaces/NAME``) from a namespaced collection;
* storage and write semantics (``store.py``, ``lifecycle.py``) - kmock merges dicts without uid,
  resourceVersion, generation, conflicts, status subresource, finalizer or GC semantics;
* discovery (``resources.py``) - kmock reports groupVersion "/v1" and knows no CRD objects;
* watches (``watch.py``) - kmock's stream ignores resourceVersion/timeoutSeconds, loses events
  between a list and a watch and uses a content type kubectl rejects;
* Table printing (``tables.py``), selectors (``selectors.py``), patches (``patching.py``),
  server-side apply and ``metadata.managedFields`` (``store.py``, ``patching.py``),
  CRD schemas (``schema.py``: pruning, defaulting, validation), the quantities of built-in kinds
  (``quantity.py``: parsed, stored in canonical form, ``1024Mi`` as ``1Gi``), the server's own validation of
  metadata and of the built-in kinds the operator writes (``validation.py``), the API server's defaults of those
  kinds (``defaults.py``: a Deployment's strategy and pod template, a Service's ports, cluster IP and node
  ports, ...) and their unknown fields (dropped with a ``Warning`` header, or refused with
  ``fieldValidation=Strict``; an apply that has one fails, ``schema.py``, ``store.py``), protobuf bodies of a
  few core kinds (``protobuf.py``, for imperative ``kubectl create``), ``/scale`` (``scale.py``) - absent in kmock.

Server-side apply: ``PATCH`` with ``application/apply-patch+yaml`` (a YAML or JSON body) and the
required ``fieldManager``; ``force=true``; on the object and its ``/status``; creates the object when
absent (201). Every write records ``metadata.managedFields``: an Apply entry per applying manager
(exactly the fields it applied), an Update entry per other writer (the fields its POST/PUT/PATCH
set or changed; the manager is ``fieldManager`` or the User-Agent's first word). A field another
manager owns with a different value is a 409 Conflict naming the field and the manager, unless
``force`` (the applier takes it over); a field the applier applied before and no longer does is
removed unless another manager owns it too. Simplified, compared with a real API server:

* list semantics: maps are walked, lists are atomic except the keyed lists of the built-in kinds
  that patching.MERGE_KEYS names (containers by name, ports by port and protocol, env, volumes,
  conditions, ...) and the set ``metadata.finalizers``; a custom resource's lists are atomic except
  ownerReferences/finalizers (x-kubernetes-list-type/-map-keys of the CRD are not read);
* ownership comes from the applied configuration as sent: defaulted fields are not owned, pruned
  ones are dropped from the set; ``null`` values in an applied configuration are ignored;
* conflicts are found only between equal paths (not between a leaf and fields under it);
  managedFields sent by a client replace the stored ones only on updates (as kubectl's
  client-side-to-server-side upgrade does), never on create; no ``application/apply-patch+cbor``,
  no apply on ``/scale``; a resourceVersion in an applied configuration is a precondition only
  when the object exists.

Test controls (not part of the Kubernetes API, never logged): ``GET /_emulator/healthz``;
``GET``/``DELETE /_emulator/requests`` (the request log: method, path, query, contentType, action,
group, version, resource, namespace, name, subresource, userAgent); ``POST /_emulator/compact``
(forget the watch history: older resourceVersions get 410); ``POST /_emulator/drop-watches`` (every
open watch stream is cut without a final chunk, as when a connection or an apiserver goes away);
``POST /_emulator/faults`` with
``{"method": "PATCH", "path": "regex", "code": 500, "reason": "...", "message": "...", "times": 1,
"retryAfter": 2, "after": false}`` (the next ``times`` matching API requests fail with that Status;
-1 = forever; ``retryAfter``: a Retry-After header and details.retryAfterSeconds; ``after``: the
request is carried out first, then answered with the fault - a write whose success is lost; not for
watches) and ``DELETE /_emulator/faults``.
"""
import argparse
import asyncio
import base64
import json
import re
import signal
import sys
import traceback
from typing import Any

import aiohttp.web
import attrs
import kmock
import yaml
from kmock._internal import apps, enums, rendering

from . import cel, patching, protobuf, scale, tables, watch
from .errors import ApiError
from .resources import Registry, ResourceDef
from .selectors import parse_field_selector, parse_label_selector
from .store import Store

VERSION = {'major': '1', 'minor': '32', 'gitVersion': 'v1.32.0-emulator', 'gitCommit': '0' * 40,
           'gitTreeState': 'clean', 'buildDate': '2025-01-01T00:00:00Z', 'goVersion': 'go1.23',
           'compiler': 'gc', 'platform': 'linux/amd64'}
CRD_RD = ('apiextensions.k8s.io', 'v1', 'customresourcedefinitions')
# The stores that set ReturnDeletedObject (a DELETE answers the object; the others and custom resources,
# apiextensions' customresource store, answer a Status): pkg/registry/core/{pod,service,serviceaccount,
# namespace}/storage, pkg/registry/storage/{storageclass,volumeattributesclass}/storage.
RETURNS_DELETED_OBJECT = {('', 'pods'), ('', 'services'), ('', 'serviceaccounts'), ('', 'namespaces'),
                          ('storage.k8s.io', 'storageclasses'), ('storage.k8s.io', 'volumeattributesclasses')}


def parse_path(path: str) -> dict[str, Any] | None:
    """Split an API path into group, version, plural, namespace, name, subresource."""
    parts = [p for p in path.split('/') if p]
    if len(parts) >= 2 and parts[0] == 'api':
        group, version, rest = '', parts[1], parts[2:]
    elif len(parts) >= 3 and parts[0] == 'apis':
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    watch_prefix = rest[:1] == ['watch']
    rest = rest[1:] if watch_prefix else rest
    namespace = None
    if rest[:1] == ['namespaces'] and len(rest) >= 3 and rest[2] not in ('status', 'finalize'):
        namespace, rest = rest[1], rest[2:]
    return {'group': group, 'version': version, 'plural': rest[0] if rest else None, 'namespace': namespace,
            'name': rest[1] if len(rest) > 1 else None, 'subresource': '/'.join(rest[2:]) or None,
            'watch': watch_prefix}


def _no_constant(name: str) -> Any:
    """A real API server's JSON decoder (Go's) has no NaN or Infinity: a body that writes one is refused."""
    raise ValueError(f"invalid character {name[0]!r} looking for beginning of value ({name} is not JSON)")


def json_response(data: Any, status: int = 200) -> aiohttp.web.Response:
    return aiohttp.web.Response(body=json.dumps(data).encode(), status=status, content_type='application/json')


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    history_size: int = 10000
    bookmark_interval: float = 5.0
    registry: Registry = attrs.field(init=False)
    store: Store = attrs.field(init=False)
    faults: list[dict[str, Any]] = attrs.field(factory=list, init=False)  # see POST /_emulator/faults
    _codes: dict[int, int] = attrs.field(factory=dict, init=False)  # request id -> the status answered
    server_address: str = '127.0.0.1:6443'

    def __attrs_post_init__(self) -> None:
        # Deliberately not calling super(): kmock's fallback reactions are replaced by _serve().
        self.registry = Registry()
        self.store = Store(self.registry, self.history_size)
        self.store.schedule = lambda delay, fn: asyncio.get_running_loop().call_later(delay, fn)

    # --- Python-level helpers ---------------------------------------------------------------

    def load_crd(self, crd: dict[str, Any]) -> dict[str, Any]:
        rd = self.registry.get(*CRD_RD)
        assert rd is not None
        name = (crd.get('metadata') or {}).get('name', '')
        if self.store.objects.get(self.store.key(rd, None, name)):
            return self.store.update(rd, None, name, {**crd, 'metadata': {**crd['metadata'], 'resourceVersion': None}})
        return self.store.create(rd, None, crd)

    def load_crd_file(self, path: str) -> None:
        with open(path, encoding='utf-8') as f:
            for doc in yaml.safe_load_all(f):
                if doc and doc.get('kind') == 'CustomResourceDefinition':
                    self.load_crd(doc)
                elif doc:
                    raise ValueError(f'{path}: not a CustomResourceDefinition: {doc.get("kind")}')

    # --- HTTP plumbing ------------------------------------------------------------------------

    async def __call__(self, raw: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        body = await raw.read()
        request = None
        try:
            request = self._parse_request(raw, body)
            if not raw.path.startswith('/_emulator/'):
                self._requests.append(request)
            response = await self._handle(request)
            self._codes[request.id] = response.status
            return response
        except ApiError as e:
            if request is not None:
                self._codes[request.id] = e.code
            response = json_response(e.status(), e.code)
            response.headers.update(getattr(e, 'headers', None) or {})
            return response
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            if self._errors:
                self._errors[-1].append(e)
            return json_response(ApiError(500, 'InternalError', f'emulator failure: {e!r}').status(), 500)

    def _parse_request(self, raw: aiohttp.web.BaseRequest, body: bytes) -> rendering.Request:
        target = parse_path(raw.path) or {}
        text = body.decode('utf-8', errors='replace')
        ctype = raw.headers.get('Content-Type', '').split(';')[0].strip().lower()
        data: Any = None
        if body and 'protobuf' in ctype:
            data = protobuf.decode(body)  # a few core kinds (kubectl create namespace/configmap/secret)
        elif body and ('yaml' in ctype):
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ApiError.bad_request(f'invalid YAML body: {e}')
        elif body:
            try:
                data = json.loads(text, parse_constant=_no_constant)
            except ValueError as e:
                raise ApiError.bad_request(f'invalid JSON body: {e}')
        query = dict(raw.query)
        name, method = target.get('name'), raw.method.upper()
        is_watch = target.get('watch') or query.get('watch') in ('true', '1')
        action = (enums.action.WATCH if method == 'GET' and is_watch else
                  enums.action.FETCH if method == 'GET' and name else enums.action.LIST if method == 'GET' else
                  enums.action.CREATE if method == 'POST' else enums.action.DELETE if method == 'DELETE' else
                  enums.action.UPDATE if method in ('PUT', 'PATCH') else None) if target else None
        resource = kmock.resource(group=target['group'], version=target['version'], plural=target['plural']) \
            if target.get('plural') else None
        return rendering.Request(
            id=len(self._requests), raw_request=raw, url=raw.url, method=raw.method, params=query,
            headers=dict(raw.headers), cookies=dict(raw.cookies), body=body, text=text, data=data,
            action=action, resource=resource, namespace=target.get('namespace'), name=name,
            subresource=target.get('subresource'))

    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        try:  # Reactions added through kmock's DSL win over the emulation (fault injection).
            return await apps.RawHandler._handle(self, request)
        except NotImplementedError:
            return await self._serve(request)

    # --- routing --------------------------------------------------------------------------------

    async def _serve(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        path, method = raw.path.rstrip('/') or '/', raw.method.upper()
        accept = raw.headers.get('Accept', '')
        if path.startswith('/openapi/'):  # no OpenAPI: kubectl needs --validate=false
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        if accept and 'json' not in accept and '*/*' not in accept and 'yaml' not in accept:
            raise ApiError(406, 'NotAcceptable', f'only application/json is served, not {accept!r}')
        if path.startswith('/_emulator/'):
            return self._serve_control(path, method, request.data)
        after = self._inject_faults(method, path)
        if after is not None:  # the request is carried out, then answered with the fault
            await self._serve_api(request, raw, path, method)
            raise after
        return await self._serve_api(request, raw, path, method)

    async def _serve_api(self, request: rendering.Request, raw: aiohttp.web.BaseRequest, path: str,
                         method: str) -> aiohttp.web.StreamResponse:
        if method == 'GET':
            if path in ('/healthz', '/livez', '/readyz'):
                return aiohttp.web.Response(text='ok')
            if path == '/version':
                return json_response(VERSION)
            if path == '/api':
                return json_response(self.registry.api_versions(self.server_address))
            if path == '/apis':
                return json_response(self.registry.api_group_list())
            parts = path.strip('/').split('/')
            if len(parts) == 2 and parts[0] == 'apis':
                group = self.registry.api_group(parts[1])
                if group is None:
                    raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
                return json_response(group)
        target = parse_path(path)
        if target is None:
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        if target['plural'] is None:
            doc = self.registry.resource_list(target['group'], target['version'])
            if doc is None or method != 'GET':
                raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
            return json_response(doc)
        rd = self.store.rd(target['group'], target['version'], target['plural'])
        namespace = target['namespace']
        if namespace and not rd.namespaced:
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        sub = target['subresource']
        if sub and (sub not in rd.subresources or sub not in ('status', 'scale')):
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        return await self._serve_resource(request, raw, rd, namespace, target['name'], sub, method)

    async def _serve_resource(self, request: rendering.Request, raw: aiohttp.web.BaseRequest, rd: ResourceDef,
                              namespace: str | None, name: str | None, sub: str | None,
                              method: str) -> aiohttp.web.StreamResponse:
        """A write carries its fieldValidation to the store and answers with its warnings."""
        options = {'POST': 'CreateOptions', 'PUT': 'UpdateOptions', 'PATCH': 'PatchOptions'}.get(method)
        if options is None:
            return await self._serve_object(request, raw, rd, namespace, name, sub, method)
        self.store.begin_write(request.params.get('fieldValidation'), options)
        try:
            response = await self._serve_object(request, raw, rd, namespace, name, sub, method)
        finally:
            warnings = self.store.end_write()
        for warning in warnings:
            response.headers.add('Warning', warning)
        return response

    async def _serve_object(self, request: rendering.Request, raw: aiohttp.web.BaseRequest, rd: ResourceDef,
                            namespace: str | None, name: str | None, sub: str | None,
                            method: str) -> aiohttp.web.StreamResponse:
        q = request.params
        dry_run = q.get('dryRun') == 'All'
        as_table = tables.wants_table(raw.headers.get('Accept'))
        if name is None:
            if method == 'GET':
                match = self._matcher(rd, q)
                if request.action == enums.action.WATCH:
                    return await watch.serve_watch(raw, self.store, rd, namespace, match, q, as_table,
                                                   self.bookmark_interval)
                return json_response(self._list(rd, namespace, match, q, as_table))
            if method == 'POST':
                if rd.namespaced and not namespace:
                    raise ApiError.method_not_allowed()
                return json_response(self.store.create(rd, namespace, request.data, dry_run,
                                                       manager=_field_manager(request)), 201)
            if method == 'DELETE':
                deleted = []
                for obj in self.store.list(rd, namespace, self._matcher(rd, q)):
                    meta = obj['metadata']
                    deleted.append(self.store.delete(rd, meta.get('namespace'), meta['name'],
                                                     self._delete_options(request), dry_run)[1])
                return json_response({'kind': rd.list_kind, 'apiVersion': rd.api_version,
                                      'metadata': {'resourceVersion': str(self.store.rv)}, 'items': deleted})
            raise ApiError.method_not_allowed()
        if rd.namespaced and not namespace:
            raise ApiError(404, 'NotFound', 'the server could not find the requested resource')
        if sub == 'scale':
            if method == 'GET':
                return json_response(scale.get_scale(self.store, rd, namespace, name))
            if method in ('PUT', 'PATCH'):
                ctype = raw.headers.get('Content-Type', '') if method == 'PATCH' else None
                return json_response(scale.write_scale(self.store, rd, namespace, name, request.data, ctype, dry_run))
            raise ApiError.method_not_allowed()
        if method == 'GET' and request.action == enums.action.WATCH:
            q = {**q, 'fieldSelector': ','.join(filter(None, [q.get('fieldSelector'), f'metadata.name={name}']))}
            return await watch.serve_watch(raw, self.store, rd, namespace, self._matcher(rd, q), q, as_table,
                                           self.bookmark_interval)
        if method == 'GET':
            obj = self.store.get(rd, namespace, name)
            if as_table:
                return json_response(tables.table(rd, [obj], obj['metadata']['resourceVersion'],
                                                  q.get('includeObject', 'Metadata')))
            return json_response(obj)
        if method == 'PUT':
            return json_response(self.store.update(rd, namespace, name, request.data, sub, dry_run,
                                                   manager=_field_manager(request)))
        if method == 'PATCH':
            ctype = raw.headers.get('Content-Type', '')
            force = q.get('force')
            if ctype.split(';')[0].strip().lower() == patching.APPLY:
                if force not in (None, 'true', 'false'):
                    raise ApiError.bad_request(f'invalid value for force: {force!r}')
                code, obj = self.store.apply(rd, namespace, name, request.data, q.get('fieldManager', ''),
                                             force == 'true', sub, dry_run)
                return json_response(obj, code)
            if force is not None:
                raise ApiError.invalid('PatchOptions.meta.k8s.io', '', [
                    ('force', 'Forbidden: may not be specified for non-apply patch')])
            return json_response(self.store.patch(rd, namespace, name, ctype, request.data, sub, dry_run,
                                                  manager=_field_manager(request)))
        if method == 'DELETE' and not sub:
            code, obj = self.store.delete(rd, namespace, name, self._delete_options(request), dry_run)
            if dry_run:
                gone = not self.store._blockers(rd, obj)
            else:
                gone = self.store.objects.get(self.store.key(rd, namespace, name)) is None
            if gone and (rd.group, rd.plural) not in RETURNS_DELETED_OBJECT:
                # generic registry Store.finalizeDelete: a Status naming the object (details.kind is the
                # resource; group omitted when empty). An object still held (finalizers): itself.
                details = {'name': name, 'group': rd.group, 'kind': rd.plural, 'uid': obj['metadata']['uid']}
                obj = {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Success',
                       'details': {k: v for k, v in details.items() if v}}
            return json_response(obj, code)
        raise ApiError.method_not_allowed()

    def _matcher(self, rd: ResourceDef, q: dict[str, str]) -> Any:
        labels = parse_label_selector(q.get('labelSelector'))
        fields = parse_field_selector(q.get('fieldSelector'), rd.plural, rd.selectable_fields)
        return lambda obj: labels(obj) and fields(obj)

    def _delete_options(self, request: rendering.Request) -> dict[str, Any]:
        options = dict(request.data) if isinstance(request.data, dict) else {}
        for key in ('propagationPolicy', 'gracePeriodSeconds', 'orphanDependents'):
            if key in request.params:
                options[key] = request.params[key] if key != 'orphanDependents' else \
                    request.params[key] == 'true'
        return options

    def _list(self, rd: ResourceDef, namespace: str | None, match: Any, q: dict[str, str],
              as_table: bool) -> dict[str, Any]:
        items = self.store.list(rd, namespace, match)
        rv = str(self.store.rv)
        meta: dict[str, Any] = {'resourceVersion': rv}
        if q.get('continue'):
            try:
                start = json.loads(base64.urlsafe_b64decode(q['continue']))['start']
            except (ValueError, KeyError, TypeError):
                raise ApiError.bad_request('invalid continue token')
            items = [o for o in items if [o['metadata'].get('namespace', ''), o['metadata']['name']] > start]
        limit = int(q.get('limit') or 0)
        if limit and len(items) > limit:
            last = items[limit - 1]['metadata']
            token = {'rv': rv, 'start': [last.get('namespace', ''), last['name']]}
            meta['continue'] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            meta['remainingItemCount'] = len(items) - limit
            items = items[:limit]
        if as_table:
            result = tables.table(rd, items, rv, q.get('includeObject', 'Metadata'))
            result['metadata'] = meta
            return result
        if not rd.custom:  # typed lists of a real server carry no apiVersion/kind in their items
            items = [{k: v for k, v in o.items() if k not in ('apiVersion', 'kind')} for o in items]
        return {'kind': rd.list_kind, 'apiVersion': rd.api_version, 'metadata': meta, 'items': items}

    def _inject_faults(self, method: str, path: str) -> ApiError | None:
        """Raise the first matching fault, or return it when it fires after the request is served."""
        for fault in self.faults:
            if fault['method'] in ('*', method) and re.search(fault['path'], path) and fault['times'] != 0:
                fault['times'] -= 1
                error = ApiError(fault['code'], fault['reason'], fault['message'])
                if fault.get('retryAfter') is not None:
                    error.details = {'retryAfterSeconds': fault['retryAfter']}
                    error.headers = {'Retry-After': str(fault['retryAfter'])}
                if fault.get('after'):
                    return error
                raise error
        return None

    def _serve_control(self, path: str, method: str, data: Any) -> aiohttp.web.Response:
        if path == '/_emulator/faults' and method == 'POST':
            if not isinstance(data, dict) or not isinstance(data.get('code'), int):
                raise ApiError.bad_request('a fault needs at least {"code": 500}')
            fault = {'method': str(data.get('method', '*')).upper(), 'path': data.get('path', ''),
                     'code': data['code'], 'reason': data.get('reason', 'InternalError'),
                     'message': data.get('message', 'injected by the emulator'), 'times': data.get('times', 1),
                     'retryAfter': data.get('retryAfter'), 'after': bool(data.get('after', False))}
            self.faults.append(fault)  # times: how many matching requests fail; -1 = all of them
            return json_response(fault, 201)
        if path == '/_emulator/faults' and method == 'DELETE':
            self.faults.clear()
            return json_response({'cleared': True})
        if path == '/_emulator/healthz' and method == 'GET':
            return json_response({'status': 'ok', 'resourceVersion': str(self.store.rv),
                                  'celValidation': cel.AVAILABLE})
        if path == '/_emulator/requests' and method == 'GET':
            return json_response([{**_describe(r), 'code': self._codes.get(r.id)} for r in self._requests])
        if path == '/_emulator/requests' and method == 'DELETE':
            count = len(self._requests)
            self._requests.clear()
            self._codes.clear()
            return json_response({'cleared': count})
        if path == '/_emulator/compact' and method == 'POST':
            self.store.compact()
            return json_response({'compactedResourceVersion': str(self.store.compacted_rv)})
        if path == '/_emulator/drop-watches' and method == 'POST':
            self.store.watch_epoch += 1
            return json_response({'watchEpoch': self.store.watch_epoch})
        raise ApiError(404, 'NotFound', f'no such emulator control endpoint: {method} {path}')


def _field_manager(request: rendering.Request) -> str:
    """The fieldManager query parameter, else the User-Agent's first word (``kubectl/v1.32 ...`` ->
    ``kubectl``), like a real API server."""
    agent = request.headers.get('User-Agent', '')
    return request.params.get('fieldManager') or agent.split('/')[0].strip()[:128] or 'unknown'


def _describe(request: rendering.Request) -> dict[str, Any]:
    raw = request._raw_request
    return {
        'method': str(request.method.value if request.method else ''), 'path': request.url.path,
        'query': dict(request.params), 'contentType': request.headers.get('Content-Type', ''),
        'action': request.action.value.lower() if request.action else None,
        'group': request.resource.group if request.resource else None,
        'version': request.resource.version if request.resource else None,
        'resource': request.resource.plural if request.resource else None,
        'namespace': request.namespace, 'name': request.name, 'subresource': request.subresource,
        'userAgent': raw.headers.get('User-Agent', '') if raw is not None else '',
    }


async def main_async(args: argparse.Namespace) -> None:
    emu = Emulator(history_size=args.history_size, bookmark_interval=args.bookmark_interval)
    for path in args.crd:
        emu.load_crd_file(path)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with emu, kmock.Server(emu, host=args.host, port=args.port) as server:
        url = str(server.url).rstrip('/')
        emu.server_address = url.split('://', 1)[1]
        print(f'READY {url}', flush=True)
        await stop.wait()
        emu.store.closed = True
        await asyncio.sleep(watch.TICK + 0.1)  # let open watches end cleanly


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog='python -m testbed.k8s.emulator', description=__doc__.split('\n')[1])
    parser.add_argument('--host', default='127.0.0.1')
    parser.add_argument('--port', type=int, default=0, help='0 picks a free port')
    parser.add_argument('--crd', action='append', default=[], help='a CRD YAML file to register (repeatable)')
    parser.add_argument('--history-size', type=int, default=10000, help='watch events kept for resuming')
    parser.add_argument('--bookmark-interval', type=float, default=5.0, help='seconds between BOOKMARKs')
    asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == '__main__':
    main()
