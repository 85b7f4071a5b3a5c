"""Real kubectl (KUBECONFIG pointing at the emulator) against the emulator."""
import json
import subprocess
import threading
import time

import pytest
import yaml

from testbed.k8s.harness import ROOT, WIDGET_CRD
from .helpers import WIDGETS, ok

pytestmark = pytest.mark.timeout(60)
WIDGET = """
apiVersion: example.io/v1
kind: Widget
metadata:
  name: {name}
  labels: {{app: demo}}
spec:
  size: {size}
  color: blue
"""


def test_kubectl_applies_a_crd_then_an_object_and_reapplies_as_unchanged_then_configured(k8s_emulator):
    emu = k8s_emulator
    out = emu.kubectl('apply', '--validate=false', '-f', str(WIDGET_CRD)).stdout
    assert out.strip() == 'customresourcedefinition.apiextensions.k8s.io/widgets.example.io created'
    assert 'unchanged' in emu.kubectl('apply', '--validate=false', '-f', str(WIDGET_CRD)).stdout
    emu.kubectl('wait', '--for=condition=Established', 'crd/widgets.example.io', '--timeout=5s')
    manifest = WIDGET.format(name='w1', size=3)
    assert emu.kubectl('apply', '--validate=false', '-f', '-', input=manifest).stdout.strip() == \
        'widget.example.io/w1 created'
    assert emu.kubectl('apply', '--validate=false', '-f', '-', input=manifest).stdout.strip() == \
        'widget.example.io/w1 unchanged'
    emu.reset_requests()
    assert emu.kubectl('apply', '--validate=false', '-f', '-', input=manifest.replace('size: 3', 'size: 4')
                       ).stdout.strip() == 'widget.example.io/w1 configured'
    patches = emu.write_requests('widgets')
    assert [(p['method'], p['contentType']) for p in patches] == [('PATCH', 'application/merge-patch+json')]
    obj = ok(emu.request('GET', WIDGETS.format(ns='default') + '/w1'))
    assert obj['spec']['size'] == 4 and obj['metadata']['generation'] == 2
    assert 'kubectl.kubernetes.io/last-applied-configuration' in obj['metadata']['annotations']
    cm = 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c1}\ndata: {a: "1"}\n'
    emu.kubectl('apply', '--validate=false', '-f', '-', input=cm)
    assert 'configured' in emu.kubectl('apply', '--validate=false', '-f', '-', input=cm.replace('"1"', '"2"')).stdout
    assert emu.write_requests('configmaps')[-1]['contentType'] == 'application/strategic-merge-patch+json'


def test_kubectl_get_shows_printer_columns_and_resolves_short_and_singular_names(api, ns):
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w1', size=3))
    api.kubectl('-n', ns, 'patch', 'wd', 'w1', '--subresource=status', '--type=merge', '-p', '{"status":{"phase":"Ready"}}')
    lines = api.kubectl('-n', ns, 'get', 'widgets').stdout.splitlines()
    assert lines[0].split() == ['NAME', 'SIZE', 'COLOR', 'PHASE', 'AGE']
    assert lines[1].split()[:4] == ['w1', '3', 'blue', 'Ready']
    assert api.kubectl('-n', ns, 'get', 'wd').stdout.split()[:9] == api.kubectl('-n', ns, 'get', 'widget').stdout.split()[:9]
    assert api.kubectl('-n', ns, 'get', 'wd', 'w1', '-o', 'name').stdout.strip() == 'widget.example.io/w1'
    assert api.kubectl('-n', ns, 'get', 'widget.example.io', '-o', 'name').stdout.strip() == 'widget.example.io/w1'
    everywhere = api.kubectl('get', 'wd', '-A').stdout.splitlines()
    assert everywhere[0].split()[:2] == ['NAMESPACE', 'NAME'] and any(line.startswith(ns) for line in everywhere)
    missing = api.kubectl('-n', ns, 'get', 'wd', 'nope', check=False)
    assert missing.returncode == 1 and 'NotFound' in missing.stderr and '"nope" not found' in missing.stderr


def test_kubectl_patch_merge_and_wait_for_jsonpath_and_condition(api, ns):
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w2', size=1))
    out = api.kubectl('-n', ns, 'patch', 'widget', 'w2', '--type', 'merge', '-p', '{"spec":{"size":5}}').stdout
    assert out.strip() == 'widget.example.io/w2 patched'
    assert api.kubectl('-n', ns, 'get', 'wd', 'w2', '-o', 'jsonpath={.spec.size}').stdout == '5'

    def later() -> None:  # make kubectl wait actually wait on its watch
        time.sleep(0.5)
        status = {'status': {'phase': 'Ready', 'conditions': [{'type': 'Ready', 'status': 'True'}]}}
        ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/w2/status', status, 'application/merge-patch+json'))
    threading.Thread(target=later).start()
    started = time.monotonic()
    api.kubectl('-n', ns, 'wait', '--for=jsonpath={.status.phase}=Ready', 'widget/w2', '--timeout=10s')
    assert time.monotonic() - started >= 0.4
    out = api.kubectl('-n', ns, 'wait', '--for=condition=Ready', 'widget/w2', '--timeout=5s').stdout
    assert 'condition met' in out
    timeout = api.kubectl('-n', ns, 'wait', '--for=jsonpath={.status.phase}=Never', 'wd/w2', '--timeout=1s',
                          check=False)
    assert timeout.returncode != 0 and 'timed out' in timeout.stderr


def test_kubectl_delete_waits_for_finalizers_and_then_the_object_is_gone(api, ns):
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w3', size=1))
    api.kubectl('-n', ns, 'patch', 'wd', 'w3', '--type=merge', '-p', '{"metadata":{"finalizers":["example.io/x"]}}')
    proc = subprocess.Popen(['kubectl', f'--cache-dir={api.cache_dir}', '-n', ns, 'delete', 'wd', 'w3',
                             '--timeout=20s'], env=api.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 10
    while not ok(api.request('GET', WIDGETS.format(ns=ns) + '/w3'))['metadata'].get('deletionTimestamp'):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert proc.poll() is None  # kubectl is waiting for the finalizer
    api.kubectl('-n', ns, 'patch', 'wd', 'w3', '--type=json', '-p', '[{"op":"remove","path":"/metadata/finalizers"}]')
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 and out.strip() == 'widget.example.io "w3" deleted', err
    assert 'NotFound' in api.kubectl('-n', ns, 'get', 'wd', 'w3', check=False).stderr


def test_kubectl_get_configmap_as_yaml_and_json(api, ns):
    cm = 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c1, labels: {a: b}}\ndata: {key: value}\n'
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=cm)
    obj = yaml.safe_load(api.kubectl('-n', ns, 'get', 'configmap', 'c1', '-o', 'yaml').stdout)
    assert obj['kind'] == 'ConfigMap' and obj['data'] == {'key': 'value'} and obj['metadata']['namespace'] == ns
    lst = json.loads(api.kubectl('-n', ns, 'get', 'cm', '-l', 'a=b', '-o', 'json').stdout)
    assert [i['metadata']['name'] for i in lst['items']] == ['c1']
    assert api.kubectl('-n', ns, 'get', 'cm').stdout.split()[:4] == ['NAME', 'DATA', 'AGE', 'c1']


def test_kubectl_get_watch_prints_changes_until_the_request_timeout(api, ns):
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=WIDGET.format(name='w4', size=1))
    proc = subprocess.Popen(['kubectl', f'--cache-dir={api.cache_dir}', '-n', ns, 'get', 'wd', '-w',
                             '--request-timeout=4s'], env=api.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while not any(r['query'].get('watch') == 'true' and r['namespace'] == ns for r in api.requests()):
        assert time.monotonic() < deadline, 'kubectl never started watching'
        time.sleep(0.05)
    api.kubectl('-n', ns, 'patch', 'wd', 'w4', '--type=merge', '-p', '{"spec":{"size":8}}')
    out, err = proc.communicate(timeout=15)
    rows = [line.split() for line in out.splitlines()]
    assert rows[0] == ['NAME', 'SIZE', 'COLOR', 'PHASE', 'AGE'], (out, err)
    assert [r[:2] for r in rows[1:]] == [['w4', '1'], ['w4', '8']], (out, err)


def test_kubectl_imperative_create_commands_work_despite_their_protobuf_bodies(k8s_emulator):
    emu = k8s_emulator
    emu.kubectl('create', 'namespace', 'imp')
    emu.kubectl('-n', 'imp', 'create', 'configmap', 'c', '--from-literal=a=b', '--from-literal=e=')
    emu.kubectl('-n', 'imp', 'create', 'secret', 'generic', 's', '--from-literal=pw=hunter2')
    emu.kubectl('-n', 'imp', 'create', 'serviceaccount', 'sa')
    assert [r['contentType'] for r in emu.write_requests()] == ['application/vnd.kubernetes.protobuf'] * 4
    cm = ok(emu.request('GET', '/api/v1/namespaces/imp/configmaps/c'))
    assert cm['data'] == {'a': 'b', 'e': ''} and 'generateName' not in cm['metadata']
    secret = ok(emu.request('GET', '/api/v1/namespaces/imp/secrets/s'))
    assert secret['data'] == {'pw': 'aHVudGVyMg=='} and secret['type'] == 'Opaque'
    unsupported = emu.kubectl('-n', 'imp', 'create', 'deployment', 'd', '--image=x', check=False)
    assert unsupported.returncode != 0 and "kind 'Deployment' are not supported" in unsupported.stderr


def test_a_secrets_string_data_is_merged_into_its_data_and_never_stored(api, ns):
    secret = ('apiVersion: v1\nkind: Secret\nmetadata: {name: s}\ndata: {a: b2xk, b: Yg==}\n'
              'stringData: {a: new, c: "x y"}\n')
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=secret)
    stored = ok(api.request('GET', f'/api/v1/namespaces/{ns}/secrets/s'))
    assert stored['data'] == {'a': 'bmV3', 'b': 'Yg==', 'c': 'eCB5'} and 'stringData' not in stored, stored
    assert stored['type'] == 'Opaque'
    api.kubectl('-n', ns, 'patch', 'secret', 's', '--type=merge', '-p', '{"stringData":{"b":"two"}}')
    assert ok(api.request('GET', f'/api/v1/namespaces/{ns}/secrets/s'))['data']['b'] == 'dHdv'
    status, body = api.request('POST', f'/api/v1/namespaces/{ns}/secrets',
                               {'metadata': {'name': 't'}, 'stringData': {'a': 1}})
    assert status == 400 and 'stringData' in body['message'], body
    status, body = api.request('POST', f'/api/v1/namespaces/{ns}/secrets',
                               {'metadata': {'name': 't'}, 'stringData': {'a/b': 'x'}})
    assert status == 422 and 'data[a/b]' in body['message'], body


def test_kubectl_scale_uses_the_scale_subresource(api, ns):
    deployment = ('apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n  replicas: 1\n'
                  '  selector: {matchLabels: {app: d}}\n  template:\n    metadata: {labels: {app: d}}\n'
                  '    spec: {containers: [{name: c, image: x}]}\n')
    api.kubectl('-n', ns, 'apply', '--validate=false', '-f', '-', input=deployment)
    assert api.kubectl('-n', ns, 'scale', 'deployment', 'd', '--replicas=3').stdout.strip() == 'deployment.apps/d scaled'
    obj = ok(api.request('GET', f'/apis/apps/v1/namespaces/{ns}/deployments/d'))
    assert obj['spec']['replicas'] == 3 and obj['metadata']['generation'] == 2
    scale = ok(api.request('GET', f'/apis/apps/v1/namespaces/{ns}/deployments/d/scale'))
    assert scale['kind'] == 'Scale' and scale['spec'] == {'replicas': 3} and scale['status']['selector'] == 'app=d'


PROJECT_CRD = ROOT / 'crds' / 'modeldeployment.yaml'


def test_the_project_crd_is_served_and_kubectl_resolves_md(k8s_emulator_factory):
    emu = k8s_emulator_factory(crds=[PROJECT_CRD])
    doc = ok(emu.request('GET', '/apis/mnnrollout.io/v1alpha1'))
    assert {r['name'] for r in doc['resources']} == {'modeldeployments', 'modeldeployments/status',
                                                     'modeldeployments/scale'}
    header = emu.kubectl('get', 'md').stderr + emu.kubectl('get', 'modeldeployments').stderr
    assert 'No resources found' in header
