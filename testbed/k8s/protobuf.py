"""
A minimal decoder of Kubernetes protobuf request bodies (``application/vnd.kubernetes.protobuf``),
for the imperative kubectl commands that send them: ``kubectl create namespace``, ``create
configmap``, ``create secret``, ``create serviceaccount``. The envelope is ``k8s\\0`` +
``runtime.Unknown{typeMeta, raw}``; ``raw`` is decoded with the field numbers of
k8s.io/api/core/v1/generated.proto. Other kinds get a 415 that names the kind.
"""
import base64
import datetime
from typing import Any

from .errors import ApiError

MAGIC = b'k8s\x00'
Schema = dict[int, tuple[str, str]]

TYPE_META: Schema = {1: ('apiVersion', 'string'), 2: ('kind', 'string')}
UNKNOWN: Schema = {1: ('typeMeta', 'message:TypeMeta'), 2: ('raw', 'bytes'), 3: ('contentEncoding', 'string'),
                   4: ('contentType', 'string')}
TIME: Schema = {1: ('seconds', 'int'), 2: ('nanos', 'int')}
OWNER_REFERENCE: Schema = {1: ('kind', 'string'), 3: ('name', 'string'), 4: ('uid', 'string'),
                           5: ('apiVersion', 'string'), 6: ('controller', 'bool'), 7: ('blockOwnerDeletion', 'bool')}
OBJECT_META: Schema = {
    1: ('name', 'string'), 2: ('generateName', 'string'), 3: ('namespace', 'string'), 5: ('uid', 'string'),
    6: ('resourceVersion', 'string'), 7: ('generation', 'int'), 8: ('creationTimestamp', 'time'),
    9: ('deletionTimestamp', 'time'), 10: ('deletionGracePeriodSeconds', 'int'), 11: ('labels', 'map:string'),
    12: ('annotations', 'map:string'), 13: ('ownerReferences', 'repeated:OwnerReference'),
    14: ('finalizers', 'repeated:string'),
}
LOCAL_OBJECT_REFERENCE: Schema = {1: ('name', 'string')}
KINDS: dict[str, Schema] = {
    'ConfigMap': {1: ('metadata', 'message:ObjectMeta'), 2: ('data', 'map:string'), 3: ('binaryData', 'map:bytes'),
                  4: ('immutable', 'bool')},
    'Secret': {1: ('metadata', 'message:ObjectMeta'), 2: ('data', 'map:bytes'), 3: ('type', 'string'),
               4: ('stringData', 'map:string'), 5: ('immutable', 'bool')},
    'Namespace': {1: ('metadata', 'message:ObjectMeta'), 2: ('spec', 'message:NamespaceSpec')},
    'ServiceAccount': {1: ('metadata', 'message:ObjectMeta'), 3: ('imagePullSecrets', 'repeated:LocalObjectReference'),
                       4: ('automountServiceAccountToken', 'bool')},
}
MESSAGES: dict[str, Schema] = {
    'TypeMeta': TYPE_META, 'ObjectMeta': OBJECT_META, 'OwnerReference': OWNER_REFERENCE,
    'NamespaceSpec': {1: ('finalizers', 'repeated:string')}, 'LocalObjectReference': LOCAL_OBJECT_REFERENCE,
}


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def _fields(data: bytes) -> list[tuple[int, Any]]:
    fields, pos = [], 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise ValueError(f'unsupported protobuf wire type {wire}')
        fields.append((number, value))
    return fields


def _scalar(kind: str, value: Any) -> Any:
    if kind == 'string':
        return value.decode('utf-8')
    if kind == 'bytes':
        return value
    if kind == 'int':
        return value - (1 << 64) if value >= 1 << 63 else value
    if kind == 'bool':
        return bool(value)
    if kind == 'time':
        seconds = decode_message(value, TIME).get('seconds', 0)
        return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ')
    return decode_message(value, MESSAGES[kind.split(':', 1)[1]])


def decode_message(data: bytes, schema: Schema) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for number, value in _fields(data):
        if number not in schema:
            continue
        name, kind = schema[number]
        if kind.startswith('map:'):
            entry = dict(_fields(value))
            item = entry.get(2, b'')
            item = base64.b64encode(item).decode() if kind == 'map:bytes' else item.decode('utf-8')
            result.setdefault(name, {})[entry.get(1, b'').decode('utf-8')] = item
        elif kind.startswith('repeated:'):
            inner = kind.split(':', 1)[1]
            result.setdefault(name, []).append(_scalar(inner if inner in ('string', 'int', 'bool') else
                                                        f'message:{inner}', value))
        else:
            result[name] = _scalar(kind, value)
    # Go's non-pointer strings are always encoded; in JSON they are omitted when empty.
    return {k: v for k, v in result.items() if v != ''}


def decode(body: bytes) -> dict[str, Any]:
    """Decode a protobuf-encoded object into its JSON form; 415 for kinds not known here."""
    if not body.startswith(MAGIC):
        raise ApiError(415, 'UnsupportedMediaType', 'a protobuf body must start with the k8s\\0 magic')
    try:
        unknown = decode_message(body[len(MAGIC):], {**UNKNOWN, 1: ('typeMeta', 'message:TypeMeta')})
    except (ValueError, IndexError) as e:
        raise ApiError.bad_request(f'invalid protobuf body: {e}')
    type_meta = unknown.get('typeMeta') or {}
    kind = type_meta.get('kind', '')
    if kind not in KINDS:
        raise ApiError(415, 'UnsupportedMediaType', f'protobuf bodies of kind {kind!r} are not supported by this'
                                                    f' emulator; send JSON (e.g. kubectl apply/create -f)')
    try:
        obj = decode_message(unknown.get('raw', b''), KINDS[kind])
    except (ValueError, IndexError, KeyError) as e:
        raise ApiError.bad_request(f'invalid protobuf body: {e}')
    return {'apiVersion': type_meta.get('apiVersion', 'v1'), 'kind': kind, **obj}
