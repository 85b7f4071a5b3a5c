"""
Built-in kinds stored as a kube-apiserver 1.30 stores them, where the emulator was lenient before:
a Service's allocated cluster IP is immutable and its node ports are allocated and unique; pod
templates carry ``creationTimestamp: null``; resource lists are rounded up to milli units; server-side
apply names a list item by all its keys. Fixtures ``api`` and ``ns`` come from conftest.py.
"""
import pytest

from .helpers import ok

pytestmark = pytest.mark.timeout(60)
APPLY = 'application/apply-patch+yaml'
MERGE = 'application/merge-patch+json'
SERVICES = '/api/v1/namespaces/{ns}/services'
DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


def service(name: str, **spec: object) -> dict:
    return {'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': name},
            'spec': {'selector': {'app': name}, 'ports': [{'name': 'http', 'port': 80}], **spec}}


def causes(body: dict) -> dict[str, str]:
    return {c['field']: c['message'] for c in body['details']['causes']}


# --- 1. a Service's cluster IP may not change once allocated --------------------------------------

def test_an_update_that_changes_the_cluster_ip_is_refused(api, ns):
    url = SERVICES.format(ns=ns)
    allocated = ok(api.request('POST', url, service('s')), 201)['spec']['clusterIP']
    status, body = api.request('PATCH', f'{url}/s', {'spec': {'clusterIP': '10.96.0.250'}}, MERGE)
    assert status == 422, body
    assert causes(body) == {'spec.clusterIPs[0]': 'Invalid value: []string{"10.96.0.250"}: may not change once set'}
    assert body['message'] == ('Service "s" is invalid: spec.clusterIPs[0]: Invalid value: []string{"10.96.0.250"}: '
                               'may not change once set')
    status, body = api.request('PATCH', f'{url}/s', {'spec': {'clusterIPs': ['10.96.0.250']}}, MERGE)
    assert status == 422 and 'may not change once set' in causes(body)['spec.clusterIPs[0]'], body
    # a headless Service only at create: an allocated address cannot become "None", nor "None" an address
    status, body = api.request('PATCH', f'{url}/s', {'spec': {'clusterIP': 'None'}}, MERGE)
    assert status == 422 and causes(body) == {
        'spec.clusterIPs[0]': 'Invalid value: []string{"None"}: may not change once set'}, body
    ok(api.request('POST', url, service('headless', clusterIP='None')), 201)
    status, body = api.request('PATCH', f'{url}/headless', {'spec': {'clusterIP': '10.96.0.251'}}, MERGE)
    assert status == 422 and 'may not change once set' in causes(body)['spec.clusterIPs[0]'], body
    assert ok(api.request('GET', f'{url}/s'))['spec']['clusterIP'] == allocated


def test_an_update_that_leaves_the_cluster_ip_out_keeps_the_allocated_one(api, ns):
    url = SERVICES.format(ns=ns)
    created = ok(api.request('POST', url, service('s')), 201)
    replaced = service('s', ports=[{'name': 'http', 'port': 81}])
    replaced['metadata']['resourceVersion'] = created['metadata']['resourceVersion']
    spec = ok(api.request('PUT', f'{url}/s', replaced))['spec']
    assert (spec['clusterIP'], spec['clusterIPs'], spec['ports'][0]['port']) == (
        created['spec']['clusterIP'], created['spec']['clusterIPs'], 81)
    # the same value sent back is no change
    ok(api.request('PATCH', f'{url}/s', {'spec': {'clusterIP': spec['clusterIP']}}, MERGE))


# --- 2. node ports -------------------------------------------------------------------------------

def test_a_node_port_service_gets_a_node_port_per_port_unique_in_the_cluster(api, ns):
    url = SERVICES.format(ns=ns)
    two = [{'name': 'http', 'port': 80}, {'name': 'metrics', 'port': 9090}]
    ports = ok(api.request('POST', url, service('np', type='NodePort', ports=two)), 201)['spec']['ports']
    got = [p['nodePort'] for p in ports]
    assert len(set(got)) == 2 and all(30000 <= p <= 32767 for p in got), ports
    lb = ok(api.request('POST', url, service('lb', type='LoadBalancer')), 201)['spec']['ports'][0]['nodePort']
    assert 30000 <= lb <= 32767 and lb not in got
    assert 'nodePort' not in ok(api.request('POST', url, service('cip')), 201)['spec']['ports'][0]
    none = ok(api.request('POST', url, service('lb2', type='LoadBalancer', allocateLoadBalancerNodePorts=False)), 201)
    assert 'nodePort' not in none['spec']['ports'][0]
    # a requested port another Service holds is refused, in any namespace; a free one is given
    taken = service('again', type='NodePort', ports=[{'name': 'http', 'port': 80, 'nodePort': got[0]}])
    status, body = api.request('POST', url, taken)
    assert status == 422 and causes(body) == {
        'spec.ports[0].nodePort': f'Invalid value: {got[0]}: provided port is already allocated'}, body
    assert body['message'] == (f'Service "again" is invalid: spec.ports[0].nodePort: Invalid value: {got[0]}: '
                               'provided port is already allocated')
    free = next(p for p in range(30000, 30100) if p not in got + [lb])
    taken['spec']['ports'][0]['nodePort'] = free
    assert ok(api.request('POST', url, taken), 201)['spec']['ports'][0]['nodePort'] == free
    status, body = api.request('POST', url, service('far', type='NodePort', ports=[
        {'name': 'http', 'port': 80, 'nodePort': 40000}]))
    assert status == 422 and 'provided port is not in the valid range' in causes(body)['spec.ports[0].nodePort']


def test_an_update_keeps_the_allocated_node_ports_and_a_change_to_cluster_ip_drops_them(api, ns):
    url = SERVICES.format(ns=ns)
    created = ok(api.request('POST', url, service('np', type='NodePort')), 201)
    port = created['spec']['ports'][0]['nodePort']
    replaced = service('np', type='NodePort', ports=[{'name': 'http', 'port': 8080}])
    spec = ok(api.request('PUT', f'{url}/np', replaced))['spec']
    assert (spec['ports'][0]['port'], spec['ports'][0]['nodePort']) == (8080, port)
    # its own port is no conflict for it
    ok(api.request('PATCH', f'{url}/np', {'spec': {'ports': [{'name': 'http', 'port': 8080, 'nodePort': port}]}},
                   'application/strategic-merge-patch+json'))
    spec = ok(api.request('PATCH', f'{url}/np', {'spec': {'type': 'ClusterIP'}}, MERGE))['spec']
    assert 'nodePort' not in spec['ports'][0] and 'externalTrafficPolicy' not in spec, spec
    assert spec['clusterIP'] == created['spec']['clusterIP']
    # released: another Service may take it
    ok(api.request('POST', url, service('next', type='NodePort', ports=[{'name': 'h', 'port': 80, 'nodePort': port}])),
       201)
    status, body = api.request('POST', url, service('bad', ports=[{'name': 'h', 'port': 80, 'nodePort': 30500}]))
    assert status == 422 and causes(body) == {
        'spec.ports[0].nodePort': "Forbidden: may not be used when `type` is 'ClusterIP'"}, body


# --- 3. creationTimestamp: null in pod templates ---------------------------------------------------

def deployment(name: str, container: dict | None = None, **pod: object) -> dict:
    return {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': name},
            'spec': {'selector': {'matchLabels': {'app': name}},
                     'template': {'metadata': {'labels': {'app': name}},
                                  'spec': {'containers': [container or {'name': 'c', 'image': 'x:1'}], **pod}}}}


def test_a_pod_template_is_stored_and_served_with_creation_timestamp_null(api, ns):
    body = ok(api.request('POST', DEPLOYMENTS.format(ns=ns), deployment('d')), 201)
    assert body['spec']['template']['metadata'] == {'creationTimestamp': None, 'labels': {'app': 'd'}}
    out = api.kubectl('get', 'deployment', 'd', '-n', ns, '-o', 'yaml').stdout
    assert '  template:\n    metadata:\n      creationTimestamp: null\n      labels:\n        app: d\n' in out, out
    job = {'apiVersion': 'batch/v1', 'kind': 'Job', 'metadata': {'name': 'j'},
           'spec': {'template': {'spec': {'restartPolicy': 'Never', 'containers': [{'name': 'c', 'image': 'x:1'}]}}}}
    stored = ok(api.request('POST', f'/apis/batch/v1/namespaces/{ns}/jobs', job), 201)
    assert stored['spec']['template']['metadata'] == {'creationTimestamp': None}
    # not a field anyone owns, nor a change: the same apply twice writes once
    first = ok(api.request('PATCH', DEPLOYMENTS.format(ns=ns) + '/d?fieldManager=m&force=true', deployment('d'), APPLY))
    again = ok(api.request('PATCH', DEPLOYMENTS.format(ns=ns) + '/d?fieldManager=m&force=true', deployment('d'), APPLY))
    assert again['metadata']['resourceVersion'] == first['metadata']['resourceVersion']
    assert 'creationTimestamp' not in str(again['metadata']['managedFields'])


# --- 4. resource lists rounded up to milli units ----------------------------------------------------

def test_requests_and_limits_are_rounded_up_to_milli_units_and_stored_canonically(api, ns):
    resources = {'requests': {'cpu': '100u', 'memory': 0.5, 'ephemeral-storage': '1.5Gi'},
                 'limits': {'cpu': '1000m', 'memory': '1Gi', 'example.com/dev': '1n'}}
    container = {'name': 'c', 'image': 'x:1', 'resources': resources}
    sent = deployment('q', container, volumes=[{'name': 'v', 'emptyDir': {'sizeLimit': '100u'}}])
    pod_spec = ok(api.request('POST', DEPLOYMENTS.format(ns=ns), sent), 201)['spec']['template']['spec']
    assert pod_spec['containers'][0]['resources'] == {
        'requests': {'cpu': '1m', 'memory': '500m', 'ephemeral-storage': '1536Mi'},
        'limits': {'cpu': '1', 'memory': '1Gi', 'example.com/dev': '1m'}}
    assert pod_spec['volumes'][0]['emptyDir'] == {'sizeLimit': '100u'}  # a Quantity, not a ResourceList
    pod = {'apiVersion': 'v1', 'kind': 'Pod', 'metadata': {'name': 'p'},
           'spec': {'containers': [{'name': 'c', 'image': 'x:1', 'resources': {'requests': {'cpu': '0.0001'}}}]}}
    stored = ok(api.request('POST', f'/api/v1/namespaces/{ns}/pods', pod), 201)
    assert stored['spec']['containers'][0]['resources'] == {'requests': {'cpu': '1m'}}


# --- 5. how a field inside a list is named ----------------------------------------------------------

def test_validation_names_a_list_item_by_index_and_apply_by_its_keys(api, ns):
    url = DEPLOYMENTS.format(ns=ns)
    status, body = api.request('POST', url, deployment('v', {'name': 'runtime', 'image': ''}))
    assert status == 422 and causes(body) == {'spec.template.spec.containers[0].image': 'Required value'}, body
    port = {'name': 'http', 'containerPort': 8080}
    ok(api.request('PATCH', f'{url}/d?fieldManager=a', deployment('d', {'name': 'runtime', 'image': 'x:1',
                                                                      'ports': [port]}), APPLY), 201)
    managed = ok(api.request('GET', f'{url}/d'))['metadata']['managedFields']
    container = managed[0]['fieldsV1']['f:spec']['f:template']['f:spec']['f:containers']['k:{"name":"runtime"}']
    assert container['f:ports'] == {'k:{"containerPort":8080,"protocol":"TCP"}': {
        '.': {}, 'f:containerPort': {}, 'f:name': {}}}, container
    other = deployment('d', {'name': 'runtime', 'image': 'x:2', 'ports': [{**port, 'name': 'web'}]})
    status, body = api.request('PATCH', f'{url}/d?fieldManager=b', other, APPLY)
    assert status == 409, body
    assert body['message'] == (
        'Apply failed with 2 conflicts: conflicts with "a" using apps/v1:\n'
        '- .spec.template.spec.containers[name="runtime"].image\n'
        '- .spec.template.spec.containers[name="runtime"].ports[containerPort=8080,protocol="TCP"].name')
    # the same port with its protocol given is the same item: no conflict, and b owns it too
    same = deployment('d', {'name': 'runtime', 'image': 'x:1', 'ports': [{**port, 'protocol': 'TCP'}]})
    ok(api.request('PATCH', f'{url}/d?fieldManager=b', same, APPLY))
    bogus = deployment('d', {'name': 'runtime', 'image': 'x:1', 'ports': [{**port, 'bogus': 1}]})
    status, body = api.request('PATCH', f'{url}/d?fieldManager=a', bogus, APPLY)
    assert status == 500, body
    assert body['message'].endswith('.spec.template.spec.containers[name="runtime"].ports[containerPort=8080,'
                                    'protocol="TCP"].bogus: field not declared in schema'), body
