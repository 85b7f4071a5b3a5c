"""
The API server's defaulting of the built-in kinds the operator writes, as Kubernetes 1.30 does it
when it decodes a write (create, update, patch and server-side apply alike): the ``SetDefaults_*``
functions of pkg/apis/apps/v1, core/v1, rbac/v1 and autoscaling/v2, through the generated
defaulters that walk a Deployment's pod template (its volumes, containers, probes, env). A value
of ``null`` is absent (decoded into Go, it is nil); a string or a probe count left empty or 0 is
defaulted too, like Go's zero values. PodDisruptionBudget, ConfigMap, ServiceAccount and Role have
no default that shows. Also shown, as a real server serializes it: a container's ``resources: {}``.
The Service's cluster IP and IP families are allocated by the store (``service_addresses``).
Not done: the defaults of volume sources the operator never renders (iscsi, rbd, azureDisk,
scaleIO), the rounding of resource quantities to milli units, node ports.
"""
import copy
from typing import Any

TEMPLATE_KINDS = {('apps/v1', 'Deployment')}
RBAC_GROUP = 'rbac.authorization.k8s.io'
SERVICE_NETWORK = '10.96.0.'  # the cluster IPs allocated (10.96.0.1 is the kubernetes Service's)


def apply(obj: dict[str, Any]) -> None:
    """Fill, in place, what the API server defaults in ``obj`` (its apiVersion and kind set)."""
    kind = (obj.get('apiVersion'), obj.get('kind'))
    spec = obj.get('spec')
    if kind in TEMPLATE_KINDS and isinstance(spec, dict):
        deployment(spec)
    elif kind == ('v1', 'Service') and isinstance(spec, dict):
        service(spec)
    elif kind == (f'{RBAC_GROUP}/v1', 'RoleBinding'):
        role_binding(obj)
    elif kind == ('autoscaling/v2', 'HorizontalPodAutoscaler') and isinstance(spec, dict):
        hpa(spec)


def _unset(obj: dict[str, Any], key: str, value: Any) -> None:
    """A pointer field: set when absent or null."""
    if obj.get(key) is None:
        obj[key] = value


def _empty(obj: dict[str, Any], key: str, value: Any) -> None:
    """A plain string or number: set when absent, null or its zero value ("" or 0)."""
    if not obj.get(key):
        obj[key] = value


def _dicts(value: Any) -> list[dict[str, Any]]:
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _dict(obj: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = obj.get(key)
    return value if isinstance(value, dict) else None


def _struct(obj: dict[str, Any], key: str) -> dict[str, Any] | None:
    """A field that is a struct (not a pointer) in Go: always there once decoded."""
    if obj.get(key) is None:
        obj[key] = {}
    return _dict(obj, key)


# --- apps/v1 -------------------------------------------------------------------------------------

def deployment(spec: dict[str, Any]) -> None:
    _unset(spec, 'replicas', 1)
    strategy = _struct(spec, 'strategy')
    if strategy is not None:
        _empty(strategy, 'type', 'RollingUpdate')
        if strategy['type'] == 'RollingUpdate':
            rolling = _struct(strategy, 'rollingUpdate')
            if rolling is not None:
                _unset(rolling, 'maxUnavailable', '25%')
                _unset(rolling, 'maxSurge', '25%')
    _unset(spec, 'revisionHistoryLimit', 10)
    _unset(spec, 'progressDeadlineSeconds', 600)
    template = _struct(spec, 'template')
    if template is not None:
        pod = _struct(template, 'spec')
        if pod is not None:
            pod_spec(pod)


# --- core/v1 -------------------------------------------------------------------------------------

def pod_spec(spec: dict[str, Any]) -> None:
    """SetDefaults_PodSpec and what the generated defaulter calls under it (a pod template's: the
    defaults only a Pod gets, such as enableServiceLinks, are not here)."""
    _empty(spec, 'dnsPolicy', 'ClusterFirst')
    _empty(spec, 'restartPolicy', 'Always')
    _unset(spec, 'securityContext', {})
    _unset(spec, 'terminationGracePeriodSeconds', 30)
    _empty(spec, 'schedulerName', 'default-scheduler')
    for volume in _dicts(spec.get('volumes')):
        _volume(volume)
    for section in ('initContainers', 'containers', 'ephemeralContainers'):
        for container in _dicts(spec.get(section)):
            _container(container)


def _volume(volume: dict[str, Any]) -> None:
    if all(value is None for key, value in volume.items() if key != 'name'):
        volume['emptyDir'] = {}  # no source given
    host_path = _dict(volume, 'hostPath')
    if host_path is not None:
        _unset(host_path, 'type', '')
    for source in ('secret', 'configMap', 'downwardAPI', 'projected'):
        found = _dict(volume, source)
        if found is not None:
            _unset(found, 'defaultMode', 420)  # 0644
    _field_refs(_dict(volume, 'downwardAPI'))
    for projection in _dicts((_dict(volume, 'projected') or {}).get('sources')):
        _field_refs(_dict(projection, 'downwardAPI'))
        token = _dict(projection, 'serviceAccountToken')
        if token is not None:
            _unset(token, 'expirationSeconds', 3600)
    claim = _dict(_dict(_dict(volume, 'ephemeral') or {}, 'volumeClaimTemplate') or {}, 'spec')
    if claim is not None:
        _unset(claim, 'volumeMode', 'Filesystem')


def _field_refs(downward: dict[str, Any] | None) -> None:
    for item in _dicts((downward or {}).get('items')):
        ref = _dict(item, 'fieldRef')
        if ref is not None:
            _empty(ref, 'apiVersion', 'v1')


def image_tag(image: str) -> str:
    """The tag of an image reference as the kubelet's parser reads it: ``latest`` when it has
    neither a tag nor a digest."""
    name, digest = image.split('@', 1)[0], '@' in image
    last = name.rsplit('/', 1)[-1]
    tag = last.rsplit(':', 1)[1] if ':' in last else ''
    return 'latest' if not tag and not digest else tag


def _container(container: dict[str, Any]) -> None:
    if not container.get('imagePullPolicy'):
        image = container.get('image')
        latest = isinstance(image, str) and image_tag(image) == 'latest'
        container['imagePullPolicy'] = 'Always' if latest else 'IfNotPresent'
    _empty(container, 'terminationMessagePath', '/dev/termination-log')
    _empty(container, 'terminationMessagePolicy', 'File')
    _struct(container, 'resources')
    for port in _dicts(container.get('ports')):
        _empty(port, 'protocol', 'TCP')
    for env in _dicts(container.get('env')):
        ref = _dict(_dict(env, 'valueFrom') or {}, 'fieldRef')
        if ref is not None:
            _empty(ref, 'apiVersion', 'v1')
    for name in ('livenessProbe', 'readinessProbe', 'startupProbe'):
        probe = _dict(container, name)
        if probe is not None:
            for key, value in (('timeoutSeconds', 1), ('periodSeconds', 10), ('successThreshold', 1),
                               ('failureThreshold', 3)):
                _empty(probe, key, value)
            _handler(probe)
            grpc = _dict(probe, 'grpc')
            if grpc is not None:
                _unset(grpc, 'service', '')
    for hook in ('postStart', 'preStop'):
        _handler(_dict(_dict(container, 'lifecycle') or {}, hook) or {})


def _handler(handler: dict[str, Any]) -> None:
    http_get = _dict(handler, 'httpGet')
    if http_get is not None:
        _empty(http_get, 'path', '/')
        _empty(http_get, 'scheme', 'HTTP')


def service(spec: dict[str, Any]) -> None:
    _empty(spec, 'sessionAffinity', 'None')
    if spec['sessionAffinity'] == 'None':
        spec.pop('sessionAffinityConfig', None)
    elif spec['sessionAffinity'] == 'ClientIP':
        client_ip = _dict(_dict(spec, 'sessionAffinityConfig') or {}, 'clientIP')
        if client_ip is None or client_ip.get('timeoutSeconds') is None:
            spec['sessionAffinityConfig'] = {'clientIP': {'timeoutSeconds': 10800}}
    _empty(spec, 'type', 'ClusterIP')
    for port in _dicts(spec.get('ports')):
        _empty(port, 'protocol', 'TCP')
        if port.get('targetPort') in (None, 0, '') and port.get('port') is not None:
            port['targetPort'] = port['port']
    if spec['type'] in ('NodePort', 'LoadBalancer'):
        _empty(spec, 'externalTrafficPolicy', 'Cluster')
    if spec['type'] in ('NodePort', 'LoadBalancer', 'ClusterIP'):
        _unset(spec, 'internalTrafficPolicy', 'Cluster')
    if spec['type'] == 'LoadBalancer':
        _unset(spec, 'allocateLoadBalancerNodePorts', True)


def service_addresses(spec: dict[str, Any], old_spec: dict[str, Any] | None, used: set[str]) -> None:
    """What the Service registry allocates on a single-stack IPv4 cluster: a cluster IP (kept on
    updates that leave it out, as the registry does), ``clusterIPs``, ``ipFamilies`` and
    ``ipFamilyPolicy``; none for an ExternalName Service."""
    if spec.get('type') == 'ExternalName':
        return
    if old_spec is not None and old_spec.get('type') != 'ExternalName':
        for key in ('clusterIP', 'clusterIPs', 'ipFamilies', 'ipFamilyPolicy'):
            if not spec.get(key) and old_spec.get(key):
                spec[key] = old_spec[key]
    if not spec.get('clusterIP'):
        spec['clusterIP'] = next(f'{SERVICE_NETWORK}{n}' for n in range(2, 255) if f'{SERVICE_NETWORK}{n}' not in used)
    if not spec.get('clusterIPs'):
        spec['clusterIPs'] = [spec['clusterIP']]
    _unset(spec, 'ipFamilies', ['IPv4'])
    headless_without_selector = spec['clusterIP'] == 'None' and not spec.get('selector')
    _unset(spec, 'ipFamilyPolicy', 'RequireDualStack' if headless_without_selector else 'SingleStack')


# --- rbac/v1, autoscaling/v2 ---------------------------------------------------------------------

def role_binding(obj: dict[str, Any]) -> None:
    ref = _dict(obj, 'roleRef')
    if ref is not None:
        _empty(ref, 'apiGroup', RBAC_GROUP)
    for subject in _dicts(obj.get('subjects')):
        if not subject.get('apiGroup') and subject.get('kind') in ('User', 'Group'):
            subject['apiGroup'] = RBAC_GROUP


SCALE_UP = {'stabilizationWindowSeconds': 0, 'selectPolicy': 'Max',
            'policies': [{'type': 'Pods', 'value': 4, 'periodSeconds': 15},
                         {'type': 'Percent', 'value': 100, 'periodSeconds': 15}]}
SCALE_DOWN = {'selectPolicy': 'Max', 'policies': [{'type': 'Percent', 'value': 100, 'periodSeconds': 15}]}


def hpa(spec: dict[str, Any]) -> None:
    _unset(spec, 'minReplicas', 1)
    if not spec.get('metrics'):
        spec['metrics'] = [{'type': 'Resource', 'resource': {
            'name': 'cpu', 'target': {'type': 'Utilization', 'averageUtilization': 80}}}]
    behavior = _dict(spec, 'behavior')
    if behavior is not None:  # only a given behavior is completed
        for key, default in (('scaleUp', SCALE_UP), ('scaleDown', SCALE_DOWN)):
            given = _dict(behavior, key) or {}
            behavior[key] = {**copy.deepcopy(default), **{k: v for k, v in given.items() if v is not None}}
