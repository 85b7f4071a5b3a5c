"""
``resource.Quantity`` as the API server reads and writes it: a written quantity is parsed (a bad
one fails the decoding of the whole object: 400) and stored and served in canonical form, so
``1024Mi`` comes back as ``1Gi``, ``0.5`` as ``500m`` and ``1.5Gi`` as ``1536Mi``.

The rules, from apimachinery's ``pkg/api/resource``: the suffix picks the format (binary ``Ki``..
``Ei``, decimal ``n``..``E`` or none, or a decimal exponent ``e3``/``E3``) and the format is kept;
the value is kept exactly down to nano (finer values round away from zero, ``0.9n`` is ``1n``) and
re-expressed with the largest suffix of its format that leaves an integer (``1500`` is ``1500``,
``2000`` is ``2k``, ``1.5`` is ``1500m``); a binary value below 1024 in magnitude or not a whole
number is written as a decimal one (``0.5Ki`` is ``512``); binary values are capped at 2^63-1; zero
is ``0``. A few strings the parser's fast path recognises as canonical are kept as sent (``+1``,
``1E3``), as the server does. JSON numbers are read from their text (``0.5`` is ``500m``). The
values of a ResourceList (requests, limits, overhead, a quota's hard limits) are first rounded up,
away from zero, to milli units by the server's defaulting: ``100u`` and ``1n`` are ``1m``.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable

from .errors import ApiError

SPLIT_RE = r'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'  # quoted in the server's error message
FORMAT_WRONG = f"quantities must match the regular expression '{SPLIT_RE}'"
NUMERIC = 'unable to parse numeric part of quantity'
SUFFIX = "unable to parse quantity's suffix"
_DECIMAL = {'n': -9, 'u': -6, 'm': -3, '': 0, 'k': 3, 'M': 6, 'G': 9, 'T': 12, 'P': 15, 'E': 18}
_BINARY = {'Ki': 10, 'Mi': 20, 'Gi': 30, 'Ti': 40, 'Pi': 50, 'Ei': 60}
_DECIMAL_SUFFIX = {e: s for s, e in _DECIMAL.items()}
_BINARY_SUFFIX = ['', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei']
_MAX_BINARY = 2**63 - 1
_SUFFIX_CHARS = set('eEinumkKMGTP')


class QuantityError(ValueError):
    """Not a quantity; the message is the API server's."""


@dataclasses.dataclass(frozen=True)
class Quantity:
    mantissa: int  # value = mantissa * 10**exponent, exact to the nano
    exponent: int
    format: str  # 'BinarySI', 'DecimalSI' or 'DecimalExponent'
    text: str = ''  # kept as sent when the server keeps it (its parser's canonical fast path)

    def __str__(self) -> str:
        return self.text or _canonical(self)


def _split(text: str) -> tuple[bool, str, str, str, str]:
    """apimachinery's parseQuantityString: (positive, value, numerator, denominator, suffix)."""
    positive, pos, end = True, 0, len(text)
    if text[:1] in ('-', '+'):
        positive, pos = text[0] == '+', 1
    while pos < end and text[pos] == '0':
        pos += 1
    if pos >= end:
        return positive, '0', '0', '', ''
    start = pos
    while pos < end and text[pos].isdigit():
        pos += 1
    num, denom = text[start:pos] or '0', ''
    if pos < end and text[pos] == '.':
        start = pos = pos + 1
        while pos < end and text[pos].isdigit():
            pos += 1
        denom = text[start:pos]
        if pos >= end:
            return positive, text, num, denom, ''
    value, suffix_start = text[:pos], pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in '+-':
        pos += 1
    while pos < end and text[pos].isdigit():
        pos += 1
    if pos < end:
        raise QuantityError(FORMAT_WRONG)
    return positive, value, num, denom, text[suffix_start:]


def _interpret(suffix: str) -> tuple[int, int, str]:
    """(base, exponent, format) of a suffix."""
    if suffix in _DECIMAL:
        return 10, _DECIMAL[suffix], 'DecimalSI'
    if suffix in _BINARY:
        return 2, _BINARY[suffix], 'BinarySI'
    if len(suffix) > 1 and suffix[0] in 'eE' and re.fullmatch(r'[+-]?[0-9]+', suffix[1:]) \
            and -2**31 <= int(suffix[1:]) < 2**31:
        return 10, int(suffix[1:]), 'DecimalExponent'
    raise QuantityError(SUFFIX)


def parse(text: str) -> Quantity:
    """A quantity string, as ParseQuantity reads it; QuantityError with the server's message."""
    if not text:
        raise QuantityError(FORMAT_WRONG)
    if text == '0':
        return Quantity(0, 0, 'DecimalSI', '0')
    positive, _, num, denom, suffix = _split(text)
    base, exponent, fmt = _interpret(suffix)
    digits = int(num + denom)
    if _kept_as_sent(num, denom, exponent, fmt):
        return Quantity((1 if positive else -1) * digits * (2**exponent if base == 2 else 1),
                        exponent - len(denom) if base == 10 else 0, fmt, text)
    if base == 2:
        mantissa, scale = digits << exponent, -len(denom)
    else:
        mantissa, scale = digits, exponent - len(denom)
    if scale < -9 and mantissa:  # kept to the nano, rounded away from zero
        shift = -9 - scale
        mantissa = 1 if shift > len(str(mantissa)) else -(-mantissa // 10**shift)
        scale = -9
    if fmt == 'BinarySI' and mantissa > _MAX_BINARY * 10**-scale:
        mantissa, scale = _MAX_BINARY, 0
    return Quantity(mantissa if positive else -mantissa, scale, fmt)


def _kept_as_sent(num: str, denom: str, exponent: int, fmt: str) -> bool:
    """Whether ParseQuantity's int64 fast path keeps the string it was given as the canonical one."""
    shifted = num + denom
    if fmt == 'BinarySI':
        precision = 15 - len(num) - int(exponent * 3 / 10) - 1 if not denom else -1
        return precision >= 0 and exponent % 10 == 0 and int(shifted) & 7 != 0
    scale = exponent - len(denom)
    return 18 - len(shifted) >= 0 and scale >= -9 and scale % 3 == 0 and not shifted.endswith('000') \
        and shifted[0] != '0'


def _canonical(q: Quantity) -> str:
    """CanonicalizeBytes: the largest suffix of the format that keeps an integer."""
    if q.mantissa == 0:
        return '0'
    fmt = q.format
    if fmt == 'BinarySI':
        whole = q.mantissa * 10**q.exponent if q.exponent >= 0 else None
        if q.exponent < 0 and q.mantissa % 10**-q.exponent == 0:
            whole = q.mantissa // 10**-q.exponent
        if whole is None or -1024 < whole < 1024:
            fmt = 'DecimalSI'
        else:
            power = 0
            while whole % 1024 == 0 and power < len(_BINARY_SUFFIX) - 1:
                whole, power = whole // 1024, power + 1
            return f'{whole}{_BINARY_SUFFIX[power]}'
    mantissa, exponent = q.mantissa, q.exponent
    while mantissa % 10 == 0:
        mantissa, exponent = mantissa // 10, exponent + 1
    while exponent % 3:
        mantissa, exponent = mantissa * 10, exponent - 1
    if fmt == 'DecimalSI' and exponent in _DECIMAL_SUFFIX:
        return f'{mantissa}{_DECIMAL_SUFFIX[exponent]}'
    return f'{mantissa}e{exponent}' if exponent else str(mantissa)


def round_up(q: Quantity, exponent: int = -3) -> Quantity:
    """Quantity.RoundUp: finer values rounded away from zero to ``10**exponent`` (the text kept as
    sent only when nothing was rounded)."""
    if q.exponent >= exponent:
        return q
    whole, rest = divmod(abs(q.mantissa), 10**(exponent - q.exponent))
    whole += 1 if rest else 0
    return Quantity(whole if q.mantissa >= 0 else -whole, exponent, q.format)


def canonical(value: Any, milli: bool = False) -> str:
    """The canonical form of a quantity as sent in JSON (a string or a number); ``milli``: an item
    of a ResourceList, which the server's defaulting rounds up to milli units first
    (SetDefaults_ResourceList in pkg/apis/core/v1/defaults.go: ``1n`` is ``1m``)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise QuantityError(FORMAT_WRONG)
    text = value.strip() if isinstance(value, str) else json.dumps(value)
    q = parse(text)
    return str(round_up(q) if milli else q)


# --- where built-in kinds hold quantities ---------------------------------------------------------

# Paths of a pod spec: ``[]`` is every item of a list, ``*`` every value of a map, ``?`` every field.
# A map's values (``*``) are those of a ResourceList: rounded up to milli units (``canonical``).
_POD_SPEC = ['containers[].resources.requests.*', 'containers[].resources.limits.*',
             'initContainers[].resources.requests.*', 'initContainers[].resources.limits.*',
             'containers[].env[].valueFrom.resourceFieldRef.divisor',
             'initContainers[].env[].valueFrom.resourceFieldRef.divisor',
             'volumes[].emptyDir.sizeLimit', 'volumes[].downwardAPI.items[].resourceFieldRef.divisor',
             'volumes[].projected.sources[].downwardAPI.items[].resourceFieldRef.divisor',
             'volumes[].ephemeral.volumeClaimTemplate.spec.resources.requests.*',
             'volumes[].ephemeral.volumeClaimTemplate.spec.resources.limits.*',
             'overhead.*', 'resources.requests.*', 'resources.limits.*']
_TEMPLATE = [f'spec.template.spec.{p}' for p in _POD_SPEC]
_CLAIM = ['spec.resources.requests.*', 'spec.resources.limits.*']
PATHS: dict[str, list[str]] = {
    'Pod': [f'spec.{p}' for p in _POD_SPEC],
    'PodTemplate': [f'template.spec.{p}' for p in _POD_SPEC],
    'Deployment': _TEMPLATE, 'ReplicaSet': _TEMPLATE, 'DaemonSet': _TEMPLATE, 'Job': _TEMPLATE,
    'ReplicationController': _TEMPLATE,
    'StatefulSet': _TEMPLATE + [f'spec.volumeClaimTemplates[].{p}' for p in _CLAIM],
    'CronJob': [f'spec.jobTemplate.spec.template.spec.{p}' for p in _POD_SPEC],
    'HorizontalPodAutoscaler': ['spec.metrics[].?.target.value', 'spec.metrics[].?.target.averageValue'],
    'PersistentVolumeClaim': _CLAIM,
    'ResourceQuota': ['spec.hard.*'],
    'LimitRange': [f'spec.limits[].{k}.*' for k in ('max', 'min', 'default', 'defaultRequest',
                                                     'maxLimitRequestRatio')],
}


def canonicalize(obj: dict[str, Any]) -> None:
    """Rewrite every quantity of a built-in object in canonical form, in place; a value that is not
    a quantity fails the request as the server's decoding does (400, naming the field too)."""
    for spec in PATHS.get(str(obj.get('kind')), ()):
        milli = spec.endswith('.*')
        _visit(obj, spec.split('.'), '', lambda holder, key, path: _rewrite(obj, holder, key, path, milli))


def _rewrite(obj: dict[str, Any], holder: Any, key: Any, path: str, milli: bool) -> None:
    value = holder[key]
    if value is None:
        return
    try:
        holder[key] = canonical(value, milli)
    except QuantityError as exc:
        version = str(obj.get('apiVersion', '')).rpartition('/')[2]
        raise ApiError.bad_request(f'{obj["kind"]} in version "{version}" cannot be handled as a {obj["kind"]}: '
                                   f'{exc} ({path}: {json.dumps(value)})') from None


def _visit(node: Any, parts: list[str], path: str, fn: Callable[[Any, Any, str], None]) -> None:
    part, rest = parts[0], parts[1:]
    if part in ('*', '?'):
        items = [(k, f'{path}[{k}]' if part == '*' else f'{path}.{k}') for k in node] if isinstance(node, dict) else []
    elif part.endswith('[]'):
        node = node.get(part[:-2]) if isinstance(node, dict) else None
        path = f'{path}.{part[:-2]}'.lstrip('.')
        items = [(n, f'{path}[{n}]') for n in range(len(node))] if isinstance(node, list) else []
    else:
        items = [(part, f'{path}.{part}'.lstrip('.'))] if isinstance(node, dict) and part in node else []
    for key, sub in items:
        if rest:
            _visit(node[key], rest, sub, fn)
        else:
            fn(node, key, sub)
