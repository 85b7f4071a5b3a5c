"""
CRD validation rules (``x-kubernetes-validations``), evaluated with ``cel-python`` (``celpy``) when it
is installed, plus the Kubernetes CEL list/string extensions that operators commonly use (``sum``,
``min``, ``max``, ``isSorted``, ``indexOf``, ``lowerAscii``, ``upperAscii``, ``trim``, ``join``).
Transition rules (those using ``oldSelf``) run on updates only, like a real server. Without celpy the
rules are skipped (``GET /_emulator/healthz`` reports ``celValidation: false``).
"""
import functools
import importlib.util
import sys
from typing import Any

AVAILABLE = importlib.util.find_spec('celpy') is not None  # imported lazily: it costs ~0.1 s
_warned = False


def _functions() -> dict[str, Any]:
    import celpy
    from celpy import celtypes
    wrap = celpy.json_to_cel
    return {
        'sum': lambda items: wrap(sum(items)) if items else celtypes.IntType(0),
        'min': lambda items: min(items), 'max': lambda items: max(items),
        'isSorted': lambda items: celtypes.BoolType(list(items) == sorted(items)),
        'indexOf': lambda items, x: celtypes.IntType(list(items).index(x) if x in items else -1),
        'lowerAscii': lambda s: celtypes.StringType(s.lower()),
        'upperAscii': lambda s: celtypes.StringType(s.upper()),
        'trim': lambda s: celtypes.StringType(s.strip()),
        'join': lambda items, sep=celtypes.StringType(''): celtypes.StringType(str(sep).join(items)),
    }


@functools.lru_cache(maxsize=512)
def _program(rule: str) -> Any:
    import celpy
    env = celpy.Environment()
    return env.program(env.compile(rule), functions=_functions())


def check(rules: list[dict[str, Any]], value: Any, path: str, old: Any, has_old: bool,
          errors: list[tuple[str, str]]) -> None:
    global _warned
    if not rules:
        return
    if not AVAILABLE:
        if not _warned:
            print('emulator: cel-python is not installed: x-kubernetes-validations are NOT enforced',
                  file=sys.stderr)
            _warned = True
        return
    import celpy
    for rule in rules:
        expr = rule.get('rule', '')
        if 'oldSelf' in expr and not has_old:
            continue  # transition rules apply to updates only
        activation = {'self': celpy.json_to_cel(value)}
        if has_old:
            activation['oldSelf'] = celpy.json_to_cel(old)
        field = path + (rule.get('fieldPath') or '')
        try:
            passed = bool(_program(expr).evaluate(activation))
        except Exception as e:  # compile errors, evaluation errors (no such key, ...)
            errors.append((field, f'Invalid value: "object": rule {expr!r} could not be evaluated: {e}'))
            continue
        if not passed:
            message = rule.get('message') or f'failed rule: {expr}'
            errors.append((field, f'Invalid value: "{_type_name(value)}": {message}'))


def _type_name(value: Any) -> str:
    return {dict: 'object', list: 'array', str: 'string', bool: 'boolean', int: 'integer',
            float: 'number'}.get(type(value), 'null')
