"""
What a container's process is given by the kubelet stand-in (see ``kubelet.py``): its env, as a
real kubelet builds it (``envFrom``, then ``env``: values with ``$(VAR)`` expanded, ``fieldRef``,
ConfigMap/Secret key refs, ``resourceFieldRef``), and its arguments (``--host`` rewritten to the
pod's loopback IP).
"""
from collections.abc import Callable
from typing import Any

Fetch = Callable[[str, str, str], dict[str, Any] | None]  # (plural, namespace, name) -> object or None


class ContainerConfigError(Exception):
    """Like the kubelet's CreateContainerConfigError (a referenced ConfigMap/Secret key is missing)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` is a literal ``$``,
    undefined references stay as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] == '$' and i + 1 < len(text):
            if text[i + 1] == '$':
                out.append('$')
                i += 2
                continue
            if text[i + 1] == '(':
                end = text.find(')', i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return ''.join(out)


def field_ref(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod.get('metadata') or {}, pod.get('spec') or {}, pod.get('status') or {}
    for prefix, mapping in (('metadata.labels', meta.get('labels') or {}),
                            ('metadata.annotations', meta.get('annotations') or {})):
        if path.startswith(prefix + '['):
            return str(mapping.get(path[len(prefix) + 1:-1].strip('\'"'), ''))
    simple = {
        'metadata.name': meta.get('name'), 'metadata.namespace': meta.get('namespace'),
        'metadata.uid': meta.get('uid'), 'spec.nodeName': spec.get('nodeName'),
        'spec.serviceAccountName': spec.get('serviceAccountName') or 'default',
        'status.hostIP': status.get('hostIP'), 'status.hostIPs': status.get('hostIP'),
        'status.podIP': status.get('podIP'), 'status.podIPs': status.get('podIP'),
    }
    if path not in simple:
        raise ContainerConfigError(f'unsupported fieldRef {path!r}')
    return str(simple[path] or '')


def _key_ref(fetch: Fetch, namespace: str, ref: dict[str, Any], secret: bool) -> str | None:
    obj = fetch('secrets' if secret else 'configmaps', namespace, ref.get('name', ''))
    data = (obj or {}).get('data') or {}
    if ref.get('key') in data:
        value = data[ref['key']]
        if secret:
            import base64
            value = base64.b64decode(value).decode(errors='replace')
        return str(value)
    if ref.get('optional'):
        return None
    kind = 'secret' if secret else 'configmap'
    raise ContainerConfigError(f'{kind} {ref.get("name")!r} or its key {ref.get("key")!r} not found')


def container_env(container: dict[str, Any], pod: dict[str, Any], fetch: Fetch) -> dict[str, str]:
    """The env a real kubelet would give the container: envFrom, then env (each value expanded
    against the variables defined before it)."""
    namespace = pod['metadata']['namespace']
    env: dict[str, str] = {}
    for source in container.get('envFrom') or []:
        prefix, secret = source.get('prefix', ''), 'secretRef' in source
        ref = source.get('secretRef') or source.get('configMapRef') or {}
        obj = fetch('secrets' if secret else 'configmaps', namespace, ref.get('name', ''))
        if obj is None:
            if ref.get('optional'):
                continue
            raise ContainerConfigError(f'{"secret" if secret else "configmap"} {ref.get("name")!r} not found')
        for key, value in (obj.get('data') or {}).items():
            if secret:
                import base64
                value = base64.b64decode(value).decode(errors='replace')
            env[prefix + key] = str(value)
    for var in container.get('env') or []:
        name, source = var['name'], var.get('valueFrom')
        if source is None:
            env[name] = expand(str(var.get('value', '')), env)
        elif 'fieldRef' in source:
            env[name] = field_ref(pod, source['fieldRef'].get('fieldPath', ''))
        elif 'configMapKeyRef' in source or 'secretKeyRef' in source:
            value = _key_ref(fetch, namespace, source.get('secretKeyRef') or source['configMapKeyRef'],
                             'secretKeyRef' in source)
            if value is not None:
                env[name] = value
        elif 'resourceFieldRef' in source:
            ref = source['resourceFieldRef']
            kind, _, res = ref.get('resource', '').partition('.')
            env[name] = str(((container.get('resources') or {}).get(kind) or {}).get(res, '0'))
    return env


def rewrite_host(args: list[str], ip: str) -> list[str]:
    """Bind addresses meant for "every interface of the pod" become the pod's own IP."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == '--host' and i + 1 < len(out):
            out[i + 1] = ip
        elif arg.startswith('--host='):
            out[i] = '--host=' + ip
    return out
