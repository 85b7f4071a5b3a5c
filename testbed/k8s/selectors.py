"""
Label selectors (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``, ``>``/``<``) and field
selectors (``=``, ``==``, ``!=``; comma means AND), parsed like the API server does: invalid syntax
or an unsupported field label is a 400 BadRequest.
"""
import re
from typing import Any, Callable

from .errors import ApiError

Matcher = Callable[[dict[str, Any]], bool]

_KEY = r'[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?'
_VALUE = r'([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?'

# Field labels a real server accepts besides metadata.name/metadata.namespace (per plural).
EXTRA_FIELDS: dict[str, set[str]] = {
    'pods': {'spec.nodeName', 'spec.restartPolicy', 'spec.schedulerName', 'spec.serviceAccountName',
             'spec.hostNetwork', 'status.phase', 'status.podIP', 'status.nominatedNodeName'},
    'events': {'involvedObject.kind', 'involvedObject.namespace', 'involvedObject.name',
               'involvedObject.uid', 'involvedObject.apiVersion', 'involvedObject.resourceVersion',
               'involvedObject.fieldPath', 'reason', 'reportingComponent', 'source', 'type',
               'regarding.kind', 'regarding.name', 'regarding.namespace', 'regarding.uid'},
    'secrets': {'type'},
    'namespaces': {'status.phase'},
    'nodes': {'spec.unschedulable'},
    'jobs': {'status.successful'},
    'replicasets': {'status.replicas'},
    'replicationcontrollers': {'status.replicas'},
}


def _split_top(text: str) -> list[str]:
    """Split by commas that are not inside parentheses."""
    parts, depth, current = [], 0, ''
    for char in text:
        if char == '(':
            depth += 1
        elif char == ')':
            depth -= 1
        if char == ',' and depth == 0:
            parts.append(current)
            current = ''
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str | None) -> Matcher:
    if not text:
        return lambda obj: True
    checks: list[Callable[[dict[str, str]], bool]] = []
    for req in _split_top(text):
        checks.append(_parse_requirement(req))

    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get('metadata') or {}).get('labels') or {}
        return all(check(labels) for check in checks)
    return match


def _parse_requirement(req: str) -> Callable[[dict[str, str]], bool]:
    m = re.fullmatch(rf'({_KEY})\s+(in|notin)\s+\(([^)]*)\)', req)
    if m:
        key, op = m.group(1), m.group(3)
        values = {v.strip() for v in m.group(4).split(',')}
        if any(v and not re.fullmatch(_VALUE, v) for v in values):
            raise _bad_label(req)
        if op == 'in':
            return lambda labels: key in labels and labels[key] in values
        return lambda labels: key not in labels or labels[key] not in values
    m = re.fullmatch(rf'({_KEY})\s*(==|=|!=|>|<)\s*(.*)', req)
    if m:
        key, op, value = m.group(1), m.group(3), m.group(4).strip()
        if op in '<>':
            if not re.fullmatch(r'-?\d+', value):
                raise _bad_label(req)
            num = int(value)
            if op == '>':
                return lambda labels: key in labels and labels[key].lstrip('-').isdigit() and int(labels[key]) > num
            return lambda labels: key in labels and labels[key].lstrip('-').isdigit() and int(labels[key]) < num
        if not re.fullmatch(_VALUE, value):
            raise _bad_label(req)
        if op == '!=':
            return lambda labels: labels.get(key) != value
        return lambda labels: key in labels and labels[key] == value
    m = re.fullmatch(rf'(!?)\s*({_KEY})', req)
    if m:
        negate, key = bool(m.group(1)), m.group(2)
        return (lambda labels: key not in labels) if negate else (lambda labels: key in labels)
    raise _bad_label(req)


def _bad_label(req: str) -> ApiError:
    return ApiError.bad_request(f'unable to parse requirement: found {req!r}, invalid label selector')


def _field_value(obj: dict[str, Any], path: str) -> str:
    value: Any = obj
    for part in path.split('.'):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ''
    if isinstance(value, bool):
        return 'true' if value else 'false'
    return str(value)


def parse_field_selector(text: str | None, plural: str, extra_fields: set[str] | None = None) -> Matcher:
    if not text:
        return lambda obj: True
    allowed = {'metadata.name', 'metadata.namespace'} | EXTRA_FIELDS.get(plural, set()) | (extra_fields or set())
    checks: list[Matcher] = []
    for req in _split_top(text):
        m = re.fullmatch(r'([A-Za-z0-9_.\[\]]+)\s*(==|=|!=)\s*(.*)', req)
        if not m:
            raise ApiError.bad_request(f'invalid selector: {text!r}; can\'t understand {req!r}')
        field, op, value = m.group(1), m.group(2), m.group(3).strip()
        if field not in allowed:
            raise ApiError.bad_request(f'field label not supported: {field}')
        if op == '!=':
            checks.append(lambda obj, f=field, v=value: _field_value(obj, f) != v)
        else:
            checks.append(lambda obj, f=field, v=value: _field_value(obj, f) == v)
    return lambda obj: all(check(obj) for check in checks)
