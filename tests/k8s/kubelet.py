"""
A kubelet + deployment controller stand-in for tests against the Kubernetes API emulator.

:class:`Kubelet` polls the API (every ``poll_interval`` s) for Deployments and runs every pod of
them as real local processes, each pod on its own loopback address (127.B.C.D, distinct per pod,
never 127.0.0.1), mirroring them as Pod objects whose status it keeps up to date.

    with Kubelet(emu.url, emu.kubeconfig_path, tmp_path / 'kubelet') as kubelet:
        ...create a Deployment through the API...
        pods = kubelet.wait_ready('scorer-runtime', 'default', replicas=2)
        httpx.get(f'http://{pods[0].ip}:{pods[0].port}/v2/health/ready')

Simulated (close to a real cluster):
* containers -> processes: ``command`` (else ``entrypoint``, default ``["mnn-rollout"]``) + ``args``
  with ``$(VAR)`` expanded from the container env; ``mnn-rollout`` -> ``python -m mnn_rollout.cli``,
  ``python*`` -> this interpreter (``commands=`` maps more); ``--host X`` / ``--host=X`` is rewritten
  to the pod IP. Env: ``env`` (``value``, ``fieldRef`` metadata.name/namespace/uid/labels/annotations,
  spec.nodeName/serviceAccountName, status.podIP/hostIP, ``configMapKeyRef``/``secretKeyRef``,
  ``resourceFieldRef`` from limits) and ``envFrom``, on top of the test process' env plus
  ``MNN_ROLLOUT_KUBE_API=<api url>``, ``KUBECONFIG``, ``PYTHONUNBUFFERED=1``. Output goes to
  ``workdir/<pod>.log`` (appended across restarts). Every pod's containers share its IP.
* restartPolicy Always with back-off (0.5 s doubling to 5 s), ``restartCount``, ``lastState``;
  httpGet / tcpSocket / exec readiness, liveness and startup probes (periods x 0.03, so the
  default 10 s is 0.3 s; liveness failures count only after the first success).
* Pod objects named ``<deployment>-<hash>-<5 chars>`` with the template's labels +
  ``pod-template-hash``, an ownerReference to the Deployment (controller) and a finalizer
  (``kubelet.emulator.local/process``) so that a DELETE is graceful as on a real cluster: the pod
  shows a deletionTimestamp, gets SIGTERM, SIGKILL after ``terminationGracePeriodSeconds`` (capped
  at 5 s), and disappears when its processes are gone. Status via /status, written only on change.
* Deployments: RollingUpdate (maxSurge/maxUnavailable, ints or percentages; default 25%/25% as
  the API server defaults them), Recreate, scaling, minReadySeconds, progressDeadlineSeconds,
  status (observedGeneration, replicas, updatedReplicas, readyReplicas, availableReplicas,
  unavailableReplicas - zero counts omitted as the real API does - and Available/Progressing
  conditions). A deleted Deployment (directly or by GC) or Pod has its processes ended.

Not simulated: ReplicaSets (pods are owned by the Deployment directly), images (every container
runs from this checkout), volumes, resources/limits, securityContext, init containers, lifecycle
hooks, grpc probes (pass), ``spec.paused`` beyond "do nothing", scheduling, Services/Endpoints,
Events. Use ``namespace=`` / ``label_selector=`` to restrict which Deployments are run.
"""
import atexit
import dataclasses
import http.client
import json
import math
import os
import signal
import sys
import threading
import time
import traceback
import urllib.parse
from pathlib import Path
from typing import Any

from .kubelet_pods import FINALIZER, IPAllocator, Pod, Timing, now_iso, random_suffix, template_hash

DEFAULT_COMMANDS = {'mnn-rollout': [sys.executable, '-m', 'mnn_rollout.cli']}
ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True)
class PodInfo:
    name: str
    namespace: str
    deployment: str
    ip: str
    port: int | None
    template_hash: str
    ready: bool  # Ready=True as written to the API
    restarts: int
    pid: int | None  # of the first container, None while it is not running
    log_path: Path
    terminating: bool = False
    uid: str | None = None

    @property
    def url(self) -> str:
        return f'http://{self.ip}:{self.port}'


class ApiError(Exception):
    def __init__(self, status: int, body: Any) -> None:
        super().__init__(f'{status}: {body}')
        self.status = status


class Api:
    """Plain HTTP/JSON to the emulator (no kubernetes client: nothing global, nothing to configure)."""

    def __init__(self, url: str, timeout: float = 5.0) -> None:
        parsed = urllib.parse.urlparse(url)
        self.host, self.port, self.timeout = parsed.hostname or '127.0.0.1', parsed.port or 80, timeout

    def call(self, method: str, path: str, body: Any = None, query: dict[str, str] | None = None,
             content_type: str = 'application/json', ok: tuple[int, ...] = (200, 201, 202)) -> Any:
        if query:
            path += '?' + urllib.parse.urlencode(query)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers={'Content-Type': content_type, 'Accept': 'application/json'})
            rsp = conn.getresponse()
            raw = rsp.read()
        finally:
            conn.close()
        try:
            parsed = json.loads(raw) if raw else None
        except ValueError:
            parsed = raw.decode(errors='replace')
        if rsp.status not in ok:
            raise ApiError(rsp.status, parsed)
        return parsed

    def get_or_none(self, path: str) -> Any:
        try:
            return self.call('GET', path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def merge_patch(self, path: str, body: Any) -> Any:
        return self.call('PATCH', path, body, content_type='application/merge-patch+json')


def _scaled(value: Any, replicas: int, round_up: bool, default: str) -> int:
    value = default if value is None else value
    if isinstance(value, str) and value.endswith('%'):
        exact = float(value[:-1]) * replicas / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


@dataclasses.dataclass
class _DeploymentState:
    name: str
    namespace: str
    uid: str
    thash: str = ''
    replicas: int = 1
    progress_key: Any = None
    progress_at: float = 0.0
    progress_ts: str = ''
    last_status: dict[str, Any] | None = None
    transitions: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)


class Kubelet:
    def __init__(self, api_url: str, kubeconfig_path: str | os.PathLike[str] | None = None,
                 workdir: str | os.PathLike[str] | None = None, namespace: str | None = None,
                 label_selector: str | None = None, *, poll_interval: float = 0.2,
                 timing: Timing | None = None, commands: dict[str, list[str]] | None = None,
                 entrypoint: list[str] | None = None, node_name: str = 'kubelet-stand-in',
                 extra_env: dict[str, str] | None = None) -> None:
        self.api_url = api_url.rstrip('/')
        self.api = Api(self.api_url)
        self.kubeconfig_path = Path(kubeconfig_path) if kubeconfig_path else None
        if workdir is None:
            import tempfile
            workdir = tempfile.mkdtemp(prefix='kubelet-')
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.namespace, self.label_selector = namespace, label_selector
        self.poll_interval = poll_interval
        self.timing = timing or Timing()
        self.commands = {**DEFAULT_COMMANDS, **(commands or {})}
        self.entrypoint = list(entrypoint or ['mnn-rollout'])
        self.node_name = node_name
        self.ips = IPAllocator()
        self.errors: list[str] = []  # tracebacks of failed ticks (a test may assert it stays empty)
        self._base_env = {
            **os.environ, 'MNN_ROLLOUT_KUBE_API': self.api_url, 'PYTHONUNBUFFERED': '1',
            'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')])),
            **({'KUBECONFIG': str(self.kubeconfig_path)} if self.kubeconfig_path else {}), **(extra_env or {}),
        }
        self._pods: dict[tuple[str, str], Pod] = {}
        self._deps: dict[str, _DeploymentState] = {}  # by uid
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events = open(self.workdir / 'kubelet.events.log', 'a', buffering=1)

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> 'Kubelet':
        self._thread = threading.Thread(target=self._run, name='kubelet-stand-in', daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Ends every process it started (SIGTERM, SIGKILL after 3 s) and removes its Pod objects."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)
        if self._thread is None or not self._thread.is_alive():
            self._shutdown()  # no-op when the thread already did it
        atexit.unregister(self.stop)

    def __enter__(self) -> 'Kubelet':
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _event(self, message: str) -> None:
        try:
            self._events.write(f'{now_iso()} {time.monotonic():.3f} {message}\n')
        except ValueError:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                with self._lock:
                    self._tick()
            except Exception:
                tb = traceback.format_exc()
                self.errors[:] = self.errors[-49:] + [tb]
                self._event(f'tick failed: {tb}')
            self._stop.wait(max(0.0, self.poll_interval - (time.monotonic() - started)))
        self._shutdown()

    def _shutdown(self) -> None:
        with self._lock:
            pods = list(self._pods.values())
            for pod in pods:
                for c in pod.containers:
                    c.terminate()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and not all(c.reap() for p in pods for c in p.containers):
                time.sleep(0.05)
            for pod in pods:
                for c in pod.containers:
                    c.kill()
                    if c.proc is not None:
                        try:
                            c.proc.wait(timeout=5)
                        except Exception:
                            pass
                        c.proc = None
            api = Api(self.api_url, timeout=1.0)
            for pod in pods:  # best effort: leave no pods behind in a still-running API
                try:
                    api.call('DELETE', self._pod_path(pod), ok=(200, 202, 404))
                    self._release(pod, api)
                except (OSError, ApiError):
                    break
            self._pods.clear()
            self._events.close()

    # --- introspection -----------------------------------------------------------------------------

    def _info(self, pod: Pod) -> PodInfo:
        return PodInfo(name=pod.name, namespace=pod.namespace, deployment=pod.deployment, ip=pod.ip, port=pod.port,
                       template_hash=pod.thash, ready=pod.api_ready, restarts=sum(c.restarts for c in pod.containers),
                       pid=pod.containers[0].pid if pod.containers else None, log_path=pod.log_path,
                       terminating=pod.terminating, uid=pod.uid)

    def pods(self, deployment: str | None = None, namespace: str | None = None,
             include_terminating: bool = False) -> list[PodInfo]:
        with self._lock:
            return sorted((self._info(p) for p in self._pods.values()
                           if (deployment is None or p.deployment == deployment)
                           and (namespace is None or p.namespace == namespace)
                           and (include_terminating or not p.terminating)), key=lambda i: i.name)

    def template_hash(self, deployment: str, namespace: str = 'default') -> str | None:
        with self._lock:
            return next((d.thash for d in self._deps.values() if (d.name, d.namespace) == (deployment, namespace)),
                        None)

    def wait_ready(self, deployment: str, namespace: str = 'default', replicas: int | None = None,
                   timeout: float = 60.0) -> list[PodInfo]:
        """Wait until the Deployment has exactly ``replicas`` (default: its spec) pods, all of its
        current template, all Ready in the API, and none terminating."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                dep = next((d for d in self._deps.values() if (d.name, d.namespace) == (deployment, namespace)), None)
                pods = self.pods(deployment, namespace, include_terminating=True)
                want = replicas if replicas is not None else dep.replicas if dep else None
                if dep and want is not None and len(pods) == want and all(
                        p.ready and not p.terminating and p.template_hash == dep.thash for p in pods):
                    return pods
            if time.monotonic() > deadline:
                raise TimeoutError(f'{namespace}/{deployment}: not {want} ready pods within {timeout} s: {pods}\n'
                                   + '\n'.join(f'--- {p.name}.log (tail)\n{self.log(p.name)[-1500:]}' for p in pods)
                                   + ('\nkubelet errors:\n' + '\n'.join(self.errors[-3:]) if self.errors else ''))
            time.sleep(0.05)

    def kill(self, pod_name: str, sig: int = signal.SIGKILL, namespace: str | None = None,
             container: str | None = None) -> int:
        """Send ``sig`` to the main process of a pod's container (default: the first); returns its pid."""
        with self._lock:
            pod = next(p for p in self._pods.values() if p.name == pod_name and namespace in (None, p.namespace))
            c = next(c for c in pod.containers if container in (None, c.name))
            pid = c.signal(sig)
            if pid is None:
                raise ProcessLookupError(f'pod {pod_name}: container {c.name} is not running')
            self._event(f'kill {pod.namespace}/{pod.name} {c.name} pid {pid} signal {sig}')
            return pid

    def log(self, pod_name: str) -> str:
        path = self.workdir / f'{pod_name}.log'
        return path.read_text(errors='replace') if path.exists() else ''

    # --- the reconcile loop ------------------------------------------------------------------------

    @staticmethod
    def _pod_path(pod: Pod) -> str:
        return f'/api/v1/namespaces/{pod.namespace}/pods/{pod.name}'

    def _fetch(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.get_or_none(f'/api/v1/namespaces/{namespace}/{plural}/{name}')

    def _tick(self) -> None:
        listed_at = time.monotonic()
        ns_part = f'/namespaces/{self.namespace}' if self.namespace else ''
        query = {'labelSelector': self.label_selector} if self.label_selector else None
        deps = self.api.call('GET', f'/apis/apps/v1{ns_part}/deployments', query=query)['items']
        api_pods = {(p['metadata']['namespace'], p['metadata']['name']): p
                    for p in self.api.call('GET', f'/api/v1{ns_part}/pods')['items']}
        live_deps = {d['metadata']['uid']: d for d in deps}
        for uid in [u for u in self._deps if u not in live_deps]:
            del self._deps[uid]
        # Pods deleted by someone else, or whose Deployment is gone.
        for key, pod in list(self._pods.items()):
            if pod.created_mono > listed_at or pod.terminating and key in api_pods:
                continue
            obj = api_pods.get(key)
            if obj is None or obj['metadata'].get('uid') != pod.uid:
                self._event(f'pod {key} vanished from the API')
                self._terminate(pod, 'deleted from the API', api_gone=True)
            elif obj['metadata'].get('deletionTimestamp'):
                # 0 = "not given" here: the emulator stores 0 where a real API server would store the
                # pod's terminationGracePeriodSeconds (only a forced delete sends 0 on a real cluster).
                grace = obj['metadata'].get('deletionGracePeriodSeconds') or None
                self._terminate(pod, 'deletionTimestamp set', grace=grace)
            elif pod.deployment_uid not in live_deps:
                self._terminate(pod, 'its Deployment is gone')
        # Foreign pods of our Deployments (e.g. from an earlier stand-in): we cannot adopt processes.
        for key, obj in api_pods.items():
            refs = obj['metadata'].get('ownerReferences') or []
            if key not in self._pods and FINALIZER in (obj['metadata'].get('finalizers') or []) and \
                    any(r.get('uid') in live_deps for r in refs):
                self.api.call('DELETE', f'/api/v1/namespaces/{key[0]}/pods/{key[1]}', ok=(200, 202, 404))
                self.api.merge_patch(f'/api/v1/namespaces/{key[0]}/pods/{key[1]}', {'metadata': {'finalizers': None}})
        for dep in deps:
            self._sync_deployment(dep)
        self._step_pods()
        for dep in deps:
            self._write_deployment_status(dep)

    # --- pods --------------------------------------------------------------------------------------

    def _create_pod(self, dep: dict[str, Any], template: dict[str, Any], thash: str) -> None:
        meta = dep['metadata']
        ports = [int(p['containerPort']) for c in (template.get('spec') or {}).get('containers') or []
                 for p in c.get('ports') or [] if p.get('containerPort')]
        name = f'{meta["name"]}-{thash}-{random_suffix()}'
        pod = Pod(name=name, namespace=meta['namespace'], deployment=meta['name'], deployment_uid=meta['uid'],
                  template=template, thash=thash, ip=self.ips.allocate(ports), node_name=self.node_name,
                  workdir=self.workdir, timing=self.timing)
        try:
            created = self.api.call('POST', f'/api/v1/namespaces/{pod.namespace}/pods', pod.manifest())
        except ApiError as e:
            self._event(f'create pod {name} failed: {e}')
            return
        pod.uid, pod.created_mono = created['metadata']['uid'], time.monotonic()
        self._pods[(pod.namespace, pod.name)] = pod
        self._event(f'created pod {pod.namespace}/{name} ip {pod.ip}')

    def _terminate(self, pod: Pod, reason: str, grace: Any = None, api_gone: bool = False) -> None:
        if pod.terminating:
            return
        pod.terminating = True
        seconds = pod.grace(grace)
        pod.term_deadline = time.monotonic() + seconds
        self._event(f'terminating {pod.namespace}/{pod.name} ({reason}), grace {seconds} s')
        if api_gone:
            pod.uid = None
        else:  # the API shows the deletion first (clients stop using the pod), then the signal
            try:
                self.api.call('DELETE', self._pod_path(pod), {'gracePeriodSeconds': int(seconds)}, ok=(200, 202, 404))
            except ApiError as e:
                self._event(f'delete pod {pod.name} failed: {e}')
        for c in pod.containers:
            c.kill() if seconds <= 0 else c.terminate()

    def _release(self, pod: Pod, api: Api | None = None) -> None:
        """Drop our finalizer: the (already deleted) Pod object then disappears."""
        api = api or self.api
        obj = api.get_or_none(self._pod_path(pod))
        if obj is None or obj['metadata'].get('uid') != pod.uid:
            return
        finalizers = [f for f in obj['metadata'].get('finalizers') or [] if f != FINALIZER]
        try:
            api.merge_patch(self._pod_path(pod), {'metadata': {'finalizers': finalizers or None,
                                                               'resourceVersion': obj['metadata']['resourceVersion']}})
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    def _step_pods(self) -> None:
        now = time.monotonic()
        for key, pod in list(self._pods.items()):
            if pod.terminating:
                if not all(c.reap() for c in pod.containers):
                    if now > pod.term_deadline:
                        for c in pod.containers:
                            c.kill()
                    continue
                self._write_pod_status(pod)
                if pod.uid is not None:
                    self._release(pod)
                del self._pods[key]
                self._event(f'pod {key} gone')
                continue
            for c in pod.containers:
                if c.check_exit():
                    self._event(f'container {pod.name}/{c.name} exited: {c.last_state}')
                if c.proc is None and now >= c.next_start:
                    c.start(self._fetch, self.commands, self.entrypoint, self._base_env, self.workdir)
                    self._event(f'container {pod.name}/{c.name} started pid {c.pid} restarts {c.restarts}'
                                if c.proc else f'container {pod.name}/{c.name} not started: {c.waiting}')
            self._write_pod_status(pod)

    def _write_pod_status(self, pod: Pod) -> None:
        status = pod.status()
        if status == pod.last_status or pod.uid is None:
            return
        try:
            self.api.merge_patch(self._pod_path(pod) + '/status', {'status': status})
        except ApiError as e:
            if e.status == 404:
                return
            raise
        pod.last_status = status
        ready = next(c['status'] == 'True' for c in status['conditions'] if c['type'] == 'Ready')
        if ready and not pod.api_ready:
            pod.ready_since = time.monotonic()
            self._event(f'pod {pod.name} ready')
        pod.api_ready = ready

    # --- the deployment controller -----------------------------------------------------------------

    def _state(self, dep: dict[str, Any]) -> _DeploymentState:
        meta = dep['metadata']
        state = self._deps.get(meta['uid'])
        if state is None:
            state = self._deps[meta['uid']] = _DeploymentState(meta['name'], meta['namespace'], meta['uid'])
        spec = dep.get('spec') or {}
        state.thash = template_hash(spec.get('template') or {})
        state.replicas = int(spec['replicas']) if spec.get('replicas') is not None else 1
        return state

    def _available(self, pod: Pod, dep: dict[str, Any]) -> bool:
        min_ready = float((dep.get('spec') or {}).get('minReadySeconds') or 0)
        return pod.api_ready and not pod.terminating and time.monotonic() - pod.ready_since >= min_ready

    @staticmethod
    def _limits(dep: dict[str, Any], replicas: int) -> tuple[int, int]:
        strategy = (dep.get('spec') or {}).get('strategy') or {}
        if strategy.get('type') == 'Recreate':
            return 0, 0
        rolling = strategy.get('rollingUpdate') or {}
        surge = _scaled(rolling.get('maxSurge'), replicas, True, '25%')
        unavailable = _scaled(rolling.get('maxUnavailable'), replicas, False, '25%')
        if surge == 0 and unavailable == 0:
            surge = 1  # the API server would refuse this; be lenient
        return surge, unavailable

    def _sync_deployment(self, dep: dict[str, Any]) -> None:
        state = self._state(dep)
        spec = dep.get('spec') or {}
        if dep['metadata'].get('deletionTimestamp') or spec.get('paused'):
            return
        template, replicas = spec.get('template') or {}, state.replicas
        pods = [p for p in self._pods.values() if p.deployment_uid == state.uid]
        live = [p for p in pods if not p.terminating]
        new = [p for p in live if p.thash == state.thash]
        old = [p for p in live if p.thash != state.thash]
        # Scale-down order: unavailable before available, newest first.
        order = lambda ps: sorted(ps, key=lambda p: (self._available(p, dep), -p.created_mono))  # noqa: E731
        if (spec.get('strategy') or {}).get('type') == 'Recreate':
            if old:
                for p in old:
                    self._terminate(p, 'Recreate')
            elif not any(p.terminating for p in pods):
                self._scale(dep, template, state.thash, new, replicas, order)
            return
        if not old:
            self._scale(dep, template, state.thash, new, replicas, order)
            return
        surge, max_unavailable = self._limits(dep, replicas)
        if len(new) > replicas:
            for p in order(new)[:len(new) - replicas]:
                self._terminate(p, 'scaled down')
            return
        room = min(replicas - len(new), replicas + surge - len(live))
        if room > 0:
            for _ in range(room):
                self._create_pod(dep, template, state.thash)
            return
        min_available = replicas - max_unavailable
        new_unavailable = sum(1 for p in new if not self._available(p, dep))
        budget = len(live) - min_available - new_unavailable
        if budget <= 0:
            return
        unhealthy = [p for p in order(old) if not self._available(p, dep)][:budget]
        for p in unhealthy:
            self._terminate(p, 'rolling update: unhealthy old pod')
        healthy = [p for p in order(old) if self._available(p, dep)]
        available = sum(1 for p in live if self._available(p, dep))
        for p in healthy[:max(0, min(budget - len(unhealthy), available - min_available))]:
            self._terminate(p, 'rolling update')

    def _scale(self, dep: dict[str, Any], template: dict[str, Any], thash: str, pods: list[Pod], replicas: int,
               order: Any) -> None:
        for _ in range(replicas - len(pods)):
            self._create_pod(dep, template, thash)
        for p in order(pods)[:max(0, len(pods) - replicas)]:
            self._terminate(p, 'scaled down')

    def _condition(self, state: _DeploymentState, ctype: str, ok: bool | None, reason: str, message: str,
                   updated: str | None = None) -> dict[str, Any]:
        status = 'Unknown' if ok is None else 'True' if ok else 'False'
        if state.transitions.get(ctype, ('', ''))[0] != status:
            state.transitions[ctype] = (status, now_iso())
        return {'type': ctype, 'status': status, 'lastUpdateTime': updated or state.transitions[ctype][1],
                'lastTransitionTime': state.transitions[ctype][1], 'reason': reason, 'message': message}

    def _write_deployment_status(self, dep: dict[str, Any]) -> None:
        meta, spec = dep['metadata'], dep.get('spec') or {}
        state = self._deps.get(meta['uid'])
        if state is None:
            return
        replicas = state.replicas
        live = [p for p in self._pods.values() if p.deployment_uid == state.uid and not p.terminating]
        updated = [p for p in live if p.thash == state.thash]
        ready = sum(1 for p in live if p.api_ready)
        available = sum(1 for p in live if self._available(p, dep))
        _, max_unavailable = self._limits(dep, replicas)
        now, rs = time.monotonic(), f'{meta["name"]}-{state.thash}'
        progress_key = (state.thash, len(updated), sum(1 for p in updated if self._available(p, dep)), len(live))
        if progress_key != state.progress_key:
            state.progress_key, state.progress_at, state.progress_ts = progress_key, now, now_iso()
        complete = len(updated) == replicas == len(live) and available >= replicas
        deadline = float(spec.get('progressDeadlineSeconds') or 600)
        if spec.get('paused'):
            progressing = self._condition(state, 'Progressing', None, 'DeploymentPaused', 'Deployment is paused',
                                          state.progress_ts)
        elif complete:
            progressing = self._condition(state, 'Progressing', True, 'NewReplicaSetAvailable',
                                          f'ReplicaSet "{rs}" has successfully progressed.', state.progress_ts)
        elif now - state.progress_at > deadline:
            progressing = self._condition(state, 'Progressing', False, 'ProgressDeadlineExceeded',
                                          f'ReplicaSet "{rs}" has timed out progressing.', state.progress_ts)
        else:
            progressing = self._condition(state, 'Progressing', True, 'ReplicaSetUpdated',
                                          f'ReplicaSet "{rs}" is progressing.', state.progress_ts)
        has_min = available >= replicas - max_unavailable
        available_cond = self._condition(
            state, 'Available', has_min, 'MinimumReplicasAvailable' if has_min else 'MinimumReplicasUnavailable',
            'Deployment has minimum availability.' if has_min else 'Deployment does not have minimum availability.')
        counts = {'replicas': len(live), 'updatedReplicas': len(updated), 'readyReplicas': ready,
                  'availableReplicas': available, 'unavailableReplicas': max(0, replicas - available)}
        status = {'observedGeneration': meta.get('generation', 1), **{k: v for k, v in counts.items() if v},
                  'conditions': [available_cond, progressing]}
        if status == state.last_status:
            return
        try:
            self.api.merge_patch(f'/apis/apps/v1/namespaces/{meta["namespace"]}/deployments/{meta["name"]}/status',
                                 {'status': {**status, **{k: None for k, v in counts.items() if not v}}})
        except ApiError as e:
            if e.status == 404:
                return
            raise
        state.last_status = status
