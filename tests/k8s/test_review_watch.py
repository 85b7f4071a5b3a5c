"""A watch with a label selector, as the API server's watch cache serves it: an object edited so
that it no longer matches is sent as DELETED carrying its previous content (which matched) with the
edit's resourceVersion (k8s.io/apiserver cacher: "return a delete event with the previous object
content"; kubernetes-client/python#2228 shows the same on a real cluster). An informer filtered by
the selector drops it from its cache; before, the emulator sent the edited object, which its
selector does not match."""
import pytest

from .helpers import CONFIGMAPS, configmap, ok, watch

pytestmark = pytest.mark.timeout(30)
MERGE = 'application/merge-patch+json'


def test_an_object_leaving_a_selection_is_deleted_with_its_previous_content_and_the_new_version(api, ns):
    ok(api.request('POST', CONFIGMAPS.format(ns=ns), configmap('s', labels={'on': 'yes'})), 201)
    rv = ok(api.request('GET', CONFIGMAPS.format(ns=ns)))['metadata']['resourceVersion']
    edited = ok(api.request('PATCH', CONFIGMAPS.format(ns=ns) + '/s',
                            {'metadata': {'labels': {'on': None}}, 'data': {'k': 'v'}}, MERGE))
    _, events = watch(api, CONFIGMAPS.format(ns=ns), {'resourceVersion': rv, 'labelSelector': 'on=yes',
                                                      'timeoutSeconds': '1'})
    assert [e['type'] for e in events] == ['DELETED']
    gone = events[0]['object']
    assert gone['metadata']['labels'] == {'on': 'yes'} and 'k' not in (gone.get('data') or {})
    assert gone['metadata']['resourceVersion'] == edited['metadata']['resourceVersion']
