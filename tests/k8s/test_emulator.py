"""
The Kubernetes API emulator's behaviour, pinned over raw HTTP (what kopf and kubectl see).
Fixtures ``api`` (one emulator with the Widget CRD per module) and ``ns`` (a fresh namespace per
test) come from conftest.py. Deletion/GC/selectors/tables/events/request log are pinned in
test_emulator_lifecycle.py, watches in test_emulator_watch.py, the kubernetes Python client in
test_emulator_client.py, real kubectl in test_emulator_kubectl.py and kopf in test_emulator_kopf.py.
"""
import pytest
import yaml

from testbed.k8s.harness import WIDGET_CRD
from .helpers import CONFIGMAPS, WIDGETS, configmap, ok, widget

pytestmark = pytest.mark.timeout(30)


# --- discovery ---------------------------------------------------------------------------------

def test_core_discovery_reports_group_version_v1_with_the_builtin_resources(api):
    assert ok(api.request('GET', '/api'))['versions'] == ['v1']
    doc = ok(api.request('GET', '/api/v1'))
    assert doc['kind'] == 'APIResourceList' and doc['groupVersion'] == 'v1'
    by_name = {r['name']: r for r in doc['resources']}
    for plural in ('namespaces', 'pods', 'configmaps', 'services', 'serviceaccounts', 'secrets', 'events', 'endpoints'):
        assert plural in by_name and 'watch' in by_name[plural]['verbs']
    assert by_name['namespaces']['namespaced'] is False and by_name['configmaps']['namespaced'] is True
    assert by_name['configmaps']['shortNames'] == ['cm'] and by_name['configmaps']['kind'] == 'ConfigMap'
    assert ok(api.request('GET', '/version'))['major'] == '1'


def test_apis_group_list_includes_the_builtin_groups_and_registered_crds(api):
    groups = {g['name']: g for g in ok(api.request('GET', '/apis'))['groups']}
    for name in ('apps', 'rbac.authorization.k8s.io', 'coordination.k8s.io', 'events.k8s.io',
                 'apiextensions.k8s.io', 'example.io'):
        assert name in groups
    assert groups['example.io']['preferredVersion'] == {'groupVersion': 'example.io/v1', 'version': 'v1'}
    assert ok(api.request('GET', '/apis/example.io'))['kind'] == 'APIGroup'
    assert api.request('GET', '/apis/nonexistent.io/v1')[0] == 404


def test_group_version_discovery_lists_verbs_scope_kind_short_names_and_status_subresource(api):
    doc = ok(api.request('GET', '/apis/example.io/v1'))
    by_name = {r['name']: r for r in doc['resources']}
    assert doc['groupVersion'] == 'example.io/v1'
    assert by_name['widgets']['kind'] == 'Widget' and by_name['widgets']['namespaced'] is True
    assert by_name['widgets']['shortNames'] == ['wd'] and by_name['widgets']['singularName'] == 'widget'
    assert {'create', 'get', 'list', 'watch', 'patch', 'update', 'delete'} <= set(by_name['widgets']['verbs'])
    assert set(by_name['widgets/status']['verbs']) == {'get', 'patch', 'update'}


def test_crd_created_through_the_api_is_served_and_its_removal_deletes_its_objects(k8s_emulator):
    emu = k8s_emulator
    assert emu.request('GET', '/apis/example.io/v1')[0] == 404
    crd = yaml.safe_load(WIDGET_CRD.read_text())
    created = ok(emu.request('POST', '/apis/apiextensions.k8s.io/v1/customresourcedefinitions', crd), 201)
    conditions = {c['type']: c['status'] for c in created['status']['conditions']}
    assert conditions == {'Established': 'True', 'NamesAccepted': 'True'}
    ok(emu.request('POST', WIDGETS.format(ns='default'), widget('w1')), 201)
    ok(emu.request('DELETE', '/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.io'))
    assert emu.request('GET', '/apis/example.io/v1')[0] == 404
    assert emu.request('GET', WIDGETS.format(ns='default') + '/w1')[0] == 404
    ok(emu.request('POST', '/apis/apiextensions.k8s.io/v1/customresourcedefinitions', crd), 201)
    assert ok(emu.request('GET', WIDGETS.format(ns='default')))['items'] == []


def test_crd_with_a_wrong_name_is_422_invalid(k8s_emulator):
    crd = yaml.safe_load(WIDGET_CRD.read_text())
    crd['metadata']['name'] = 'gadgets.example.io'
    status, body = k8s_emulator.request('POST', '/apis/apiextensions.k8s.io/v1/customresourcedefinitions', crd)
    assert status == 422 and body['reason'] == 'Invalid'


# --- namespaces and objects --------------------------------------------------------------------

def test_default_namespaces_exist_and_can_be_listed(api):
    names = {n['metadata']['name'] for n in ok(api.request('GET', '/api/v1/namespaces'))['items']}
    assert {'default', 'kube-system', 'kube-public'} <= names
    assert ok(api.request('GET', '/api/v1/namespaces/default'))['status']['phase'] == 'Active'


def test_creating_in_a_missing_namespace_is_404_not_found(api):
    status, body = api.request('POST', CONFIGMAPS.format(ns='no-such-ns'), configmap('x'))
    assert status == 404 and body['kind'] == 'Status' and body['reason'] == 'NotFound'
    assert body['message'] == 'namespaces "no-such-ns" not found'


def test_deleting_a_namespace_terminates_it_and_removes_its_objects(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('plain')), 201)
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('held', finalizers=['example.io/hold'])), 201)
    assert ok(api.request('DELETE', f'/api/v1/namespaces/{ns}'), 200)['status']['phase'] == 'Terminating'
    assert api.request('GET', CONFIGMAPS.format(ns=ns) + '/plain')[0] == 404
    assert api.request('POST', CONFIGMAPS.format(ns=ns), configmap('late'))[0] == 403
    held = ok(api.request('GET', WIDGETS.format(ns=ns) + '/held'))
    assert held['metadata']['deletionTimestamp']
    ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/held', {'metadata': {'finalizers': None}},
                   'application/merge-patch+json'))
    assert api.request('GET', f'/api/v1/namespaces/{ns}')[0] == 404
    assert api.request('DELETE', '/api/v1/namespaces/default')[0] == 403


def test_created_object_gets_uid_timestamp_generation_resource_version_and_namespace(api, ns):
    body = configmap('cm', {'a': '1'})
    status, obj = api.request('POST', CONFIGMAPS.format(ns=ns), body)
    assert status == 201
    meta = obj['metadata']
    assert meta['namespace'] == ns and meta['uid'] and meta['creationTimestamp'].endswith('Z')
    assert meta['generation'] == 1 and int(meta['resourceVersion']) > 0
    assert ok(api.request('GET', CONFIGMAPS.format(ns=ns) + '/cm')) == obj


def test_generate_name_produces_a_unique_name(api, ns):
    a = ok(api.request('POST', CONFIGMAPS.format(ns=ns), {'metadata': {'generateName': 'gen-'}}), 201)
    b = ok(api.request('POST', CONFIGMAPS.format(ns=ns), {'metadata': {'generateName': 'gen-'}}), 201)
    assert a['metadata']['name'].startswith('gen-') and len(a['metadata']['name']) == 9
    assert a['metadata']['name'] != b['metadata']['name']


def test_duplicate_create_is_409_already_exists(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('dup')), 201)
    status, body = api.request('POST', WIDGETS.format(ns=ns), widget('dup'))
    assert status == 409 and body['reason'] == 'AlreadyExists'
    assert body['message'] == 'widgets.example.io "dup" already exists'


def test_missing_object_is_404_with_a_status_object(api, ns):
    status, body = api.request('GET', WIDGETS.format(ns=ns) + '/ghost')
    assert status == 404
    assert body == {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Failure',
                    'message': 'widgets.example.io "ghost" not found', 'reason': 'NotFound', 'code': 404,
                    'details': {'name': 'ghost', 'group': 'example.io', 'kind': 'widgets'}}


def test_errors_are_status_objects_for_bad_bodies_unknown_resources_and_protobuf(api, ns):
    status, body = api.request('POST', CONFIGMAPS.format(ns=ns), b'{not json')
    assert status == 400 and body['kind'] == 'Status' and body['status'] == 'Failure'
    assert api.request('GET', '/apis/example.io/v1/namespaces/default/gadgets')[1]['code'] == 404
    status, body = api.request('POST', CONFIGMAPS.format(ns=ns), b'k8s\x00', 'application/vnd.kubernetes.protobuf')
    assert status == 415 and body['reason'] == 'UnsupportedMediaType'
    status, body = api.request('POST', CONFIGMAPS.format(ns=ns), {'apiVersion': 'v2', 'metadata': {'name': 'x'}})
    assert status == 400 and 'does not match the expected API version' in body['message']


def test_a_json_body_with_nan_or_infinity_is_refused_as_go_refuses_it(api, ns):
    for constant in (b'NaN', b'Infinity', b'-Infinity'):
        raw = b'{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "nan"}, "data": {}, "x": ' + constant + b'}'
        status, body = api.request('POST', CONFIGMAPS.format(ns=ns), raw)
        assert status == 400 and 'is not JSON' in body['message'], (constant, body)
    status, _ = api.request('POST', CONFIGMAPS.format(ns=ns), {'metadata': {'name': 'finite'}, 'data': {'x': '1'}})
    assert status == 201  # the same body with a number is taken


def test_lists_carry_kind_api_version_and_resource_version(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('w')), 201)
    lst = ok(api.request('GET', WIDGETS.format(ns=ns)))
    assert lst['kind'] == 'WidgetList' and lst['apiVersion'] == 'example.io/v1'
    assert int(lst['metadata']['resourceVersion']) >= int(lst['items'][0]['metadata']['resourceVersion'])
    assert lst['items'][0]['kind'] == 'Widget'  # custom resource lists carry kind per item ...
    cms = ok(api.request('GET', CONFIGMAPS.format(ns='default')))
    assert cms['kind'] == 'ConfigMapList' and cms['apiVersion'] == 'v1'


def test_list_pagination_uses_limit_and_continue(api, ns):
    for n in range(5):
        ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap(f'p{n}')), 201)
    first = ok(api.request('GET', CONFIGMAPS.format(ns=ns) + '?limit=2'))
    assert [i['metadata']['name'] for i in first['items']] == ['p0', 'p1']
    assert first['metadata']['remainingItemCount'] == 3
    rest = ok(api.request('GET', CONFIGMAPS.format(ns=ns) + f'?limit=10&continue={first["metadata"]["continue"]}'))
    assert [i['metadata']['name'] for i in rest['items']] == ['p2', 'p3', 'p4'] and 'continue' not in rest['metadata']


def test_generation_bumps_only_on_spec_changes(api, ns):
    url = WIDGETS.format(ns=ns) + '/g'
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('g')), 201)
    merge = 'application/merge-patch+json'
    assert ok(api.request('PATCH', url, {'metadata': {'labels': {'x': 'y'}}}, merge))['metadata']['generation'] == 1
    assert ok(api.request('PATCH', url + '/status', {'status': {'phase': 'A'}}, merge))['metadata']['generation'] == 1
    assert ok(api.request('PATCH', url, {'spec': {'size': 2}}, merge))['metadata']['generation'] == 2
    cm_url = CONFIGMAPS.format(ns=ns) + '/cmg'
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('cmg', {'a': '1'})), 201)
    assert ok(api.request('PATCH', cm_url, {'metadata': {'labels': {'x': 'y'}}}, merge))['metadata']['generation'] == 1
    assert ok(api.request('PATCH', cm_url, {'data': {'a': '2'}}, merge))['metadata']['generation'] == 2


def test_resource_versions_grow_globally_and_noop_writes_keep_them(api, ns):
    a = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('a')), 201)
    b = ok(api.request('POST', WIDGETS.format(ns=ns), widget('b')), 201)
    assert int(b['metadata']['resourceVersion']) > int(a['metadata']['resourceVersion'])
    same = ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/b', {'spec': {'size': 1}},
                          'application/merge-patch+json'))
    assert same['metadata']['resourceVersion'] == b['metadata']['resourceVersion']


def test_custom_resources_are_defaulted_pruned_and_validated_by_their_schema(api, ns):
    body = widget('s', size=3)
    body['spec']['unknown'] = 'dropped'
    body['junk'] = 1
    obj = ok(api.request('POST', WIDGETS.format(ns=ns), body), 201)
    assert obj['spec'] == {'size': 3, 'color': 'red'} and 'junk' not in obj
    status, err = api.request('POST', WIDGETS.format(ns=ns), widget('bad', size='three'))
    assert status == 422 and err['reason'] == 'Invalid' and 'spec.size' in err['message']
    status, err = api.request('POST', WIDGETS.format(ns=ns), {**widget('bad2'), 'spec': {'color': 'pink'}})
    assert status == 422 and {c['field'] for c in err['details']['causes']} == {'spec.color', 'spec.size'}
    status, err = api.request('PATCH', WIDGETS.format(ns=ns) + '/s', {'spec': {'size': -1}},
                              'application/merge-patch+json')
    assert status == 422


# --- updates -------------------------------------------------------------------------------------

def test_put_replaces_the_object_and_keeps_server_owned_metadata(api, ns):
    obj = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('r', {'a': '1', 'b': '2'})), 201)
    obj['data'] = {'c': '3'}
    obj['metadata']['uid'] = obj['metadata']['uid']
    new = ok(api.request('PUT', CONFIGMAPS.format(ns=ns) + '/r', obj))
    assert new['data'] == {'c': '3'} and new['metadata']['uid'] == obj['metadata']['uid']
    assert int(new['metadata']['resourceVersion']) > int(obj['metadata']['resourceVersion'])
    obj['metadata']['name'] = 'other'
    assert api.request('PUT', CONFIGMAPS.format(ns=ns) + '/r', obj)[0] == 400


def test_merge_patch_merges_dicts_and_null_deletes_keys(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('m', {'a': '1', 'b': '2'})), 201)
    new = ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/m', {'data': {'a': None, 'c': '3'}},
                         'application/merge-patch+json'))
    assert new['data'] == {'b': '2', 'c': '3'}


def test_strategic_merge_patch_merges_containers_by_name_and_is_refused_for_custom_resources(api, ns):
    deploy = {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': 'd'},
              'spec': {'selector': {'matchLabels': {'app': 'd'}},
                       'template': {'metadata': {'labels': {'app': 'd'}},
                                    'spec': {'containers': [{'name': 'a', 'image': 'a:1'},
                                                            {'name': 'b', 'image': 'b:1'}]}}}}
    ok(api.request('POST', f'/apis/apps/v1/namespaces/{ns}/deployments', deploy), 201)
    patch = {'spec': {'template': {'spec': {'containers': [{'name': 'b', 'image': 'b:2'}]}}}}
    new = ok(api.request('PATCH', f'/apis/apps/v1/namespaces/{ns}/deployments/d', patch,
                         'application/strategic-merge-patch+json'))
    images = [(c['name'], c['image']) for c in new['spec']['template']['spec']['containers']]
    assert images == [('a', 'a:1'), ('b', 'b:2')]
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('smp')), 201)
    status, _ = api.request('PATCH', WIDGETS.format(ns=ns) + '/smp', {'spec': {'size': 2}},
                            'application/strategic-merge-patch+json')
    assert status == 415


def test_json_patch_applies_operations_and_a_failed_test_op_is_422(api, ns):
    obj = ok(api.request('POST', WIDGETS.format(ns=ns), widget('j', finalizers=['example.io/f'])), 201)
    rv = obj['metadata']['resourceVersion']
    ops = [{'op': 'test', 'path': '/metadata/resourceVersion', 'value': rv},
           {'op': 'remove', 'path': '/metadata/finalizers'}, {'op': 'replace', 'path': '/spec/size', 'value': 7}]
    new = ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/j', ops, 'application/json-patch+json'))
    assert 'finalizers' not in new['metadata'] and new['spec']['size'] == 7
    status, body = api.request('PATCH', WIDGETS.format(ns=ns) + '/j', ops, 'application/json-patch+json')
    assert status == 422 and body['kind'] == 'Status'


def test_stale_resource_version_update_gets_409(api, ns):
    obj = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('c', {'a': '1'})), 201)
    ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/c', {'data': {'a': '2'}}, 'application/merge-patch+json'))
    obj['data'] = {'a': 'stale'}
    status, body = api.request('PUT', CONFIGMAPS.format(ns=ns) + '/c', obj)
    assert status == 409 and body['reason'] == 'Conflict'
    assert 'the object has been modified' in body['message']
    stale = {'metadata': {'resourceVersion': obj['metadata']['resourceVersion']}, 'data': {'a': 'x'}}
    assert api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/c', stale, 'application/merge-patch+json')[0] == 409
    assert ok(api.request('GET', CONFIGMAPS.format(ns=ns) + '/c'))['data'] == {'a': '2'}


# --- status subresource --------------------------------------------------------------------------

def test_a_built_in_kind_that_breaks_its_schema_is_refused_with_422_naming_the_field(api, ns):
    deploy = {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': 'bad'},
              'spec': {'selector': {'matchLabels': {'app': 'bad'}},
                       'template': {'metadata': {'labels': {'app': 'bad'}},
                                    'spec': {'containers': [{'name': 'a', 'image': 'a:1'}],
                                             'volumes': [{'name': 'v', 'emptyDir': 'oops'}]}}}}
    status, body = api.request('POST', f'/apis/apps/v1/namespaces/{ns}/deployments', deploy)
    assert status == 422 and body['reason'] == 'Invalid'
    assert body['details']['causes'][0]['field'] == 'spec.template.spec.volumes[0].emptyDir'
    deploy['spec']['template']['spec']['volumes'][0]['emptyDir'] = {}
    ok(api.request('POST', f'/apis/apps/v1/namespaces/{ns}/deployments', deploy), 201)


def test_status_subresource_writes_change_only_the_status(api, ns):
    obj = ok(api.request('POST', WIDGETS.format(ns=ns), widget('st')), 201)
    obj['spec']['size'] = 99
    obj['metadata']['labels'] = {'ignored': 'yes'}
    obj['status'] = {'phase': 'Ready'}
    new = ok(api.request('PUT', WIDGETS.format(ns=ns) + '/st/status', obj))
    assert new['status'] == {'phase': 'Ready'} and new['spec']['size'] == 1 and 'labels' not in new['metadata']
    assert int(new['metadata']['resourceVersion']) > int(obj['metadata']['resourceVersion'])


def test_main_resource_writes_ignore_status_when_the_subresource_is_enabled(api, ns):
    body = widget('ig', status={'phase': 'FromCreate'})
    assert 'status' not in ok(api.request('POST', WIDGETS.format(ns=ns), body), 201)
    ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/ig/status', {'status': {'phase': 'Real'}},
                   'application/merge-patch+json'))
    new = ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/ig', {'status': {'phase': 'Fake'}, 'spec': {'size': 5}},
                         'application/merge-patch+json'))
    assert new['status'] == {'phase': 'Real'} and new['spec']['size'] == 5


def test_status_subresource_is_404_for_kinds_without_it(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('nost')), 201)
    assert api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/nost/status', {'status': {}},
                       'application/merge-patch+json')[0] == 404


def test_custom_resources_refuse_a_put_without_resource_version_like_a_real_server(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('u')), 201)
    status, body = api.request('PUT', WIDGETS.format(ns=ns) + '/u', widget('u', size=2))
    assert status == 422 and 'metadata.resourceVersion' in body['message']
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('u')), 201)
    ok(api.request('PUT', CONFIGMAPS.format(ns=ns) + '/u', configmap('u', {'a': 'b'})))  # built-ins allow it


def test_invalid_names_and_labels_are_422(api, ns):
    assert api.request('POST', CONFIGMAPS.format(ns=ns), configmap('Upper_Case'))[0] == 422
    assert api.request('POST', '/api/v1/namespaces', {'metadata': {'name': 'has.dot'}})[0] == 422
    assert api.request('POST', CONFIGMAPS.format(ns=ns), configmap('l', labels={'k': 'bad value!'}))[0] == 422


def test_crd_cel_validation_rules_are_enforced_including_transition_rules(k8s_emulator):
    pytest.importorskip('celpy', reason='cel-python is needed to enforce x-kubernetes-validations')
    crd = yaml.safe_load(WIDGET_CRD.read_text())
    spec_schema = crd['spec']['versions'][0]['schema']['openAPIV3Schema']['properties']['spec']
    spec_schema['properties']['weights'] = {'type': 'object', 'additionalProperties': {'type': 'integer'}}
    spec_schema['x-kubernetes-validations'] = [
        {'rule': '!has(self.weights) || self.weights.map(k, self.weights[k]).sum() == 100',
         'message': 'weights must sum to 100'},
        {'rule': 'self.size >= oldSelf.size', 'message': 'size may not shrink'}]
    ok(k8s_emulator.request('POST', '/apis/apiextensions.k8s.io/v1/customresourcedefinitions', crd), 201)
    url = WIDGETS.format(ns='default')
    ok(k8s_emulator.request('POST', url, {**widget('c', size=2), 'spec': {'size': 2, 'weights': {'a': 60, 'b': 40}}}), 201)
    status, body = k8s_emulator.request('POST', url, {**widget('d'), 'spec': {'size': 1, 'weights': {'a': 60}}})
    assert status == 422 and 'weights must sum to 100' in body['message']
    merge = 'application/merge-patch+json'
    status, body = k8s_emulator.request('PATCH', url + '/c', {'spec': {'size': 1}}, merge)
    assert status == 422 and 'size may not shrink' in body['message']
    ok(k8s_emulator.request('PATCH', url + '/c', {'spec': {'size': 3}}, merge))
