"""
The API server's own (Go) validation of objects, beyond the OpenAPI schemas of schema.py: object
metadata (names, label keys and values, annotation keys, ownerReferences) and, for the built-in
kinds the operator writes, the rules a schema cannot say (a Deployment's selector matching its
template, requests within limits, port ranges, replica bounds, immutable fields). Each problem is a
``(field, message)`` cause of a 422 Invalid, worded as the server's field errors.
"""

import json
import re
from decimal import Decimal
from typing import Any

from . import quantity
from .selectors import parse_label_selector

_SUBDOMAIN = r'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*'
_DNS1035 = r'[a-z]([-a-z0-9]*[a-z0-9])?'
_NAME_PART = r'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]'
_LABEL_VALUE = r'(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?'
_CONFIG_KEY = r'[-._a-zA-Z0-9]+'
SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and "
                 f"must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation "
                 f"is '{_SUBDOMAIN}')")
DNS1035_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
               f"character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
               f"validation is '{_DNS1035}')")
NAME_PART_MSG = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                 f"alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
                 f"'{_NAME_PART}')")
LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
                   "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
                   f"regex used for validation is '{_LABEL_VALUE}')")
CONFIG_KEY_MSG = ("a valid config key must consist of alphanumeric characters, '-', '_' or '.' (e.g. 'key.name',  or "
                  f"'KEY_NAME',  or 'key-name', regex used for validation is '{_CONFIG_KEY}')")
ANNOTATIONS_MAX_BYTES = 256 * 1024
Causes = list[tuple[str, str]]


def _go(value: Any) -> str:
    """A value as the server's field errors print it."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return 'map[string]string{' + ', '.join(f'{json.dumps(k)}:{json.dumps(v)}' for k, v in value.items()) + '}'
    return json.dumps(value, separators=(',', ':')) if isinstance(value, (dict, list)) else str(value)


def invalid(field: str, value: Any, detail: str) -> tuple[str, str]:
    return field, f'Invalid value: {_go(value)}: {detail}'


def qualified_name(key: str) -> list[str]:
    """IsQualifiedName: ``[prefix/]name``, the prefix a DNS subdomain, the name at most 63 chars."""
    parts = key.split('/')
    if len(parts) > 2:
        return ['a qualified name must consist of alphanumeric characters, \'-\', \'_\' or \'.\', and must start '
                'and end with an alphanumeric character (e.g. \'MyName\',  or \'my.name\',  or \'123-abc\', regex '
                f'used for validation is \'{_NAME_PART}\') with an optional DNS subdomain prefix and \'/\' (e.g. '
                '\'example.com/MyName\')']
    errors, name = [], parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append('prefix part must be non-empty')
        elif len(prefix) > 253:
            errors.append('prefix part must be no more than 253 characters')
        elif not re.fullmatch(_SUBDOMAIN, prefix):
            errors.append(f'prefix part {SUBDOMAIN_MSG}')
    if not name:
        errors.append('name part must be non-empty')
    elif len(name) > 63:
        errors.append('name part must be no more than 63 characters')
    elif not re.fullmatch(_NAME_PART, name):
        errors.append(NAME_PART_MSG)
    return errors


def label_value(value: Any) -> list[str]:
    if not isinstance(value, str):
        return [LABEL_VALUE_MSG]
    if len(value) > 63:
        return ['must be no more than 63 characters']
    return [] if re.fullmatch(_LABEL_VALUE, value) else [LABEL_VALUE_MSG]


def labels(values: Any, field: str) -> Causes:
    """ValidateLabels: keys are qualified names, values label values (also a nodeSelector)."""
    causes = []
    for key, value in (values or {}).items():
        causes += [invalid(field, key, msg) for msg in qualified_name(key)]
        causes += [invalid(field, value, msg) for msg in label_value(value)]
    return causes


def annotations(values: Any, field: str) -> Causes:
    """ValidateAnnotations: keys are qualified names (case aside), 256 KiB in all."""
    values = values or {}
    causes = [invalid(field, key, msg) for key in values for msg in qualified_name(key.lower())]
    if sum(len(k) + len(str(v)) for k, v in values.items()) > ANNOTATIONS_MAX_BYTES:
        causes.append((field, f'Too long: must have at most {ANNOTATIONS_MAX_BYTES} bytes'))
    return causes


def owner_references(refs: Any) -> Causes:
    field, causes = 'metadata.ownerReferences', []
    for ref in refs or []:
        version = str(ref.get('apiVersion') or '').rpartition('/')[2]
        if not version:
            causes.append(invalid(f'{field}.apiVersion', ref.get('apiVersion', ''), 'version must not be empty'))
        for key in ('kind', 'name', 'uid'):
            if not ref.get(key):
                causes.append(invalid(f'{field}.{key}', ref.get(key, ''), 'must not be empty'))
    controllers = [f'{r.get("kind")}/{r.get("name")}' for r in refs or [] if r.get('controller')]
    if len(controllers) > 1:
        causes.append(invalid(field, refs, 'Only one reference can have Controller set to true. Found "true" in '
                                           f'references for {" and ".join(controllers)}'))
    return causes


def meta(obj: dict[str, Any], name_rule: str) -> Causes:
    """ValidateObjectMeta; ``name_rule``: 'subdomain', 'label' (DNS-1123, no dots) or 'dns1035'."""
    m = obj['metadata']
    name = m.get('name', '')
    if name_rule == 'dns1035':
        if len(name) > 63 or not re.fullmatch(_DNS1035, name):
            return [invalid('metadata.name', name, DNS1035_MSG)]
    elif len(name) > (63 if name_rule == 'label' else 253) or not re.fullmatch(_SUBDOMAIN, name) \
            or (name_rule == 'label' and '.' in name):
        return [invalid('metadata.name', name, SUBDOMAIN_MSG)]
    return labels(m.get('labels'), 'metadata.labels') + annotations(m.get('annotations'), 'metadata.annotations') \
        + owner_references(m.get('ownerReferences'))


def config_keys(obj: dict[str, Any], sections: tuple[str, ...] = ('data', 'binaryData')) -> Causes:
    """ConfigMap and Secret keys."""
    causes = []
    for section in sections:
        for key in obj.get(section) or {}:
            field = f'{section}[{key}]'
            if not re.fullmatch(_CONFIG_KEY, key):
                causes.append(invalid(field, key, CONFIG_KEY_MSG))
            elif key in ('.', '..') or key.startswith('..'):
                causes.append(invalid(field, key, f"must not be '.'" if key == '.' else "must not start with '..'"))
    if len(sections) > 1:
        both = set(obj.get('data') or {}) & set(obj.get('binaryData') or {})
        causes += [invalid(f'data[{k}]', k, 'duplicate of key present in binaryData') for k in sorted(both)]
    return causes


def _selector_matches(selector: dict[str, Any], values: dict[str, str]) -> bool:
    parts = [f'{k}={v}' for k, v in (selector.get('matchLabels') or {}).items()]
    for expr in selector.get('matchExpressions') or []:
        key, op, vals = expr.get('key', ''), expr.get('operator', ''), ','.join(expr.get('values') or [])
        parts.append({'In': f'{key} in ({vals})', 'NotIn': f'{key} notin ({vals})', 'Exists': key,
                      'DoesNotExist': f'!{key}'}.get(op, key))
    return parse_label_selector(','.join(parts))({'metadata': {'labels': values}})


def _overcommit_allowed(resource: str) -> bool:
    """Native resources may request less than their limit; extended ones and hugepages may not."""
    native = '/' not in resource or resource.split('/')[0].endswith('kubernetes.io')
    return native and not resource.startswith('hugepages-')


def _amount(text: str) -> Decimal:
    q = quantity.parse(str(text))
    return Decimal(f'{q.mantissa}e{q.exponent}')


def resources(res: Any, field: str) -> Causes:
    causes = []
    requests, limits = (res or {}).get('requests') or {}, (res or {}).get('limits') or {}
    for kind, values in (('requests', requests), ('limits', limits)):
        causes += [invalid(f'{field}.{kind}[{name}]', value, 'must be greater than or equal to 0')
                   for name, value in values.items() if _amount(value) < 0]
    for name, value in requests.items():
        if name not in limits:
            continue
        request, limit = _amount(value), _amount(limits[name])
        if request != limit and not _overcommit_allowed(name):
            causes.append(invalid(f'{field}.requests', value, f'must be equal to {name} limit of {limits[name]}'))
        elif request > limit:
            causes.append(invalid(f'{field}.requests', value,
                                  f'must be less than or equal to {name} limit of {limits[name]}'))
    return causes


def pod_template(template: dict[str, Any], field: str) -> Causes:
    tmeta, spec = template.get('metadata') or {}, template.get('spec') or {}
    causes = labels(tmeta.get('labels'), f'{field}.metadata.labels')
    causes += annotations(tmeta.get('annotations'), f'{field}.metadata.annotations')
    causes += labels(spec.get('nodeSelector'), f'{field}.spec.nodeSelector')
    for section in ('initContainers', 'containers'):
        for n, container in enumerate(spec.get(section) or []):
            where = f'{field}.spec.{section}[{n}]'
            if not container.get('image'):
                causes.append((f'{where}.image', 'Required value'))
            causes += resources(container.get('resources'), f'{where}.resources')
    return causes


def deployment(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    spec = obj.get('spec') or {}
    causes = []
    if (spec.get('replicas') or 0) < 0:
        causes.append(invalid('spec.replicas', spec['replicas'], 'must be greater than or equal to 0'))
    selector, template = spec.get('selector'), spec.get('template') or {}
    if selector is None:
        causes.append(('spec.selector', 'Required value'))
    elif not selector.get('matchLabels') and not selector.get('matchExpressions'):
        causes.append(invalid('spec.selector', selector, 'empty selector is invalid for deployment'))
    elif not _selector_matches(selector, (template.get('metadata') or {}).get('labels') or {}):
        causes.append(invalid('spec.template.metadata.labels', (template.get('metadata') or {}).get('labels') or {},
                              '`selector` does not match template `labels`'))
    causes += labels((selector or {}).get('matchLabels'), 'spec.selector.matchLabels')
    causes += pod_template(template, 'spec.template')
    if old is not None and (old.get('spec') or {}).get('selector') != selector:
        causes.append(invalid('spec.selector', selector, 'field is immutable'))
    return causes


def _go_strings(values: Any) -> str:
    """A []string as the server's field errors print it (Go's %#v)."""
    if not values:
        return '[]string(nil)'
    return '[]string{' + ', '.join(json.dumps(v) for v in values) + '}'


def service(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    spec, causes = obj.get('spec') or {}, []
    node_ports: set[tuple[Any, Any]] = set()
    for n, port in enumerate(spec.get('ports') or []):
        for key in ('port', 'targetPort'):
            value = port.get(key)
            if isinstance(value, int) and not 1 <= value <= 65535:
                causes.append(invalid(f'spec.ports[{n}].{key}', value, 'must be between 1 and 65535, inclusive'))
        if port.get('nodePort') and spec.get('type') == 'ClusterIP':
            causes.append((f'spec.ports[{n}].nodePort', "Forbidden: may not be used when `type` is 'ClusterIP'"))
        elif port.get('nodePort'):
            if (port.get('protocol'), port['nodePort']) in node_ports:
                causes.append((f'spec.ports[{n}].nodePort', f'Duplicate value: {port["nodePort"]}'))
            node_ports.add((port.get('protocol'), port['nodePort']))
    if old is not None:
        causes += _cluster_ips_update(old.get('spec') or {}, spec)
    return causes


def _cluster_ips_update(old: dict[str, Any], new: dict[str, Any]) -> Causes:
    """validateUpgradeDowngradeClusterIPs (ValidateServiceUpdate): the allocated cluster IPs may not
    change (nor become or stop being "None"), but to or from an ExternalName Service."""
    if 'ExternalName' in (old.get('type'), new.get('type')) or old.get('clusterIP') == new.get('clusterIP') == 'None':
        return []
    before, after = old.get('clusterIPs') or [], new.get('clusterIPs') or []
    field, shown = 'spec.clusterIPs[0]', _go_strings(after)
    if len(before) == len(after):
        return [(field, f'Invalid value: {shown}: may not change once set') for a, b in zip(before, after) if a != b]
    if len(before) > len(after):
        causes = [] if after else [(field, f'Invalid value: {shown}: primary clusterIP can not be unset')]
        if after and after[0] != before[0]:
            causes.append((field, f'Invalid value: {shown}: may not change once set'))
        if len(after) == 1 and new.get('ipFamilyPolicy') != 'SingleStack':
            causes.append((field, f"Invalid value: {shown}: `ipFamilyPolicy` must be set to 'SingleStack' when "
                                  'releasing the secondary clusterIP'))
        return causes
    return [(field, f'Invalid value: {shown}: may not change once set')] if before and after[0] != before[0] else []


def hpa(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    spec, causes = obj.get('spec') or {}, []
    low, high = spec.get('minReplicas'), spec.get('maxReplicas', 0)
    if low is not None and low < 1:
        causes.append(invalid('spec.minReplicas', low, 'must be greater than or equal to 1'))
    if high < 1:
        causes.append(invalid('spec.maxReplicas', high, 'must be greater than 0'))
    if low is not None and high < low:
        causes.append(invalid('spec.maxReplicas', high, 'must be greater than or equal to `minReplicas`'))
    return causes


def pdb(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    spec = obj.get('spec') or {}
    if spec.get('minAvailable') is not None and spec.get('maxUnavailable') is not None:
        return [invalid('spec', spec, 'minAvailable and maxUnavailable cannot be both set')]
    return []


def role_binding(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    if old is not None and old.get('roleRef') != obj.get('roleRef'):
        return [invalid('roleRef', obj.get('roleRef'), 'cannot change roleRef')]
    return []


KINDS = {
    'Deployment': deployment, 'Service': service, 'HorizontalPodAutoscaler': hpa, 'PodDisruptionBudget': pdb,
    'RoleBinding': role_binding, 'ConfigMap': lambda obj, old: config_keys(obj),
}


def validate(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    """The kind's own rules (objects that passed their schema); ``old``: the stored object on updates."""
    check = KINDS.get(str(obj.get('kind')))
    return check(obj, old) if check else []
