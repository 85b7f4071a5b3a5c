"""Server-side apply and managedFields in the emulator: over raw HTTP, and with real
``kubectl apply --server-side`` (kubectl 1.32)."""
import json

import pytest
import yaml

from .helpers import CONFIGMAPS, WIDGETS, ok, widget

pytestmark = pytest.mark.timeout(60)
APPLY = 'application/apply-patch+yaml'
MERGE = 'application/merge-patch+json'
DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


def cm(name, data, **meta):
    return {'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': {'name': name, **meta}, 'data': data}


def apply(api, path, body, manager='m1', force=False, **params):
    query = {'fieldManager': manager, **({'force': 'true'} if force else {}), **params}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return api.request('PATCH', path + '?' + '&'.join(f'{k}={v}' for k, v in query.items()), data, APPLY)


def managed(obj):
    """manager/operation[/subresource] -> fieldsV1."""
    return {'/'.join(filter(None, [e['manager'], e['operation'], e.get('subresource')])): e['fieldsV1']
            for e in obj['metadata'].get('managedFields') or []}


def test_apply_creates_then_updates_and_removes_the_fields_it_no_longer_applies(api, ns):
    path = CONFIGMAPS.format(ns=ns) + '/c'
    status, obj = apply(api, path, cm('c', {'a': '1', 'b': '2'}, labels={'app': 'x'}))
    assert status == 201 and obj['data'] == {'a': '1', 'b': '2'}
    entry = obj['metadata']['managedFields'][0]
    assert {k: entry[k] for k in ('manager', 'operation', 'apiVersion', 'fieldsType')} == \
        {'manager': 'm1', 'operation': 'Apply', 'apiVersion': 'v1', 'fieldsType': 'FieldsV1'}
    assert entry['fieldsV1'] == {'f:data': {'f:a': {}, 'f:b': {}}, 'f:metadata': {'f:labels': {'f:app': {}}}}
    rv = obj['metadata']['resourceVersion']
    assert ok(apply(api, path, cm('c', {'a': '1', 'b': '2'}, labels={'app': 'x'})))['metadata']['resourceVersion'] == rv
    obj = ok(apply(api, path, cm('c', {'a': '2'})))  # b and the label dropped: removed
    assert obj['data'] == {'a': '2'} and 'labels' not in obj['metadata']
    assert managed(obj) == {'m1/Apply': {'f:data': {'f:a': {}}}}
    assert ok(api.request('GET', path))['data'] == {'a': '2'}


def test_an_apply_body_may_be_yaml_and_another_appliers_fields_stay(api, ns):
    path = CONFIGMAPS.format(ns=ns) + '/y'
    ok(apply(api, path, b'apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: y\ndata:\n  a: "1"\n'), 201)
    obj = ok(apply(api, path, cm('y', {'b': '2'}), manager='m2'))
    assert obj['data'] == {'a': '1', 'b': '2'}
    assert managed(obj) == {'m1/Apply': {'f:data': {'f:a': {}}}, 'm2/Apply': {'f:data': {'f:b': {}}}}
    obj = ok(apply(api, path, cm('y', {}), manager='m2'))  # m2 drops b: only m2's field goes
    assert obj['data'] == {'a': '1'} and list(managed(obj)) == ['m1/Apply']


def test_a_field_another_manager_set_differently_is_a_conflict_unless_forced(api, ns):
    path = CONFIGMAPS.format(ns=ns) + '/k'
    ok(api.request('POST', CONFIGMAPS.format(ns=ns) + '?fieldManager=creator', cm('k', {'a': '1', 'b': '2'})), 201)
    obj = ok(api.request('GET', path))
    assert managed(obj) == {'creator/Update': {'f:data': {'f:a': {}, 'f:b': {}}}}
    status, body = apply(api, path, cm('k', {'a': '1', 'b': 'mine'}))
    assert status == 409 and body['reason'] == 'Conflict'
    assert body['message'] == 'Apply failed with 1 conflict: conflict with "creator" using v1: .data.b'
    assert body['details']['causes'] == [{'reason': 'FieldManagerConflict', 'field': '.data.b',
                                          'message': 'conflict with "creator" using v1'}]
    assert ok(api.request('GET', path))['data'] == {'a': '1', 'b': '2'}  # nothing written
    # the same value is no conflict: both own it
    obj = ok(apply(api, path, cm('k', {'a': '1'})))
    assert managed(obj) == {'creator/Update': {'f:data': {'f:a': {}, 'f:b': {}}}, 'm1/Apply': {'f:data': {'f:a': {}}}}
    # forced: the value changes and the field moves to the applier
    obj = ok(apply(api, path, cm('k', {'a': '1', 'b': 'mine'}), force=True))
    assert obj['data'] == {'a': '1', 'b': 'mine'}
    assert managed(obj) == {'creator/Update': {'f:data': {'f:a': {}}},
                            'm1/Apply': {'f:data': {'f:a': {}, 'f:b': {}}}}
    # a shared field the applier drops stays (creator still owns it); an own field goes
    obj = ok(apply(api, path, cm('k', {})))
    assert obj['data'] == {'a': '1'} and list(managed(obj)) == ['creator/Update']


def test_update_managers_own_what_they_change_named_by_field_manager_or_user_agent(api, ns):
    path = CONFIGMAPS.format(ns=ns) + '/u'
    ok(apply(api, path, cm('u', {'a': '1', 'b': '2'})), 201)
    obj = ok(api.request('PATCH', path, {'data': {'b': '3', 'c': '4'}}, MERGE, headers={'User-Agent': 'tool/1.2 (x)'}))
    assert managed(obj) == {'m1/Apply': {'f:data': {'f:a': {}}}, 'tool/Update': {'f:data': {'f:b': {}, 'f:c': {}}}}
    obj['data'] = {'a': '1', 'b': '3'}
    obj = ok(api.request('PUT', path + '?fieldManager=editor', obj))  # c removed: out of every set
    assert managed(obj) == {'m1/Apply': {'f:data': {'f:a': {}}}, 'tool/Update': {'f:data': {'f:b': {}}}}
    status, body = apply(api, path, cm('u', {'a': '1', 'b': '9'}))
    assert status == 409 and 'conflict with "tool"' in body['message']
    status, body = api.request('PATCH', path + '?force=true', {'data': {'a': '5'}}, MERGE)
    assert status == 422 and 'non-apply' in body['message']
    # managedFields sent by a client replace the stored ones; [{}] clears them
    obj = ok(api.request('PATCH', path, {'metadata': {'managedFields': [{}]}}, MERGE))
    assert 'managedFields' not in obj['metadata']


def test_apply_needs_a_field_manager_a_type_and_a_matching_name(api, ns):
    path = CONFIGMAPS.format(ns=ns) + '/v'
    status, body = api.request('PATCH', path, cm('v', {}), APPLY)
    assert status == 422 and 'fieldManager: Required value' in body['message']
    assert apply(api, path, {'metadata': {'name': 'v'}, 'data': {}})[0] == 400
    assert apply(api, path, cm('other', {}))[0] == 400
    assert apply(api, path, {**cm('v', {}), 'kind': 'Secret'})[0] == 400
    assert apply(api, path, b'data: [unclosed')[0] == 400
    assert apply(api, CONFIGMAPS.format(ns=ns) + '/w', cm('w', {}), dryRun='All')[0] == 201
    assert api.request('GET', CONFIGMAPS.format(ns=ns) + '/w')[0] == 404  # a dry run stores nothing
    status, body = api.request('PATCH', path, cm('v', {}), 'application/apply-patch+cbor')
    assert status == 415


def test_keyed_lists_merge_item_by_item_and_an_item_the_applier_drops_goes(api, ns):
    path = DEPLOYMENTS.format(ns=ns) + '/d'

    def deployment(*containers):
        return {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': 'd'},
                'spec': {'selector': {'matchLabels': {'app': 'd'}}, 'template': {
                    'metadata': {'labels': {'app': 'd'}}, 'spec': {'containers': list(containers)}}}}

    ok(apply(api, path, deployment({'name': 'a', 'image': 'a:1'}, {'name': 'b', 'image': 'b:1'})), 201)
    sidecar = {'spec': {'template': {'spec': {'containers': [{'name': 'injected', 'image': 's:1'}]}}}}
    obj = ok(api.request('PATCH', path + '?fieldManager=injector', sidecar, 'application/strategic-merge-patch+json'))
    names = lambda o: [c['name'] for c in o['spec']['template']['spec']['containers']]  # noqa: E731
    assert names(obj) == ['a', 'b', 'injected']
    fields = managed(obj)['m1/Apply']['f:spec']['f:template']['f:spec']['f:containers']
    assert fields['k:{"name":"a"}'] == {'.': {}, 'f:image': {}, 'f:name': {}}
    obj = ok(apply(api, path, deployment({'name': 'a', 'image': 'a:2'})))  # b dropped, a changed
    assert names(obj) == ['a', 'injected'] and obj['spec']['template']['spec']['containers'][0]['image'] == 'a:2'
    ok(api.request('PATCH', path + '?fieldManager=injector', {'spec': {'template': {'spec': {
        'containers': [{'name': 'a', 'image': 'hacked'}]}}}}, 'application/strategic-merge-patch+json'))
    status, body = apply(api, path, deployment({'name': 'a', 'image': 'a:3'}))
    assert status == 409
    assert '.spec.template.spec.containers[name="a"].image' in body['message'] and '"injector"' in body['message']


def test_status_is_applied_through_its_subresource_only(api, ns):
    path = WIDGETS.format(ns=ns) + '/w'
    body = {**widget('w', size=2), 'status': {'phase': 'Ignored'}}
    obj = ok(apply(api, path, body, manager='owner'), 201)
    assert 'status' not in obj and obj['spec'] == {'size': 2, 'color': 'red'}  # color: the CRD's default
    assert managed(obj) == {'owner/Apply': {'f:spec': {'f:size': {}}}}
    status_body = {'apiVersion': 'example.io/v1', 'kind': 'Widget', 'metadata': {'name': 'w'},
                   'status': {'phase': 'Ready'}, 'spec': {'size': 99}}
    obj = ok(apply(api, path + '/status', status_body, manager='controller'))
    assert obj['status'] == {'phase': 'Ready'} and obj['spec']['size'] == 2
    assert managed(obj)['controller/Apply/status'] == {'f:status': {'f:phase': {}}}
    assert apply(api, WIDGETS.format(ns=ns) + '/absent/status', {**status_body, 'metadata': {'name': 'absent'}},
                 manager='controller')[0] == 404
    obj = ok(apply(api, path, widget('w', size=3), manager='owner'))  # status and its owner stay
    assert obj['status'] == {'phase': 'Ready'} and 'controller/Apply/status' in managed(obj)


def test_kubectl_apply_server_side_creates_conflicts_forces_and_prunes(k8s_emulator):
    emu = k8s_emulator
    manifest = 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: s1, labels: {x: "1"}}\ndata: {a: "1", b: "2"}\n'
    ssa = ('apply', '--server-side', '--validate=false', '-f', '-')
    assert emu.kubectl(*ssa, input=manifest).stdout.strip() == 'configmap/s1 serverside-applied'
    request = emu.write_requests('configmaps')[-1]
    assert (request['method'], request['contentType'], request['query']['fieldManager']) == \
        ('PATCH', APPLY, 'kubectl')
    emu.kubectl(*ssa, input=manifest.replace(', b: "2"', ''))
    obj = yaml.safe_load(emu.kubectl('get', 'cm', 's1', '-o', 'yaml', '--show-managed-fields').stdout)
    assert obj['data'] == {'a': '1'} and managed(obj) == {'kubectl/Apply': {
        'f:data': {'f:a': {}}, 'f:metadata': {'f:labels': {'f:x': {}}}}}
    emu.kubectl('create', 'configmap', 's2', '--from-literal=a=1')
    other = manifest.replace('s1', 's2').replace('a: "1"', 'a: "9"')
    result = emu.kubectl(*ssa, input=other, check=False)
    assert result.returncode == 1
    assert 'Apply failed with 1 conflict: conflict with "kubectl-create" using v1: .data.a' in result.stderr
    emu.kubectl(*ssa, '--force-conflicts', input=other)
    obj = json.loads(emu.kubectl('get', 'cm', 's2', '-o', 'json', '--show-managed-fields').stdout)
    assert obj['data'] == {'a': '9', 'b': '2'} and list(managed(obj)) == ['kubectl/Apply']


def test_kubectl_moves_a_client_side_applied_object_to_server_side_apply(k8s_emulator):
    """kubectl's upgrade rewrites managedFields with a JSON patch; the next apply then prunes what
    the old client-side configuration had and the new one has not."""
    emu = k8s_emulator
    manifest = 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: m}\ndata: {a: "1", b: "2"}\n'
    emu.kubectl('apply', '--validate=false', '-f', '-', input=manifest)
    obj = json.loads(emu.kubectl('get', 'cm', 'm', '-o', 'json', '--show-managed-fields').stdout)
    assert list(managed(obj)) == ['kubectl-client-side-apply/Update']
    emu.kubectl('apply', '--server-side', '--validate=false', '-f', '-', input=manifest.replace('b: "2"', 'c: "3"'))
    obj = json.loads(emu.kubectl('get', 'cm', 'm', '-o', 'json', '--show-managed-fields').stdout)
    assert obj['data'] == {'a': '1', 'c': '3'}
    assert managed(obj)['kubectl/Apply']['f:data'] == {'f:a': {}, 'f:c': {}}
