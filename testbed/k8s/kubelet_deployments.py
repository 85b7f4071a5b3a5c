"""
The deployment controller of the kubelet stand-in (see ``kubelet.py``): which pods a Deployment
should have (scaling, RollingUpdate with maxSurge/maxUnavailable, Recreate, minReadySeconds) and
the Deployment's status (counts, Available/Progressing conditions, progressDeadlineSeconds).
Pods are created and ended through the node side (``kubelet_runner.PodRunner``).
"""
import dataclasses
import math
import time
from typing import Any

from .kubelet_api import Api, ApiError
from .kubelet_containers import now_iso
from .kubelet_pods import Pod, template_hash
from .kubelet_runner import PodRunner


def _scaled(value: Any, replicas: int, round_up: bool, default: str) -> int:
    value = default if value is None else value
    if isinstance(value, str) and value.endswith('%'):
        exact = float(value[:-1]) * replicas / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


@dataclasses.dataclass
class DeploymentState:
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


class DeploymentController:
    """``states``: what it keeps of each Deployment, by uid."""

    def __init__(self, api: Api, runner: PodRunner) -> None:
        self.api, self.runner = api, runner
        self.states: dict[str, DeploymentState] = {}

    def find(self, name: str, namespace: str) -> DeploymentState | None:
        return next((d for d in self.states.values() if (d.name, d.namespace) == (name, namespace)), None)

    def forget_all_but(self, uids: Any) -> None:
        """Drop the state of every Deployment whose uid is not in ``uids`` (it is gone)."""
        for uid in [u for u in self.states if u not in uids]:
            del self.states[uid]

    def _state(self, dep: dict[str, Any]) -> DeploymentState:
        meta = dep['metadata']
        state = self.states.get(meta['uid'])
        if state is None:
            state = self.states[meta['uid']] = DeploymentState(meta['name'], meta['namespace'], meta['uid'])
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

    def sync(self, dep: dict[str, Any]) -> None:
        """Create and end pods towards what the Deployment asks for."""
        state = self._state(dep)
        spec = dep.get('spec') or {}
        if dep['metadata'].get('deletionTimestamp') or spec.get('paused'):
            return
        template, replicas = spec.get('template') or {}, state.replicas
        pods = [p for p in self.runner.pods.values() if p.deployment_uid == state.uid]
        live = [p for p in pods if not p.terminating]
        new = [p for p in live if p.thash == state.thash]
        old = [p for p in live if p.thash != state.thash]
        # Scale-down order: unavailable before available, newest first.
        order = lambda ps: sorted(ps, key=lambda p: (self._available(p, dep), -p.created_mono))  # noqa: E731
        if (spec.get('strategy') or {}).get('type') == 'Recreate':
            if old:
                for p in old:
                    self.runner.terminate(p, 'Recreate')
            elif not any(p.terminating for p in pods):
                self._scale(dep, template, state.thash, new, replicas, order)
            return
        if not old:
            self._scale(dep, template, state.thash, new, replicas, order)
            return
        surge, max_unavailable = self._limits(dep, replicas)
        if len(new) > replicas:
            for p in order(new)[:len(new) - replicas]:
                self.runner.terminate(p, 'scaled down')
            return
        room = min(replicas - len(new), replicas + surge - len(live))
        if room > 0:
            for _ in range(room):
                self.runner.create(dep, template, state.thash)
            return
        min_available = replicas - max_unavailable
        new_unavailable = sum(1 for p in new if not self._available(p, dep))
        budget = len(live) - min_available - new_unavailable
        if budget <= 0:
            return
        unhealthy = [p for p in order(old) if not self._available(p, dep)][:budget]
        for p in unhealthy:
            self.runner.terminate(p, 'rolling update: unhealthy old pod')
        healthy = [p for p in order(old) if self._available(p, dep)]
        available = sum(1 for p in live if self._available(p, dep))
        for p in healthy[:max(0, min(budget - len(unhealthy), available - min_available))]:
            self.runner.terminate(p, 'rolling update')

    def _scale(self, dep: dict[str, Any], template: dict[str, Any], thash: str, pods: list[Pod], replicas: int,
               order: Any) -> None:
        for _ in range(replicas - len(pods)):
            self.runner.create(dep, template, thash)
        for p in order(pods)[:max(0, len(pods) - replicas)]:
            self.runner.terminate(p, 'scaled down')

    def _condition(self, state: DeploymentState, ctype: str, ok: bool | None, reason: str, message: str,
                   updated: str | None = None) -> dict[str, Any]:
        status = 'Unknown' if ok is None else 'True' if ok else 'False'
        if state.transitions.get(ctype, ('', ''))[0] != status:
            state.transitions[ctype] = (status, now_iso())
        return {'type': ctype, 'status': status, 'lastUpdateTime': updated or state.transitions[ctype][1],
                'lastTransitionTime': state.transitions[ctype][1], 'reason': reason, 'message': message}

    def write_status(self, dep: dict[str, Any]) -> None:
        meta, spec = dep['metadata'], dep.get('spec') or {}
        state = self.states.get(meta['uid'])
        if state is None:
            return
        replicas = state.replicas
        live = [p for p in self.runner.pods.values() if p.deployment_uid == state.uid and not p.terminating]
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
