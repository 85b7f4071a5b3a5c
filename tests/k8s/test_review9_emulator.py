"""
Deletion propagation against kube-apiserver 1.30 and the garbage collector of kube-controller-manager,
where the emulator differed before (it deleted the owner at once whatever the policy):

1. ``propagationPolicy=Foreground``: the DELETE adds the ``foregroundDeletion`` finalizer and marks the
   object (generic registry store.go, deletionFinalizersForGarbageCollection / updateForGracefulDeletion-
   AndFinalizers), answered 200 with the object, a MODIFIED event; the collector deletes the dependents
   (in Foreground those that have dependents) and removes the finalizer once no ``blockOwnerDeletion``
   dependent is left (pkg/controller/garbagecollector, processDeletingDependentsItem).
2. ``Orphan`` / ``orphanDependents=true``: the ``orphan`` finalizer; the collector strips the dependents'
   references to the owner, then the finalizer (attemptToOrphan).
3. the default policy of the kind: Background, Orphan for core/v1 ReplicationControllers; Events take no
   GC finalizer (their strategy's DefaultGarbageCollectionPolicy is Unsupported).
4. ``kubectl delete --cascade=foreground|orphan`` sends the policy and waits for the object to go.

Fixtures ``api`` and ``ns`` come from conftest.py.
"""
import pytest
from mnn_rollout.local.net import wait_for

from .helpers import CONFIGMAPS, WIDGETS, configmap, ok, watch, widget

pytestmark = pytest.mark.timeout(120)
MERGE = 'application/merge-patch+json'


def ref(owner: dict, block: bool = True) -> dict:
    return {'apiVersion': owner['apiVersion'], 'kind': owner['kind'], 'name': owner['metadata']['name'],
            'uid': owner['metadata']['uid'], 'blockOwnerDeletion': block}


def gone(api, path: str) -> bool:
    return api.request('GET', path)[0] == 404


def test_a_foreground_delete_keeps_the_owner_until_its_blocking_dependents_are_gone(api, ns):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('owner')), 201)
    cms = CONFIGMAPS.format(ns=ns)
    child = ok(api.request('POST', cms, configmap('child', ownerReferences=[ref(owner)])), 201)
    ok(api.request('POST', cms, configmap('grandchild', ownerReferences=[ref(child)])), 201)
    ok(api.request('POST', cms, configmap('held', ownerReferences=[ref(owner)], finalizers=['a.io/hold'])), 201)
    ok(api.request('POST', cms, configmap('loose', ownerReferences=[ref(owner, block=False)])), 201)
    status, body = api.request('DELETE', WIDGETS.format(ns=ns) + '/owner?propagationPolicy=Foreground')
    assert status == 200 and body['kind'] == 'Widget', body  # kept: the object, not a Status
    assert body['metadata']['finalizers'] == ['foregroundDeletion'] and body['metadata']['deletionTimestamp']
    wait_for(lambda: gone(api, cms + '/child') and gone(api, cms + '/grandchild') and gone(api, cms + '/loose')
             and ok(api.request('GET', cms + '/held'))['metadata'].get('deletionTimestamp'), 10,
             'the dependents deleted by the collector')
    kept = ok(api.request('GET', WIDGETS.format(ns=ns) + '/owner'))  # "held" still blocks it
    assert kept['metadata']['finalizers'] == ['foregroundDeletion']
    ok(api.request('PATCH', cms + '/held', {'metadata': {'finalizers': None}}, MERGE))
    wait_for(lambda: gone(api, WIDGETS.format(ns=ns) + '/owner'), 10, 'the owner gone after its dependents')
    _, events = watch(api, WIDGETS.format(ns=ns), {'resourceVersion': owner['metadata']['resourceVersion'],
                                                   'timeoutSeconds': '1'})
    assert [e['type'] for e in events] == ['MODIFIED', 'DELETED']
    assert events[0]['object']['metadata']['finalizers'] == ['foregroundDeletion']


def test_the_dependent_with_dependents_is_deleted_in_the_foreground_too(api, ns):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('top')), 201)
    cms = CONFIGMAPS.format(ns=ns)
    mid = ok(api.request('POST', WIDGETS.format(ns=ns), widget('mid', ownerReferences=[ref(owner)])), 201)
    ok(api.request('POST', cms, configmap('leaf', ownerReferences=[ref(mid)], finalizers=['a.io/hold'])), 201)
    ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/top', {'propagationPolicy': 'Foreground'}))
    wait_for(lambda: ok(api.request('GET', cms + '/leaf'))['metadata'].get('deletionTimestamp'), 10,
             'the leaf marked by the collector')
    marked = ok(api.request('GET', WIDGETS.format(ns=ns) + '/mid'))['metadata']
    assert marked['finalizers'] == ['foregroundDeletion'] and marked['deletionTimestamp']
    assert ok(api.request('GET', WIDGETS.format(ns=ns) + '/top'))['metadata']['finalizers'] == ['foregroundDeletion']
    ok(api.request('PATCH', cms + '/leaf', {'metadata': {'finalizers': None}}, MERGE))
    wait_for(lambda: gone(api, WIDGETS.format(ns=ns) + '/top') and gone(api, WIDGETS.format(ns=ns) + '/mid'), 10,
             'the chain gone bottom-up')


def test_a_dependent_with_another_live_owner_only_loses_the_reference(api, ns):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('o1')), 201)
    other = ok(api.request('POST', WIDGETS.format(ns=ns), widget('o2')), 201)
    cms = CONFIGMAPS.format(ns=ns)
    ok(api.request('POST', cms, configmap('shared', ownerReferences=[ref(owner), ref(other)])), 201)
    marked = ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/o1?propagationPolicy=Foreground'))
    assert marked['metadata']['finalizers'] == ['foregroundDeletion']
    wait_for(lambda: gone(api, WIDGETS.format(ns=ns) + '/o1'), 10, 'the owner gone')
    refs = ok(api.request('GET', cms + '/shared'))['metadata']['ownerReferences']
    assert [r['name'] for r in refs] == ['o2']
    rv = owner['metadata']['resourceVersion']
    _, owner_events = watch(api, WIDGETS.format(ns=ns), {'resourceVersion': rv, 'timeoutSeconds': '1',
                                                         'fieldSelector': 'metadata.name=o1'})
    _, shared_events = watch(api, cms, {'resourceVersion': rv, 'timeoutSeconds': '1'})
    rv_of = lambda events, etype: [int(e['object']['metadata']['resourceVersion'])  # noqa: E731
                                   for e in events if e['type'] == etype]
    assert max(rv_of(shared_events, 'MODIFIED')) < min(rv_of(owner_events, 'DELETED'))  # freed before it went


@pytest.mark.parametrize('query, body', [('?propagationPolicy=Orphan', None), ('', {'orphanDependents': True})])
def test_an_orphan_delete_strips_the_references_then_the_owner_goes(api, ns, query, body):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('owner', finalizers=['a.io/x'])), 201)
    cms = CONFIGMAPS.format(ns=ns)
    ok(api.request('POST', cms, configmap('kept', ownerReferences=[ref(owner)])), 201)
    status, marked = api.request('DELETE', WIDGETS.format(ns=ns) + '/owner' + query, body)
    assert status == 200 and marked['metadata']['finalizers'] == ['a.io/x', 'orphan'], marked
    wait_for(lambda: ok(api.request('GET', WIDGETS.format(ns=ns) + '/owner'))['metadata']['finalizers']
             == ['a.io/x'], 10, 'the orphan finalizer removed by the collector')
    assert 'ownerReferences' not in ok(api.request('GET', cms + '/kept'))['metadata']
    ok(api.request('PATCH', WIDGETS.format(ns=ns) + '/owner', {'metadata': {'finalizers': None}}, MERGE))
    assert gone(api, WIDGETS.format(ns=ns) + '/owner') and not gone(api, cms + '/kept')


def test_a_second_delete_changes_the_policy_of_an_object_held_by_finalizers(api, ns):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('owner', finalizers=['a.io/x'])), 201)
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('dep', ownerReferences=[ref(owner)])), 201)
    first = ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/owner'))
    assert first['metadata']['finalizers'] == ['a.io/x']
    again = ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/owner?propagationPolicy=Foreground'))
    assert again['metadata']['finalizers'] == ['a.io/x', 'foregroundDeletion']
    assert again['metadata']['deletionTimestamp'] == first['metadata']['deletionTimestamp']
    wait_for(lambda: gone(api, CONFIGMAPS.format(ns=ns) + '/dep'), 10, 'the dependent deleted before the owner')
    wait_for(lambda: ok(api.request('GET', WIDGETS.format(ns=ns) + '/owner'))['metadata']['finalizers']
             == ['a.io/x'], 10, 'foregroundDeletion removed, a.io/x left')


def test_the_default_policy_of_the_kind(api, ns):
    rcs = f'/api/v1/namespaces/{ns}/replicationcontrollers'
    rc = {'apiVersion': 'v1', 'kind': 'ReplicationController', 'metadata': {'name': 'rc'},
          'spec': {'replicas': 0, 'selector': {'app': 'x'}, 'template': {
              'metadata': {'labels': {'app': 'x'}}, 'spec': {'containers': [{'name': 'c', 'image': 'i'}]}}}}
    ok(api.request('POST', rcs, rc), 201)
    status, body = api.request('DELETE', rcs + '/rc')  # no options: core/v1 RCs orphan (back compatibility)
    assert status == 200 and body['kind'] == 'ReplicationController' and body['metadata']['finalizers'] == ['orphan']
    wait_for(lambda: gone(api, rcs + '/rc'), 10, 'the RC gone once orphaned')
    events = f'/api/v1/namespaces/{ns}/events'
    event = {'apiVersion': 'v1', 'kind': 'Event', 'metadata': {'name': 'e'}, 'reason': 'R', 'message': 'm',
             'involvedObject': {'kind': 'ConfigMap', 'name': 'x', 'namespace': ns}}
    ok(api.request('POST', events, event), 201)
    status, body = api.request('DELETE', events + '/e?propagationPolicy=Foreground')  # no GC finalizer on Events
    assert status == 200 and body['kind'] == 'Status' and gone(api, events + '/e')
    status, body = api.request('DELETE', CONFIGMAPS.format(ns=ns) + '/x',
                               {'propagationPolicy': 'Orphan', 'orphanDependents': True})
    assert status == 422 and 'cannot be both set' in body['message']


@pytest.mark.parametrize('cascade', ['foreground', 'orphan'])
def test_kubectl_delete_cascade_sends_the_policy_and_waits_for_the_object(api, ns, cascade):
    owner = ok(api.request('POST', WIDGETS.format(ns=ns), widget('owner')), 201)
    cms = CONFIGMAPS.format(ns=ns)
    ok(api.request('POST', cms, configmap('child', ownerReferences=[ref(owner)])), 201)
    api.kubectl('delete', 'widget', 'owner', '-n', ns, f'--cascade={cascade}', '--timeout=30s', timeout=60)
    assert gone(api, WIDGETS.format(ns=ns) + '/owner')
    if cascade == 'foreground':
        assert gone(api, cms + '/child')  # before the owner: kubectl waited for the owner only
    else:
        assert 'ownerReferences' not in ok(api.request('GET', cms + '/child'))['metadata']
    _, events = watch(api, WIDGETS.format(ns=ns), {'resourceVersion': owner['metadata']['resourceVersion'],
                                                   'timeoutSeconds': '1'})
    assert [e['type'] for e in events] == ['MODIFIED', 'DELETED']
    assert events[0]['object']['metadata']['finalizers'] == [{'foreground': 'foregroundDeletion'}.get(cascade, cascade)]


def test_a_dry_run_foreground_delete_answers_the_marked_object_and_changes_nothing(api, ns):
    created = ok(api.request('POST', WIDGETS.format(ns=ns), widget('dry')), 201)
    status, body = api.request('DELETE', WIDGETS.format(ns=ns) + '/dry?dryRun=All&propagationPolicy=Foreground')
    assert status == 200 and body['kind'] == 'Widget', body  # store.go: the dry-run update's object
    assert body['metadata']['finalizers'] == ['foregroundDeletion'] and body['metadata']['deletionTimestamp']
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('real')), 201)  # the positive signal: the collector ran
    ok(api.request('DELETE', WIDGETS.format(ns=ns) + '/real?propagationPolicy=Foreground'))
    wait_for(lambda: gone(api, WIDGETS.format(ns=ns) + '/real'), 10, 'the real delete done by the collector')
    stored = ok(api.request('GET', WIDGETS.format(ns=ns) + '/dry'))
    assert stored['metadata']['resourceVersion'] == created['metadata']['resourceVersion']
    assert 'finalizers' not in stored['metadata'] and 'deletionTimestamp' not in stored['metadata']
