"""
A chaos soak: rollouts under traffic while operator replicas, runtime pods, the API, its watches,
Prometheus and the alert webhook misbehave, with invariants checked all along.

Three ModelDeployments roll out one canary after another: ``good`` (direct provider, healthy
canaries), ``bad`` (direct provider, every canary the error-returning ``v2-breaking``) and
``prom`` (Prometheus provider, healthy canaries). Each has its own traffic. Every few seconds one
fault, drawn from a seeded random sequence: SIGKILL an operator replica (another is started at
once; a standby takes over when the peering keep-alive lapses), delete or SIGKILL a runtime pod,
API faults (409, 429 with Retry-After, 500, a 500 after the write landed), cut every watch, cut
them after a compaction (410 Gone on resume), stop Prometheus for a while, malformed and
unauthenticated alerts, a real firing alert on the failing canary, and manual actions (promote,
abort, retry, pause/resume).

Invariants, checked twice a second and at the end:

(a) no step advance or promotion without evidence: when the status moves a canary past a step
    (and no manual promote asked for it), the canary answered at least ``minRequests`` requests
    in that step, by the traffic generator's own count, with an error rate within the metric's;
(b) the weights in the status are what every ready pod serves (its routing table, with versions
    it has not loaded routed to stable) within 5 s;
(c) one child of each kind per ModelDeployment, owned by it; none whose owner is gone;
(d) a failing canary never becomes stable and ends rolled back (RolledBack or Failed);
(e) every manual action gets an outcome: applied, ignored with a reason, or pending and then one
    of those.
"""

from __future__ import annotations

import dataclasses
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import kubernetes
import yaml

from mnn_rollout.local.traffic import Traffic
from rollout_operator import ctl
from rollout_operator.children import OWNER_LABEL
from rollout_operator.kube import KubeClient
from rollout_operator.reconcile import ACTION_ANNOTATION
from testbed.cluster import Cluster
from testbed.promstack import Prometheus

NS = "default"
MD_PATH = f"/apis/mnnrollout.io/v1alpha1/namespaces/{NS}/modeldeployments"
MIN_REQUESTS = 10
MAX_ERROR_RATE = 0.05
WEIGHT_GRACE = 5.0  # (b): how long the status and a ready pod may disagree
TERMINAL = {"Ready", "Succeeded", "RolledBack", "Failed"}
FAULTS = ("operator-kill", "pod-delete", "pod-kill", "api-409", "api-429", "api-500", "api-500-after", "watch-drop",
          "watch-410", "prometheus-stop", "alerts-bad", "alert-firing", "action")
CHILD_KINDS = {"configmaps": "ConfigMap", "services": "Service", "serviceaccounts": "ServiceAccount"}
CHILD_PATHS = {**{f"/api/v1/namespaces/{NS}/{p}": k for p, k in CHILD_KINDS.items()},
               f"/apis/apps/v1/namespaces/{NS}/deployments": "Deployment",
               f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets": "PodDisruptionBudget",
               f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers": "HorizontalPodAutoscaler",
               f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles": "Role",
               f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings": "RoleBinding"}


@dataclasses.dataclass
class Subject:
    """One ModelDeployment under test and its rollouts."""

    name: str
    canary_files: list[str]
    failing: bool = False
    prometheus: bool = False
    attempt: int = 0
    stable: tuple[str, str] = ("s0", "v1.mnn")  # (version name, file)
    canary: str | None = None
    traffic: Traffic | None = None
    terminal_since: float | None = None
    history: list[tuple[float, dict[str, Any]]] = dataclasses.field(default_factory=list)
    disagree_since: dict[str, float] = dataclasses.field(default_factory=dict)
    busy: bool = False  # an action is in flight
    rollouts: Counter[str] = dataclasses.field(default_factory=Counter)  # how each attempt ended


@dataclasses.dataclass
class Action:
    subject: str
    verb: str
    token: str
    sent: float
    generation: int | None = None  # pause / resume: the generation that must be observed
    outcome: str | None = None
    code: int | None = None
    resolved_at: float | None = None


class Soak:
    def __init__(self, cluster: Cluster, prometheus: Prometheus, seconds: float, seed: int = 1,
                 period: float = 3.0, rate: float = 40.0, log: Callable[[str], None] = print) -> None:
        self.cluster = cluster
        self.prom = prometheus
        self.seconds = seconds
        self.rng = random.Random(seed)
        self.period = period
        self.rate = rate
        self.log = log
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(cluster.emu.kubeconfig_path),
                                           client_configuration=configuration)
        self.kube = KubeClient(configuration, qps=0)  # the CLI's client, as a user runs it
        self.subjects = [Subject("good", ["v2.mnn", "v1.mnn"]), Subject("bad", ["v2-breaking.mnn"], failing=True),
                         Subject("prom", ["v2.mnn", "v1.mnn"], prometheus=True)]
        self.faults: Counter[str] = Counter()
        self.checks: Counter[str] = Counter()
        self.violations: list[str] = []
        self.actions: list[Action] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._prom_down_until: float | None = None
        self._prom_targets: list[str] = []
        self._threads: list[threading.Thread] = []
        self._schedule: list[str] = []
        self.started = time.monotonic()

    # -- the run -------------------------------------------------------------------------------------

    def run(self) -> Soak:
        for _ in range(2):
            self.cluster.start_operator("--peering-lifetime", "5")
        for s in self.subjects:
            self._apply(s, self._manifest(s))
        for s in self.subjects:
            self.cluster.wait_ready(s.name, replicas=2, timeout=120)
            s.traffic = Traffic(lambda s=s: self.cluster.pods(s.name), model=s.name, users=300, rate=self.rate,
                                connections=2, max_seconds=self.seconds + 400, timeout=5).start()
        self.started = time.monotonic()
        checker = threading.Thread(target=self._check_loop, name="soak-checker", daemon=True)
        checker.start()
        try:
            next_fault = time.monotonic() + self.period
            while time.monotonic() - self.started < self.seconds:
                self._drive(starting=True)
                if time.monotonic() >= next_fault:
                    self._inject()
                    next_fault = time.monotonic() + self.period * self.rng.uniform(0.5, 1.5)
                self._revive_prometheus()
                time.sleep(0.2)
            self.log(f"[{self._t():6.1f}s] faults stop; waiting for every rollout and action to settle")
            self.cluster.emu.request("DELETE", "/_emulator/faults")
            self._revive_prometheus(force=True)
            self._settle(deadline=240)
        finally:
            self._stop.set()
            checker.join(10)
            for t in self._threads:
                t.join(30)
            for s in self.subjects:
                if s.traffic is not None:
                    s.traffic.stop()
        self._final_checks()
        return self

    def _t(self) -> float:
        return time.monotonic() - self.started

    def _manifest(self, s: Subject) -> dict[str, Any]:
        models = self.cluster.models
        versions = [{"name": s.stable[0], "uri": f"file://{models}/{s.stable[1]}"}]
        spec: dict[str, Any] = {"model": s.name, "stable": s.stable[0], "versions": versions,
                                "progressDeadlineSeconds": 45,
                                "runtime": {"replicas": 2, "resources": {"limits": {"cpu": "1", "memory": "1Gi"}}}}
        if s.canary is not None:
            file = s.canary_files[s.attempt % len(s.canary_files)]
            versions.append({"name": s.canary, "uri": f"file://{models}/{file}"})
            provider = ({"type": "prometheus", "address": self.prom.url, "timeout": "2s"} if s.prometheus
                        else {"type": "direct"})
            spec["canary"] = s.canary
            spec["strategy"] = {"steps": [{"weight": 20, "pause": "3s"}, {"weight": 50, "pause": "3s"}],
                                "analysis": {"interval": "1s", "minRequests": MIN_REQUESTS, "failureLimit": 2,
                                             "provider": provider,
                                             "metrics": [{"name": "error-rate", "max": MAX_ERROR_RATE}]},
                                "scaleDownDelaySeconds": 2}
        return {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment",
                "metadata": {"name": s.name, "namespace": NS}, "spec": spec}

    def _apply(self, s: Subject, obj: dict[str, Any]) -> None:
        for attempt in range(20):  # the API may be failing on purpose
            try:
                self.cluster.apply(obj)
                return
            except Exception as exc:  # kubectl's error under an injected fault
                if attempt == 19:
                    raise
                self.log(f"[{self._t():6.1f}s] apply {s.name} failed ({str(exc)[-120:]}); again")
                time.sleep(0.5)

    def _drive(self, starting: bool) -> None:
        """Start each subject's next rollout once its last one ended (and no action is in flight)."""
        for s in self.subjects:
            st = self._status(s)
            if st is None or s.busy or st.get("phase") not in TERMINAL or self._paused(s):
                s.terminal_since = None
                continue
            if s.terminal_since is None:
                s.terminal_since = time.monotonic()
                if s.canary is not None and st.get("canaryVersion") == s.canary:
                    s.rollouts[str(st["phase"])] += 1
                    self.log(f"[{self._t():6.1f}s] {s.name}: {s.canary} ended {st['phase']}"
                             f" ({st.get('abortReason') or st.get('message', '')})"[:200])
                    if st["phase"] == "Failed":  # held to the deadline: say by what
                        self.log(f"          last analysis: {st.get('analysis')}"[:600])
            if not starting or time.monotonic() - s.terminal_since < 2:
                continue
            if st.get("phase") == "Succeeded":
                file = s.canary_files[s.attempt % len(s.canary_files)]
                s.stable = (str(st["stableVersion"]), file)
            s.attempt += 1
            s.canary = f"{'b' if s.failing else 'r'}{s.attempt}"
            s.terminal_since = None
            self._apply(s, self._manifest(s))
            self.log(f"[{self._t():6.1f}s] {s.name}: rollout of {s.canary} (stable {s.stable[0]})")

    def _settle(self, deadline: float) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            self._drive(starting=False)
            for s in self.subjects:
                if self._paused(s) and not s.busy:
                    self._resume(s)
            if all(s.terminal_since is not None and not s.busy for s in self.subjects):
                return
            time.sleep(0.5)
        self.violations.append(f"not settled within {deadline:g} s after the faults stopped: " + ", ".join(
            f"{s.name} {(self._status(s) or {}).get('phase')}" for s in self.subjects))

    # -- faults ----------------------------------------------------------------------------------------

    def _inject(self) -> None:
        if not self._schedule:  # every kind once per round, in a shuffled order; actions three times
            self._schedule = list(FAULTS) + ["action", "action"]
            self.rng.shuffle(self._schedule)
        kind = self._schedule.pop()
        try:
            detail = getattr(self, "_fault_" + kind.replace("-", "_"))()
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
            detail = f"not injected: {type(exc).__name__}: {exc}"
        if detail is None:
            return
        if not detail.startswith("not injected"):
            self.faults[kind] += 1
        self.log(f"[{self._t():6.1f}s] fault {kind}: {detail}")

    def _fault_operator_kill(self) -> str:
        alive = [op for op in self.cluster.operators if op.proc is not None and op.proc.poll() is None]
        victim = self.rng.choice(alive)
        victim.kill(signal.SIGKILL)
        self.cluster.start_operator("--peering-lifetime", "5")
        return f"SIGKILL {victim.log_path.name}; started operator-{len(self.cluster.operators) - 1}"

    def _pod(self) -> Any:
        pods = [p for s in self.subjects for p in self.cluster.kubelet.pods(f"{s.name}-runtime", NS)]
        return self.rng.choice(pods)

    def _fault_pod_delete(self) -> str:
        pod = self._pod()
        self.cluster.emu.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{pod.name}")
        return f"deleted pod {pod.name}"

    def _fault_pod_kill(self) -> str:
        pod = self._pod()
        pid = self.cluster.kubelet.kill(pod.name)
        return f"SIGKILL pod {pod.name} (pid {pid})"

    def _fault(self, code: int, method: str, path: str, times: int, **kw: Any) -> str:
        self.cluster.emu.inject_fault(code, method=method, path=path, times=times, **kw)
        return f"{code} on the next {times} {method} {path}" + (f" {kw}" if kw else "")

    def _fault_api_409(self) -> str:
        return self._fault(409, "PATCH", self.rng.choice(["modeldeployments/[a-z]+/status$", "configmaps/"]),
                           self.rng.randint(1, 3), reason="Conflict")

    def _fault_api_429(self) -> str:
        return self._fault(429, "*", self.rng.choice(["modeldeployments", "configmaps/", "/pods"]),
                           self.rng.randint(2, 6), reason="TooManyRequests", retry_after=1)

    def _fault_api_500(self) -> str:
        return self._fault(500, self.rng.choice(["PATCH", "GET", "POST"]),
                           self.rng.choice(["modeldeployments", "configmaps/", "deployments/", "/events"]),
                           self.rng.randint(1, 4))

    def _fault_api_500_after(self) -> str:
        return self._fault(500, "PATCH", self.rng.choice(["modeldeployments/[a-z]+/status$", "configmaps/"]),
                           self.rng.randint(1, 2), after=True)

    def _fault_watch_drop(self) -> str:
        self.cluster.emu.drop_watches()
        return "every watch cut"

    def _fault_watch_410(self) -> str:
        self.cluster.emu.compact()
        self.cluster.emu.drop_watches()
        return "history compacted and every watch cut (resumes get 410 Gone)"

    def _fault_prometheus_stop(self) -> str | None:
        if self._prom_down_until is not None:
            return None
        self.prom.stop()
        self._prom_down_until = time.monotonic() + 15
        return "Prometheus stopped for 15 s"

    def _revive_prometheus(self, force: bool = False) -> None:
        if self._prom_down_until is not None and (force or time.monotonic() >= self._prom_down_until):
            self.prom.start()
            self._prom_down_until = None
            self._prom_targets = []
            self.log(f"[{self._t():6.1f}s] Prometheus started again")

    def _webhooks(self) -> list[str]:
        return [f"http://127.0.0.1:{op.webhook_port}/alerts" for op in self.cluster.operators
                if op.proc is not None and op.proc.poll() is None]

    def _fault_alerts_bad(self) -> str:
        answers = []
        token = {"Authorization": f"Bearer {self.cluster.token}"}
        cases = [({}, b'{"alerts": []}', 401), ({"Authorization": "Bearer wrong"}, b'{"alerts": []}', 401),
                 (token, b"{not json", 400), (token, b'{"alerts": "nope"}', 400),
                 (token, b'{"alerts": [{"status": "firing", "labels": 7}]}', 400)]
        for url in self._webhooks():
            for headers, body, expected in cases:
                try:
                    code = httpx.post(url, content=body, headers=headers, timeout=5).status_code
                except httpx.HTTPError:
                    continue  # a replica that is starting or just killed
                answers.append(code)
                self.checks["alerts refused"] += 1
                if code != expected:
                    self.violations.append(f"webhook {url} answered {code} to a bad alert, not {expected}")
        return f"{len(answers)} malformed or unauthenticated posts, answered {sorted(Counter(answers).items())}"

    def _fault_alert_firing(self) -> str | None:
        bad = next(s for s in self.subjects if s.failing)
        st = self._status(bad) or {}
        if st.get("phase") != "Progressing" or not bad.canary:
            return None
        payload = {"version": "4", "status": "firing", "alerts": [{
            "status": "firing", "labels": {"alertname": "SoakCanaryErrors", "model": bad.name, "version": bad.canary},
            "startsAt": "2026-12-01T00:00:00Z"}]}
        for url in self._webhooks():
            try:
                code = httpx.post(url, json=payload, headers={"Authorization": f"Bearer {self.cluster.token}"},
                                  timeout=5).status_code
                return f"firing alert for {bad.name}/{bad.canary} via {url}: {code}"
            except httpx.HTTPError:
                continue
        return "not injected: no webhook answered"

    def _fault_action(self) -> str | None:
        candidates = [s for s in self.subjects if not s.busy]
        if not candidates:
            return None
        s = self.rng.choice(candidates)
        verbs = ["abort", "retry", "pause"] + ([] if s.failing else ["promote", "promote"])
        verb = self.rng.choice(verbs)
        s.busy = True
        thread = threading.Thread(target=self._act, args=(s, verb), daemon=True)
        self._threads.append(thread)
        thread.start()
        return f"{verb} {s.name}"

    # -- manual actions --------------------------------------------------------------------------------

    def _act(self, s: Subject, verb: str) -> None:
        """One action, as a user sends it with the CLI; the subject takes no other until the
        operator has answered it (a second action in the same annotation would replace it)."""
        try:
            if verb == "pause":
                self._set_paused(s, True)
                time.sleep(self.rng.uniform(2, 6))
                self._resume(s)
                return
            action = Action(s.name, verb, f"{verb}:soak-{len(self.actions)}", time.monotonic())
            with self._lock:
                self.actions.append(action)
            try:
                action.code, action.outcome = ctl.act(self.kube, NS, s.name, verb, wait=15, token=action.token)
            except Exception as exc:  # noqa: BLE001 - the request itself failed (API fault): no action was made
                action.code, action.outcome = -1, f"not sent: {exc}"
            self.log(f"[{self._t():6.1f}s] action {action.token} on {s.name}: {action.code} {action.outcome}")
            if action.code == 2 or action.outcome.startswith("pending"):
                self._follow(s, action)
            action.resolved_at = time.monotonic()
        finally:
            s.busy = False

    def _follow(self, s: Subject, action: Action) -> None:
        """An action without a final answer yet: watch the status for it (at most 90 s)."""
        end = time.monotonic() + 90
        while time.monotonic() < end:
            st = self._status(s) or {}
            if st.get("lastAction") == action.token:
                result = str(st.get("actionResult") or "applied")
                action.code, action.outcome = (1 if result.startswith("ignored") else 0), result + " (later)"
            elif action.generation is not None and (st.get("observedGeneration") or 0) >= action.generation:
                action.code, action.outcome = 0, f"applied later (phase {st.get('phase')})"
            elif action.generation is None and st.get("lastAction") and not str(
                    st.get("pendingAction") or "").startswith(action.token) and self._annotation(s) != action.token:
                action.code, action.outcome = 3, f"lost: the request is gone and the operator answered " \
                                                 f"{st.get('lastAction')}"
            else:
                self.checks["(e) pending actions followed"] += 1
                time.sleep(0.25)
                continue
            self.log(f"[{self._t():6.1f}s] action {action.token} on {s.name}: {action.code} {action.outcome}")
            return

    def _annotation(self, s: Subject) -> str | None:
        md = self._md(s) or {}
        return ((md.get("metadata") or {}).get("annotations") or {}).get(ACTION_ANNOTATION)

    def _set_paused(self, s: Subject, paused: bool) -> None:
        verb = "pause" if paused else "resume"
        action = Action(s.name, verb, f"{verb}:soak-{len(self.actions)}", time.monotonic())
        with self._lock:
            self.actions.append(action)
        for _ in range(20):
            try:
                patched = self.kube.patch("ModelDeployment", NS, s.name, {"spec": {"paused": paused}})
                action.generation = int(patched["metadata"]["generation"])
                break
            except Exception:  # noqa: BLE001 - an injected fault: the user tries again
                time.sleep(0.5)
        else:
            action.code, action.outcome = -1, "not sent: the API refused every try"
            return
        action.code, action.outcome = 2, "requested"
        self._follow(s, action)
        action.resolved_at = time.monotonic()

    def _resume(self, s: Subject) -> None:
        self._set_paused(s, False)

    def _paused(self, s: Subject) -> bool:
        md = self._md(s)
        return bool(md and (md.get("spec") or {}).get("paused"))

    # -- reading the cluster ---------------------------------------------------------------------------

    def _md(self, s: Subject) -> dict[str, Any] | None:
        try:
            code, body = self.cluster.emu.request("GET", f"{MD_PATH}/{s.name}")
        except OSError:
            return None
        return body if code == 200 else None

    def _status(self, s: Subject) -> dict[str, Any] | None:
        md = self._md(s)
        return None if md is None else dict(md.get("status") or {})

    # -- invariants --------------------------------------------------------------------------------------

    def _check_loop(self) -> None:
        tick = 0
        while not self._stop.is_set():
            tick += 1
            try:
                for s in self.subjects:
                    md = self._md(s)
                    if md is None:
                        continue
                    st = dict(md.get("status") or {})
                    self._observe(s, st)
                    self._check_weights(s, st)
                if tick % 4 == 0:
                    self._check_children()
                self._update_prometheus_targets()
            except Exception as exc:  # noqa: BLE001 - a checker hiccup under API faults: next tick
                self.log(f"[{self._t():6.1f}s] checker: {type(exc).__name__}: {exc}")
            self._stop.wait(0.5)

    def _observe(self, s: Subject, st: dict[str, Any]) -> None:
        now = time.monotonic()
        if s.history and s.history[-1][1] == st:
            return  # unchanged: the time kept is when it was first seen
        s.history.append((now, st))
        if len(s.history) < 2:
            return
        before = s.history[-2][1]
        canary = before.get("canaryVersion")
        advanced = (canary and st.get("canaryVersion") == canary and before.get("phase") in ("Progressing", "Paused")
                    and before.get("currentStep") is not None
                    and ((st.get("currentStep") or -1) > before["currentStep"]
                         or (st.get("phase") in ("Promoting", "Succeeded") and st.get("stableVersion") == canary)))
        if s.failing and st.get("phase") in ("Promoting", "Succeeded") and st.get("stableVersion") == s.canary:
            self.violations.append(f"(d) {s.name}: the failing canary {s.canary} became stable")
        if not advanced:
            return
        # The step's window: from the observation before this step was first seen, to now.
        first = len(s.history) - 2
        while first > 0 and s.history[first - 1][1].get("currentStep") == before["currentStep"] \
                and s.history[first - 1][1].get("canaryVersion") == canary:
            first -= 1
        start = s.history[max(0, first - 1)][0]
        if any(a.subject == s.name and a.verb == "promote" and a.sent <= now and a.code != 1
               and (a.resolved_at is None or a.resolved_at >= start) for a in self.actions):
            self.checks["(a) advances by a manual promote"] += 1
            return
        samples = [x for x in s.traffic.samples(start) if x.version == canary and x.done <= now] if s.traffic else []
        errors = sum(1 for x in samples if x.status != 200)
        self.checks["(a) advances checked"] += 1
        rate = errors / len(samples) if samples else 1.0
        if len(samples) < MIN_REQUESTS or rate > MAX_ERROR_RATE:
            self.violations.append(
                f"(a) {s.name}: {canary} moved past step {before['currentStep']} at {before.get('canaryWeight')}%"
                f" with {len(samples)} requests ({errors} errors) in [{start - self.started:.1f}, "
                f"{now - self.started:.1f}] s")

    def _served(self, pod: Any, model: str) -> dict[str, int] | None:
        """The weights a pod serves: its table, with versions it has not loaded routed to stable."""
        try:
            body = httpx.get(f"{pod.url}/v2/models/{model}/status", timeout=1).json()
        except (httpx.HTTPError, ValueError):
            return None
        weights = {k: int(v) for k, v in (body.get("weights") or {}).items()}
        stable = body.get("stable_version")
        for name, state in (body.get("versions") or {}).items():
            if not state.get("ready") and weights.get(name) and stable in weights:
                weights[stable] += weights.pop(name)
        return {k: v for k, v in weights.items() if v}

    def _check_weights(self, s: Subject, st: dict[str, Any]) -> None:
        claimed = {k: int(v) for k, v in (st.get("weights") or {}).items() if v}
        if not claimed:
            return
        now = time.monotonic()
        for pod in self.cluster.pods(s.name):
            served = self._served(pod, s.name)
            if served is None:
                continue
            self.checks["(b) weights compared"] += 1
            key = pod.name
            if served == claimed:
                s.disagree_since.pop(key, None)
                continue
            since = s.disagree_since.setdefault(key, now)
            if now - since > WEIGHT_GRACE:
                self.violations.append(f"(b) {s.name}: status says {claimed} but pod {pod.name} serves {served}"
                                       f" for {now - since:.1f} s")
                s.disagree_since[key] = now  # one report per grace period

    def _check_children(self) -> None:
        owners: dict[str, str] = {}
        for s in self.subjects:
            md = self._md(s)
            if md is not None:
                owners[s.name] = md["metadata"]["uid"]
        if len(owners) != len(self.subjects):
            return
        for path, kind in CHILD_PATHS.items():
            code, body = self.cluster.emu.request("GET", f"{path}?labelSelector={OWNER_LABEL}")
            if code != 200:
                continue
            self.checks["(c) child lists"] += 1
            seen: Counter[str] = Counter()
            for item in body.get("items", []):
                meta = item["metadata"]
                owner = meta["labels"][OWNER_LABEL]
                seen[owner] += 1
                refs = [r.get("uid") for r in meta.get("ownerReferences") or []]
                if owner not in owners or refs != [owners[owner]]:
                    self.violations.append(f"(c) orphan {kind} {meta['name']}: owner {owner}, references {refs}")
            for owner, count in seen.items():
                if count > 1:
                    self.violations.append(f"(c) {count} {kind}s for {owner}")

    def _update_prometheus_targets(self) -> None:
        if self._prom_down_until is not None:
            return
        prom = next(s for s in self.subjects if s.prometheus)
        targets = sorted(f"{p.ip}:{p.port}" for p in self.cluster.kubelet.pods(f"{prom.name}-runtime", NS)
                         if p.port)
        if targets and targets != self._prom_targets:
            try:
                self.prom.set_targets(targets)
                self._prom_targets = targets
            except Exception as exc:  # noqa: BLE001 - Prometheus restarting; next tick
                self.log(f"[{self._t():6.1f}s] Prometheus targets not updated: {exc}")

    def _final_checks(self) -> None:
        for a in self.actions:
            if a.code == -1:
                continue  # never reached the API (the user saw the error)
            self.checks["(e) actions with an outcome"] += 1
            if a.outcome is None or a.outcome.startswith("pending") or a.code in (2, 3):
                self.violations.append(f"(e) action {a.token} on {a.subject}: no outcome ({a.outcome})")
        for s in self.subjects:
            st = self._status(s) or {}
            if s.failing:
                self.checks["(d) failing canaries ended"] += sum(s.rollouts.values())
                if set(s.rollouts) - {"RolledBack", "Failed"}:
                    self.violations.append(f"(d) {s.name}: failing canaries ended {dict(s.rollouts)}")
                if st.get("canaryVersion") and st.get("phase") not in ("RolledBack", "Failed"):
                    self.violations.append(f"(d) {s.name}: the last failing canary ended {st.get('phase')}")
        for op in self.cluster.operators:
            if op.proc is not None and op.proc.poll() not in (None, -signal.SIGKILL):
                self.violations.append(f"operator {op.log_path.name} exited by itself: {op.proc.poll()}")

    # -- the report ------------------------------------------------------------------------------------

    def report(self) -> str:
        lines = [f"chaos soak: {self.seconds:g} s of faults, 3 ModelDeployments under traffic"]
        lines.append("faults injected: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
                     + f" (total {sum(self.faults.values())})")
        lines.append("invariant checks: " + ", ".join(f"{k} {v}" for k, v in sorted(self.checks.items())))
        for s in self.subjects:
            requests = len(s.traffic.samples()) if s.traffic else 0
            lines.append(f"{s.name}: {s.attempt} rollouts, ended {dict(s.rollouts)}; {requests} requests")
        outcomes = Counter((a.verb, (a.outcome or "none").split(" ")[0].split(":")[0]) for a in self.actions)
        lines.append("actions: " + ", ".join(f"{v} {o} {n}" for (v, o), n in sorted(outcomes.items())))
        lines.append(f"violations: {len(self.violations)}")
        lines.extend("  " + v for v in self.violations[:40])
        return "\n".join(lines)


def write_peering(cluster: Cluster) -> None:
    cluster.emu.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "mnn-rollout", "namespace": NS}}))


def build(emu: Any, kubelet: Any, models: Path, workdir: Path) -> tuple[Cluster, Prometheus]:
    """A cluster for the soak on a running emulator and kubelet, and a Prometheus (not started)."""
    cluster = Cluster(emu, kubelet, models, workdir)
    write_peering(cluster)
    prom = Prometheus(workdir, scrape_targets=[]).start()
    return cluster, prom
