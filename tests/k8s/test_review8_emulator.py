"""
The emulator against kube-apiserver 1.30, where it differed before:

1. ``details.causes[].reason`` of a 422 is the field error's type (apimachinery errors.NewInvalid:
   ``Type: metav1.CauseType(err.Type)``): FieldValueRequired, FieldValueNotSupported, FieldValueTypeInvalid...

Fixtures ``api`` and ``ns`` come from conftest.py.
"""
import pytest

from .helpers import WIDGETS, widget

pytestmark = pytest.mark.timeout(90)
DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


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
