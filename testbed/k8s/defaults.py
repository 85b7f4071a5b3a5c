"""
The API server's defaulting of the built-in kinds the operator writes, as Kubernetes 1.30 does it
when it decodes a write (create, update, patch and server-side apply alike): the ``SetDefaults_*``
functions of pkg/apis/apps/v1, core/v1, rbac/v1 and autoscaling/v2, through the generated
defaulters that walk a Deployment's pod template (its volumes, containers, probes, env). A value
of ``null`` is absent (decoded into Go, it is nil); a string or a probe count left empty or 0 is
defaulted too, like Go's zero values. PodDisruptionBudget, ConfigMap, ServiceAccount and Role have
no default that shows. Also shown, as a real server serializes it: a container's ``resources: {}``
and a pod template's ``metadata.creationTimestamp: null``. The Service's cluster IP, IP families
and node ports are allocated by the store (``service_addresses``); resource lists are rounded up
to milli units with the rest of quantity.py's canonical forms. Not done: the defaults of volume
sources the operator never renders (iscsi, rbd, azureDisk, scaleIO), a LoadBalancer Service's
healthCheckNodePort.
"""
import copy
import random
from typing import Any

TEMPLATE_KINDS = {('apps/v1', 'Deployment')}
RBAC_GROUP = 'rbac.authorization.k8s.io'
SERVICE_NETWORK = '10.96.0.'  # the cluster IPs allocated (10.96.0.1 is the kubernetes Service's)


# The ObjectMeta a kind holds besides its own (pod templates, claim templates), as paths; ``[]`` is
# every item of a list, ``?`` a pointer (only when given: a ReplicationController's template).
# Each is a struct in Go, and its zero creationTimestamp (metav1.Time, a struct too, which
# ``omitempty`` does not omit) is written as null: ``creationTimestamp: null``.
_TEMPLATE = ['spec', 'template']
TEMPLATE_META: dict[tuple[str, str], list[list[str]]] = {
    ('apps/v1', 'Deployment'): [_TEMPLATE], ('apps/v1', 'ReplicaSet'): [_TEMPLATE],
    ('apps/v1', 'DaemonSet'): [_TEMPLATE], ('apps/v1', 'StatefulSet'): [_TEMPLATE, ['spec', 'volumeClaimTemplates[]']],
    ('batch/v1', 'Job'): [_TEMPLATE], ('batch/v1', 'CronJob'): [['spec', 'jobTemplate'],
                                                             ['spec', 'jobTemplate', 'spec', 'template']],
    ('v1', 'PodTemplate'): [['template']], ('v1', 'ReplicationController'): [['spec', 'template?']],
}


def apply(obj: dict[str, Any]) -> None:
    """Fill, in place, what the API server defaults in ``obj`` (its apiVersion and kind set)."""
    kind = (obj.get('apiVersion'), obj.get('kind'))
    for path in TEMPLATE_META.get((str(kind[0]), str(kind[1])), ()):
        for holder in _holders(obj, path):
            meta = _struct(holder, 'metadata')
            if meta is not None:
                meta.setdefault('creationTimestamp', None)
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


def _holders(obj: dict[str, Any], path: list[str]) -> list[dict[str, Any]]:
    """The objects at ``path``, each a struct (made when absent) but for a list's items (``[]``)
    and a pointer (``?``: only when given)."""
    nodes = [obj]
    for part in path:
        if part.endswith('[]'):
            nodes = [item for node in nodes for item in _dicts(node.get(part[:-2]))]
        elif part.endswith('?'):
            nodes = [found for node in nodes if (found := _dict(node, part[:-1])) is not None]
        else:
            nodes = [found for node in nodes if (found := _struct(node, part)) is not None]
    return nodes


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


NODE_PORTS = (30000, 32767)  # --service-node-port-range's default
NODE_PORTS_STATIC = 86  # the lower band taken last (min(max(16, size/32), 128) ports, KEP-3668)


def _needs_node_ports(spec: dict[str, Any]) -> bool:
    return spec.get('type') in ('NodePort', 'LoadBalancer')


def _same_cluster_ips(old: dict[str, Any], new: dict[str, Any]) -> bool:
    return (old.get('clusterIP'), old.get('clusterIPs') or []) == (new.get('clusterIP'), new.get('clusterIPs') or [])


def node_ports(spec: dict[str, Any]) -> set[int]:
    """The node ports a Service's ports hold."""
    return {p['nodePort'] for p in _dicts(spec.get('ports')) if p.get('nodePort')}


def service_addresses(spec: dict[str, Any], old_spec: dict[str, Any] | None, used_ips: set[str],
                      used_ports: set[int]) -> list[tuple[str, str]]:
    """What the Service registry does to a Service's allocated fields on a single-stack IPv4 cluster
    (pkg/registry/core/service/storage: beginCreate, beginUpdate; strategy.go: dropTypeDependentFields),
    before validation: an update that leaves out the cluster IP or a node port keeps the allocated one
    (patchAllocatedValues), ``clusterIP`` and ``clusterIPs`` are kept in step (normalizeClusterIPs), a
    change of type drops what the new type does not use when the update left it as it was; then a
    cluster IP, ``clusterIPs``, ``ipFamilies`` and ``ipFamilyPolicy`` are allocated (none for an
    ExternalName Service) and a node port per port of a NodePort or LoadBalancer Service (unless
    ``allocateLoadBalancerNodePorts`` is false), unique in the cluster (``used_ports``: every other
    Service's). Returns the allocation's errors (a requested node port taken or out of range), as the
    allocator words them; changing an allocated address is refused by validation.service."""
    if old_spec is not None:
        if old_spec.get('type') != 'ExternalName' and spec.get('type') != 'ExternalName':  # patchAllocatedValues
            if not spec.get('clusterIP'):
                spec['clusterIP'] = old_spec.get('clusterIP')
            if not spec.get('clusterIPs') and old_spec.get('clusterIPs'):
                spec['clusterIPs'] = old_spec['clusterIPs']
            for key in ('ipFamilies', 'ipFamilyPolicy'):
                if not spec.get(key) and old_spec.get(key):
                    spec[key] = old_spec[key]
        if _needs_node_ports(old_spec) and _needs_node_ports(spec):
            taken = node_ports(old_spec) & node_ports(spec)
            by_name = {p.get('name', ''): p.get('nodePort') for p in _dicts(old_spec.get('ports'))}
            for port in _dicts(spec.get('ports')):
                kept = by_name.get(port.get('name', ''))
                if not port.get('nodePort') and kept and kept not in taken:
                    port['nodePort'] = kept
        if old_spec.get('clusterIPs') and not spec.get('clusterIPs') \
                and old_spec.get('clusterIP') == spec.get('clusterIP'):  # normalizeClusterIPs
            spec['clusterIPs'] = old_spec['clusterIPs']
        if old_spec.get('clusterIP') != spec.get('clusterIP') \
                and (old_spec.get('clusterIPs') or []) == (spec.get('clusterIPs') or []):
            spec['clusterIPs'] = [spec['clusterIP']] if spec.get('clusterIP') else None
        if old_spec.get('type') != 'ExternalName' and spec.get('type') == 'ExternalName':  # dropTypeDependentFields
            if _same_cluster_ips(old_spec, spec):
                spec['clusterIP'] = spec['clusterIPs'] = None
            for key in ('ipFamilies', 'ipFamilyPolicy'):
                if spec.get(key) == old_spec.get(key):
                    spec[key] = None
        if _needs_node_ports(old_spec) and not _needs_node_ports(spec):
            if node_ports(spec) <= node_ports(old_spec):
                for port in _dicts(spec.get('ports')):
                    port.pop('nodePort', None)
            if spec.get('externalTrafficPolicy') == old_spec.get('externalTrafficPolicy'):
                spec.pop('externalTrafficPolicy', None)
    elif spec.get('clusterIP') and not spec.get('clusterIPs'):
        spec['clusterIPs'] = [spec['clusterIP']]
    for key in ('clusterIP', 'clusterIPs', 'ipFamilies', 'ipFamilyPolicy'):
        if spec.get(key) is None:
            spec.pop(key, None)
    if spec.get('type') != 'ExternalName':
        if not spec.get('clusterIP'):
            spec['clusterIP'] = next(f'{SERVICE_NETWORK}{n}' for n in range(2, 255)
                                     if f'{SERVICE_NETWORK}{n}' not in used_ips)
        if not spec.get('clusterIPs'):
            spec['clusterIPs'] = [spec['clusterIP']]
        _unset(spec, 'ipFamilies', ['IPv4'])
        headless_without_selector = spec['clusterIP'] == 'None' and not spec.get('selector')
        _unset(spec, 'ipFamilyPolicy', 'RequireDualStack' if headless_without_selector else 'SingleStack')
    if spec.get('type') == 'NodePort' or (spec.get('type') == 'LoadBalancer'
                                          and spec.get('allocateLoadBalancerNodePorts') is not False):
        return _allocate_node_ports(spec, used_ports)
    return []


def _allocate_node_ports(spec: dict[str, Any], used: set[int]) -> list[tuple[str, str]]:
    """The node port allocator (portallocator): a requested port must be in range and not another
    Service's (``used``); a port without one gets a random free one, from the upper band first."""
    low, high = NODE_PORTS
    errors, taken = [], set(used)
    ports = _dicts(spec.get('ports'))
    for n, port in enumerate(ports):
        wanted = port.get('nodePort')
        if not wanted or not isinstance(wanted, int):
            continue
        if not low <= wanted <= high:
            errors.append((f'spec.ports[{n}].nodePort', f'Invalid value: {wanted}: provided port is not in the '
                                                        f'valid range. The range of valid ports is {low}-{high}'))
        elif wanted in used:
            errors.append((f'spec.ports[{n}].nodePort', f'Invalid value: {wanted}: provided port is already allocated'))
        taken.add(wanted)
    if errors:
        return errors
    for port in ports:
        if not port.get('nodePort'):
            free = [p for p in range(low + NODE_PORTS_STATIC, high + 1) if p not in taken] \
                or [p for p in range(low, low + NODE_PORTS_STATIC) if p not in taken]
            port['nodePort'] = random.choice(free)
            taken.add(port['nodePort'])
    return errors


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
