"""The emulator as a program and a library: CLI entry, kubeconfig, fault injection, in-process use."""
import json
import subprocess
import sys
import urllib.request

import kmock
import pytest
import yaml

from testbed.k8s.emulator import Emulator
from testbed.k8s.harness import ROOT, WIDGET_CRD
from .helpers import CONFIGMAPS, WIDGETS, configmap, ok, widget

pytestmark = pytest.mark.timeout(30)


def test_the_cli_prints_ready_with_its_url_and_registers_crds_from_files():
    proc = subprocess.Popen([sys.executable, '-m', 'testbed.k8s.emulator', '--host', '127.0.0.1', '--port', '0',
                             '--crd', str(WIDGET_CRD)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith('READY http://127.0.0.1:')
        with urllib.request.urlopen(line.split()[1] + '/apis/example.io/v1', timeout=5) as rsp:
            assert json.load(rsp)['resources'][0]['name'] == 'widgets'
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_the_kubeconfig_points_at_the_emulator(k8s_emulator):
    config = yaml.safe_load(k8s_emulator.kubeconfig_path.read_text())
    assert config['clusters'][0]['cluster']['server'] == k8s_emulator.url
    assert config['contexts'][0]['context']['namespace'] == 'default'
    assert k8s_emulator.kubectl('config', 'view', '--minify', '-o', 'jsonpath={.clusters[0].cluster.server}'
                                ).stdout == k8s_emulator.url


def test_injected_faults_fail_the_next_matching_requests_then_stop(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('f')), 201)
    api.inject_fault(code=500, method='PATCH', path=f'/namespaces/{ns}/widgets/f$', times=2)
    patch = ({'spec': {'size': 2}}, 'application/merge-patch+json')
    assert api.request('GET', WIDGETS.format(ns=ns) + '/f')[0] == 200  # other methods are untouched
    status, body = api.request('PATCH', WIDGETS.format(ns=ns) + '/f', *patch)
    assert status == 500 and body['kind'] == 'Status' and body['message'] == 'injected by the emulator'
    assert api.request('PATCH', WIDGETS.format(ns=ns) + '/f', *patch)[0] == 500
    assert ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/f', *patch))['spec']['size'] == 2
    api.inject_fault(code=409, reason='Conflict', times=-1, path=f'/namespaces/{ns}/')
    assert api.request('POST', CONFIGMAPS.format(ns=ns), configmap('x'))[0] == 409
    ok(api.request('DELETE', '/_emulator/faults'))
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('x')), 201)


@pytest.mark.asyncio
async def test_in_process_kmock_reactions_take_priority_over_the_emulation():
    emu = Emulator()
    async with emu, kmock.Server(emu):
        emu['get', kmock.resource('', 'v1', 'configmaps'), kmock.name('teapot')] << 418
        async with emu.get('/api/v1/namespaces/default/configmaps/teapot') as rsp:
            assert rsp.status == 418
        async with emu.post('/api/v1/namespaces/default/configmaps', json={'metadata': {'name': 'real'}}) as rsp:
            assert rsp.status == 201
        async with emu.get('/api/v1/namespaces/default/configmaps/real') as rsp:
            assert rsp.status == 200 and (await rsp.json())['metadata']['namespace'] == 'default'
        assert len(emu) == 3  # kmock's own request log
        rd = emu.registry.get('', 'v1', 'configmaps')
        assert emu.store.get(rd, 'default', 'real')['metadata']['generation'] == 1
