"""Small helpers shared by the emulator's own tests (raw watches, objects)."""
import http.client
import itertools
import json
import urllib.parse
from typing import Any

from testbed.k8s.harness import EmulatorProcess

WIDGETS = '/apis/example.io/v1/namespaces/{ns}/widgets'
CONFIGMAPS = '/api/v1/namespaces/{ns}/configmaps'
_counter = itertools.count(1)


def unique(prefix: str) -> str:
    return f'{prefix}-{next(_counter)}'


def widget(name: str, size: int = 1, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {'apiVersion': 'example.io/v1', 'kind': 'Widget', 'metadata': {'name': name},
                            'spec': {'size': size}}
    for key, value in extra.items():
        if key in ('labels', 'finalizers', 'ownerReferences', 'annotations'):
            body['metadata'][key] = value
        else:
            body[key] = value
    return body


def configmap(name: str, data: dict[str, str] | None = None, **meta: Any) -> dict[str, Any]:
    return {'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': {'name': name, **meta}, 'data': data or {}}


def ok(result: tuple[int, Any], *codes: int) -> Any:
    status, body = result
    assert status in (codes or (200, 201)), (status, body)
    return body


def watch(emu: EmulatorProcess, path: str, params: dict[str, str], max_events: int | None = None,
          timeout: float = 10.0, headers: dict[str, str] | None = None) -> tuple[http.client.HTTPResponse, list]:
    """Open a raw watch and read events until EOF or ``max_events``; returns (response, events)."""
    parsed = urllib.parse.urlparse(emu.url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
    conn.request('GET', path + '?' + urllib.parse.urlencode({'watch': 'true', **params}), headers=headers or {})
    rsp = conn.getresponse()
    events = []
    try:
        while max_events is None or len(events) < max_events:
            line = rsp.readline()
            if not line:
                break
            if line.strip():
                events.append(json.loads(line))
    finally:
        conn.close()
    return rsp, events


def create_namespace(emu: EmulatorProcess, name: str) -> str:
    ok(emu.request('POST', '/api/v1/namespaces', {'apiVersion': 'v1', 'kind': 'Namespace',
                                                   'metadata': {'name': name}}), 201)
    return name
