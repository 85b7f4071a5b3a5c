"""Observe the runtime pods: which are ready, and which versions each has loaded (and why not).

Each pod answers ``GET /v2/models/{model}/status`` with every version's state and reason, the
backend it runs on beside the one its engine settings ask for, and the weights and routing table
(its digest) it routes by. The scrape is concurrent and
bounded by a short timeout so that one stuck pod cannot stall a reconcile.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from mnn_rollout.contract.config import VersionSpec
from mnn_rollout.contract.routing import WORKERS_DIFFER, table_digest


@dataclass(frozen=True)
class PodView:
    name: str
    ip: str | None
    port: int
    ready: bool  # the pod's Ready condition
    status: dict[str, Any] | None = None  # the runtime's /status answer, None when unreachable
    error: str | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


@dataclass(frozen=True)
class EngineFallback:
    """Pods that run a version on another backend than its ``engine.backend`` (one the node lacks)."""

    requested: str
    backend: str
    pods: int
    reason: str | None


@dataclass(frozen=True)
class VersionView:
    name: str
    ready_pods: int
    pods: int
    reason: str | None
    fallback: EngineFallback | None = None
    offloaded_pods: int = 0  # of the ready ones: unloaded while idle, loading again on demand

    @property
    def ready(self) -> bool:
        return self.pods > 0 and self.ready_pods == self.pods

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "ready": self.ready, "readyPods": self.ready_pods,
                               "pods": self.pods}
        if self.reason:
            out["reason"] = self.reason
        if self.offloaded_pods:
            out["offloadedPods"] = self.offloaded_pods
        if self.fallback is not None:
            fb = self.fallback
            out.update(requestedBackend=fb.requested, backend=fb.backend,
                       engineFallback=f"{fb.pods} of {self.pods} pods run it on {fb.backend}, not {fb.requested}"
                                      + (f": {fb.reason}" if fb.reason else ""))
        return out


@dataclass(frozen=True)
class Observation:
    pods: list[PodView] = field(default_factory=list)

    @property
    def ready_pods(self) -> int:
        return sum(1 for p in self.pods if p.ready)

    @property
    def answering(self) -> list[PodView]:
        return [p for p in self.pods if p.status is not None]

    def serving(self, weights: dict[str, int], table: Mapping[str, object] | None = None,
                shadow: tuple[str, int] | None = None) -> tuple[bool | None, str]:
        """Whether every ready pod that answers routes by ``weights`` (their entries above 0), as the
        runtime reports in its status, and by ``table`` (the encoded routing table published with
        them: the same weights can come with another table, after a change and back), compared by
        digest where the pod reports one (an older runtime does not: judged by weights alone); and
        whether it shadows ``shadow`` (version, percent; None: nothing), where the pod reports
        ``shadow`` (a shadow step changes neither weights nor table; an older runtime does not say).
        (True, ""), (False, which pod serves what instead), or (None, "") when no pod reports
        weights (an older runtime). A ready pod asked that did not answer is not confirmed: its
        timeout (one look, under load) would otherwise have made the step look served by the others,
        or, all silent, counted it from the write (as for an older runtime) while they routed the old weights."""
        want = {k: v for k, v in weights.items() if v}
        digest = table_digest(table) if table is not None else None
        silent = [f"{p.name} did not answer ({p.error})" for p in self.pods if p.ready and p.status is None and p.error]
        reported, off = 0, []
        for pod in self.answering:
            got = (pod.status or {}).get("weights")
            if not pod.ready or not isinstance(got, dict):
                continue
            reported += 1
            routes = {k: v for k, v in got.items() if v}
            versions = (pod.status or {}).get("versions") or {}
            # a version with weight that the pod has not loaded: its share goes to the pod's fallback
            missing = [v for v in routes if not (versions.get(v) or {}).get("ready")
                       and (versions.get(v) or {}).get("state") != "offloaded"]
            served = (pod.status or {}).get("table_digest")
            if served == WORKERS_DIFFER:
                off.append(_lagging(pod, routes if routes != want else None))
            elif routes != want:
                off.append(f"{pod.name} serves {weights_text(routes)}")
            elif digest is not None and isinstance(served, str) and served != digest:
                off.append(f"{pod.name} routes by another table of these weights (digest {served}, not {digest})")
            elif missing:
                off.append(f"{pod.name} has not loaded {', '.join(sorted(missing))} (its share goes to the fallback)")
            elif "shadow" in (pod.status or {}):
                off.extend(_shadow_off(pod, shadow))
        if not reported and (not silent or any(p.ready for p in self.answering)):
            return None, ""  # silent pods beside ones answering without weights: an older runtime
        off = silent + off
        if not off:
            return True, ""
        return False, off[0] + (f" (and {len(off) - 1} more pods)" if len(off) > 1 else "")

    def version(self, spec: VersionSpec) -> VersionView:
        """A version is ready when every pod that answers has it loaded from exactly the ``uri``
        (and, when the spec names one, the ``sha256``) of ``spec``: a pod still serving an older
        file of the version, or that failed to load the new one, does not count. A version the pod
        unloaded while idle (``runtime.idleUnloadSeconds``) counts: the pod loads that same file
        again for its next request, and before a config gives it weight."""
        pods = self.answering
        ready, offloaded, failed, loading = 0, 0, [], []
        for pod in pods:
            state = (pod.status or {}).get("versions", {}).get(spec.name)
            serves = _serves(state, spec)
            if state and state.get("state") == "offloaded" and serves is None:
                ready += 1
                offloaded += 1
            elif state and state.get("ready") and serves is None:
                ready += 1
            elif state and state.get("reason"):
                failed.append(f"{pod.name}: {state['reason']}")
            elif state and state.get("ready"):
                failed.append(f"{pod.name}: {serves}")
            else:
                loading.append(f"{pod.name}: not loaded yet")
        reasons = failed or loading  # a load failure says more than "not yet"
        reason = None if not reasons else reasons[0] + (f" (and {len(reasons) - 1} more pods)" if len(reasons) > 1
                                                          else "")
        return VersionView(spec.name, ready, len(pods), reason, _fallback(pods, spec.name), offloaded)


def _lagging(pod: PodView, routes: dict[str, int] | None, what: str = "route by the pod's newest table",
             differ: str = "route by different tables") -> str:
    """What a pod whose workers route (or shadow: ``what``) differently says: the workers not on its
    newest config yet (``lagging_workers``, pids), and the weights they route by when not the ones wanted."""
    pids = (pod.status or {}).get("lagging_workers")
    named = [str(p) for p in pids if isinstance(p, int) and not isinstance(p, bool)] if isinstance(pids, list) else []
    if not named:
        return f"{pod.name}: its workers {differ} (the runtime names none lagging)"
    who = f"worker {named[0]} does" if len(named) == 1 else f"workers {', '.join(named)} do"
    serve = f"{weights_text(routes)}; " if routes is not None else ""
    return f"{pod.name}: {who} not {what} yet ({serve}the other workers do)"


def _shadow_off(pod: PodView, want: tuple[str, int] | None) -> list[str]:
    """Why ``pod`` does not shadow ``want`` (as its /status's ``shadow`` says), or nothing when it does."""
    status = pod.status or {}
    got = status.get("shadow")
    if got == WORKERS_DIFFER:
        return [_lagging(pod, None, "shadow as the pod's newest config", "shadow differently")]
    wanted = None if want is None else {"version": want[0], "percent": want[1]}
    if got != wanted:
        return [f"{pod.name} shadows {shadow_text(got)}, not {shadow_text(wanted)}"]
    state = (status.get("versions") or {}).get(want[0]) if want is not None else None
    if want is not None and not (state or {}).get("ready"):
        return [f"{pod.name} has not loaded {want[0]} (its shadow runs nothing)"]
    return []


def shadow_text(shadow: object) -> str:
    """``20% of stable's requests on v2``, ``nothing``, or what a pod said that is neither."""
    if shadow is None:
        return "nothing"
    if isinstance(shadow, dict):
        return f"{shadow.get('percent')}% of stable's requests on {shadow.get('version')}"
    return repr(shadow)


def weights_text(weights: dict[str, int]) -> str:
    """``v1:80, v2:20``: heaviest first, then by name."""
    return ", ".join(f"{k}:{v}" for k, v in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))) or "nothing"


def _fallback(pods: list[PodView], version: str) -> EngineFallback | None:
    """The backend fallback the pods report for ``version``: the first one's, with the number of
    pods reporting the same (None when none does)."""
    engines = [((p.status or {}).get("versions", {}).get(version) or {}).get("engine") or {} for p in pods]
    fallen = [e for e in engines if e.get("fallback")]
    if not fallen:
        return None
    first = fallen[0]
    same = [e for e in fallen if (e.get("requested_backend"), e.get("backend")) ==
            (first.get("requested_backend"), first.get("backend"))]
    return EngineFallback(str(first.get("requested_backend")), str(first.get("backend")), len(same),
                          first.get("reason"))


def _serves(state: dict[str, Any] | None, spec: VersionSpec) -> str | None:
    """None when the pod's loaded file is the one ``spec`` names; else what it serves instead."""
    if not state:
        return None
    uri, sha = state.get("uri"), state.get("sha256")
    if uri != spec.uri:
        return f"serves {uri}, not {spec.uri} yet"
    if spec.sha256 is not None and sha != spec.sha256:
        return f"serves {uri} with sha256 {str(sha)[:12]}..., not {spec.sha256[:12]}..."
    return None


def pod_views(pods: list[dict[str, Any]], port: int) -> list[PodView]:
    views = []
    for pod in pods:
        meta, status = pod.get("metadata", {}), pod.get("status", {})
        if meta.get("deletionTimestamp") or status.get("phase") not in ("Running", None):
            continue
        conditions = {c.get("type"): c.get("status") for c in status.get("conditions", [])}
        views.append(PodView(meta.get("name", "?"), status.get("podIP"), port, conditions.get("Ready") == "True"))
    return views


_pods_http: httpx.Client | None = None
_pods_http_lock = threading.Lock()


def pods_http() -> httpx.Client:
    """One HTTP client (one connection pool) for every request to runtime pods: a client per
    request built a TLS context each time, which profiled at three quarters of the operator's CPU
    with 50 rollouts in flight."""
    global _pods_http
    with _pods_http_lock:
        if _pods_http is None:
            _pods_http = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=32))
        return _pods_http


def scrape(views: list[PodView], model: str, timeout: float = 1.0) -> Observation:
    def one(view: PodView) -> PodView:
        if not view.ip:
            return view
        try:
            resp = pods_http().get(f"{view.url}/v2/models/{model}/status", timeout=timeout)
            resp.raise_for_status()
            return PodView(view.name, view.ip, view.port, view.ready, resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            return PodView(view.name, view.ip, view.port, view.ready, None, str(exc) or type(exc).__name__)

    if not views:
        return Observation([])
    with ThreadPoolExecutor(max_workers=min(16, len(views))) as pool:
        return Observation(list(pool.map(one, views)))
