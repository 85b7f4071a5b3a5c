"""The kubelet stand-in (kubelet.py) runs the real runtime as pods on loopback IPs behind the emulator."""
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mnn_rollout.contract.routing import RoutingTable
from mnn_rollout.local.net import wait_for

from testbed.k8s.harness import EmulatorProcess
from testbed.k8s.kubelet import Kubelet
from .kubelet_fixtures import kubelet, kubelet_factory  # noqa: F401

pytestmark = pytest.mark.timeout(60)

NS = 'default'
DEPLOYMENT = 'scorer-runtime'
DEPLOYMENTS = f'/apis/apps/v1/namespaces/{NS}/deployments'
CONFIGMAPS = f'/api/v1/namespaces/{NS}/configmaps'
PODS = f'/api/v1/namespaces/{NS}/pods'
BODY = {'inputs': [{'name': 'features', 'datatype': 'FP32', 'shape': [1, 64], 'data': [0.5] * 64}]}
USERS = [f'user-{i}' for i in range(300)]


@pytest.fixture(scope='module')
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mnn_runtime.examples import build_examples

    out = tmp_path_factory.mktemp('kubelet-models')
    build_examples(out)
    return out


def runtime_yaml(models: Path, weights: dict[str, int], versions: tuple[str, ...] = ('v1', 'v2'),
                 stable: str = 'v1') -> str:
    lines = ['model: scorer', 'versions:']
    for v in versions:
        lines += [f'  - name: {v}', f'    uri: file://{models / (v + ".mnn")}']
    lines += ['weights: {' + ', '.join(f'{k}: {w}' for k, w in weights.items()) + '}', f'stable: {stable}']
    return '\n'.join(lines) + '\n'


def deployment(replicas: int = 2, configmap: str = 'scorer-routing', **spec: Any) -> dict[str, Any]:
    """What the operator renders for the runtime (named port, fieldRef env, httpGet probes)."""
    container = {
        'name': 'runtime', 'image': 'mnn-rollout:dev', 'command': ['mnn-rollout'],
        'args': ['serve', '--configmap', f'$(POD_NAMESPACE)/{configmap}', '--host', '0.0.0.0', '--port', '8080'],
        'env': [{'name': 'POD_NAMESPACE', 'valueFrom': {'fieldRef': {'fieldPath': 'metadata.namespace'}}},
                {'name': 'POD_NAME', 'valueFrom': {'fieldRef': {'fieldPath': 'metadata.name'}}},
                {'name': 'POD_IP', 'valueFrom': {'fieldRef': {'fieldPath': 'status.podIP'}}}],
        'ports': [{'name': 'http', 'containerPort': 8080}],
        'readinessProbe': {'httpGet': {'path': '/v2/health/ready', 'port': 'http'}, 'periodSeconds': 2},
        'livenessProbe': {'httpGet': {'path': '/v2/health/live', 'port': 8080}, 'failureThreshold': 3},
        'resources': {'limits': {'cpu': '1', 'memory': '512Mi'}},
        'volumeMounts': [{'name': 'tmp', 'mountPath': '/tmp'}],
    }
    labels = {'app.kubernetes.io/name': 'scorer'}
    pod = {'containers': [container], 'volumes': [{'name': 'tmp', 'emptyDir': {}}]}
    return {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': DEPLOYMENT, 'labels': labels},
            'spec': {'replicas': replicas, 'selector': {'matchLabels': labels},
                     'strategy': {'type': 'RollingUpdate', 'rollingUpdate': {'maxSurge': 1, 'maxUnavailable': 0}},
                     'template': {'metadata': {'labels': labels}, 'spec': pod}, **spec}}


def ok(result: tuple[int, Any], *codes: int) -> Any:
    assert result[0] in (codes or (200, 201)), result
    return result[1]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5, trust_env=False) as client:
        yield client


def infer(http: httpx.Client, ip: str, user: str) -> tuple[int, str | None]:
    rsp = http.post(f'http://{ip}:8080/v2/models/scorer/infer', json=BODY, headers={'X-User-Id': user})
    return rsp.status_code, rsp.headers.get('x-model-version')


def api_pods(emu: EmulatorProcess) -> list[dict[str, Any]]:
    return ok(emu.request('GET', PODS))['items']


def is_ready(pod: dict[str, Any]) -> bool:
    conds = (pod.get('status') or {}).get('conditions') or []
    return any(c['type'] == 'Ready' and c['status'] == 'True' for c in conds)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def running(k8s_emulator: EmulatorProcess, kubelet: Kubelet,  # noqa: F811
            models: Path) -> tuple[EmulatorProcess, Kubelet]:
    """Two ready runtime pods serving v1:90 / v2:10 from the ConfigMap scorer-routing."""
    ok(k8s_emulator.request('POST', CONFIGMAPS, {'metadata': {'name': 'scorer-routing'},
                                                 'data': {'runtime.yaml': runtime_yaml(models, {'v1': 90, 'v2': 10})}}))
    ok(k8s_emulator.request('POST', DEPLOYMENTS, deployment(replicas=2)))
    kubelet.wait_ready(DEPLOYMENT, NS, replicas=2, timeout=30)
    return k8s_emulator, kubelet


def test_a_deployment_runs_as_processes_on_distinct_loopback_ips_with_ready_pod_objects(running, http):
    emu, kubelet = running
    pods = kubelet.pods(DEPLOYMENT, NS)
    ips = {p.ip for p in pods}
    assert len(ips) == 2 and all(ip.startswith('127.') and ip != '127.0.0.1' for ip in ips)
    assert all(p.pid and alive(p.pid) for p in pods)
    objects = {p['metadata']['name']: p for p in api_pods(emu)}
    assert set(objects) == {p.name for p in pods}
    thash = kubelet.template_hash(DEPLOYMENT, NS)
    tmp_dirs = set()
    for info in pods:
        obj = objects[info.name]
        assert obj['status']['podIP'] == info.ip and obj['status']['phase'] == 'Running' and is_ready(obj)
        assert obj['metadata']['labels']['pod-template-hash'] == thash
        assert info.name.startswith(f'{DEPLOYMENT}-{thash}-')
        owner = obj['metadata']['ownerReferences'][0]
        assert (owner['kind'], owner['name'], owner['controller']) == ('Deployment', DEPLOYMENT, True)
        assert obj['status']['containerStatuses'][0]['ready'] is True
        assert infer(http, info.ip, 'alice')[0] == 200
        assert http.get(f'http://{info.ip}:8080/v2/health/ready').status_code == 200
        environ = dict(line.split('=', 1) for line in Path(f'/proc/{info.pid}/environ').read_bytes().decode()
                       .split('\0') if '=' in line)
        assert environ['POD_IP'] == info.ip
        # the emptyDir at /tmp: the pod's own directory, as TMPDIR
        assert Path(environ['TMPDIR']).is_dir() and environ['TMPDIR'].endswith(f'{info.name}.volumes/tmp')
        tmp_dirs.add(environ['TMPDIR'])
    assert len(tmp_dirs) == 2
    status = ok(emu.request('GET', f'{DEPLOYMENTS}/{DEPLOYMENT}'))['status']
    assert (status['readyReplicas'], status['availableReplicas'], status['updatedReplicas']) == (2, 2, 2)
    assert status['observedGeneration'] == 1
    assert {c['type']: c['status'] for c in status['conditions']} == {'Available': 'True', 'Progressing': 'True'}
    listed = emu.kubectl('get', 'pods', '-n', NS).stdout
    assert all(p.name in listed for p in pods) and 'Running' in listed
    wide = json.loads(emu.kubectl('get', 'pods', '-n', NS, '-o', 'json').stdout)
    assert sorted(i['status']['podIP'] for i in wide['items']) == sorted(ips)
    assert not kubelet.errors


def test_a_configmap_weight_patch_reaches_every_pod_within_seconds(running, models, http):
    emu, kubelet = running
    before = RoutingTable.build('scorer', {'v1': 90, 'v2': 10}, 'v1')
    after = RoutingTable.build('scorer', {'v1': 70, 'v2': 30}, 'v1')
    movers = [u for u in USERS if before.route(u) != after.route(u)][:20]
    stayers = [u for u in USERS if before.route(u) == after.route(u)][:20]
    assert len(movers) == 20 and len(stayers) == 20
    pods = kubelet.pods(DEPLOYMENT, NS)
    for p in pods:
        assert all(infer(http, p.ip, u) == (200, before.route(u)) for u in movers + stayers)
    text = runtime_yaml(models, {'v1': 70, 'v2': 30})
    started = time.monotonic()
    ok(emu.request('PATCH', f'{CONFIGMAPS}/scorer-routing', {'data': {'runtime.yaml': text}},
                   content_type='application/merge-patch+json'))
    applied: dict[str, float] = {}
    deadline = started + 10
    while len(applied) < len(pods) and time.monotonic() < deadline:
        for p in pods:
            if p.name not in applied and all(infer(http, p.ip, u) == (200, after.route(u)) for u in movers):
                applied[p.name] = time.monotonic() - started
        time.sleep(0.02)
    print(f'ConfigMap patch -> new routing per pod: {", ".join(f"{t:.3f} s" for t in applied.values())}')
    assert len(applied) == len(pods), f'not every pod routes by the new weights within 10 s: {applied}'
    for p in pods:
        assert all(infer(http, p.ip, u) == (200, after.route(u)) for u in movers + stayers)


def test_a_template_change_replaces_pods_one_by_one_without_losing_ready_capacity(running, http):
    emu, kubelet = running
    old_hash = kubelet.template_hash(DEPLOYMENT, NS)
    old_names = {p.name for p in kubelet.pods(DEPLOYMENT, NS)}
    patch = {'spec': {'template': {'metadata': {'annotations': {'kubectl.kubernetes.io/restartedAt': 'now'}}}}}
    ok(emu.request('PATCH', f'{DEPLOYMENTS}/{DEPLOYMENT}', patch, content_type='application/merge-patch+json'))
    new_hash = wait_for(lambda: (h := kubelet.template_hash(DEPLOYMENT, NS)) != old_hash and h, 5, 'the new hash')
    min_ready, max_live, polls, seen = 99, 0, 0, set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pods = api_pods(emu)
        live = [p for p in pods if not p['metadata'].get('deletionTimestamp')]
        ready = [p for p in live if is_ready(p)]
        min_ready, max_live, polls = min(min_ready, len(ready)), max(max_live, len(live)), polls + 1
        seen |= {p['metadata']['name'] for p in pods}
        for p in ready[:1]:  # a pod the API calls Ready really serves
            assert infer(http, p['status']['podIP'], 'bob')[0] == 200
        if len(pods) == 2 and all(p['metadata']['labels']['pod-template-hash'] == new_hash and is_ready(p)
                                  for p in pods):
            break
        time.sleep(0.03)
    else:
        raise AssertionError(f'the rollout did not finish: {kubelet.pods(DEPLOYMENT, NS, include_terminating=True)}')
    print(f'{polls} polls during the roll: at least {min_ready} ready pods, at most {max_live} live pods')
    assert min_ready >= 2, 'a moment with fewer Ready pods than replicas'
    assert max_live <= 3, 'maxSurge 1 exceeded'
    final = kubelet.wait_ready(DEPLOYMENT, NS, replicas=2, timeout=10)
    assert all(p.template_hash == new_hash for p in final) and not old_names & {p.name for p in final}
    assert len(seen - old_names) == 2, f'more pods than needed were created: {seen - old_names}'
    status = wait_for(lambda: (s := ok(emu.request('GET', f'{DEPLOYMENTS}/{DEPLOYMENT}'))['status'])
                      .get('observedGeneration') == 2 and s.get('updatedReplicas') == 2 and s, 5, 'deployment status')
    assert status['readyReplicas'] == 2 and status['replicas'] == 2


def test_a_killed_process_is_restarted_and_becomes_ready_again(running, http):
    emu, kubelet = running
    victim = kubelet.pods(DEPLOYMENT, NS)[0]
    pid = kubelet.kill(victim.name, signal.SIGKILL)
    back = wait_for(lambda: next((p for p in kubelet.pods(DEPLOYMENT, NS)
                                  if p.name == victim.name and p.restarts == 1 and p.ready and p.pid != pid), None),
                    20, 'the restarted pod to be ready')
    assert back.ip == victim.ip and not alive(pid)
    obj = ok(emu.request('GET', f'{PODS}/{victim.name}'))
    cs = obj['status']['containerStatuses'][0]
    assert cs['restartCount'] == 1 and cs['ready'] and 'running' in cs['state'] and is_ready(obj)
    assert cs['lastState']['terminated']['exitCode'] == 137
    assert infer(http, victim.ip, 'carol')[0] == 200
    assert {p.name for p in kubelet.pods(DEPLOYMENT, NS)} == {p['metadata']['name'] for p in api_pods(emu)}


def test_a_deleted_pod_is_replaced_and_a_deleted_deployment_takes_its_processes_and_pods_along(running):
    emu, kubelet = running
    first = kubelet.pods(DEPLOYMENT, NS)[0]
    emu.kubectl('delete', 'pod', '-n', NS, first.name, '--timeout=20s')  # waits until the object is gone
    assert not alive(first.pid)
    replaced = kubelet.wait_ready(DEPLOYMENT, NS, replicas=2, timeout=20)
    assert first.name not in {p.name for p in replaced}
    pids = [p.pid for p in replaced]
    ok(emu.request('DELETE', f'{DEPLOYMENTS}/{DEPLOYMENT}'))
    wait_for(lambda: not any(alive(pid) for pid in pids), 15, 'the processes to end')
    wait_for(lambda: not api_pods(emu), 10, 'the Pod objects to be deleted')
    assert kubelet.pods(include_terminating=True) == []


def test_a_template_that_never_gets_ready_stalls_the_rollout_while_old_pods_keep_serving(running, models, http):
    emu, kubelet = running
    old = kubelet.pods(DEPLOYMENT, NS)
    # 1. The process runs but is never ready: its only version (weight 100) does not exist.
    broken = runtime_yaml(models, {'v9': 100}, versions=('v9',), stable='v9')
    ok(emu.request('POST', CONFIGMAPS, {'metadata': {'name': 'scorer-broken'}, 'data': {'runtime.yaml': broken}}))
    ok(emu.request('PATCH', f'{DEPLOYMENTS}/{DEPLOYMENT}', {'spec': {
        'progressDeadlineSeconds': 3, 'template': deployment(configmap='scorer-broken')['spec']['template']}},
        content_type='application/merge-patch+json'))

    def stalled_with(condition: str) -> Any:
        status = ok(emu.request('GET', f'{DEPLOYMENTS}/{DEPLOYMENT}'))['status']
        progressing = next(c for c in status['conditions'] if c['type'] == 'Progressing')
        return progressing['reason'] == condition and status

    status = wait_for(lambda: stalled_with('ProgressDeadlineExceeded'), 15, 'ProgressDeadlineExceeded')
    assert (status['updatedReplicas'], status['readyReplicas'], status['availableReplicas']) == (1, 2, 2)
    assert status['replicas'] == 3 and 'unavailableReplicas' not in status
    pods = kubelet.pods(DEPLOYMENT, NS)
    assert {p.name for p in old} < {p.name for p in pods} and len(pods) == 3
    new = next(p for p in pods if p.name not in {o.name for o in old})
    assert not new.ready and new.restarts == 0 and new.pid and alive(new.pid)
    assert http.get(f'http://{new.ip}:8080/v2/health/ready').status_code == 503
    for p in old:
        assert infer(http, p.ip, 'dave')[0] == 200
    # 2. The process exits at once (an unknown flag): a crash loop, the rollout still stalls.
    template = deployment()['spec']['template']
    template['spec']['containers'][0]['args'].append('--no-such-flag')
    ok(emu.request('PATCH', f'{DEPLOYMENTS}/{DEPLOYMENT}', {'spec': {'template': template}},
                   content_type='application/merge-patch+json'))
    crashing = wait_for(lambda: next((p for p in kubelet.pods(DEPLOYMENT, NS) if p.restarts >= 1), None), 15,
                        'a restarted crashing pod')
    # The never-ready pod of the previous template ends (its drain waits up to 5 s for this test's
    # idle kept-alive connection, as uvicorn's keep-alive timeout would close it then).
    wait_for(lambda: new.name not in {p.name for p in kubelet.pods(DEPLOYMENT, NS, include_terminating=True)},
             10, 'the never-ready pod of the previous template to end')
    assert not alive(new.pid), 'the never-ready pod of the previous template was not ended'
    obj = ok(emu.request('GET', f'{PODS}/{crashing.name}'))
    cs = obj['status']['containerStatuses'][0]
    assert cs['lastState']['terminated']['exitCode'] == 2 and not is_ready(obj)
    assert 'unrecognized arguments: --no-such-flag' in kubelet.log(crashing.name)
    assert {p.name for p in old} <= {p.name for p in kubelet.pods(DEPLOYMENT, NS)}
    assert len(kubelet.pods(DEPLOYMENT, NS)) == 3
    for p in old:
        assert infer(http, p.ip, 'erin')[0] == 200
    status = ok(emu.request('GET', f'{DEPLOYMENTS}/{DEPLOYMENT}'))['status']
    assert status['readyReplicas'] == 2 and status['availableReplicas'] == 2
    # 3. Going back to the working template finishes the rollout on fresh pods.
    ok(emu.request('PATCH', f'{DEPLOYMENTS}/{DEPLOYMENT}', {'spec': {'template': deployment()['spec']['template']}},
                   content_type='application/merge-patch+json'))
    final = kubelet.wait_ready(DEPLOYMENT, NS, replicas=2, timeout=20)
    assert {p.name for p in final} == {p.name for p in old}, 'the original template is the old pods\' template'


# --- generic containers (a tiny stdlib HTTP server: fast to start) ---------------------------------

TINY_SERVER = '''
import http.server, os, sys
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
live_for, calls = int(os.environ.get("LIVE_FOR") or 0), [0]
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/live":
            calls[0] += 1
        failing = self.path == "/live" and live_for and calls[0] > live_for
        self.send_response(500 if failing else 200)
        self.end_headers()
        self.wfile.write(os.environ.get("GREETING", "").encode())
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer((args["--host"], int(args["--port"])), Handler).serve_forever()
'''


def tiny_deployment(name: str, replicas: int, env: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    labels = {'app': name}
    container = {
        'name': 'tiny', 'image': 'python:3.11', 'command': ['python3', '-c', TINY_SERVER],
        'args': ['--host', '0.0.0.0', '--port', '$(PORT)'],
        'env': [{'name': 'PORT', 'value': '9000'},
                {'name': 'POD', 'valueFrom': {'fieldRef': {'fieldPath': 'metadata.name'}}},
                {'name': 'GREETING', 'value': 'hello from $(POD) $$(POD)'}]
               + [{'name': k, 'value': v} for k, v in (env or {}).items()],
        'ports': [{'name': 'web', 'containerPort': 9000}],
        'readinessProbe': {'httpGet': {'path': '/ready', 'port': 'web'}, 'periodSeconds': 1},
        'livenessProbe': {'httpGet': {'path': '/live', 'port': 'web'}, 'periodSeconds': 1, 'failureThreshold': 2},
    }
    return {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': name},
            'spec': {'replicas': replicas, 'selector': {'matchLabels': labels},
                     'template': {'metadata': {'labels': labels}, 'spec': {'containers': [container]}}, **spec}}


def patch_deployment(emu: EmulatorProcess, name: str, patch: dict[str, Any]) -> None:
    ok(emu.request('PATCH', f'{DEPLOYMENTS}/{name}', patch, content_type='application/merge-patch+json'))


def test_a_container_failing_its_liveness_probe_is_killed_and_restarted(k8s_emulator, kubelet, http):
    emu = k8s_emulator
    ok(emu.request('POST', DEPLOYMENTS, tiny_deployment('tiny', 1, env={'LIVE_FOR': '3'})))
    pod = kubelet.wait_ready('tiny', NS, replicas=1, timeout=10)[0]
    assert http.get(f'http://{pod.ip}:9000/').text == f'hello from {pod.name} $(POD)'
    restarted = wait_for(lambda: next((p for p in kubelet.pods('tiny', NS) if p.restarts >= 1), None), 15,
                         'a liveness restart')
    assert restarted.name == pod.name and restarted.ip == pod.ip
    cs = ok(emu.request('GET', f'{PODS}/{pod.name}'))['status']['containerStatuses'][0]
    assert cs['restartCount'] >= 1 and cs['lastState']['terminated']['exitCode'] == 137
    assert 'liveness probe failed 2 times' in kubelet.log(pod.name)


def test_scaling_removes_the_newest_pods_and_recreate_never_runs_two_templates_at_once(k8s_emulator, kubelet):
    emu = k8s_emulator
    ok(emu.request('POST', DEPLOYMENTS, tiny_deployment('web', 1)))
    first = kubelet.wait_ready('web', NS, replicas=1, timeout=10)[0]
    patch_deployment(emu, 'web', {'spec': {'replicas': 3}})
    three = kubelet.wait_ready('web', NS, replicas=3, timeout=10)
    assert len({p.ip for p in three}) == 3 and first.name in {p.name for p in three}
    patch_deployment(emu, 'web', {'spec': {'replicas': 1}})
    assert [p.name for p in kubelet.wait_ready('web', NS, replicas=1, timeout=10)] == [first.name]
    wait_for(lambda: len(api_pods(emu)) == 1, 10, 'the scaled-down Pod objects to go')
    status = wait_for(lambda: (s := ok(emu.request('GET', f'{DEPLOYMENTS}/web'))['status']).get('replicas') == 1
                      and s, 5, 'the status to show 1 replica')
    assert status['readyReplicas'] == 1 and status['observedGeneration'] == 3

    patch_deployment(emu, 'web', {'spec': {'replicas': 2, 'strategy': {'type': 'Recreate'}}})
    kubelet.wait_ready('web', NS, replicas=2, timeout=10)
    old_hash = kubelet.template_hash('web', NS)
    patch_deployment(emu, 'web', {'spec': {'template': tiny_deployment('web', 2, env={'V': '2'})['spec']['template']}})
    deadline, mixed = time.monotonic() + 20, 0
    while time.monotonic() < deadline:
        hashes = [p['metadata']['labels']['pod-template-hash'] for p in api_pods(emu)]
        mixed += len(set(hashes)) > 1
        if len(hashes) == 2 and old_hash not in hashes and all(is_ready(p) for p in api_pods(emu)):
            break
        time.sleep(0.03)
    else:
        raise AssertionError('the Recreate rollout did not finish')
    assert mixed == 0, 'old and new pods existed at the same time under Recreate'
    assert all(p.template_hash != old_hash for p in kubelet.wait_ready('web', NS, replicas=2, timeout=10))
