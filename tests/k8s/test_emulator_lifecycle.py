"""Deletion, finalizers, garbage collection, selectors, Tables, events, leases and the request log."""
import time

import pytest
from mnn_rollout.local.net import wait_for

from .helpers import CONFIGMAPS, WIDGETS, configmap, ok, watch, widget

pytestmark = pytest.mark.timeout(30)
MERGE = 'application/merge-patch+json'
TABLE = 'application/json;as=Table;v=v1;g=meta.k8s.io,application/json'


def owner_ref(owner: dict) -> dict:
    return {'apiVersion': owner['apiVersion'], 'kind': owner['kind'], 'name': owner['metadata']['name'],
            'uid': owner['metadata']['uid']}


# --- finalizers and deletion ---------------------------------------------------------------------

def test_delete_with_finalizers_marks_the_object_and_removing_the_last_finalizer_deletes_it(api, ns):
    url = WIDGETS.format(ns=ns) + '/f'
    created = ok(api.request('POST', WIDGETS.format(ns=ns), widget('f', finalizers=['a.io/x', 'b.io/y'])), 201)
    status, marked = api.request('DELETE', url)
    assert status == 200  # as a real server: 202 only for orphanDependents=false (below)
    assert marked['metadata']['deletionTimestamp'] and marked['metadata']['deletionGracePeriodSeconds'] == 0
    assert marked['metadata']['generation'] == 2  # a real server bumps it when marking for deletion
    assert ok(api.request('DELETE', url), 200)['metadata']['deletionTimestamp'] == marked['metadata']['deletionTimestamp']
    assert ok(api.request('DELETE', url + '?orphanDependents=false'), 202)['metadata']['deletionTimestamp']
    ok(api.request('PATCH', url, {'metadata': {'finalizers': ['b.io/y']}}, MERGE))
    assert ok(api.request('GET', url))['metadata']['finalizers'] == ['b.io/y']
    ok(api.request('PATCH', url, {'metadata': {'finalizers': []}}, MERGE))
    assert api.request('GET', url)[0] == 404
    _, events = watch(api, WIDGETS.format(ns=ns), {'resourceVersion': created['metadata']['resourceVersion'],
                                                   'timeoutSeconds': '1'})
    assert [e['type'] for e in events] == ['MODIFIED', 'MODIFIED', 'DELETED']
    assert events[-1]['object']['metadata']['finalizers'] == ['b.io/y']  # the last stored object, as upstream


def test_delete_without_finalizers_is_immediate(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('now')), 201)
    status, body = api.request('DELETE', WIDGETS.format(ns=ns) + '/now')
    assert status == 200 and body['kind'] == 'Status' and body['details']['name'] == 'now'  # customresource store
    assert api.request('GET', WIDGETS.format(ns=ns) + '/now')[0] == 404
    assert api.request('DELETE', WIDGETS.format(ns=ns) + '/now')[0] == 404


def test_no_new_finalizers_can_be_added_to_a_deleting_object(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('nf', finalizers=['a.io/x'])), 201)
    api.request('DELETE', WIDGETS.format(ns=ns) + '/nf')
    status, _ = api.request('PATCH', WIDGETS.format(ns=ns) + '/nf', {'metadata': {'finalizers': ['a.io/x', 'b.io/y']}},
                            MERGE)
    assert status == 422


def test_delete_preconditions_on_uid_and_resource_version_give_409(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('pre')), 201)
    body = {'kind': 'DeleteOptions', 'apiVersion': 'v1', 'preconditions': {'resourceVersion': '1'}}
    assert api.request('DELETE', CONFIGMAPS.format(ns=ns) + '/pre', body)[0] == 409
    body = {'preconditions': {'uid': 'not-the-uid'}}
    assert api.request('DELETE', CONFIGMAPS.format(ns=ns) + '/pre', body)[0] == 409


def test_deleting_an_owner_garbage_collects_its_dependents(api, ns):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('owner')), 201)
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('child', ownerReferences=[owner_ref(owner)])), 201)
    grandchild = configmap('grandchild', ownerReferences=[owner_ref(ok(api.request('GET', CONFIGMAPS.format(ns=ns) + '/child')))])
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), grandchild), 201)
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('bystander')), 201)
    ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/owner'))
    assert api.request('GET', CONFIGMAPS.format(ns=ns) + '/child')[0] == 404
    assert api.request('GET', CONFIGMAPS.format(ns=ns) + '/grandchild')[0] == 404
    assert api.request('GET', CONFIGMAPS.format(ns=ns) + '/bystander')[0] == 200


def test_orphan_propagation_keeps_dependents_and_strips_the_owner_reference(api, ns):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('owner')), 201)
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('kept', ownerReferences=[owner_ref(owner)])), 201)
    ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/owner?propagationPolicy=Orphan'))
    # the owner goes once the garbage collector has stripped the references and its "orphan" finalizer
    wait_for(lambda: api.request('GET', WIDGETS.format(ns=ns) + '/owner')[0] == 404, 10, 'the owner gone')
    assert 'ownerReferences' not in ok(api.request('GET', CONFIGMAPS.format(ns=ns) + '/kept'))['metadata']


def test_dependents_of_a_nonexistent_owner_are_collected_shortly_after_creation(api, ns):
    ghost = {'apiVersion': 'example.io/v1', 'kind': 'Widget', 'name': 'ghost',
             'uid': '00000000-0000-0000-0000-000000000000'}
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('dangling', ownerReferences=[ghost])), 201)
    deadline = time.monotonic() + 3
    while api.request('GET', CONFIGMAPS.format(ns=ns) + '/dangling')[0] == 200:
        assert time.monotonic() < deadline, 'the dangling dependent was not collected'
        time.sleep(0.05)


# --- selectors -----------------------------------------------------------------------------------

@pytest.mark.parametrize('selector, expected', [
    ('app=web', {'a', 'b'}), ('app==web', {'a', 'b'}), ('app!=web', {'c', 'd'}),
    ('app in (web,db)', {'a', 'b', 'c'}), ('app notin (web)', {'c', 'd'}), ('tier', {'a', 'c'}),
    ('!tier', {'b', 'd'}), ('app=web,tier=front', {'a'}), ('app in (web, db),!tier', {'b'}),
])
def test_label_selectors_support_every_operator(api, ns, selector, expected):
    labels = {'a': {'app': 'web', 'tier': 'front'}, 'b': {'app': 'web'}, 'c': {'app': 'db', 'tier': 'back'}, 'd': {}}
    for name, lbl in labels.items():
        ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap(name, labels=lbl)), 201)
    import urllib.parse
    lst = ok(api.request('GET', CONFIGMAPS.format(ns=ns) + '?labelSelector=' + urllib.parse.quote(selector)))
    assert {i['metadata']['name'] for i in lst['items']} == expected


def test_field_selectors_filter_by_name_and_namespace_and_reject_unsupported_fields(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('one')), 201)
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('two')), 201)
    names = lambda q: {i['metadata']['name'] for i in ok(api.request('GET', q))['items']}  # noqa: E731
    assert names(CONFIGMAPS.format(ns=ns) + '?fieldSelector=metadata.name%3Done') == {'one'}
    assert names(CONFIGMAPS.format(ns=ns) + '?fieldSelector=metadata.name!%3Done') == {'two'}
    assert names(f'/api/v1/configmaps?fieldSelector=metadata.namespace%3D{ns}') == {'one', 'two'}
    status, body = api.request('GET', CONFIGMAPS.format(ns=ns) + '?fieldSelector=data.x%3D1')
    assert status == 400 and body['reason'] == 'BadRequest'
    assert api.request('GET', CONFIGMAPS.format(ns=ns) + '?labelSelector=a%20in%20b')[0] == 400


# --- tables ----------------------------------------------------------------------------------------

def test_table_rendering_uses_the_crd_printer_columns(api, ns):
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('t', size=4)), 201)
    ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/t/status', {'status': {'phase': 'Ready'}}, MERGE))
    tbl = ok(api.request('GET', WIDGETS.format(ns=ns), headers={'Accept': TABLE}))
    assert tbl['kind'] == 'Table' and tbl['apiVersion'] == 'meta.k8s.io/v1'
    assert [c['name'] for c in tbl['columnDefinitions']] == ['Name', 'Size', 'Color', 'Phase', 'Age']
    name, size, color, phase, age = tbl['rows'][0]['cells']
    assert (name, size, color, phase) == ('t', 4, 'red', 'Ready') and age.endswith('s')
    assert tbl['rows'][0]['object']['kind'] == 'PartialObjectMetadata'
    one = ok(api.request('GET', WIDGETS.format(ns=ns) + '/t?includeObject=Object', headers={'Accept': TABLE}))
    assert one['rows'][0]['object']['spec']['size'] == 4


def test_table_rendering_for_builtins_has_name_and_age(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('tc', {'a': '1'})), 201)
    tbl = ok(api.request('GET', CONFIGMAPS.format(ns=ns), headers={'Accept': TABLE}))
    columns = [c['name'] for c in tbl['columnDefinitions']]
    assert columns[0] == 'Name' and columns[-1] == 'Age' and tbl['rows'][0]['cells'][0] == 'tc'


def test_human_ages_follow_the_api_server_format():
    from testbed.k8s.tables import human_duration
    assert [human_duration(s) for s in (5, 119, 150, 3600, 9 * 3600, 3 * 86400 + 3600, 400 * 86400)] == \
        ['5s', '119s', '2m30s', '60m', '9h', '3d1h', '400d']


# --- events, leases, peering objects -------------------------------------------------------------

def test_core_and_events_k8s_io_events_can_be_created_and_listed(api, ns):
    core = {'apiVersion': 'v1', 'kind': 'Event', 'metadata': {'generateName': 'w.'}, 'reason': 'Created',
            'message': 'hello', 'type': 'Normal', 'involvedObject': {'kind': 'Widget', 'name': 'w', 'namespace': ns}}
    ok(api.request('POST', f'/api/v1/namespaces/{ns}/events', core), 201)
    new = {'apiVersion': 'events.k8s.io/v1', 'kind': 'Event', 'metadata': {'name': 'e2'}, 'reason': 'Synced',
           'note': 'hi', 'type': 'Normal', 'action': 'Sync', 'reportingController': 'x', 'reportingInstance': 'y',
           'eventTime': '2024-01-01T00:00:00.000000Z', 'regarding': {'kind': 'Widget', 'name': 'w'}}
    ok(api.request('POST', f'/apis/events.k8s.io/v1/namespaces/{ns}/events', new), 201)
    listed = ok(api.request('GET', f'/api/v1/namespaces/{ns}/events?fieldSelector=involvedObject.name%3Dw'))
    assert [e['reason'] for e in listed['items']] == ['Created']


def test_leases_are_created_and_renewed_with_optimistic_concurrency(api, ns):
    url = f'/apis/coordination.k8s.io/v1/namespaces/{ns}/leases'
    lease = ok(api.request('POST', url, {'metadata': {'name': 'leader'}, 'spec': {'holderIdentity': 'a'}}), 201)
    lease['spec']['holderIdentity'] = 'b'
    ok(api.request('PUT', url + '/leader', lease))
    lease['spec']['holderIdentity'] = 'c'
    assert api.request('PUT', url + '/leader', lease)[0] == 409


# --- the request log -----------------------------------------------------------------------------

def test_request_log_records_method_path_query_and_content_type_and_can_be_reset(k8s_emulator):
    emu = k8s_emulator
    emu.reset_requests()
    ok(emu.request('POST', CONFIGMAPS.format(ns='default'), configmap('log')), 201)
    ok(emu.request('PATCH', CONFIGMAPS.format(ns='default') + '/log?fieldManager=me', {'data': {'a': 'b'}}, MERGE))
    emu.request('GET', CONFIGMAPS.format(ns='default') + '/log')
    log = emu.requests()
    assert [(r['method'], r['path']) for r in log] == [
        ('POST', '/api/v1/namespaces/default/configmaps'), ('PATCH', '/api/v1/namespaces/default/configmaps/log'),
        ('GET', '/api/v1/namespaces/default/configmaps/log')]
    assert log[1]['query'] == {'fieldManager': 'me'} and log[1]['contentType'] == MERGE
    assert log[1]['resource'] == 'configmaps' and log[1]['name'] == 'log' and log[1]['namespace'] == 'default'
    assert len(emu.write_requests()) == 2 and len(emu.write_requests('widgets')) == 0
    assert ok(emu.request('DELETE', '/_emulator/requests'))['cleared'] == 3
    assert emu.requests() == []
    assert ok(emu.request('GET', '/_emulator/healthz'))['status'] == 'ok'
