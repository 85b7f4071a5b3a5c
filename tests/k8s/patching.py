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
"""
import copy
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
    if ctype in (APPLY, APPLY_CBOR):
        raise ApiError(415, 'UnsupportedMediaType',
                       'server-side apply (application/apply-patch+yaml) is not supported by this emulator;'
                       ' use client-side kubectl apply, merge or JSON patches')
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
