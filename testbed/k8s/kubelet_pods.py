"""
The pods of the kubelet stand-in (see ``kubelet.py``): a pod is a set of processes
(``kubelet_containers.Container``) that share one loopback IP (127.x.y.z), as containers of a real
pod share one network namespace. Also here: the IPs, the template hash and the name suffixes.
"""
import hashlib
import json
import random
import socket
import threading
from pathlib import Path
from typing import Any

from .kubelet_containers import Container, Timing, now_iso

SAFE_ALPHABET = 'bcdfghjklmnpqrstvwxz2456789'  # what Kubernetes uses for hashes and name suffixes


def template_hash(template: dict[str, Any]) -> str:
    """A stable 10-character hash of a pod template (the ``pod-template-hash`` label)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True, separators=(',', ':')).encode()).digest()
    n, out = int.from_bytes(digest[:8], 'big'), []
    for _ in range(10):
        n, r = divmod(n, len(SAFE_ALPHABET))
        out.append(SAFE_ALPHABET[r])
    return ''.join(out)


def random_suffix(n: int = 5) -> str:
    return ''.join(random.choices(SAFE_ALPHABET, k=n))


# --- loopback addresses ----------------------------------------------------------------------------

_B_RANGE = range(20, 251)  # the second octets IPAllocator takes addresses from (see own_addresses)


def own_addresses(bs: range) -> None:
    """Take this process's pod addresses from 127.B.*.* with B in ``bs`` only: processes running
    stand-ins beside each other (pytest-xdist's workers) given slices of their own never hand out
    the same address."""
    global _B_RANGE
    _B_RANGE = bs


class IPAllocator:
    """Hands out 127.B.C.D addresses from a random base, never the same one twice (so an address is
    never reused while a dying process may still hold it), never 127.0.0.1, never .0/.1/.255."""

    def __init__(self, rng: random.Random | None = None) -> None:
        rng = rng or random.SystemRandom()
        self.bs = _B_RANGE
        self.b, self.c, self.d = rng.choice(self.bs), rng.randint(0, 255), 1
        self.lock = threading.Lock()

    def allocate(self, ports: list[int]) -> str:
        with self.lock:
            for _ in range(10000):
                self.d += 1
                if self.d > 254:
                    self.d, self.c = 2, (self.c + 1) % 256
                    if self.c == 0:
                        self.b = self.bs[(self.bs.index(self.b) + 1) % len(self.bs)]
                ip = f'127.{self.b}.{self.c}.{self.d}'
                if all(port_free(ip, p) for p in ports):
                    return ip
        raise RuntimeError('no free loopback address found')


def port_free(ip: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((ip, port))
            return True
        except OSError:
            return False


# --- a pod: containers sharing one loopback IP ------------------------------------------------------

FINALIZER = 'kubelet.emulator.local/process'  # makes DELETE graceful: the object stays until the processes end


class Pod:
    def __init__(self, *, name: str, namespace: str, deployment: str, deployment_uid: str, template: dict[str, Any],
                 thash: str, ip: str, node_name: str, workdir: Path, timing: Timing) -> None:
        self.name, self.namespace, self.deployment, self.deployment_uid = name, namespace, deployment, deployment_uid
        self.template, self.thash, self.ip, self.node_name, self.timing = template, thash, ip, node_name, timing
        self.uid: str | None = None
        self.created_mono = 0.0
        self.start_time = now_iso()
        self.log_path = workdir / f'{name}.log'
        self.volumes_dir = workdir / f'{name}.volumes'
        spec = template.get('spec') or {}
        self.containers = [Container(self, c, i, timing) for i, c in enumerate(spec.get('containers') or [])]
        self.port = next((int(p['containerPort']) for c in spec.get('containers') or []
                          for p in c.get('ports') or [] if p.get('containerPort')), None)
        self.terminating = False
        self.term_deadline = 0.0
        self.api_ready = False  # Ready=True has been written to the API
        self.ready_since = 0.0
        self.last_status: dict[str, Any] | None = None
        self.transitions: dict[str, tuple[str, str]] = {}

    def _empty_dirs(self, container: dict[str, Any]) -> dict[str, Path]:
        """mountPath -> the pod's own directory, for each emptyDir the container mounts (kept across
        the container's restarts, as an emptyDir lives as long as the pod)."""
        empty = {v.get('name') for v in (self.template.get('spec') or {}).get('volumes') or []
                 if isinstance(v, dict) and 'emptyDir' in v}
        out = {}
        for mount in container.get('volumeMounts') or []:
            if mount.get('name') in empty and mount.get('mountPath'):
                out[str(mount['mountPath']).rstrip('/') or '/'] = self.volumes_dir / str(mount['name'])
        return out

    def tmp_env(self, container: dict[str, Any]) -> dict[str, str]:
        """An emptyDir the container mounts at /tmp is the pod's own directory: its processes get it
        as TMPDIR."""
        path = self._empty_dirs(container).get('/tmp')
        if path is None:
            return {}
        path.mkdir(parents=True, exist_ok=True)
        return {'TMPDIR': str(path)}

    def mounted_env(self, container: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
        """``env`` with each value that is a path under another emptyDir's mountPath moved to the
        pod's own directory for that volume: a process cannot be given a mount, so a path the
        container is told about (``MNN_ROLLOUT_MODEL_CACHE=/var/cache/mnn-rollout``) is where its
        volume lives for this pod, not the host's directory shared by every pod."""
        deepest_first = sorted(((p, d) for p, d in self._empty_dirs(container).items() if p != '/tmp'),
                               key=lambda m: -len(m[0]))  # the deepest mount holds a path
        out = dict(env)
        for name, value in env.items():
            for point, own in deepest_first:
                if value == point or value.startswith(point + '/'):
                    own.mkdir(parents=True, exist_ok=True)
                    out[name] = str(own) + value[len(point):]
                    break
        return out

    @property
    def all_ports(self) -> list[int]:
        return [int(p['containerPort']) for c in self.containers for p in c.spec.get('ports') or []
                if p.get('containerPort')]

    def manifest(self) -> dict[str, Any]:
        meta = self.template.get('metadata') or {}
        body: dict[str, Any] = {
            'apiVersion': 'v1', 'kind': 'Pod',
            'metadata': {
                'name': self.name, 'namespace': self.namespace,
                'labels': {**(meta.get('labels') or {}), 'pod-template-hash': self.thash},
                'ownerReferences': [{'apiVersion': 'apps/v1', 'kind': 'Deployment', 'name': self.deployment,
                                     'uid': self.deployment_uid, 'controller': True, 'blockOwnerDeletion': True}],
                'finalizers': [FINALIZER],
            },
            'spec': {**(self.template.get('spec') or {}), 'nodeName': self.node_name},
            'status': {'hostIP': '127.0.0.1', 'podIP': self.ip},
        }
        if meta.get('annotations'):
            body['metadata']['annotations'] = dict(meta['annotations'])
        if self.uid:
            body['metadata']['uid'] = self.uid
        return body

    def grace(self, requested: Any = None) -> float:
        spec = self.template.get('spec') or {}
        value = requested if requested is not None else spec.get('terminationGracePeriodSeconds', 30)
        return min(float(value), self.timing.grace_cap)

    @property
    def ready(self) -> bool:
        return not self.terminating and bool(self.containers) and all(c.ready and c.running for c in self.containers)

    def _condition(self, ctype: str, ok: bool) -> dict[str, Any]:
        status = 'True' if ok else 'False'
        if self.transitions.get(ctype, ('', ''))[0] != status:
            self.transitions[ctype] = (status, now_iso())
        return {'type': ctype, 'status': status, 'lastProbeTime': None,
                'lastTransitionTime': self.transitions[ctype][1]}

    def status(self) -> dict[str, Any]:
        ready = self.ready
        running = any(c.proc is not None or c.last_state for c in self.containers)
        return {
            'phase': 'Running' if running else 'Pending',
            'conditions': [self._condition('PodReadyToStartContainers', True), self._condition('Initialized', True),
                           self._condition('Ready', ready), self._condition('ContainersReady', ready),
                           self._condition('PodScheduled', True)],
            'hostIP': '127.0.0.1', 'hostIPs': [{'ip': '127.0.0.1'}],
            'podIP': self.ip, 'podIPs': [{'ip': self.ip}], 'startTime': self.start_time, 'qosClass': 'BestEffort',
            'containerStatuses': [c.status() for c in self.containers],
        }
