"""
Built-in kinds as a kube-apiserver decodes, validates and stores them: quantities in canonical form
(testbed/k8s/quantity.py). Fixtures ``api`` and ``ns`` come from conftest.py.
"""
import pytest

from testbed.k8s.quantity import QuantityError, canonical
from .helpers import ok

pytestmark = pytest.mark.timeout(30)
APPLY = 'application/apply-patch+yaml'
DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


def deployment(name: str, container: dict | None = None, **pod: object) -> dict:
    labels = {'app': name}
    return {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': name},
            'spec': {'selector': {'matchLabels': labels},
                     'template': {'metadata': {'labels': dict(labels)},
                                  'spec': {'containers': [container or {'name': 'c', 'image': 'x:1'}], **pod}}}}


# --- quantities -----------------------------------------------------------------------------------

# (sent, stored): the Quantity reference's and apimachinery's own examples (quantity_test.go)
CANONICAL = [
    ('1024Mi', '1Gi'), ('1Gi', '1Gi'), ('0.5', '500m'), (0.5, '500m'), ('1.5', '1500m'), ('1.5Gi', '1536Mi'),
    ('1000', '1k'), ('1000000', '1M'), ('2048', '2048'), ('2Ki', '2Ki'), ('307200Ki', '300Mi'),
    ('1025024Mi', '1001Gi'), ('1024Gi', '1Ti'), ('5000m', '5'), ('0.5Ki', '512'), ('1025Ki', '1025Ki'),
    ('1000M', '1G'), ('0.001T', '1G'), ('1000u', '1m'), ('1.08', '1080m'), ('1080000000n', '1080m'),
    ('.001Ki', '1024m'), ('.000001Ki', '1024u'), ('.000000001Ki', '1024n'), ('.000000000001Ki', '2n'),
    ('1000E', '1e21'), ('.001e12', '1e9'), ('0.001e0', '1e-3'), ('1000e-12', '1e-9'), ('1.3E+6', '1300e3'),
    ('3.001n', '4n'), ('0.9n', '1n'), ('9Ei', '9223372036854775807'), ('-1024Mi', '-1Gi'), ('-1.5', '-1500m'),
    ('0', '0'), ('0Mi', '0'), ('00', '0'), (2, '2'), (1.0, '1'), (' 1 ', '1'),
]


@pytest.mark.parametrize(('sent', 'stored'), CANONICAL)
def test_a_quantity_is_stored_in_the_canonical_form_of_its_format(sent, stored):
    assert canonical(sent) == stored


@pytest.mark.parametrize('bad', ['', 'abc', '1.1.M', '1+1.0M', '0.1mi', '1i', '.5i', '-3.01e-', '1Ki5', True, {}])
def test_what_the_api_server_cannot_parse_is_not_a_quantity(bad):
    with pytest.raises(QuantityError, match='quantities must match|suffix'):
        canonical(bad)


def test_the_quantities_of_built_in_kinds_are_stored_and_served_canonically(api, ns):
    container = {'name': 'c', 'image': 'x:1', 'resources': {'requests': {'cpu': 0.5, 'memory': '1024Mi'},
                                                           'limits': {'cpu': '2000m', 'nvidia.com/gpu': '1'}}}
    sent = deployment('q', container, volumes=[{'name': 'v', 'emptyDir': {'sizeLimit': '1.5Gi'}}])
    body = ok(api.request('POST', DEPLOYMENTS.format(ns=ns), sent), 201)
    pod = body['spec']['template']['spec']
    assert pod['containers'][0]['resources'] == {'requests': {'cpu': '500m', 'memory': '1Gi'},
                                                 'limits': {'cpu': '2', 'nvidia.com/gpu': '1'}}
    assert pod['volumes'][0]['emptyDir'] == {'sizeLimit': '1536Mi'}
    assert ok(api.request('GET', DEPLOYMENTS.format(ns=ns) + '/q')) == body
    # the same configuration applied again is the stored object: no write, the same resourceVersion
    applied = ok(api.request('PATCH', DEPLOYMENTS.format(ns=ns) + '/q?fieldManager=m&force=true', sent, APPLY))
    again = ok(api.request('PATCH', DEPLOYMENTS.format(ns=ns) + '/q?fieldManager=m&force=true', sent, APPLY))
    assert again['metadata']['resourceVersion'] == applied['metadata']['resourceVersion']
    assert again['spec']['template']['spec']['volumes'][0]['emptyDir'] == {'sizeLimit': '1536Mi'}
    hpa = {'apiVersion': 'autoscaling/v2', 'kind': 'HorizontalPodAutoscaler', 'metadata': {'name': 'h'},
           'spec': {'scaleTargetRef': {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'name': 'q'},
                    'maxReplicas': 3, 'metrics': [{'type': 'Pods', 'pods': {
                        'metric': {'name': 'm'}, 'target': {'type': 'AverageValue', 'averageValue': '8000m'}}}]}}
    body = ok(api.request('POST', f'/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers', hpa), 201)
    assert body['spec']['metrics'][0]['pods']['target']['averageValue'] == '8'


def test_a_value_that_is_not_a_quantity_fails_the_decoding_with_400_naming_the_field(api, ns):
    container = {'name': 'c', 'image': 'x:1', 'resources': {'requests': {'cpu': 'abc'}}}
    status, body = api.request('POST', DEPLOYMENTS.format(ns=ns), deployment('bad', container))
    assert status == 400 and body['reason'] == 'BadRequest', body
    assert body['message'].startswith('Deployment in version "v1" cannot be handled as a Deployment: quantities '
                                      'must match the regular expression')
    assert 'spec.template.spec.containers[0].resources.requests[cpu]: "abc"' in body['message']
