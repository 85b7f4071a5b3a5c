"""
The container side of the kubelet stand-in (see ``kubelet.py``): loopback IPs, turning a container
spec into a local process (command mapping, ``$(VAR)`` expansion, env), the process lifecycle with
restart back-off, and the probes.

A pod is a set of processes that share one loopback IP (127.x.y.z), as containers of a real pod
share one network namespace. Every process runs in its own session/process group (so a container
is killed as a whole, workers included) under a tiny launcher that sets ``PR_SET_PDEATHSIG``, so
nothing outlives the kubelet thread that started it even if the test process dies hard.
"""
import dataclasses
import hashlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SAFE_ALPHABET = 'bcdfghjklmnpqrstvwxz2456789'  # what Kubernetes uses for hashes and name suffixes
_LAUNCHER = ('import ctypes, os, sys\n'
             'ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n'
             'if os.getppid() != int(sys.argv[1]): os._exit(137)\n'
             'os.execvpe(sys.argv[2], sys.argv[2:], os.environ)\n')
Fetch = Callable[[str, str, str], dict[str, Any] | None]  # (plural, namespace, name) -> object or None


def now_iso() -> str:
    return time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())


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

class IPAllocator:
    """Hands out 127.B.C.D addresses from a random base, never the same one twice (so an address is
    never reused while a dying process may still hold it), never 127.0.0.1, never .0/.1/.255."""

    def __init__(self, rng: random.Random | None = None) -> None:
        rng = rng or random.SystemRandom()
        self.b, self.c, self.d = rng.randint(20, 250), rng.randint(0, 255), 1
        self.lock = threading.Lock()

    def allocate(self, ports: list[int]) -> str:
        with self.lock:
            for _ in range(10000):
                self.d += 1
                if self.d > 254:
                    self.d, self.c = 2, (self.c + 1) % 256
                    if self.c == 0:
                        self.b = 20 + (self.b - 19) % 231
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


# --- env and arguments -----------------------------------------------------------------------------

class ContainerConfigError(Exception):
    """Like the kubelet's CreateContainerConfigError (a referenced ConfigMap/Secret key is missing)."""


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names are replaced, ``$$`` is a literal ``$``,
    undefined references stay as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] == '$' and i + 1 < len(text):
            if text[i + 1] == '$':
                out.append('$')
                i += 2
                continue
            if text[i + 1] == '(':
                end = text.find(')', i + 2)
                if end != -1:
                    name = text[i + 2:end]
                    out.append(env[name] if name in env else text[i:end + 1])
                    i = end + 1
                    continue
        out.append(text[i])
        i += 1
    return ''.join(out)


def field_ref(pod: dict[str, Any], path: str) -> str:
    meta, spec, status = pod.get('metadata') or {}, pod.get('spec') or {}, pod.get('status') or {}
    for prefix, mapping in (('metadata.labels', meta.get('labels') or {}),
                            ('metadata.annotations', meta.get('annotations') or {})):
        if path.startswith(prefix + '['):
            return str(mapping.get(path[len(prefix) + 1:-1].strip('\'"'), ''))
    simple = {
        'metadata.name': meta.get('name'), 'metadata.namespace': meta.get('namespace'),
        'metadata.uid': meta.get('uid'), 'spec.nodeName': spec.get('nodeName'),
        'spec.serviceAccountName': spec.get('serviceAccountName') or 'default',
        'status.hostIP': status.get('hostIP'), 'status.hostIPs': status.get('hostIP'),
        'status.podIP': status.get('podIP'), 'status.podIPs': status.get('podIP'),
    }
    if path not in simple:
        raise ContainerConfigError(f'unsupported fieldRef {path!r}')
    return str(simple[path] or '')


def _key_ref(fetch: Fetch, namespace: str, ref: dict[str, Any], secret: bool) -> str | None:
    obj = fetch('secrets' if secret else 'configmaps', namespace, ref.get('name', ''))
    data = (obj or {}).get('data') or {}
    if ref.get('key') in data:
        value = data[ref['key']]
        if secret:
            import base64
            value = base64.b64decode(value).decode(errors='replace')
        return str(value)
    if ref.get('optional'):
        return None
    kind = 'secret' if secret else 'configmap'
    raise ContainerConfigError(f'{kind} {ref.get("name")!r} or its key {ref.get("key")!r} not found')


def container_env(container: dict[str, Any], pod: dict[str, Any], fetch: Fetch) -> dict[str, str]:
    """The env a real kubelet would give the container: envFrom, then env (each value expanded
    against the variables defined before it)."""
    namespace = pod['metadata']['namespace']
    env: dict[str, str] = {}
    for source in container.get('envFrom') or []:
        prefix, secret = source.get('prefix', ''), 'secretRef' in source
        ref = source.get('secretRef') or source.get('configMapRef') or {}
        obj = fetch('secrets' if secret else 'configmaps', namespace, ref.get('name', ''))
        if obj is None:
            if ref.get('optional'):
                continue
            raise ContainerConfigError(f'{"secret" if secret else "configmap"} {ref.get("name")!r} not found')
        for key, value in (obj.get('data') or {}).items():
            if secret:
                import base64
                value = base64.b64decode(value).decode(errors='replace')
            env[prefix + key] = str(value)
    for var in container.get('env') or []:
        name, source = var['name'], var.get('valueFrom')
        if source is None:
            env[name] = expand(str(var.get('value', '')), env)
        elif 'fieldRef' in source:
            env[name] = field_ref(pod, source['fieldRef'].get('fieldPath', ''))
        elif 'configMapKeyRef' in source or 'secretKeyRef' in source:
            value = _key_ref(fetch, namespace, source.get('secretKeyRef') or source['configMapKeyRef'],
                             'secretKeyRef' in source)
            if value is not None:
                env[name] = value
        elif 'resourceFieldRef' in source:
            ref = source['resourceFieldRef']
            kind, _, res = ref.get('resource', '').partition('.')
            env[name] = str(((container.get('resources') or {}).get(kind) or {}).get(res, '0'))
    return env


def rewrite_host(args: list[str], ip: str) -> list[str]:
    """Bind addresses meant for "every interface of the pod" become the pod's own IP."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg == '--host' and i + 1 < len(out):
            out[i + 1] = ip
        elif arg.startswith('--host='):
            out[i] = '--host=' + ip
    return out


# --- probes ----------------------------------------------------------------------------------------

def run_probe(probe: dict[str, Any], ip: str, ports: dict[str, int], env: dict[str, str]) -> bool:
    timeout = float(probe.get('timeoutSeconds') or 1)
    try:
        if 'httpGet' in probe:
            get = probe['httpGet']
            port = resolve_port(get.get('port'), ports)
            conn = http.client.HTTPConnection(get.get('host') or ip, port, timeout=timeout)
            try:
                headers = {h['name']: h['value'] for h in get.get('httpHeaders') or []}
                conn.request('GET', get.get('path') or '/', headers={'User-Agent': 'kube-probe/1.32', **headers})
                status = conn.getresponse().status
            finally:
                conn.close()
            return 200 <= status < 400
        if 'tcpSocket' in probe:
            port = resolve_port(probe['tcpSocket'].get('port'), ports)
            with socket.create_connection((probe['tcpSocket'].get('host') or ip, port), timeout=timeout):
                return True
        if 'exec' in probe:
            result = subprocess.run(probe['exec'].get('command') or ['false'], env={**os.environ, **env},
                                    timeout=timeout, capture_output=True)
            return result.returncode == 0
        return True  # grpc probes are not simulated: treated as passing
    except (OSError, ValueError, subprocess.SubprocessError, http.client.HTTPException):
        return False


def resolve_port(port: Any, ports: dict[str, int]) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    if port in ports:
        return ports[port]
    raise ValueError(f'named port {port!r} not declared by the container')


# --- one container = one process (restarted in place) ----------------------------------------------

@dataclasses.dataclass
class Timing:
    """How the stand-in compresses Kubernetes time for tests."""
    probe_scale: float = 0.03       # probe periods/delays x this (10 s period -> 0.3 s)
    min_readiness_period: float = 0.2
    min_liveness_period: float = 0.5
    backoff_base: float = 0.5       # restart back-off: base * 2^(n-1), capped (real: 10 s .. 5 min)
    backoff_cap: float = 5.0
    backoff_reset: float = 10.0     # a container that ran this long starts the back-off afresh
    grace_cap: float = 5.0          # terminationGracePeriodSeconds is capped at this


class Container:
    def __init__(self, pod: 'Any', spec: dict[str, Any], index: int, timing: Timing) -> None:
        self.pod, self.spec, self.index, self.timing = pod, spec, index, timing
        self.name = spec.get('name') or f'c{index}'
        self.ports = {p['name']: int(p['containerPort']) for p in spec.get('ports') or [] if p.get('name')}
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.restarts = 0
        self.crashes = 0  # consecutive, for the back-off
        self.next_start = 0.0
        self.started_at: str | None = None
        self.started_mono = 0.0
        self.last_state: dict[str, Any] = {}
        self.waiting: tuple[str, str] | None = ('ContainerCreating', '')
        self.ready = False
        self.started = False  # startupProbe passed (or none)
        self._stop_probes: threading.Event | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # --- start ---

    def argv(self, commands: dict[str, list[str]], entrypoint: list[str]) -> list[str]:
        command = [expand(c, self.env) for c in self.spec.get('command') or []]
        args = [expand(a, self.env) for a in self.spec.get('args') or []]
        argv = (command or list(entrypoint)) + rewrite_host(args, self.pod.ip)
        head = argv[0]
        if head in commands or os.path.basename(head) in commands:
            return commands.get(head, commands.get(os.path.basename(head), [])) + argv[1:]
        if os.path.basename(head) in ('python', 'python3', f'python{sys.version_info[0]}.{sys.version_info[1]}'):
            return [sys.executable] + argv[1:]
        return argv

    def start(self, fetch: Fetch, commands: dict[str, list[str]], entrypoint: list[str],
              base_env: dict[str, str], cwd: Path) -> None:
        try:
            self.env = container_env(self.spec, self.pod.manifest(), fetch)
        except ContainerConfigError as e:
            self.waiting = ('CreateContainerConfigError', str(e))
            self.next_start = time.monotonic() + self.timing.backoff_base
            return
        argv = self.argv(commands, entrypoint)
        env = {**base_env, **self.env}
        log = open(self.pod.log_path, 'ab')
        try:
            log.write(f'--- {now_iso()} kubelet: starting container {self.name} (restart {self.restarts}):'
                      f' {argv}\n'.encode())
            log.flush()
            self.proc = subprocess.Popen([sys.executable, '-c', _LAUNCHER, str(os.getpid()), *argv], env=env,
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=str(cwd), start_new_session=True)
        except OSError as e:
            self.waiting = ('RunContainerError', str(e))
            self.next_start = time.monotonic() + self.timing.backoff_base
            return
        finally:
            log.close()
        if self.last_state:
            self.restarts += 1
        self.waiting, self.ready = None, False
        self.started_at, self.started_mono = now_iso(), time.monotonic()
        self.started = 'startupProbe' not in self.spec
        self._stop_probes = threading.Event()
        threading.Thread(target=self._probe_loop, args=(self._stop_probes,), daemon=True,
                         name=f'probe-{self.pod.name}-{self.name}').start()

    # --- exit / stop ---

    def check_exit(self) -> bool:
        """Reap an exited process; returns True when it just exited (then schedules a restart)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        code = self.proc.returncode
        self._kill_group(signal.SIGKILL)  # the whole container goes, like its cgroup would
        exit_code = 128 - code if code < 0 else code
        self.last_state = {'terminated': {'exitCode': exit_code, 'reason': 'Completed' if code == 0 else 'Error',
                                          'startedAt': self.started_at, 'finishedAt': now_iso(),
                                          'containerID': f'process://{self.proc.pid}'}}
        if code < 0:
            self.last_state['terminated']['signal'] = -code
        ran = time.monotonic() - self.started_mono
        self.crashes = 1 if ran > self.timing.backoff_reset else self.crashes + 1
        delay = min(self.timing.backoff_cap, self.timing.backoff_base * 2 ** (self.crashes - 1))
        self.next_start = time.monotonic() + delay
        self.waiting = ('CrashLoopBackOff', f'back-off {delay:.1f}s restarting failed container={self.name}'
                                            f' pod={self.pod.name}')
        self._end_probes()
        self.proc = None
        return True

    def _end_probes(self) -> None:
        if self._stop_probes is not None:
            self._stop_probes.set()
        self.ready = False

    def _kill_group(self, sig: int) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def signal(self, sig: int) -> int | None:
        pid = self.pid
        if pid is not None:
            os.kill(pid, sig)
        return pid

    def terminate(self) -> None:
        self._end_probes()
        self._kill_group(signal.SIGTERM)

    def kill(self) -> None:
        self._end_probes()
        self._kill_group(signal.SIGKILL)

    def reap(self) -> bool:
        """For a terminating container: True once its process is gone."""
        if self.proc is None:
            return True
        if self.proc.poll() is None:
            return False
        self._kill_group(signal.SIGKILL)
        self.proc = None
        return True

    # --- probes ---

    def _period(self, probe: dict[str, Any], minimum: float) -> float:
        return max(minimum, float(probe.get('periodSeconds') or 10) * self.timing.probe_scale)

    def _probe_loop(self, stop: threading.Event) -> None:
        t = self.timing
        ip = self.pod.ip
        startup, readiness, liveness = (self.spec.get(k) for k in ('startupProbe', 'readinessProbe',
                                                                     'livenessProbe'))
        if startup:
            stop.wait(float(startup.get('initialDelaySeconds') or 0) * t.probe_scale)
            fails = 0
            while not stop.is_set():
                if run_probe(startup, ip, self.ports, self.env):
                    break
                fails += 1
                if fails >= int(startup.get('failureThreshold') or 3) and self.started_mono + 1 < time.monotonic():
                    self._log(f'startup probe failed {fails} times: killing')
                    self._kill_group(signal.SIGKILL)
                    return
                stop.wait(self._period(startup, t.min_readiness_period))
            self.started = True
        if not readiness:
            self.ready = not stop.is_set()
        start = time.monotonic()
        next_ready = start + (float(readiness.get('initialDelaySeconds') or 0) * t.probe_scale if readiness else 0)
        next_live = start + (float(liveness.get('initialDelaySeconds') or 0) * t.probe_scale if liveness else 0)
        r_ok = r_fail = l_fail = 0
        l_seen = False  # liveness failures count only once the container was live (an implicit startup probe)
        while not stop.is_set():
            now = time.monotonic()
            if readiness and now >= next_ready:
                if run_probe(readiness, ip, self.ports, self.env):
                    r_ok, r_fail = r_ok + 1, 0
                    if r_ok >= int(readiness.get('successThreshold') or 1) and not stop.is_set():
                        self.ready = True
                else:
                    r_ok, r_fail = 0, r_fail + 1
                    if r_fail >= int(readiness.get('failureThreshold') or 3):
                        self.ready = False
                next_ready = time.monotonic() + self._period(readiness, t.min_readiness_period)
            if liveness and now >= next_live:
                if run_probe(liveness, ip, self.ports, self.env):
                    l_seen, l_fail = True, 0
                elif l_seen:
                    l_fail += 1
                    if l_fail >= int(liveness.get('failureThreshold') or 3):
                        self._log(f'liveness probe failed {l_fail} times: killing')
                        self.ready = False
                        self._kill_group(signal.SIGKILL)
                        return
                next_live = time.monotonic() + self._period(liveness, t.min_liveness_period)
            stop.wait(0.05)
        self.ready = False

    def _log(self, message: str) -> None:
        with open(self.pod.log_path, 'ab') as f:
            f.write(f'--- {now_iso()} kubelet: {self.name}: {message}\n'.encode())

    # --- status ---

    def status(self) -> dict[str, Any]:
        state: dict[str, Any]
        if self.proc is not None:
            state = {'running': {'startedAt': self.started_at}}
        else:
            reason, message = self.waiting or ('ContainerCreating', '')
            state = {'waiting': {'reason': reason, **({'message': message} if message else {})}}
        return {
            'name': self.name, 'image': self.spec.get('image', ''), 'imageID': '',
            'containerID': f'process://{self.proc.pid}' if self.proc is not None else '',
            'ready': bool(self.ready and self.proc is not None), 'started': bool(self.started and self.proc),
            'restartCount': self.restarts, 'state': state, 'lastState': self.last_state,
        }


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
