"""
The node side of the kubelet stand-in (see ``kubelet.py``): the pods it runs. Creating a Pod
object, starting and restarting its containers, ending it gracefully (the API shows the deletion,
then SIGTERM, SIGKILL after the grace period), dropping its finalizer once its processes are gone,
and writing its status (only on change).
"""
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .kubelet_api import Api, ApiError
from .kubelet_containers import Timing
from .kubelet_pods import FINALIZER, IPAllocator, Pod, random_suffix


class PodRunner:
    """Runs the pods of this node: ``pods`` by (namespace, name), ``event`` logs what happens."""

    def __init__(self, api: Api, *, workdir: Path, node_name: str, timing: Timing, commands: dict[str, list[str]],
                 entrypoint: list[str], base_env: dict[str, str], event: Callable[[str], None]) -> None:
        self.api, self.workdir, self.node_name, self.timing = api, workdir, node_name, timing
        self.commands, self.entrypoint, self.base_env, self.event = commands, entrypoint, base_env, event
        self.ips = IPAllocator()
        self.pods: dict[tuple[str, str], Pod] = {}

    @staticmethod
    def pod_path(pod: Pod) -> str:
        return f'/api/v1/namespaces/{pod.namespace}/pods/{pod.name}'

    def fetch(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.api.get_or_none(f'/api/v1/namespaces/{namespace}/{plural}/{name}')

    def create(self, dep: dict[str, Any], template: dict[str, Any], thash: str) -> None:
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
            self.event(f'create pod {name} failed: {e}')
            return
        pod.uid, pod.created_mono = created['metadata']['uid'], time.monotonic()
        self.pods[(pod.namespace, pod.name)] = pod
        self.event(f'created pod {pod.namespace}/{name} ip {pod.ip}')

    def terminate(self, pod: Pod, reason: str, grace: Any = None, api_gone: bool = False) -> None:
        if pod.terminating:
            return
        pod.terminating = True
        seconds = pod.grace(grace)
        pod.term_deadline = time.monotonic() + seconds
        self.event(f'terminating {pod.namespace}/{pod.name} ({reason}), grace {seconds} s')
        if api_gone:
            pod.uid = None
        else:  # the API shows the deletion first (clients stop using the pod), then the signal
            try:
                self.api.call('DELETE', self.pod_path(pod), {'gracePeriodSeconds': int(seconds)}, ok=(200, 202, 404))
            except ApiError as e:
                self.event(f'delete pod {pod.name} failed: {e}')
        for c in pod.containers:
            c.kill() if seconds <= 0 else c.terminate()

    def release(self, pod: Pod, api: Api | None = None) -> None:
        """Drop our finalizer: the (already deleted) Pod object then disappears."""
        api = api or self.api
        obj = api.get_or_none(self.pod_path(pod))
        if obj is None or obj['metadata'].get('uid') != pod.uid:
            return
        finalizers = [f for f in obj['metadata'].get('finalizers') or [] if f != FINALIZER]
        try:
            api.merge_patch(self.pod_path(pod), {'metadata': {'finalizers': finalizers or None,
                                                              'resourceVersion': obj['metadata']['resourceVersion']}})
        except ApiError as e:
            if e.status not in (404, 409):
                raise

    def step(self) -> None:
        """One pass over every pod: reap the ended, (re)start containers whose time has come,
        write each status."""
        now = time.monotonic()
        for key, pod in list(self.pods.items()):
            if pod.terminating:
                for c in pod.containers:
                    c.advance()
                if not all(c.reap() for c in pod.containers):
                    if now > pod.term_deadline:
                        for c in pod.containers:
                            c.kill()
                    continue
                self.write_status(pod)
                if pod.uid is not None:
                    self.release(pod)
                del self.pods[key]
                self.event(f'pod {key} gone')
                continue
            for c in pod.containers:
                if c.check_exit():
                    self.event(f'container {pod.name}/{c.name} exited: {c.last_state}')
                if c.proc is None and now >= c.next_start:
                    c.start(self.fetch, self.commands, self.entrypoint, self.base_env, self.workdir)
                    self.event(f'container {pod.name}/{c.name} started pid {c.pid} restarts {c.restarts}'
                               if c.proc else f'container {pod.name}/{c.name} not started: {c.waiting}')
            self.write_status(pod)

    def write_status(self, pod: Pod) -> None:
        status = pod.status()
        if status == pod.last_status or pod.uid is None:
            return
        try:
            self.api.merge_patch(self.pod_path(pod) + '/status', {'status': status})
        except ApiError as e:
            if e.status == 404:
                return
            raise
        pod.last_status = status
        ready = next(c['status'] == 'True' for c in status['conditions'] if c['type'] == 'Ready')
        if ready and not pod.api_ready:
            pod.ready_since = time.monotonic()
            self.event(f'pod {pod.name} ready')
        pod.api_ready = ready

    def end_all(self, api: Api) -> None:
        """End every process (SIGTERM, SIGKILL after 3 s) and, best effort through ``api``, delete
        every Pod object; forget every pod."""
        pods = list(self.pods.values())
        for pod in pods:
            for c in pod.containers:
                c.quit()
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
        for pod in pods:  # best effort: leave no pods behind in a still-running API
            try:
                api.call('DELETE', self.pod_path(pod), ok=(200, 202, 404))
                self.release(pod, api)
            except (OSError, ApiError):
                break
        self.pods.clear()
