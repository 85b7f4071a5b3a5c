"""
The ``/scale`` subresource (autoscaling/v1 Scale) of Deployments, ReplicaSets, StatefulSets,
ReplicationControllers and of CRDs that declare ``subresources.scale`` (specReplicasPath,
statusReplicasPath, labelSelectorPath). ``kubectl scale`` uses it.
"""
import copy
from typing import Any

from . import patching
from .errors import ApiError
from .resources import ResourceDef
from .store import Store

BUILTIN = {'specReplicasPath': '.spec.replicas', 'statusReplicasPath': '.status.replicas'}


def _get(obj: dict[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.strip('.').split('.'):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _set(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.strip('.').split('.')
    for part in parts[:-1]:
        obj = obj.setdefault(part, {})
    obj[parts[-1]] = value


def _paths(rd: ResourceDef) -> dict[str, str]:
    return rd.scale_paths or BUILTIN


def _selector(rd: ResourceDef, obj: dict[str, Any]) -> str | None:
    if rd.scale_paths:
        path = rd.scale_paths.get('labelSelectorPath')
        return _get(obj, path) if path else None
    labels = _get(obj, '.spec.selector.matchLabels') or _get(obj, '.spec.selector') or {}
    return ','.join(f'{k}={v}' for k, v in sorted(labels.items()) if isinstance(v, str)) or None


def get_scale(store: Store, rd: ResourceDef, namespace: str | None, name: str) -> dict[str, Any]:
    obj = store.find(rd, namespace, name)
    meta = obj['metadata']
    scale: dict[str, Any] = {
        'kind': 'Scale', 'apiVersion': 'autoscaling/v1',
        'metadata': {k: meta[k] for k in ('name', 'namespace', 'uid', 'resourceVersion', 'creationTimestamp')
                     if k in meta},
        'spec': {'replicas': _get(obj, _paths(rd)['specReplicasPath']) or 0},
        'status': {'replicas': _get(obj, _paths(rd)['statusReplicasPath']) or 0},
    }
    selector = _selector(rd, obj)
    if selector:
        scale['status']['selector'] = selector
    return scale


def write_scale(store: Store, rd: ResourceDef, namespace: str | None, name: str, body: Any,
                content_type: str | None, dry_run: bool = False) -> dict[str, Any]:
    """PUT (content_type None) or PATCH the Scale; only spec.replicas is taken over."""
    current = get_scale(store, rd, namespace, name)
    new = patching.apply_patch(content_type, current, body, custom=True) if content_type else body
    if not isinstance(new, dict):
        raise ApiError.bad_request('the request body must be a Scale object')
    replicas = (new.get('spec') or {}).get('replicas')
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ApiError.invalid('Scale.autoscaling', name, [('spec.replicas', f'Invalid value: {replicas!r}: must be'
                                                                             ' greater than or equal to 0')])
    obj = copy.deepcopy(store.find(rd, namespace, name))
    obj['metadata']['resourceVersion'] = (new.get('metadata') or {}).get('resourceVersion') or \
        obj['metadata']['resourceVersion']
    _set(obj, _paths(rd)['specReplicasPath'], replicas)
    store.update(rd, namespace, name, obj, dry_run=dry_run)
    return get_scale(store, rd, namespace, name) if not dry_run else {**current, 'spec': {'replicas': replicas}}
