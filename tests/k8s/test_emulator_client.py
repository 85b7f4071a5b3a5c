"""The official kubernetes Python client against the emulator."""
import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from .helpers import CONFIGMAPS, configmap, ok

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def core(api):
    with api.api_client() as api_client:
        yield client.CoreV1Api(api_client)


@pytest.fixture
def custom(api):
    with api.api_client() as api_client:
        yield client.CustomObjectsApi(api_client)


def cm(name: str, data: dict[str, str]) -> client.V1ConfigMap:
    return client.V1ConfigMap(metadata=client.V1ObjectMeta(name=name, labels={'app': 'x'}), data=data)


def test_python_client_creates_gets_lists_patches_replaces_and_deletes(core, ns):
    created = core.create_namespaced_config_map(ns, cm('c', {'a': '1'}))
    assert created.metadata.uid and created.metadata.namespace == ns
    assert core.read_namespaced_config_map('c', ns).data == {'a': '1'}
    listed = core.list_namespaced_config_map(ns, label_selector='app=x')
    assert [i.metadata.name for i in listed.items] == ['c'] and listed.metadata.resource_version
    patched = core.patch_namespaced_config_map('c', ns, {'data': {'b': '2'}})
    assert patched.data == {'a': '1', 'b': '2'}
    patched.data = {'z': '9'}
    replaced = core.replace_namespaced_config_map('c', ns, patched)
    assert replaced.data == {'z': '9'}
    core.delete_namespaced_config_map('c', ns)
    with pytest.raises(ApiException) as err:
        core.read_namespaced_config_map('c', ns)
    assert err.value.status == 404


def test_python_client_gets_409_on_a_stale_replace(core, ns):
    first = core.create_namespaced_config_map(ns, cm('s', {'a': '1'}))
    core.patch_namespaced_config_map('s', ns, {'data': {'a': '2'}})
    first.data = {'a': 'stale'}
    with pytest.raises(ApiException) as err:
        core.replace_namespaced_config_map('s', ns, first)
    assert err.value.status == 409 and '"reason":"Conflict"' in err.value.body.replace(' ', '')
    with pytest.raises(ApiException) as err:
        core.create_namespaced_config_map(ns, cm('s', {}))
    assert err.value.status == 409


def test_python_client_watch_resumes_from_a_list_resource_version_without_losing_events(core, ns):
    core.create_namespaced_config_map(ns, cm('w0', {}))
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    for n in range(1, 4):  # created between the list and the watch
        core.create_namespaced_config_map(ns, cm(f'w{n}', {}))
    core.delete_namespaced_config_map('w0', ns)
    seen = [(e['type'], e['object'].metadata.name)
            for e in watch.Watch().stream(core.list_namespaced_config_map, ns, resource_version=rv,
                                          timeout_seconds=1)]
    assert seen == [('ADDED', 'w1'), ('ADDED', 'w2'), ('ADDED', 'w3'), ('DELETED', 'w0')]


def test_python_client_watch_from_a_too_old_resource_version_raises_410(k8s_emulator_factory):
    emu = k8s_emulator_factory(args=['--history-size', '2'])
    with emu.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        rv = core.list_namespaced_config_map('default').metadata.resource_version
        for n in range(4):
            ok(emu.request('POST', CONFIGMAPS.format(ns='default'), configmap(f'o{n}')), 201)
        with pytest.raises(ApiException) as err:
            list(watch.Watch().stream(core.list_namespaced_config_map, 'default', resource_version=rv,
                                      timeout_seconds=2))
        assert err.value.status == 410


def test_python_client_custom_objects_use_merge_patches_and_the_status_subresource(custom, ns):
    body = {'apiVersion': 'example.io/v1', 'kind': 'Widget', 'metadata': {'name': 'w'}, 'spec': {'size': 1}}
    custom.create_namespaced_custom_object('example.io', 'v1', ns, 'widgets', body)
    custom.patch_namespaced_custom_object('example.io', 'v1', ns, 'widgets', 'w', {'spec': {'size': 2}})
    custom.patch_namespaced_custom_object_status('example.io', 'v1', ns, 'widgets', 'w',
                                                 {'status': {'phase': 'Ready'}})
    obj = custom.get_namespaced_custom_object('example.io', 'v1', ns, 'widgets', 'w')
    assert obj['spec']['size'] == 2 and obj['status'] == {'phase': 'Ready'} and obj['metadata']['generation'] == 2
    assert [i['metadata']['name'] for i in custom.list_cluster_custom_object('example.io', 'v1', 'widgets')['items']
            if i['metadata']['namespace'] == ns] == ['w']
    custom.delete_namespaced_custom_object('example.io', 'v1', ns, 'widgets', 'w')
    with pytest.raises(ApiException) as err:
        custom.get_namespaced_custom_object('example.io', 'v1', ns, 'widgets', 'w')
    assert err.value.status == 404
