"""
Structural-schema handling for custom resources, like the API server does it on every write:
defaulting (``default``), pruning of unknown fields (unless ``x-kubernetes-preserve-unknown-fields``)
and the common OpenAPI validations (type, nullable, enum, required, minimum/maximum, exclusive
bounds, minLength/maxLength, pattern, minItems/maxItems, maxProperties/minProperties,
x-kubernetes-int-or-string, x-kubernetes-embedded-resource) and CEL rules (``x-kubernetes-validations``,
see cel.py). Not done: ``format`` checks, ``anyOf``/``oneOf``/``not``, list-type/map-keys uniqueness,
validation ratcheting. A write that fails validation is a 422 Invalid, with causes.
"""
import copy
import functools
import json
import re
from typing import Any, Callable

from . import cel

_TYPES = {
    'object': dict, 'array': list, 'string': str, 'boolean': bool,
}


def prune_and_default(obj: dict[str, Any], schema: dict[str, Any] | None) -> dict[str, Any]:
    """Return a copy with unknown fields removed and defaults filled (metadata/apiVersion/kind kept)."""
    if not schema:
        return obj
    result = copy.deepcopy(obj)
    props = schema.get('properties') or {}
    for key in list(result):
        if key in ('apiVersion', 'kind', 'metadata'):
            continue
        if key in props:
            result[key] = _prune(result[key], props[key])
        elif not schema.get('x-kubernetes-preserve-unknown-fields'):
            del result[key]
    _apply_defaults(result, schema, root=True)
    return result


def _prune(value: Any, schema: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        if schema.get('x-kubernetes-embedded-resource'):
            keep = {'apiVersion', 'kind', 'metadata'}
        else:
            keep = set()
        props = schema.get('properties')
        addl = schema.get('additionalProperties')
        if props is not None:
            for key in list(value):
                if key in props:
                    value[key] = _prune(value[key], props[key])
                elif key in keep or schema.get('x-kubernetes-preserve-unknown-fields'):
                    continue
                elif isinstance(addl, dict):
                    value[key] = _prune(value[key], addl)
                else:
                    del value[key]
        elif isinstance(addl, dict):
            for key in list(value):
                value[key] = _prune(value[key], addl)
        elif not schema.get('x-kubernetes-preserve-unknown-fields') and schema.get('type') == 'object':
            for key in list(value):
                if key not in keep:
                    del value[key]
        _apply_defaults(value, schema)
    elif isinstance(value, list) and isinstance(schema.get('items'), dict):
        return [_prune(item, schema['items']) for item in value]
    return value


def _apply_defaults(value: dict[str, Any], schema: dict[str, Any], root: bool = False) -> None:
    for key, sub in (schema.get('properties') or {}).items():
        if root and key in ('apiVersion', 'kind', 'metadata'):
            continue
        if key not in value and 'default' in sub:
            value[key] = _prune(copy.deepcopy(sub['default']), sub)


def validate(obj: dict[str, Any], schema: dict[str, Any] | None,
             old: dict[str, Any] | None = None) -> list[tuple[str, str]]:
    """Return (field path, message) pairs; empty when valid. ``old``: the stored object on updates."""
    if not schema:
        return []
    errors: list[tuple[str, str]] = []
    for key, sub in (schema.get('properties') or {}).items():
        if key in ('apiVersion', 'kind', 'metadata'):
            continue
        if key in obj:
            _validate(obj[key], sub, key, errors, *_old_of(old, key))
    for key in schema.get('required') or []:
        if key not in obj:
            errors.append((key, 'Required value'))
    if not errors:
        cel.check(schema.get('x-kubernetes-validations') or [], obj, '<root>', old, old is not None, errors)
    return errors


def _old_of(old: Any, key: str) -> tuple[Any, bool]:
    return (old[key], True) if isinstance(old, dict) and key in old else (None, False)


def _type_name(value: Any) -> str:
    if value is None:
        return 'null'
    if isinstance(value, bool):
        return 'boolean'
    if isinstance(value, int):
        return 'integer'
    if isinstance(value, float):
        return 'number'
    if isinstance(value, str):
        return 'string'
    if isinstance(value, list):
        return 'array'
    return 'object'


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    expected = schema.get('type')
    if schema.get('x-kubernetes-int-or-string'):
        return isinstance(value, (int, str)) and not isinstance(value, bool)
    if expected is None:
        return True
    if expected == 'integer':
        return isinstance(value, int) and not isinstance(value, bool) or (
            isinstance(value, float) and value.is_integer())
    if expected == 'number':
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES.get(expected, object))


def _validate(value: Any, schema: dict[str, Any], path: str, errors: list[tuple[str, str]],
              old: Any = None, has_old: bool = False) -> None:
    start = len(errors)
    if value is None:
        if not schema.get('nullable') and schema.get('type'):
            errors.append((path, f'Invalid value: "null": {path} in body must be of type {schema["type"]}: "null"'))
        return
    if not _type_ok(value, schema):
        errors.append((path, f'Invalid value: "{_type_name(value)}": {path} in body must be of type '
                             f'{schema.get("type", "int-or-string")}: "{_type_name(value)}"'))
        return
    if 'enum' in schema and value not in schema['enum']:
        allowed = ', '.join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema['enum'])
        errors.append((path, f'Unsupported value: {value!r}: supported values: {allowed}'))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if 'minimum' in schema:
            bad = value <= schema['minimum'] if schema.get('exclusiveMinimum') else value < schema['minimum']
            if bad:
                errors.append((path, f'Invalid value: {value}: {path} in body should be greater than or equal '
                                     f'to {schema["minimum"]}'))
        if 'maximum' in schema:
            bad = value >= schema['maximum'] if schema.get('exclusiveMaximum') else value > schema['maximum']
            if bad:
                errors.append((path, f'Invalid value: {value}: {path} in body should be less than or equal '
                                     f'to {schema["maximum"]}'))
    if isinstance(value, str):
        if 'minLength' in schema and len(value) < schema['minLength']:
            errors.append((path, f'Invalid value: "{value}": {path} in body should be at least '
                                 f'{schema["minLength"]} chars long'))
        if 'maxLength' in schema and len(value) > schema['maxLength']:
            errors.append((path, f'Too long: may not be more than {schema["maxLength"]} bytes'))
        if 'pattern' in schema and not re.search(schema['pattern'], value):
            errors.append((path, f'Invalid value: "{value}": {path} in body should match \'{schema["pattern"]}\''))
    if isinstance(value, list):
        if 'minItems' in schema and len(value) < schema['minItems']:
            errors.append((path, f'Invalid value: {len(value)}: {path} in body should have at least '
                                 f'{schema["minItems"]} items'))
        if 'maxItems' in schema and len(value) > schema['maxItems']:
            errors.append((path, f'Too many: {len(value)}: must have at most {schema["maxItems"]} items'))
        if isinstance(schema.get('items'), dict):
            for n, item in enumerate(value):
                _validate(item, schema['items'], f'{path}[{n}]', errors)
    if isinstance(value, dict):
        if 'minProperties' in schema and len(value) < schema['minProperties']:
            errors.append((path, f'Invalid value: {len(value)}: {path} in body should have at least '
                                 f'{schema["minProperties"]} properties'))
        if 'maxProperties' in schema and len(value) > schema['maxProperties']:
            errors.append((path, f'Too many: {len(value)}: must have at most {schema["maxProperties"]} items'))
        props = schema.get('properties') or {}
        for key, sub in props.items():
            if key in value:
                _validate(value[key], sub, f'{path}.{key}', errors, *_old_of(old if has_old else None, key))
        addl = schema.get('additionalProperties')
        if isinstance(addl, dict):
            for key, item in value.items():
                if key not in props:
                    _validate(item, addl, f'{path}.{key}', errors, *_old_of(old if has_old else None, key))
        for key in schema.get('required') or []:
            if key not in value:
                errors.append((f'{path}.{key}', 'Required value'))
    if len(errors) == start:  # like a real server: rules run only on otherwise valid values
        cel.check(schema.get('x-kubernetes-validations') or [], value, path, old, has_old, errors)


# Built-in kinds whose writes are checked against the upstream OpenAPI schema, as an API server
# does; their unknown fields are dropped (``unknown_fields``; store.py warns about them or refuses
# them as the request's fieldValidation asks). Pods are left out: the kubelet stand-in writes them
# often, and the operator never does.
BUILTIN_VALIDATED = {'ConfigMap', 'Service', 'ServiceAccount', 'Deployment', 'Role', 'RoleBinding',
                     'PodDisruptionBudget', 'HorizontalPodAutoscaler'}
KUBERNETES_VERSION = '1.30'


def validate_builtin(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(field path, message) of the first schema violation of a built-in kind; empty when valid."""
    if obj.get('kind') not in BUILTIN_VALIDATED:
        return []
    import jsonschema

    try:
        _builtin_validator(str(obj.get('apiVersion', '')), str(obj['kind'])).validate(obj)
    except jsonschema.ValidationError as e:
        path = '.'.join(f'[{p}]' if isinstance(p, int) else str(p) for p in e.path).replace('.[', '[')
        return [(path or '<root>', f'Invalid value: {e.message}')]
    return []


@functools.lru_cache(maxsize=None)
def _builtin_schema(api_version: str, kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """kubernetes-validate's schema of one kind and the definitions it refers to, read once."""
    from kubernetes_validate import utils

    wanted = utils.major_minor(KUBERNETES_VERSION)
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= wanted][-1]
    folder = f'kubernetes-json-schema/v{version}-local'
    group = re.sub(r'^([^./]*)(?:\.[^/]*)?/', r'\1-', api_version)
    schema = utils.schema_contents(f'{folder}/{kind.lower()}-{group}.json', KUBERNETES_VERSION)
    return schema, utils.schema_contents(f'{folder}/_definitions.json', KUBERNETES_VERSION)


@functools.lru_cache(maxsize=None)
def _builtin_validator(api_version: str, kind: str) -> Any:
    """The schema of one kind, compiled once (kubernetes-validate's ``validate`` parses the JSON
    files on every call: most of the emulator's CPU under a burst of writes)."""
    import jsonschema
    from referencing import Registry, Resource

    schema, definitions = _builtin_schema(api_version, kind)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


Path = list[str | int]


def unknown_fields(obj: dict[str, Any], prune: bool = False) -> list[Path]:
    """The fields of a built-in kind (``BUILTIN_VALIDATED``) that its schema does not declare, as
    paths (keys and list indexes); with ``prune``, removed from ``obj`` as a server's decoding
    drops them. Values of the wrong type are left to the validation."""
    if obj.get('kind') not in BUILTIN_VALIDATED:
        return []
    schema, definitions = _builtin_schema(str(obj.get('apiVersion', '')), str(obj['kind']))
    found: list[Path] = []
    _unknown(obj, schema, definitions['$defs'], [], found, prune)
    return found


def _unknown(value: Any, node: dict[str, Any], defs: dict[str, Any], path: Path, found: list[Path],
             prune: bool) -> None:
    while '$ref' in node:
        node = defs[node['$ref'].rsplit('/', 1)[-1]]
    props, addl = node.get('properties'), node.get('additionalProperties')
    if isinstance(value, dict) and (props is not None or isinstance(addl, dict)):
        for key in list(value):
            sub = (props or {}).get(key, addl)
            if isinstance(sub, dict):
                _unknown(value[key], sub, defs, [*path, key], found, prune)
            elif not node.get('x-kubernetes-preserve-unknown-fields'):
                found.append([*path, key])
                if prune:
                    del value[key]
    elif isinstance(value, list) and isinstance(node.get('items'), dict):
        for n, item in enumerate(value):
            _unknown(item, node['items'], defs, [*path, n], found, prune)


def json_path(path: Path) -> str:
    """``spec.template.spec.containers[0].foo``, as a server's strict decoding names a field."""
    return ''.join(f'[{p}]' if isinstance(p, int) else f'.{p}' for p in path).lstrip('.')


def typed_path(obj: Any, path: Path, selector: Callable[[str, Any], str | None]) -> str:
    """``.spec.template.spec.containers[name="app"].foo``, as server-side apply names a field: an
    item of a keyed list by its keys (``selector(list field, item)``), else by index."""
    out, parent = '', ''
    for part in path:
        if isinstance(part, int):
            item = obj[part] if isinstance(obj, list) else None
            keys = selector(parent, item)
            out += f'[{keys}]' if keys else f'[{part}]'
            obj = item
        else:
            out += f'.{part}'
            obj, parent = obj.get(part) if isinstance(obj, dict) else None, part
    return out

