"""Write a kubeconfig file that points kubectl / the kubernetes client / kopf at an emulator URL."""
import pathlib

import yaml


def kubeconfig_dict(url: str, namespace: str = 'default', name: str = 'emulator') -> dict:
    return {
        'apiVersion': 'v1', 'kind': 'Config', 'preferences': {},
        'clusters': [{'name': name, 'cluster': {'server': url}}],
        'users': [{'name': name, 'user': {'token': 'emulator-token'}}],
        'contexts': [{'name': name, 'context': {'cluster': name, 'user': name, 'namespace': namespace}}],
        'current-context': name,
    }


def write_kubeconfig(path: str | pathlib.Path, url: str, namespace: str = 'default') -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(kubeconfig_dict(url, namespace)), encoding='utf-8')
    path.chmod(0o600)
    return path
