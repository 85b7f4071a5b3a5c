"""The emulator defaults and drops fields of the built-in kinds as a real API server (1.30) does, and
the operator, writing its children against it, finds no drift in what the server added: after they
are created, later reconciles write nothing and repair nothing."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import kubernetes
import pytest

from rollout_operator import children
from rollout_operator.kube import KubeClient
from rollout_operator.ports import ClusterPorts
from rollout_operator.spec import parse_spec
from testbed.cluster import Cluster, wait_for
from testbed.k8s.harness import EmulatorProcess
from tests.operator.conftest import cluster  # noqa: F401
from tests.operator.test_e2e_basic import ready_cluster
from .helpers import ok
from .kubelet_fixtures import kubelet_factory  # noqa: F401

DEPLOYMENTS = '/apis/apps/v1/namespaces/{ns}/deployments'


def deployment(name: str, **pod: Any) -> dict[str, Any]:
    return {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'metadata': {'name': name},
            'spec': {'selector': {'matchLabels': {'app': name}},
                     'template': {'metadata': {'labels': {'app': name}},
                                  'spec': {'containers': [{'name': 'app', 'image': 'registry.example/app'}], **pod}}}}


def send(emu: EmulatorProcess, method: str, path: str, body: Any, content_type: str = 'application/json',
         query: str = '') -> tuple[int, Any, list[str]]:
    """(status, parsed body, Warning headers)."""
    req = urllib.request.Request(f'{emu.url}{path}{query}', data=json.dumps(body).encode(), method=method,
                                 headers={'Content-Type': content_type})
    try:
        with urllib.request.urlopen(req, timeout=10) as rsp:
            return rsp.status, json.loads(rsp.read()), rsp.headers.get_all('Warning') or []
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get_all('Warning') or []


def test_a_deployment_is_stored_with_the_api_servers_defaults(api: EmulatorProcess, ns: str) -> None:
    probe = {'httpGet': {'port': 8080}}
    body = deployment('d', volumes=[{'name': 'c', 'configMap': {'name': 'c'}}, {'name': 'e'}])
    container = body['spec']['template']['spec']['containers'][0]
    container.update(ports=[{'containerPort': 8080}], readinessProbe=probe,
                     env=[{'name': 'NS', 'valueFrom': {'fieldRef': {'fieldPath': 'metadata.namespace'}}}])
    spec = ok(api.request('POST', DEPLOYMENTS.format(ns=ns), body), 201)['spec']
    assert (spec['replicas'], spec['revisionHistoryLimit'], spec['progressDeadlineSeconds']) == (1, 10, 600)
    assert spec['strategy'] == {'type': 'RollingUpdate', 'rollingUpdate': {'maxSurge': '25%', 'maxUnavailable': '25%'}}
    pod = spec['template']['spec']
    assert {k: pod[k] for k in ('restartPolicy', 'dnsPolicy', 'schedulerName', 'securityContext',
                                'terminationGracePeriodSeconds')} == {
        'restartPolicy': 'Always', 'dnsPolicy': 'ClusterFirst', 'schedulerName': 'default-scheduler',
        'securityContext': {}, 'terminationGracePeriodSeconds': 30}
    assert pod['volumes'] == [{'name': 'c', 'configMap': {'name': 'c', 'defaultMode': 420}},
                              {'name': 'e', 'emptyDir': {}}]
    c = pod['containers'][0]
    assert (c['imagePullPolicy'], c['terminationMessagePath'], c['terminationMessagePolicy'], c['resources']) == (
        'Always', '/dev/termination-log', 'File', {})  # no tag: :latest, pulled always
    assert c['ports'] == [{'containerPort': 8080, 'protocol': 'TCP'}]
    assert c['readinessProbe'] == {'httpGet': {'port': 8080, 'path': '/', 'scheme': 'HTTP'}, 'timeoutSeconds': 1,
                                   'periodSeconds': 10, 'successThreshold': 1, 'failureThreshold': 3}
    assert c['env'][0]['valueFrom']['fieldRef'] == {'fieldPath': 'metadata.namespace', 'apiVersion': 'v1'}
    # a Recreate strategy gets no rollingUpdate; what a write sets is kept
    body = deployment('r')
    body['spec'].update(replicas=0, strategy={'type': 'Recreate'})
    body['spec']['template']['spec']['containers'][0]['image'] = 'registry.example/app:1.2'
    spec = ok(api.request('POST', DEPLOYMENTS.format(ns=ns), body), 201)['spec']
    assert (spec['replicas'], spec['strategy']) == (0, {'type': 'Recreate'})
    assert spec['template']['spec']['containers'][0]['imagePullPolicy'] == 'IfNotPresent'


def test_a_service_an_hpa_and_a_role_binding_are_stored_with_their_defaults(api: EmulatorProcess, ns: str) -> None:
    svc = ok(api.request('POST', f'/api/v1/namespaces/{ns}/services', {
        'apiVersion': 'v1', 'kind': 'Service', 'metadata': {'name': 's'},
        'spec': {'selector': {'app': 's'}, 'ports': [{'port': 80}]}}), 201)['spec']
    assert svc['ports'] == [{'port': 80, 'protocol': 'TCP', 'targetPort': 80}]
    assert (svc['type'], svc['sessionAffinity'], svc['internalTrafficPolicy']) == ('ClusterIP', 'None', 'Cluster')
    assert (svc['ipFamilies'], svc['ipFamilyPolicy'], svc['clusterIPs']) == (['IPv4'], 'SingleStack',
                                                                             [svc['clusterIP']])
    # a PUT that leaves the cluster IP out keeps the one allocated
    body = ok(api.request('GET', f'/api/v1/namespaces/{ns}/services/s'))
    del body['spec']['clusterIP'], body['spec']['clusterIPs']
    assert ok(api.request('PUT', f'/api/v1/namespaces/{ns}/services/s', body))['spec']['clusterIP'] == svc['clusterIP']
    hpa = ok(api.request('POST', f'/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers', {
        'apiVersion': 'autoscaling/v2', 'kind': 'HorizontalPodAutoscaler', 'metadata': {'name': 'h'},
        'spec': {'scaleTargetRef': {'apiVersion': 'apps/v1', 'kind': 'Deployment', 'name': 'd'}, 'maxReplicas': 3,
                 'behavior': {'scaleDown': {'stabilizationWindowSeconds': 60}}}}), 201)['spec']
    assert hpa['minReplicas'] == 1
    assert hpa['metrics'] == [{'type': 'Resource', 'resource': {
        'name': 'cpu', 'target': {'type': 'Utilization', 'averageUtilization': 80}}}]
    assert hpa['behavior']['scaleDown'] == {'stabilizationWindowSeconds': 60, 'selectPolicy': 'Max',
                                            'policies': [{'type': 'Percent', 'value': 100, 'periodSeconds': 15}]}
    assert hpa['behavior']['scaleUp']['policies'][0] == {'type': 'Pods', 'value': 4, 'periodSeconds': 15}
    binding = ok(api.request('POST', f'/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings', {
        'apiVersion': 'rbac.authorization.k8s.io/v1', 'kind': 'RoleBinding', 'metadata': {'name': 'b'},
        'roleRef': {'kind': 'Role', 'name': 'r'}, 'subjects': [{'kind': 'User', 'name': 'u'}]}), 201)
    assert binding['roleRef']['apiGroup'] == binding['subjects'][0]['apiGroup'] == 'rbac.authorization.k8s.io'


def test_unknown_fields_of_builtin_kinds_are_dropped_with_a_warning_or_refused_as_asked(
        api: EmulatorProcess, ns: str) -> None:
    cm = {'apiVersion': 'v1', 'kind': 'ConfigMap', 'metadata': {'name': 'c', 'color': 'red'}, 'data': {'a': '1'},
          'spec': {'x': 1}}
    path = f'/api/v1/namespaces/{ns}/configmaps'
    code, body, warnings = send(api, 'POST', path, cm)
    assert code == 201 and 'spec' not in body and 'color' not in body['metadata']
    assert warnings == ['299 - "unknown field \\"metadata.color\\""', '299 - "unknown field \\"spec\\""']
    code, body, _ = send(api, 'POST', path, {**cm, 'metadata': {'name': 'c2'}}, query='?fieldValidation=Strict')
    assert code == 400 and body['reason'] == 'BadRequest'
    assert body['message'] == ('ConfigMap in version "v1" cannot be handled as a ConfigMap: strict decoding error: '
                               'unknown field "spec"')
    code, body, warnings = send(api, 'POST', path, {**cm, 'metadata': {'name': 'c3'}},
                                query='?fieldValidation=Ignore')
    assert (code, warnings) == (201, []) and 'spec' not in body
    code, body, _ = send(api, 'POST', path, cm, query='?fieldValidation=Loose')
    assert code == 422 and 'fieldValidation' in body['message']
    # a patch: the field it adds is dropped; refused as a patch (422) when strict
    deploy = f'{DEPLOYMENTS.format(ns=ns)}/p'
    ok(api.request('POST', DEPLOYMENTS.format(ns=ns), deployment('p')), 201)
    patch = {'spec': {'template': {'spec': {'containers': [{'name': 'app', 'imagePolicy': 'Always'}]}}}}
    code, body, warnings = send(api, 'PATCH', deploy, patch, 'application/strategic-merge-patch+json')
    assert code == 200 and 'imagePolicy' not in body['spec']['template']['spec']['containers'][0]
    assert warnings == ['299 - "unknown field \\"spec.template.spec.containers[0].imagePolicy\\""']
    code, body, _ = send(api, 'PATCH', deploy, patch, 'application/strategic-merge-patch+json',
                         query='?fieldValidation=Strict')
    assert code == 422 and body['details']['causes'][0]['field'] == 'patch'
    # a server-side apply with a field its schema lacks fails, whatever fieldValidation (500, as 1.30 answers)
    applied = deployment('p')
    applied['spec']['template']['spec']['containers'][0]['imagePolicy'] = 'Always'
    code, body, _ = send(api, 'PATCH', deploy, applied, 'application/apply-patch+yaml',
                         query='?fieldManager=me&fieldValidation=Ignore')
    assert code == 500
    assert body['message'] == (f'failed to create typed patch object ({ns}/p; apps/v1, Kind=Deployment): '
                               '.spec.template.spec.containers[name="app"].imagePolicy: field not declared in schema')


def _kube(emu: EmulatorProcess) -> KubeClient:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(emu.kubeconfig_path), client_configuration=cfg)
    return KubeClient(cfg, backoff_base=0.02)


@pytest.mark.parametrize('runtime', [
    {},
    {'imagePullPolicy': 'IfNotPresent', 'autoscaling': {'maxReplicas': 4, 'targetInFlightPerPod': 2},
     'feedback': {'secretName': 'tokens', 'key': 'feedback'},
     'tolerations': [{'key': 'gpu', 'operator': 'Exists', 'effect': 'NoSchedule'}],
     'volumes': [{'name': 'cm', 'configMap': {'name': 'extra'}}, {'name': 'sec', 'secret': {'secretName': 's'}},
                 {'name': 'proj', 'projected': {'sources': [{'serviceAccountToken': {'path': 't'}},
                                                            {'downwardAPI': {'items': [{'path': 'n', 'fieldRef': {
                                                                'fieldPath': 'metadata.name'}}]}}]}},
                 {'name': 'host', 'hostPath': {'path': '/data'}}],
     'volumeMounts': [{'name': 'cm', 'mountPath': '/etc/extra'}, {'name': 'host', 'mountPath': '/data'}]},
], ids=['plain', 'every-pod-field'])
def test_children_the_server_defaulted_are_not_drift_and_later_reconciles_write_nothing(
        k8s_emulator: EmulatorProcess, runtime: dict[str, Any]) -> None:
    spec = parse_spec({'versions': [{'name': 'v1', 'uri': '/m/v1.mnn'}], 'runtime': runtime})
    target = children.Target('defaults', 'default')
    objs = children.render_all(target, spec, children.runtime_config(spec, 'defaults', {'v1': 100}, 'v1', ['v1']))
    kube = _kube(k8s_emulator)
    try:
        ports = ClusterPorts(kube)
        ports.cache.synced = True  # the watch cache, kept current here by the writes' answers
        assert set(ports.write_children(objs).values()) == {'created'}
        # the server did add its defaults (a lenient emulator would show none)
        live = kube.get('Deployment', 'default', 'defaults-runtime')
        assert live is not None
        assert live['spec']['template']['spec']['dnsPolicy'] == 'ClusterFirst'
        assert live['spec']['template']['spec']['containers'][0]['terminationMessagePolicy'] == 'File'
        assert live['spec']['revisionHistoryLimit'] == 10
        writes = len(k8s_emulator.write_requests())
        for _ in range(3):  # later reconciles: each child compared with what the server kept
            written = ports.write_children(objs)
            assert len(written) == len(objs) and set(written.values()) == {'unchanged'}, written
        assert len(k8s_emulator.write_requests()) == writes
    finally:
        kube.close()


def test_the_running_operator_repairs_nothing_the_server_defaulted(cluster: Cluster) -> None:  # noqa: F811
    ready_cluster(cluster, weights={'v1': 90, 'v2': 10})
    cluster.emu.reset_requests()
    for weights in ({'v1': 80, 'v2': 20}, {'v1': 70, 'v2': 30}):  # reconciles that rewrite the routing ConfigMap
        patch = json.dumps({'spec': {'weights': weights}})
        cluster.emu.kubectl('patch', 'md', 'scorer', '--type', 'merge', '-p', patch)
        wait_for(lambda: cluster.status().get('weights') == weights
                 and cluster.condition('WeightsServed')['status'] == 'True', 60, f'weights {weights} served')
    written = {r['resource'] for r in cluster.emu.write_requests() if r['resource'] != 'events'}
    assert 'configmaps' in written  # the reconciles ran and wrote what changed
    assert written & {'deployments', 'services', 'poddisruptionbudgets', 'serviceaccounts', 'roles',
                      'rolebindings'} == set()
    assert [e for e in cluster.events() if e['reason'] in ('DriftRepaired', 'DriftNotRepaired')] == []
