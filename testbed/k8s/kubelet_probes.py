"""
The probes of the kubelet stand-in (see ``kubelet.py``): one httpGet, tcpSocket or exec probe
against a pod's loopback IP. When and how often they run is the container's business
(``kubelet_containers.Container``).
"""
import http.client
import os
import socket
import subprocess
from typing import Any


def run_probe(probe: dict[str, Any], ip: str, ports: dict[str, int], env: dict[str, str]) -> bool:
    timeout = float(probe.get('timeoutSeconds') or 1)
    try:
        if 'httpGet' in probe:
            get = probe['httpGet']
            port = resolve_port(get.get('port'), ports)
            conn = http.client.HTTPConnection(get.get('host') or ip, port, timeout=timeout)
            try:
                headers = {h['name']: h['value'] for h in get.get('httpHeaders') or []}
                conn.request('GET', get.get('path') or '/', headers={'User-Agent': 'kube-probe/1.32', **headers})
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400
        if 'tcpSocket' in probe:
            port = resolve_port(probe['tcpSocket'].get('port'), ports)
            with socket.create_connection((probe['tcpSocket'].get('host') or ip, port), timeout=timeout):
                return True
        if 'exec' in probe:
            result = subprocess.run(probe['exec'].get('command') or ['false'], env={**os.environ, **env},
                                    timeout=timeout, capture_output=True)
            return result.returncode == 0
        return True  # grpc probes are not simulated: treated as passing
    except (OSError, ValueError, subprocess.SubprocessError, http.client.HTTPException):
        return False


def resolve_port(port: Any, ports: dict[str, int]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    if port in ports:
        return ports[port]
    raise ValueError(f'named port {port!r} not declared by the container')
