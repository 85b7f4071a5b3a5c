"""
The emulator against kube-apiserver 1.30, where it differed before:

1. the body of a DELETE that removes the object at once: the generic registry's ``Store.finalizeDelete``
   (staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go) answers a ``Status`` (status
   Success, details name / group (omitted when empty) / kind = the resource plural / uid) unless the store
   sets ``ReturnDeletedObject``: pods, services, serviceaccounts, namespaces, storageclasses answer the
   object; custom resources (apiextensions' customresource/etcd.go sets no such flag) answer a Status. A
   DELETE that only marks the object (finalizers) answers 200 with it.
2. ``details.causes[].reason`` of a 422 is the field error's type (apimachinery errors.NewInvalid:
   ``Type: metav1.CauseType(err.Type)``): FieldValueRequired, FieldValueNotSupported, FieldValueTypeInvalid...
3. ``deletionGracePeriodSeconds`` of an object a DELETE marks: 0 for every kind but pods (markAsDeleting);
   for a scheduled pod the option, else its terminationGracePeriodSeconds (rest.BeforeDelete with the pod
   strategy's CheckGracefulDelete); not set on a namespace (its store's own Delete sets the timestamp only).

Fixtures ``api`` and ``ns`` come from conftest.py.
"""
import json
import re

import pytest

from .helpers import CONFIGMAPS, WIDGETS, configmap, ok, widget

pytestmark = pytest.mark.timeout(90)
PODS = '/api/v1/namespaces/{ns}/pods'
DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


def pod(name: str, node: str | None = None, **meta) -> dict:
    spec: dict = {'containers': [{'name': 'c', 'image': 'i'}]}
    if node:
        spec['nodeName'] = node
    return {'apiVersion': 'v1', 'kind': 'Pod', 'metadata': {'name': name, **meta}, 'spec': spec}


def release(api, path: str) -> None:
    ok(api.request('PATCH', path, {'metadata': {'finalizers': None}}, content_type='application/merge-patch+json'))


def test_a_custom_resource_deleted_at_once_answers_a_status(api, ns):
    created = ok(api.request('POST', WIDGETS.format(ns=ns), widget('gone')), 201)
    status, body = api.request('DELETE', WIDGETS.format(ns=ns) + '/gone')
    assert status == 200, body
    assert body == {'kind': 'Status', 'apiVersion': 'v1', 'metadata': {}, 'status': 'Success',
                    'details': {'name': 'gone', 'group': 'example.io', 'kind': 'widgets',
                                'uid': created['metadata']['uid']}}


def test_a_core_kind_without_return_deleted_object_answers_a_status_without_group(api, ns):
    created = ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('cm')), 201)
    body = ok(api.request('DELETE', CONFIGMAPS.format(ns=ns) + '/cm'))
    assert body['kind'] == 'Status' and body['status'] == 'Success', body
    assert body['details'] == {'name': 'cm', 'kind': 'configmaps', 'uid': created['metadata']['uid']}


@pytest.mark.parametrize('plural, obj', [
    ('services', {'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': 's'},
                  'spec': {'selector': {'app': 's'}, 'ports': [{'port': 80}]}}),
    ('serviceaccounts', {'apiVersion': 'v1', 'kind': 'ServiceAccount', 'metadata': {'name': 's'}}),
    ('pods', pod('s')),
])
def test_stores_with_return_deleted_object_answer_the_object(api, ns, plural, obj):
    url = f'/api/v1/namespaces/{ns}/{plural}'
    created = ok(api.request('POST', url, obj), 201)
    body = ok(api.request('DELETE', f'{url}/s'))
    assert body['kind'] == obj['kind'] and body['metadata']['uid'] == created['metadata']['uid'], body
    assert api.request('GET', f'{url}/s')[0] == 404


def test_a_marked_object_answers_itself_with_grace_period_zero_whatever_the_option(api, ns):
    url = WIDGETS.format(ns=ns) + '/held'
    ok(api.request('POST', WIDGETS.format(ns=ns), widget('held', finalizers=['a.io/x'])), 201)
    body = ok(api.request('DELETE', url + '?gracePeriodSeconds=30'), 200)
    assert body['kind'] == 'Widget' and body['metadata']['deletionTimestamp'], body
    assert body['metadata']['deletionGracePeriodSeconds'] == 0, body
    release(api, url)


def test_a_scheduled_pod_marked_for_deletion_keeps_its_grace_period(api, ns):
    for name, options, node, grace in [('dflt', '', 'n1', 30), ('opt', '?gracePeriodSeconds=5', 'n1', 5),
                                       ('neg', '?gracePeriodSeconds=-3', 'n1', 1), ('unsched', '', None, 0)]:
        url = PODS.format(ns=ns) + '/' + name
        ok(api.request('POST', PODS.format(ns=ns), pod(name, node, finalizers=['a.io/x'])), 201)
        body = ok(api.request('DELETE', url + options), 200)
        assert body['kind'] == 'Pod' and body['metadata']['deletionGracePeriodSeconds'] == grace, (name, body)
        release(api, url)


def test_a_terminating_namespace_has_no_deletion_grace_period(api, ns):
    ok(api.request('POST', '/api/v1/namespaces', {'apiVersion': 'v1', 'kind': 'Namespace',
                                                  'metadata': {'name': f'{ns}-x'}}), 201)
    body = ok(api.request('DELETE', f'/api/v1/namespaces/{ns}-x'), 200)
    assert body['kind'] == 'Namespace' and body['metadata']['deletionTimestamp'], body
    assert 'deletionGracePeriodSeconds' not in body['metadata'], body


def test_cause_reasons_follow_the_field_error_type(api, ns):
    bad = widget('bad')
    bad['spec'] = {'color': 'pink', 'tags': 'x'}
    status, body = api.request('POST', WIDGETS.format(ns=ns), bad)
    assert status == 422, body
    reasons = {c['field']: c['reason'] for c in body['details']['causes']}
    assert reasons == {'spec.size': 'FieldValueRequired', 'spec.color': 'FieldValueNotSupported',
                       'spec.tags': 'FieldValueTypeInvalid'}, body
    status, body = api.request('POST', WIDGETS.format(ns=ns), widget('neg', size=-1))
    assert status == 422 and [c['reason'] for c in body['details']['causes']] == ['FieldValueInvalid'], body
    dep = {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': 'd'},
           'spec': {'selector': {'matchLabels': {'app': 'd'}},
                    'template': {'metadata': {'labels': {'app': 'd'}}, 'spec': {'containers': [{'name': 'c'}]}}}}
    status, body = api.request('POST', DEPLOYMENTS.format(ns=ns), dep)
    assert status == 422, body
    assert [(c['field'], c['reason']) for c in body['details']['causes']] == [
        ('spec.template.spec.containers[0].image', 'FieldValueRequired')], body


def test_kubectl_delete_reads_the_status_of_a_custom_resource(api, ns):
    created = ok(api.request('POST', WIDGETS.format(ns=ns), widget('kd')), 201)
    result = api.kubectl('-n', ns, 'delete', 'widget', 'kd', '-v=8')
    assert result.stdout.strip() == 'widget.example.io "kd" deleted', result.stdout
    after_delete = result.stderr.split(f'DELETE {api.url}{WIDGETS.format(ns=ns)}/kd', 1)[1]
    body = re.search(r'"Response Body" body=("(?:[^"\\]|\\.)*")', after_delete)
    assert body, result.stderr[-3000:]
    deleted = [json.loads(json.loads(body.group(1)))]
    assert deleted[0]['kind'] == 'Status' and deleted[0]['status'] == 'Success', deleted
    assert deleted and deleted[0]['details']['uid'] == created['metadata']['uid'], result.stderr[-3000:]
    out = api.kubectl('-n', ns, 'get', 'widget', 'kd', '--ignore-not-found', '-o', 'name').stdout
    assert out == ''
    ok(api.request('POST', f'/api/v1/namespaces/{ns}/serviceaccounts',
                   {'apiVersion': 'v1', 'kind': 'ServiceAccount', 'metadata': {'name': 'sa'}}), 201)
    assert api.kubectl('-n', ns, 'delete', 'sa', 'sa', '-o', 'name').stdout.strip() == 'serviceaccount/sa'
