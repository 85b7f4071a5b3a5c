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
  shows a deletionTimestamp, runs each container's preStop hook (exec, httpGet or sleep), then its
  main process gets SIGTERM (the process alone, as from a container runtime), the whole container
  SIGKILL once ``terminationGracePeriodSeconds`` (capped at 30 s) have passed since the deletion,
  and the pod disappears when its processes are gone. Status via /status, written only on change.
* Services (``kubelet_services``, kube-proxy's part): each Service with a selector listens on a
  loopback address of its own (``service_url``) and forwards each TCP connection to a random ready,
  not deleted pod; endpoint changes take effect ``service_delay`` s (default 0.3) after the
  stand-in sees them.
* Deployments: RollingUpdate (maxSurge/maxUnavailable, ints or percentages; default 25%/25% as
  the API server defaults them), Recreate, scaling, minReadySeconds, progressDeadlineSeconds,
  status (observedGeneration, replicas, updatedReplicas, readyReplicas, availableReplicas,
  unavailableReplicas - zero counts omitted as the real API does - and Available/Progressing
  conditions). A deleted Deployment (directly or by GC) or Pod has its processes ended.

Not simulated: ReplicaSets (pods are owned by the Deployment directly), images (every container
runs from this checkout), volumes (but an emptyDir is the pod's own directory: mounted at /tmp, its TMPDIR;
elsewhere, env values naming a path under its mountPath point there),
resources/limits, securityContext, init containers, postStart hooks, grpc probes (pass),
``spec.paused`` beyond "do nothing", scheduling, Endpoints and EndpointSlice objects (the proxy
reads the pods), ClusterIP allocation, DNS, Events. Use ``namespace=`` / ``label_selector=`` to
restrict which Deployments are run.

Here: the public face (:class:`Kubelet`, :class:`PodInfo`) and the reconcile loop. The parts:
``kubelet_runner`` (the pods this node runs), ``kubelet_deployments`` (the deployment controller),
``kubelet_services`` (the Service proxy), ``kubelet_pods`` (a pod, its IP, its name), ``kubelet_containers`` (a container = a process, with
restarts and probes), ``kubelet_env`` (its env and arguments), ``kubelet_probes`` (one probe),
``kubelet_api`` (the client of the API).
"""
import atexit
import dataclasses
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from .kubelet_api import Api
from .kubelet_containers import Timing, now_iso
from .kubelet_deployments import DeploymentController
from .kubelet_pods import FINALIZER, Pod
from .kubelet_runner import PodRunner
from .kubelet_services import Endpoint, ServiceProxy

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


class Kubelet:
    def __init__(self, api_url: str, kubeconfig_path: str | os.PathLike[str] | None = None,
                 workdir: str | os.PathLike[str] | None = None, namespace: str | None = None,
                 label_selector: str | None = None, *, poll_interval: float = 0.2,
                 timing: Timing | None = None, commands: dict[str, list[str]] | None = None,
                 entrypoint: list[str] | None = None, node_name: str = 'kubelet-stand-in',
                 extra_env: dict[str, str] | None = None, service_delay: float = 0.3) -> None:
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
        self.errors: list[str] = []  # tracebacks of failed ticks (a test may assert it stays empty)
        base_env = {
            **os.environ, 'MNN_ROLLOUT_KUBE_API': self.api_url, 'PYTHONUNBUFFERED': '1',
            'PYTHONPATH': os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH')])),
            **({'KUBECONFIG': str(self.kubeconfig_path)} if self.kubeconfig_path else {}), **(extra_env or {}),
        }
        self._runner = PodRunner(self.api, workdir=self.workdir, node_name=node_name, timing=self.timing,
                                 commands=self.commands, entrypoint=self.entrypoint, base_env=base_env,
                                 event=self._event)
        self.ips = self._runner.ips
        self._pods = self._runner.pods
        self._deployments = DeploymentController(self.api, self._runner)
        self.services = ServiceProxy(self._runner.ips, delay=service_delay, event=self._event)
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
            self.services.stop()
            self._runner.end_all(Api(self.api_url, timeout=1.0))
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
            dep = self._deployments.find(deployment, namespace)
            return dep.thash if dep is not None else None

    def wait_ready(self, deployment: str, namespace: str = 'default', replicas: int | None = None,
                   timeout: float = 60.0) -> list[PodInfo]:
        """Wait until the Deployment has exactly ``replicas`` (default: its spec) pods, all of its
        current template, all Ready in the API, and none terminating."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                dep = self._deployments.find(deployment, namespace)
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

    def service_url(self, name: str, namespace: str = 'default', port: int | None = None,
                    timeout: float = 30.0) -> str:
        """``http://ADDRESS:PORT`` of a Service (its first port unless ``port``), once it listens."""
        deadline = time.monotonic() + timeout
        while True:
            address = self.services.addresses.get((namespace, name))
            ports = sorted(self.services.listening(namespace, name))
            if address is not None and ports and (port is None or port in ports):
                return f'http://{address}:{port if port is not None else ports[0]}'
            if time.monotonic() > deadline:
                raise TimeoutError(f'service {namespace}/{name}: no listener within {timeout} s')
            time.sleep(0.05)

    def service_endpoints(self, name: str, namespace: str = 'default',
                          port: int | None = None) -> tuple[Endpoint, ...] | None:
        """The endpoints the Service forwards new connections to now (None: not listening there)."""
        ports = self.services.listening(namespace, name)
        return ports.get(port) if port is not None else next(iter(ports.values()), None)

    def log(self, pod_name: str) -> str:
        path = self.workdir / f'{pod_name}.log'
        return path.read_text(errors='replace') if path.exists() else ''

    # --- the reconcile loop ------------------------------------------------------------------------

    def _tick(self) -> None:
        listed_at = time.monotonic()
        ns_part = f'/namespaces/{self.namespace}' if self.namespace else ''
        query = {'labelSelector': self.label_selector} if self.label_selector else None
        deps = self.api.call('GET', f'/apis/apps/v1{ns_part}/deployments', query=query)['items']
        api_pods = {(p['metadata']['namespace'], p['metadata']['name']): p
                    for p in self.api.call('GET', f'/api/v1{ns_part}/pods')['items']}
        live_deps = {d['metadata']['uid']: d for d in deps}
        self._deployments.forget_all_but(live_deps)
        # Pods deleted by someone else, or whose Deployment is gone.
        for key, pod in list(self._pods.items()):
            if pod.created_mono > listed_at or pod.terminating and key in api_pods:
                continue
            obj = api_pods.get(key)
            if obj is None or obj['metadata'].get('uid') != pod.uid:
                self._event(f'pod {key} vanished from the API')
                self._runner.terminate(pod, 'deleted from the API', api_gone=True)
            elif obj['metadata'].get('deletionTimestamp'):
                # The API stores the DELETE's gracePeriodSeconds, else the pod's terminationGracePeriodSeconds
                # (0 for a forced delete or an unscheduled pod: read here as "not given", the pod's own value).
                grace = obj['metadata'].get('deletionGracePeriodSeconds') or None
                self._runner.terminate(pod, 'deletionTimestamp set', grace=grace)
            elif pod.deployment_uid not in live_deps:
                self._runner.terminate(pod, 'its Deployment is gone')
        # Foreign pods of our Deployments (e.g. from an earlier stand-in): we cannot adopt processes.
        for key, obj in api_pods.items():
            refs = obj['metadata'].get('ownerReferences') or []
            if key not in self._pods and FINALIZER in (obj['metadata'].get('finalizers') or []) and \
                    any(r.get('uid') in live_deps for r in refs):
                self.api.call('DELETE', f'/api/v1/namespaces/{key[0]}/pods/{key[1]}', ok=(200, 202, 404))
                self.api.merge_patch(f'/api/v1/namespaces/{key[0]}/pods/{key[1]}', {'metadata': {'finalizers': None}})
        services = self.api.call('GET', f'/api/v1{ns_part}/services')['items']
        self.services.sync(services, api_pods.values())
        for dep in deps:
            self._deployments.sync(dep)
        self._runner.step()
        for dep in deps:
            self._deployments.write_status(dep)
