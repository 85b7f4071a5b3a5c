"""The kubelet stand-in's Service proxy (kubelet_services.py) and preStop hooks: a Service's address
forwards to ready pods only, a few hundred milliseconds behind the API, and a deleted pod keeps
serving through its preStop hook while the Service has already dropped it."""
import socket
import time

import httpx
import pytest

from mnn_rollout.local.net import wait_for

from .kubelet_fixtures import kubelet, kubelet_factory  # noqa: F401
from .test_kubelet import NS, PODS, DEPLOYMENTS, ok, patch_deployment, tiny_deployment

pytestmark = pytest.mark.timeout(60)


def service(name: str, target: object = 'web') -> dict[str, object]:
    return {'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': name},
            'spec': {'selector': {'app': name}, 'ports': [{'name': 'http', 'port': 80, 'targetPort': target}]}}


def greeting(url: str) -> str:
    with httpx.Client(timeout=5) as c:  # a new connection each time (one per client)
        return c.get(url + '/').text


def test_a_service_spreads_new_connections_over_its_ready_pods_and_refuses_without_any(k8s_emulator, kubelet):
    emu = k8s_emulator
    ok(emu.request('POST', DEPLOYMENTS, tiny_deployment('web', 2)))
    ok(emu.request('POST', f'/api/v1/namespaces/{NS}/services', service('web')))
    pods = kubelet.wait_ready('web', NS, replicas=2, timeout=15)
    url = kubelet.service_url('web')
    assert url.rsplit(':', 1)[1] == '80' and url.split('//')[1].split(':')[0] not in {p.ip for p in pods}
    wait_for(lambda: len(kubelet.service_endpoints('web') or ()) == 2, 10, 'both pods as endpoints')
    assert set(kubelet.service_endpoints('web')) == {(p.ip, 9000) for p in pods}  # named targetPort resolved
    seen = {greeting(url).split()[2] for _ in range(40)}
    assert seen == {p.name for p in pods}  # random choice per connection reaches both

    patch_deployment(emu, 'web', {'spec': {'replicas': 0}})
    wait_for(lambda: kubelet.service_endpoints('web') == (), 15, 'no endpoints')
    refused = kubelet.services.refused
    with pytest.raises(httpx.TransportError):
        greeting(url)
    assert kubelet.services.refused == refused + 1


def test_endpoints_follow_a_deletion_a_few_hundred_ms_late_while_prestop_keeps_the_pod_serving(
        k8s_emulator, kubelet_factory):  # noqa: F811
    emu = k8s_emulator
    kubelet = kubelet_factory(emu, service_delay=0.3)
    dep = tiny_deployment('web', 2)
    container = dep['spec']['template']['spec']['containers'][0]
    container['lifecycle'] = {'preStop': {'exec': {'command': ['sleep', '4']}}}  # a window wide enough under load
    dep['spec']['template']['spec']['terminationGracePeriodSeconds'] = 10
    ok(emu.request('POST', DEPLOYMENTS, dep))
    ok(emu.request('POST', f'/api/v1/namespaces/{NS}/services', service('web', 9000)))
    pods = kubelet.wait_ready('web', NS, replicas=2, timeout=15)
    wait_for(lambda: len(kubelet.service_endpoints('web') or ()) == 2, 10, 'both pods as endpoints')
    victim = pods[0]
    deleted = time.monotonic()
    ok(emu.request('DELETE', f'{PODS}/{victim.name}'), 200)
    wait_for(lambda: (victim.ip, 9000) not in kubelet.service_endpoints('web'), 5, 'the endpoint to go')
    dropped = time.monotonic() - deleted
    assert 0.3 <= dropped < 2.5, dropped  # after the delay, within a few ticks of it (the host may be loaded)
    # Still in its preStop hook: the pod answers on its own address, the Service sends nothing there.
    assert greeting(f'http://{victim.ip}:9000').split()[2] == victim.name
    assert all(greeting(kubelet.service_url('web')).split()[2] != victim.name for _ in range(15))
    assert time.monotonic() - deleted < 4, 'too slow to see the preStop window'
    gone = wait_for(lambda: all(p.name != victim.name for p in kubelet.pods('web', NS, include_terminating=True)),
                    15, 'the pod to end')
    assert gone and time.monotonic() - deleted >= 4  # SIGTERM only after the 4 s hook
    log = kubelet.log(victim.name)
    assert "preStop hook: {'exec': {'command': ['sleep', '4']}}" in log


def test_a_connection_stays_with_its_pod_after_the_pod_left_the_endpoints(k8s_emulator, kubelet):
    """conntrack: an established connection is not moved; it ends when the pod's process ends it."""
    emu = k8s_emulator
    dep = tiny_deployment('web', 1)
    dep['spec']['template']['spec']['containers'][0]['lifecycle'] = {'preStop': {'sleep': {'seconds': 2}}}
    ok(emu.request('POST', DEPLOYMENTS, dep))
    ok(emu.request('POST', f'/api/v1/namespaces/{NS}/services', service('web')))
    pod = kubelet.wait_ready('web', NS, replicas=1, timeout=15)[0]
    wait_for(lambda: kubelet.service_endpoints('web') == ((pod.ip, 9000),), 10, 'the pod as endpoint')
    host, port = kubelet.service_url('web').removeprefix('http://').split(':')
    sock = socket.create_connection((host, int(port)), timeout=5)
    try:
        ok(emu.request('DELETE', f'{PODS}/{pod.name}'), 200)
        wait_for(lambda: (pod.ip, 9000) not in kubelet.service_endpoints('web'), 5, 'the endpoint to go')
        sock.sendall(f'GET / HTTP/1.0\r\nHost: {host}\r\n\r\n'.encode())
        data = b''
        while chunk := sock.recv(4096):
            data += chunk
        assert data.startswith(b'HTTP/1.0 200') and data.endswith(f'hello from {pod.name} $(POD)'.encode())
    finally:
        sock.close()
