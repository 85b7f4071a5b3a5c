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


# --- the API server's own validation of built-in kinds --------------------------------------------

def _with(body: dict, path: str, value: object) -> dict:
    node = body
    *parents, last = path.split('.')
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    node[last] = value
    return body


def _service(name: str, port: int = 80) -> dict:
    return {'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': name},
            'spec': {'selector': {'app': 'a'}, 'ports': [{'name': 'http', 'port': port, 'targetPort': 'http'}]}}


def _hpa(low: int, high: int) -> dict:
    return {'apiVersion': 'autoscaling/v2', 'kind': 'HorizontalPodAutoscaler', 'metadata': {'name': 'h'},
            'spec': {'scaleTargetRef': {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'name': 'd'},
                     'minReplicas': low, 'maxReplicas': high}}


def _pdb(**spec: object) -> dict:
    return {'apiVersion': 'policy/v1', 'kind': 'PodDisruptionBudget', 'metadata': {'name': 'p'},
            'spec': {'selector': {'matchLabels': {'app': 'a'}}, **spec}}


def _configmap(**meta: object) -> dict:
    return {'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': {'name': 'c', **meta}, 'data': {'ok.key': 'v'}}


PATHS = {'Deployment': '/apis/apps/v1/namespaces/{ns}/deployments', 'Service': '/api/v1/namespaces/{ns}/services',
         'HorizontalPodAutoscaler': '/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers',
         'PodDisruptionBudget': '/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets',
         'ConfigMap': '/api/v1/namespaces/{ns}/configmaps'}
BIG = {'name': 'c', 'image': 'x:1', 'resources': {'requests': {'memory': '4Gi'}, 'limits': {'memory': '1Gi'}}}
# (what, object, the field named, the message)
REFUSED = [
    ('a template label value that is not a label value',
     _with(deployment('d'), 'spec.template.metadata.labels.team', 'ml platform'), 'spec.template.metadata.labels',
     'Invalid value: "ml platform": a valid label must be an empty string or consist of alphanumeric characters'),
    ('a template annotation key that is not a qualified name',
     _with(deployment('d'), 'spec.template.metadata.annotations', {'not a key!': 'x'}),
     'spec.template.metadata.annotations', 'Invalid value: "not a key!": name part must consist of alphanumeric'),
    ('an annotation key that is not a qualified name', _configmap(annotations={'a/b/c': 'x'}),
     'metadata.annotations', 'Invalid value: "a/b/c": a qualified name must consist of alphanumeric characters'),
    ('a nodeSelector value that is not a label value',
     _with(deployment('d'), 'spec.template.spec.nodeSelector', {'pool': 'gpu nodes'}),
     'spec.template.spec.nodeSelector', 'Invalid value: "gpu nodes": a valid label must be an empty string'),
    ('requests above limits', deployment('d', BIG), 'spec.template.spec.containers[0].resources.requests',
     'Invalid value: "4Gi": must be less than or equal to memory limit of 1Gi'),
    ('a Service name that is not a DNS-1035 label', _service('3d-detector'), 'metadata.name',
     'Invalid value: "3d-detector": a DNS-1035 label must consist of lower case alphanumeric characters or \'-\', '
     'start with an alphabetic character'),
    ('a container with no image', deployment('d', {'name': 'c'}), 'spec.template.spec.containers[0].image',
     'Required value'),
    ('negative replicas', _with(deployment('d'), 'spec.replicas', -1), 'spec.replicas',
     'Invalid value: -1: must be greater than or equal to 0'),
    ('a selector that does not match the template',
     _with(deployment('d'), 'spec.template.metadata.labels', {'app': 'other'}), 'spec.template.metadata.labels',
     'Invalid value: map[string]string{"app":"other"}: `selector` does not match template `labels`'),
    ('a Service port above 65535', _service('s', 70000), 'spec.ports[0].port',
     'Invalid value: 70000: must be between 1 and 65535, inclusive'),
    ('an HPA whose minReplicas is above its maxReplicas', _hpa(5, 2), 'spec.maxReplicas',
     'Invalid value: 2: must be greater than or equal to `minReplicas`'),
    ('a PDB with both minAvailable and maxUnavailable', _pdb(minAvailable=1, maxUnavailable=1), 'spec',
     'minAvailable and maxUnavailable cannot be both set'),
    ('a ConfigMap key that is not a config key', _with(_configmap(), 'data', {'a/b': 'x'}), 'data[a/b]',
     'Invalid value: "a/b": a valid config key must consist of alphanumeric characters'),
    ('an ownerReference without uid',
     _configmap(ownerReferences=[{'apiVersion': 'v1', 'kind': 'ConfigMap', 'name': 'o', 'uid': ''}]),
     'metadata.ownerReferences.uid', 'Invalid value: "": must not be empty'),
]


@pytest.mark.parametrize(('obj', 'field', 'message'), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_what_a_real_api_server_refuses_is_422_naming_the_field_and_the_value(api, ns, obj, field, message):
    status, body = api.request('POST', PATHS[obj['kind']].format(ns=ns), obj)
    assert status == 422 and body['reason'] == 'Invalid', body
    causes = {c['field']: c['message'] for c in body['details']['causes']}
    assert message in causes.get(field, ''), causes
    assert f'{field}: {causes[field]}' in body['message']


def test_immutable_fields_cannot_change(api, ns):
    ok(api.request('POST', DEPLOYMENTS.format(ns=ns), deployment('d')), 201)
    moved = {'spec': {'selector': {'matchLabels': {'app': 'd', 'z': 'y'}},
                      'template': {'metadata': {'labels': {'app': 'd', 'z': 'y'}}}}}
    status, body = api.request('PATCH', DEPLOYMENTS.format(ns=ns) + '/d', moved, 'application/merge-patch+json')
    assert status == 422 and 'spec.selector: Invalid value: ' in body['message'], body
    assert body['message'].endswith('field is immutable')
    bindings = f'/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings'
    binding = {'apiVersion': 'rbac.authorization.k8s.io/v1', 'kind': 'RoleBinding', 'metadata': {'name': 'rb'},
               'roleRef': {'apiGroup': 'rbac.authorization.k8s.io', 'kind': 'Role', 'name': 'r'},
               'subjects': [{'kind': 'ServiceAccount', 'name': 'sa', 'namespace': ns}]}
    ok(api.request('POST', bindings, binding), 201)
    other = {'roleRef': {'apiGroup': 'rbac.authorization.k8s.io', 'kind': 'Role', 'name': 'other'}}
    status, body = api.request('PATCH', f'{bindings}/rb', other, 'application/merge-patch+json')
    assert status == 422 and body['message'].endswith('cannot change roleRef'), body
    binding['subjects'] = []  # the rest may change
    ok(api.request('PUT', f'{bindings}/rb', binding))


def test_valid_built_in_objects_are_accepted(api, ns):
    container = {'name': 'c', 'image': 'x:1', 'resources': {'requests': {'cpu': '1', 'nvidia.com/gpu': '1'},
                                                           'limits': {'cpu': '1000m', 'nvidia.com/gpu': 1}}}
    dep = _with(deployment('fine', container), 'spec.template.metadata.annotations', {'example.com/Key_1': 'x y'})
    ok(api.request('POST', DEPLOYMENTS.format(ns=ns), _with(dep, 'spec.template.spec.nodeSelector', {'k': ''})), 201)
    for obj in (_service('d3-detector', 65535), _hpa(2, 2), _pdb(maxUnavailable=1), _configmap()):
        ok(api.request('POST', PATHS[obj['kind']].format(ns=ns), obj), 201)
