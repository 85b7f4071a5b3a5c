"""
Patch formats of the Kubernetes API: JSON merge patch (RFC 7386), strategic merge patch
(an approximation, see below) and JSON patch (RFC 6902, via the ``jsonpatch`` library that kopf
itself depends on).

Strategic merge patch: like a merge patch, plus the ``patchMergeKey`` lists of the built-in
types that matter in practice (containers, volumes, env, ports, conditions, ...) are merged item
by item, ``metadata.finalizers`` is merged as a set, and the directives ``$patch``
(``delete``/``replace``/``merge``), ``$retainKeys``, ``$setElementOrder/<field>`` and
``$deleteFromPrimitiveList/<field>`` are honoured (ordering directives are only stripped).
Custom resources reject it with 415, exactly like a real API server.

Server-side apply's building blocks live here too (field sets in the ``managedFields.fieldsV1``
form, the apply merge, removing a field); ``store.Store.apply`` uses them.
"""
import copy
import json
from typing import Any

import jsonpatch
import jsonpointer

from .errors import ApiError

MERGE = 'application/merge-patch+json'
STRATEGIC = 'application/strategic-merge-patch+json'
JSON_PATCH = 'application/json-patch+json'
APPLY = 'application/apply-patch+yaml'
APPLY_CBOR = 'application/apply-patch+cbor'

# field name -> merge key (for lists of objects merged item by item).
MERGE_KEYS: dict[str, str] = {
    'containers': 'name', 'initContainers': 'name', 'ephemeralContainers': 'name',
    'volumes': 'name', 'env': 'name', 'envFrom': '', 'volumeMounts': 'mountPath',
    'volumeDevices': 'devicePath', 'imagePullSecrets': 'name', 'hostAliases': 'ip',
    'topologySpreadConstraints': 'topologyKey', 'conditions': 'type', 'ownerReferences': 'uid',
    'readinessGates': 'conditionType', 'resourceClaims': 'name', 'subsets': '',
}
# Lists of primitives merged as sets.
SET_LISTS = {'finalizers'}
# Server-side apply's keys of ports (listMapKeys): containerPort or port, and protocol, which has a default.
KEY_DEFAULTS = {'protocol': 'TCP'}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: dicts merge recursively, ``null`` removes a key, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get('$patch') == 'replace':
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != '$patch'}
    if patch.get('$patch') == 'delete':
        return None
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    retain = patch.get('$retainKeys')
    for key, value in patch.items():
        if key.startswith('$setElementOrder/') or key in ('$retainKeys', '$patch'):
            continue
        if key.startswith('$deleteFromPrimitiveList/'):
            field = key.split('/', 1)[1]
            if isinstance(result.get(field), list):
                result[field] = [item for item in result[field] if item not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_list(key, result[key], value)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(field: str, current: list[Any], patch: list[Any]) -> list[Any]:
    if field in SET_LISTS:
        return current + [item for item in patch if item not in current]
    key = MERGE_KEYS.get(field)
    if field == 'ports' and all(isinstance(i, dict) for i in current + patch):
        key = 'containerPort' if any('containerPort' in i for i in current + patch) else 'port'
    if not key or not all(isinstance(i, dict) for i in current + patch):
        return [copy.deepcopy(item) for item in patch if not _is_directive(item)]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if item.get('$patch') == 'replace':  # the whole list is replaced
            return [copy.deepcopy(i) for i in patch if not _is_directive(i)]
        index = next((n for n, old in enumerate(result) if old.get(key) == item.get(key)), None)
        if item.get('$patch') == 'delete':
            if index is not None:
                del result[index]
        elif index is None:
            result.append(strategic_merge_patch({}, item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def _is_directive(item: Any) -> bool:
    return isinstance(item, dict) and '$patch' in item


def json_patch(target: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise ApiError.bad_request('json patch must be a list of operations')
    try:
        return jsonpatch.JsonPatch(ops).apply(copy.deepcopy(target))
    except jsonpatch.JsonPatchTestFailed as e:
        # A real API server answers 422 for a failed "test" op (kopf relies on it).
        raise ApiError(422, 'Invalid', f'the server rejected our request due to an error in our request: {e}')
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException, KeyError, TypeError) as e:
        raise ApiError(422, 'Invalid', f'the server rejected our request due to an error in our request: {e}')


def check_content_type(content_type: str, *, custom: bool) -> str:
    ctype = content_type.split(';')[0].strip().lower()
    if ctype == APPLY_CBOR:
        raise ApiError(415, 'UnsupportedMediaType',
                       f'{APPLY_CBOR} is not supported by this emulator; send server-side apply as {APPLY}')
    if ctype == APPLY:
        return ctype  # Store.apply
    if ctype == STRATEGIC and custom:
        raise ApiError(415, 'UnsupportedMediaType',
                       f'the body of the request was in an unknown format - accepted media types include: '
                       f'{JSON_PATCH}, {MERGE}, {APPLY}')
    if ctype not in (MERGE, STRATEGIC, JSON_PATCH):
        raise ApiError(415, 'UnsupportedMediaType',
                       f'the body of the request was in an unknown format - accepted media types include: '
                       f'{JSON_PATCH}, {MERGE}, {APPLY}, {STRATEGIC}')
    return ctype


def apply_patch(content_type: str, target: dict[str, Any], patch: Any, *, custom: bool) -> dict[str, Any]:
    ctype = check_content_type(content_type, custom=custom)
    if ctype == APPLY:
        raise ApiError(415, 'UnsupportedMediaType', 'server-side apply is not supported on this subresource by'
                                                    ' the emulator')
    if ctype == JSON_PATCH:
        result = json_patch(target, patch)
    elif not isinstance(patch, dict):
        raise ApiError.bad_request('the patch must be a JSON object')
    elif ctype == MERGE:
        result = merge_patch(target, patch)
    else:
        result = strategic_merge_patch(target, patch)
    if not isinstance(result, dict):
        raise ApiError(422, 'Invalid', 'the patch turned the object into a non-object')
    return result


# --- server-side apply: field sets (managedFields.fieldsV1) ----------------------------------------
#
# A field set is a dict {path: value}: a path is a tuple of fieldsV1 keys ('f:spec', 'f:replicas'),
# ('f:spec', 'f:containers', 'k:{"name":"app"}', '.') for a keyed list item itself, ('f:metadata',
# 'f:finalizers', 'v:"x"') for a member of a set list; the value is the leaf's value (None for '.').
# Maps are walked into (an empty map is a leaf), lists are atomic (one leaf) except the keyed lists
# of MERGE_KEYS and the sets of SET_LISTS - of built-in kinds; a custom resource's lists are atomic
# but for metadata.ownerReferences and metadata.finalizers (the CRD's x-kubernetes-list-type is not read).

Path = tuple[str, ...]
ITEM = '.'
# Never owned: identity and server-set metadata (structured-merge-diff strips them too).
UNOWNED_META = ('name', 'namespace', 'uid', 'resourceVersion', 'generation', 'creationTimestamp',
                'deletionTimestamp', 'deletionGracePeriodSeconds', 'managedFields', 'selfLink', 'generateName')


def _j(value: Any) -> str:
    return json.dumps(value, separators=(',', ':'), sort_keys=True)


def _list_keys(field: str, items: list[Any], custom: bool) -> list[str] | str | None:
    """'v' for a set list, the key fields of a keyed list, None for an atomic list."""
    if field in SET_LISTS and all(not isinstance(i, (dict, list)) for i in items):
        return 'v'
    if custom and field != 'ownerReferences':
        return None
    keys = [MERGE_KEYS[field]] if MERGE_KEYS.get(field) else []
    if field == 'ports' and items and all(isinstance(i, dict) for i in items):  # listMapKeys of both kinds
        keys = ['containerPort' if any('containerPort' in i for i in items) else 'port', 'protocol']
    if not keys or not all(isinstance(i, dict) and all(k in i or k in KEY_DEFAULTS for k in keys) for i in items):
        return None
    return keys


def _key_values(item: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """An item's key fields, a key it leaves out at its default (as structured-merge-diff reads
    a list map key that has a default: a port without ``protocol`` is the TCP one)."""
    return {k: item[k] if k in item else KEY_DEFAULTS[k] for k in keys}


def _item_key(item: dict[str, Any], keys: list[str]) -> str:
    return 'k:' + _j(_key_values(item, keys))


def item_selector(field: str, item: Any) -> str | None:
    """How server-side apply names an item of a keyed list in its errors, by its key fields sorted
    (``name="app"``, ``containerPort=8080,protocol="TCP"``); None for an item of another list."""
    keys = _list_keys(field, [item], custom=False)
    if not isinstance(keys, list):
        return None
    return ','.join(f'{k}={json.dumps(v)}' for k, v in sorted(_key_values(item, keys).items()))


def field_set(obj: dict[str, Any], custom: bool) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    _walk(obj, (), out, custom)
    return out


def _walk(value: dict[str, Any], prefix: Path, out: dict[Path, Any], custom: bool) -> None:
    for name, v in value.items():
        path = prefix + (f'f:{name}',)
        if v is None:  # null: absent
            continue
        if isinstance(v, dict) and v:
            _walk(v, path, out, custom)
            continue
        keys = _list_keys(name, v, custom) if isinstance(v, list) and v else None
        if keys == 'v':
            for item in v:
                out[path + ('v:' + _j(item),)] = item
        elif keys:
            for item in v:
                kp = path + (_item_key(item, list(keys)),)
                out[kp + (ITEM,)] = None
                _walk(item, kp, out, custom)
        else:
            out[path] = copy.deepcopy(v)


def ownable(obj: dict[str, Any], scope: str) -> dict[str, Any]:
    """The part of an object whose fields managers own: ``scope`` 'all', 'main' (a resource with a
    status subresource: everything but status) or 'status' (only status)."""
    if scope == 'status':
        return {'status': copy.deepcopy(obj['status'])} if isinstance(obj.get('status'), dict) else {}
    out = {k: copy.deepcopy(v) for k, v in obj.items()
           if k not in ('apiVersion', 'kind') and not (scope == 'main' and k == 'status')}
    if isinstance(out.get('metadata'), dict):
        out['metadata'] = {k: v for k, v in out['metadata'].items() if k not in UNOWNED_META}
        if not out['metadata']:
            del out['metadata']
    return out


def to_fields_v1(paths: Any) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path in sorted(paths):
        node = root
        for element in path:
            node = node.setdefault(element, {})
    return root


def from_fields_v1(fields: Any, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    if not isinstance(fields, dict):
        return out
    for key, child in fields.items():
        if key == ITEM or not child:
            out.add(prefix + (key,))
        else:
            out |= from_fields_v1(child, prefix + (key,))
    return out


def describe(path: Path) -> str:
    """A path as the API server prints it in conflicts: .spec.containers[name="app"].image"""
    text = ''
    for element in path:
        kind, _, rest = element.partition(':')
        if element == ITEM:
            continue
        if kind == 'f':
            text += f'.{rest}'
        elif kind == 'k':
            text += '[' + ','.join(f'{k}={json.dumps(v)}' for k, v in json.loads(rest).items()) + ']'
        elif kind == 'v':
            text += f'[={rest}]'
    return text or '.'


def apply_merge(live: Any, applied: Any, custom: bool) -> Any:
    """The live object with the applied configuration merged in: maps recursively, keyed lists item
    by item, set lists as a union, anything else (atomic lists, scalars) replaced."""
    if not isinstance(applied, dict) or not isinstance(live, dict):
        return copy.deepcopy(applied)
    result = copy.deepcopy(live)
    for name, value in applied.items():
        current = result.get(name)
        if isinstance(value, dict) and isinstance(current, dict):
            result[name] = apply_merge(current, value, custom)
        elif isinstance(value, list) and isinstance(current, list) and value:
            keys = _list_keys(name, value + current, custom)
            if keys == 'v':
                result[name] = current + [copy.deepcopy(i) for i in value if i not in current]
            elif keys:
                merged = list(current)
                for item in value:
                    index = next((n for n, old in enumerate(merged)
                                  if _item_key(old, list(keys)) == _item_key(item, list(keys))), None)
                    if index is None:
                        merged.append(copy.deepcopy(item))
                    else:
                        merged[index] = apply_merge(merged[index], item, custom)
                result[name] = merged
            else:
                result[name] = copy.deepcopy(value)
        else:
            result[name] = copy.deepcopy(value)
    return result


def remove_path(obj: dict[str, Any], path: Path) -> None:
    """Remove one owned field (a map key, a keyed list item with ITEM, a set member) if present,
    and the maps left empty above it."""
    _remove(obj, path)
    for n in range(len(path) - 1, 0, -1):
        parent: Any = obj
        for element in path[:n - 1]:
            parent = parent.get(element[2:]) if element.startswith('f:') and isinstance(parent, dict) else None
        last = path[n - 1]
        if not (isinstance(parent, dict) and last.startswith('f:') and parent.get(last[2:]) == {}):
            break
        del parent[last[2:]]


def _remove(obj: dict[str, Any], path: Path) -> None:
    node: Any = obj
    for n, element in enumerate(path[:-1]):
        kind, _, rest = element.partition(':')
        if element == ITEM:
            return
        if kind == 'f' and isinstance(node, dict):
            node = node.get(rest)
        elif kind == 'k' and isinstance(node, list):
            key = json.loads(rest)
            match = [i for i in node if isinstance(i, dict) and all(i.get(k) == v for k, v in key.items())]
            if path[n + 1] == ITEM:  # the item itself
                node[:] = [i for i in node if not any(i is m for m in match)]
                return
            node = match[0] if match else None
        else:
            return
        if node is None:
            return
    last = path[-1]
    kind, _, rest = last.partition(':')
    if kind == 'f' and isinstance(node, dict):
        node.pop(rest, None)
    elif kind == 'v' and isinstance(node, list):
        value = json.loads(rest)
        node[:] = [i for i in node if i != value]
