"""
Server-side printing: ``Accept: application/json;as=Table;v=v1;g=meta.k8s.io`` turns a get, list or
watch event into a ``meta.k8s.io/v1`` Table. Custom resources use their additionalPrinterColumns
(JSONPath subset: ``.a.b``, ``.a[0]``, ``.a['x.y']``, ``.a[?(@.k=="v")].b``; types string, integer,
number, boolean, date - dates rendered as ages like the API server's own convertor does);
built-ins get NAME (+ a few well-known extras) + AGE.
"""
import datetime
import re
from typing import Any

from .resources import ResourceDef

_NAME_COLUMN = {'name': 'Name', 'type': 'string', 'format': 'name', 'priority': 0,
                'description': 'Name must be unique within a namespace. '
                               'More info: http://kubernetes.io/docs/user-guide/identifiers#names'}
_AGE = {'name': 'Age', 'type': 'date', 'jsonPath': '.metadata.creationTimestamp',
        'description': 'CreationTimestamp is a timestamp representing the server time when this object was created.'}
# Extra built-in columns: plural -> [(column, type, jsonpath or callable)].
_BUILTIN: dict[str, list[tuple[str, str, Any]]] = {
    'namespaces': [('Status', 'string', '.status.phase')],
    'configmaps': [('Data', 'integer', lambda o: len(o.get('data') or {}) + len(o.get('binaryData') or {}))],
    'secrets': [('Type', 'string', '.type'), ('Data', 'integer', lambda o: len(o.get('data') or {}))],
    'deployments': [('Ready', 'string', lambda o: f'{(o.get("status") or {}).get("readyReplicas", 0)}/'
                                                  f'{(o.get("spec") or {}).get("replicas", 1)}'),
                    ('Up-to-date', 'integer', lambda o: (o.get('status') or {}).get('updatedReplicas', 0)),
                    ('Available', 'integer', lambda o: (o.get('status') or {}).get('availableReplicas', 0))],
    'pods': [('Status', 'string', '.status.phase')],
    'services': [('Type', 'string', '.spec.type'), ('Cluster-IP', 'string', '.spec.clusterIP')],
    'leases': [('Holder', 'string', '.spec.holderIdentity')],
}


def wants_table(accept: str | None) -> bool:
    if not accept:
        return False
    first = accept.split(',')[0]
    return 'as=Table' in first and 'g=meta.k8s.io' in first


def jsonpath(obj: Any, path: str) -> list[Any]:
    """Evaluate the JSONPath subset used by printer columns; returns all matches."""
    tokens = re.findall(r"\.([A-Za-z0-9_\-$]+)|\[(\d+|\*)\]|\['([^']*)'\]|\[\?\(@\.([A-Za-z0-9_.]+)\s*==\s*"
                        r"[\"']?([^\"')]*)[\"']?\)\]", path.strip().strip('{}'))
    values = [obj]
    for field, index, quoted, fkey, fvalue in tokens:
        nxt: list[Any] = []
        for value in values:
            if field or quoted:
                key = field or quoted
                if isinstance(value, dict) and key in value:
                    nxt.append(value[key])
            elif index == '*':
                nxt.extend(value if isinstance(value, list) else list(value.values()) if isinstance(value, dict) else [])
            elif index:
                if isinstance(value, list) and int(index) < len(value):
                    nxt.append(value[int(index)])
            elif fkey:
                for item in value if isinstance(value, list) else []:
                    current: Any = item
                    for part in fkey.split('.'):
                        current = current.get(part) if isinstance(current, dict) else None
                    if current is not None and str(current) == fvalue:
                        nxt.append(item)
        values = nxt
    return values


def human_duration(seconds: float) -> str:
    """Port of k8s.io/apimachinery/pkg/util/duration.HumanDuration."""
    s = int(seconds)
    if s < -1:
        return '<invalid>'
    if s < 0:
        return '0s'
    if s < 120:
        return f'{s}s'
    minutes = s // 60
    if minutes < 10:
        return f'{minutes}m' if s % 60 == 0 else f'{minutes}m{s % 60}s'
    if minutes < 180:
        return f'{minutes}m'
    hours = s // 3600
    if hours < 8:
        return f'{hours}h' if minutes % 60 == 0 else f'{hours}h{minutes % 60}m'
    if hours < 48:
        return f'{hours}h'
    if hours < 24 * 8:
        return f'{hours // 24}d' if hours % 24 == 0 else f'{hours // 24}d{hours % 24}h'
    if hours < 24 * 365 * 2:
        return f'{hours // 24}d'
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f'{hours // 24 // 365}y' if days == 0 else f'{hours // 24 // 365}y{days}d'
    return f'{hours // 24 // 365}y'


def _age(timestamp: Any) -> str:
    if not isinstance(timestamp, str):
        return '<unknown>'
    try:
        then = datetime.datetime.fromisoformat(timestamp.replace('Z', '+00:00'))
    except ValueError:
        return '<invalid>'
    return human_duration((datetime.datetime.now(datetime.UTC) - then).total_seconds())


def _cell(column_type: str, value: Any) -> Any:
    if value is None:
        return None
    if column_type == 'date':
        return _age(value)
    if column_type == 'integer':
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if column_type == 'number':
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if column_type == 'boolean':
        return value if isinstance(value, bool) else None
    return value if isinstance(value, str) else str(value) if not isinstance(value, (dict, list)) else None


def _columns(rd: ResourceDef) -> list[tuple[dict[str, Any], Any]]:
    if rd.printer_columns is not None:
        return [({'name': c['name'], 'type': c.get('type', 'string'), 'format': c.get('format', ''),
                  'description': c.get('description', ''), 'priority': c.get('priority', 0)}, c['jsonPath'])
                for c in rd.printer_columns]
    extra = [({'name': n, 'type': t, 'format': '', 'description': '', 'priority': 0}, p)
             for n, t, p in _BUILTIN.get(rd.plural, [])]
    age = {k: v for k, v in _AGE.items() if k != 'jsonPath'} | {'format': '', 'priority': 0}
    return extra + [(age, _AGE['jsonPath'])]


def table(rd: ResourceDef, objects: list[dict[str, Any]], resource_version: str,
          include_object: str = 'Metadata', headers: bool = True) -> dict[str, Any]:
    columns = _columns(rd)
    rows = []
    for obj in objects:
        cells: list[Any] = [obj['metadata']['name']]
        for column, path in columns:
            if callable(path):
                cells.append(path(obj))
            else:
                found = jsonpath(obj, path)
                cells.append(_cell(column['type'], found[0] if found else None))
        row: dict[str, Any] = {'cells': cells}
        if include_object == 'Object':
            row['object'] = obj
        elif include_object != 'None':
            row['object'] = {'kind': 'PartialObjectMetadata', 'apiVersion': 'meta.k8s.io/v1',
                             'metadata': obj['metadata']}
        rows.append(row)
    result: dict[str, Any] = {'kind': 'Table', 'apiVersion': 'meta.k8s.io/v1',
                              'metadata': {'resourceVersion': resource_version}}
    if headers:
        result['columnDefinitions'] = [_NAME_COLUMN] + [column for column, _ in columns]
    result['rows'] = rows
    return result
