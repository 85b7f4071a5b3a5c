"""
The emulator against kube-apiserver 1.30, where it differed before:

1. a write that empties the finalizers of a deleting object is not stored: the object is deleted
   (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go, ``Store.Update`` returns
   ``errEmptiedFinalizers`` and calls ``deleteWithoutFinalizers``). Watchers see one DELETED event with
   the last stored object (its finalizers still listed) at the resourceVersion of the delete
   (storage/etcd3/watcher.go: "the *old* object with the etcd revision for the time at which it gets
   deleted"); the write answers 200 with the object as written, at the resourceVersion it had.
2. a 422 Invalid with several causes reads ``<Kind>.<group> "<name>" is invalid: [cause1, cause2]``
   (apimachinery errors.NewInvalid with field.ErrorList.ToAggregate), one cause without brackets.

Fixtures ``api`` and ``ns`` come from conftest.py.
"""
import json

import pytest

from testbed.k8s.errors import ApiError
from .helpers import CONFIGMAPS, WIDGETS, configmap, ok, watch, widget

pytestmark = pytest.mark.timeout(90)
MERGE = 'application/merge-patch+json'
DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


def rv(obj: dict) -> int:
    return int(obj['metadata']['resourceVersion'])


def server_rv(api) -> int:
    return int(ok(api.request('GET', '/_emulator/healthz'))['resourceVersion'])


def first_event(api, path: str, name: str, since: int) -> dict:
    """The first watch event about ``name`` after ``since`` (waits for it, with a deadline)."""
    _, events = watch(api, path, {'resourceVersion': str(since), 'fieldSelector': f'metadata.name={name}',
                                  'timeoutSeconds': '20'}, max_events=1, timeout=30)
    assert events, f'no watch event about {name} after {since}'
    return events[0]


def marked_for_deletion(api, url: str) -> dict:
    marked = ok(api.request('DELETE', url))
    assert marked['metadata']['deletionTimestamp'], marked
    return marked


# --- 1. deletion by emptying the finalizers --------------------------------------------------------

@pytest.mark.parametrize('how', ['merge patch', 'json patch', 'put'])
def test_emptying_the_finalizers_deletes_the_object_with_one_deleted_event_of_the_last_stored_object(
        api, ns, how):
    url = WIDGETS.format(ns=ns) + '/f'
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('f', finalizers=['a.io/x'], labels={'k': 'v'})), 201)
    marked = marked_for_deletion(api, url)
    if how == 'merge patch':
        status, answer = api.request('PATCH', url, {'metadata': {'finalizers': None}}, MERGE)
    elif how == 'json patch':
        status, answer = api.request('PATCH', url, [{'op': 'remove', 'path': '/metadata/finalizers'}],
                                     'application/json-patch+json')
    else:
        body = json.loads(json.dumps(marked))
        body['metadata']['finalizers'] = []
        status, answer = api.request('PUT', url, body)
    # The answer: 200, the object as written (no finalizers), at the resourceVersion it had.
    assert status == 200, answer
    assert not answer['metadata'].get('finalizers'), answer
    assert answer['metadata']['deletionTimestamp'] == marked['metadata']['deletionTimestamp']
    assert rv(answer) == rv(marked)
    assert api.request('GET', url)[0] == 404
    assert server_rv(api) == rv(marked) + 1  # one resourceVersion for the whole step
    # Watchers: the first event after the mark is DELETED (no MODIFIED with empty finalizers), and
    # it carries the last stored object, at the resourceVersion of the delete.
    event = first_event(api, WIDGETS.format(ns=ns), 'f', rv(marked))
    assert event['type'] == 'DELETED', event
    gone = event['object']
    assert gone['metadata']['finalizers'] == ['a.io/x']
    assert gone['metadata']['deletionTimestamp'] == marked['metadata']['deletionTimestamp']
    assert gone['metadata']['labels'] == {'k': 'v'} and gone['spec'] == marked['spec']
    assert rv(gone) == rv(marked) + 1


def test_removing_one_of_two_finalizers_is_stored_and_the_last_one_deletes(api, ns):
    url = WIDGETS.format(ns=ns) + '/two'
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('two', finalizers=['a.io/x', 'b.io/y'])), 201)
    marked = marked_for_deletion(api, url)
    kept = ok(api.request('PATCH', url, {'metadata': {'finalizers': ['b.io/y']}}, MERGE))
    assert kept['metadata']['finalizers'] == ['b.io/y'] and rv(kept) == rv(marked) + 1
    ok(api.request('PATCH', url, {'metadata': {'finalizers': []}}, MERGE))
    _, events = watch(api, WIDGETS.format(ns=ns), {'resourceVersion': str(rv(marked)), 'timeoutSeconds': '20',
                                                   'fieldSelector': 'metadata.name=two'}, max_events=2, timeout=30)
    assert [(e['type'], e['object']['metadata']['finalizers'], rv(e['object'])) for e in events] == [
        ('MODIFIED', ['b.io/y'], rv(kept)), ('DELETED', ['b.io/y'], rv(kept) + 1)]


def test_kubectl_patch_that_removes_the_last_finalizer_prints_the_object_as_written(api, ns):
    url = WIDGETS.format(ns=ns) + '/k'
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('k', finalizers=['a.io/x'])), 201)
    api.kubectl('-n', ns, 'delete', 'wd', 'k', '--wait=false')
    marked = ok(api.request('GET', url))
    assert marked['metadata']['deletionTimestamp'], marked
    out = api.kubectl('-n', ns, 'patch', 'wd', 'k', '--type=json', '-o', 'json',
                      '-p', '[{"op":"remove","path":"/metadata/finalizers"}]').stdout
    printed = json.loads(out)
    assert 'finalizers' not in printed['metadata'] and rv(printed) == rv(marked)
    assert 'NotFound' in api.kubectl('-n', ns, 'get', 'wd', 'k', check=False).stderr
    event = first_event(api, WIDGETS.format(ns=ns), 'k', rv(marked))
    assert (event['type'], event['object']['metadata']['finalizers'], rv(event['object'])) == (
        'DELETED', ['a.io/x'], rv(marked) + 1)


def test_a_namespace_ends_with_one_deleted_event_of_its_last_stored_state(api):
    name = 'ns-review7-end'
    ok(api.request('POST', '/api/v1/namespaces', {'metadata': {'name': name}}), 201)
    ok(api.request('POST', CONFIGMAPS.format(ns=name), configmap('c', {'a': '1'},
                                                                  finalizers=['a.io/x'])), 201)
    terminating = ok(api.request('DELETE', f'/api/v1/namespaces/{name}'))
    assert terminating['status']['phase'] == 'Terminating', terminating
    ok(api.request('PATCH', CONFIGMAPS.format(ns=name) + '/c', {'metadata': {'finalizers': None}}, MERGE))
    event = first_event(api, '/api/v1/namespaces', name, rv(terminating))
    assert event['type'] == 'DELETED', event
    assert event['object']['spec']['finalizers'] == ['kubernetes']  # as last stored, not emptied
    assert event['object']['status']['phase'] == 'Terminating'
    assert rv(event['object']) > rv(terminating)


def test_kubectl_delete_without_finalizers_sends_the_last_stored_object(api, ns):
    stored = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('plain', {'a': '1'}, labels={'k': 'v'})), 201)
    api.kubectl('-n', ns, 'delete', 'configmap', 'plain')
    event = first_event(api, CONFIGMAPS.format(ns=ns), 'plain', rv(stored))
    assert event['type'] == 'DELETED', event
    gone = event['object']
    assert (gone['data'], gone['metadata']['labels'], gone['metadata']['uid']) == (
        {'a': '1'}, {'k': 'v'}, stored['metadata']['uid'])
    assert rv(gone) == rv(stored) + 1


def test_a_garbage_collected_dependent_is_sent_as_last_stored(api, ns):
    owner = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('owner')), 201)
    ref = {'apiVersion': 'v1', 'kind': 'ConfigMap', 'name': 'owner', 'uid': owner['metadata']['uid']}
    dep = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('dep', {'a': '1'}, ownerReferences=[ref])), 201)
    ok(api.request('DELETE', CONFIGMAPS.format(ns=ns) + '/owner'))
    event = first_event(api, CONFIGMAPS.format(ns=ns), 'dep', rv(dep))
    assert event['type'] == 'DELETED', event
    assert event['object']['metadata']['ownerReferences'] == [ref] and event['object']['data'] == {'a': '1'}


# --- 2. the message of a 422 Invalid -----------------------------------------------------------------

def test_an_invalid_object_with_several_causes_lists_them_in_brackets(api, ns):
    bad = {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': 'd'},
           'spec': {'replicas': -1, 'selector': {'matchLabels': {'app': 'd'}},
                    'template': {'metadata': {'labels': {'app': 'other'}},
                                 'spec': {'containers': [{'name': 'c', 'image': 'i'}]}}}}
    status, body = api.request('POST', DEPLOYMENTS.format(ns=ns), bad)
    assert status == 422 and body['reason'] == 'Invalid', body
    causes = body['details']['causes']
    assert [c['field'] for c in causes] == ['spec.replicas', 'spec.template.metadata.labels'], causes
    assert all(set(c) == {'reason', 'message', 'field'} for c in causes), causes
    listed = ', '.join(f'{c["field"]}: {c["message"]}' for c in causes)
    assert body['message'] == f'Deployment.apps "d" is invalid: [{listed}]'
    assert causes[0]['message'] == 'Invalid value: -1: must be greater than or equal to 0'
    assert (body['details']['kind'], body['details']['group'], body['details']['name']) == ('Deployment', 'apps', 'd')
    # one cause: no brackets
    bad['spec']['replicas'] = 1
    status, body = api.request('POST', DEPLOYMENTS.format(ns=ns), bad)
    assert status == 422 and len(body['details']['causes']) == 1, body
    cause = body['details']['causes'][0]
    assert body['message'] == f'Deployment.apps "d" is invalid: {cause["field"]}: {cause["message"]}'


def test_repeated_causes_are_listed_once_as_the_aggregate_does():
    twice = ApiError.invalid('Widget.example.io', 'w', [('spec.a', 'Required value'), ('spec.a', 'Required value')])
    assert twice.message == 'Widget.example.io "w" is invalid: spec.a: Required value'
    assert len(twice.details['causes']) == 2  # the causes are kept as listed (errors.NewInvalid)
    three = ApiError.invalid('Widget.example.io', 'w', [('spec.a', 'x'), ('spec.b', 'y'), ('spec.a', 'x')])
    assert three.message == 'Widget.example.io "w" is invalid: [spec.a: x, spec.b: y]'
