"""One reconcile of one ModelDeployment: observe, decide, write children, then status.

Plain code with its ports passed in (``ports.Ports``: the Kubernetes API in a cluster, a config
file and a local process in ``mnn-rollout demo``), so kopf handlers, the e2e tests and the demo
run this same loop.
Order matters: children (the routing ConfigMap above all) are written before the status that
describes them, so status never claims weights that are not being served. Nothing is written
when nothing changed.

A rollback is the one decision that must survive the operator being cut between those two writes
(a crash, an exit): decided again from the old status, it would find weights the routing no
longer serves, too little canary traffic to judge, and put the canary's share back until it
breached again. So the status first records the rollback as pending (condition
``RollbackPending`` and ``rollbackPendingFor``, the canary file or experiment it is for, beside the
weights still served), then the children are written, then the status that says it is done; a
reconcile that finds it finishes that rollback while the spec still names that rollout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from . import children, experiment
from .verdicts import Analysis
from .analyzer import analysing, next_due
from .kube import ApiError
from .metrics import OperatorMetrics
from .observe import Observation, shadow_text, weights_text
from .ports import ADOPTED, CREATED_AS, DELETED, NOT_REPAIRED, REJECTED, REPAIRED, Ports
from .rollout import Event, World, decide, mark_invalid, rollback_target, routed_versions, unlisted_stable
from .spec import DEFAULT_IMAGE, ModelDeploymentSpec, SpecError, name_problem, parse_spec
from .status import Phase, RolloutStatus, condition, pending_rollback, with_condition, with_pending_rollback

log = logging.getLogger(__name__)

ACTION_ANNOTATION = f"{children.GROUP}/action"
ALERT_ANNOTATION = f"{children.GROUP}/alert"

Analyzer = Callable[[ModelDeploymentSpec, RolloutStatus, dict[str, Any], Observation, float], Analysis | None]


@dataclass
class Outcome:
    status: RolloutStatus
    events: list[Event] = field(default_factory=list)
    children: dict[str, str] = field(default_factory=dict)
    wrote_status: bool = False
    analysis: Analysis | None = None
    conflict: bool = False  # the status write met a newer version of the object: reconcile again


ALERT_MARK_SEPARATOR = ";"  # between the marks of alerts firing at once (alert names are kept free of it)


def firing_alert(marks: str | None, canary: str | None) -> str | None:
    """The alert name of the first ``alertname@startsAt@instance@versions`` mark (of those the
    annotation holds, ``;``-separated: one per alert firing; ``alertname@startsAt@versions`` from an
    operator before instances) that names ``canary`` (versions: one, or an experiment's challengers
    joined by commas; a mark without them names any canary). The webhook removes a mark when its
    alert resolves, and only that one."""
    if not marks or not canary:
        return None
    for mark in marks.split(ALERT_MARK_SEPARATOR):
        parts = mark.split("@")
        if mark and (len(parts) < 3 or canary in parts[-1].split(",")):
            return parts[0]
    return None


def shadow_of(status: RolloutStatus) -> tuple[str, int] | None:
    """The shadow ``status`` asks the pods for: (the canary, its percent) during a shadow step."""
    return (status.canary_version, status.shadow_percent) if status.canary_version and status.shadow_percent else None


def guarded(status: RolloutStatus) -> bool:
    """Whether a canary serves users (at a step with weight, or a shadow), or an experiment runs,
    so that an invalid spec must not leave it unguarded."""
    if status.phase_in_effect not in (Phase.PROGRESSING, Phase.PAUSED):
        return False
    if status.experiment and not status.experiment.get("removed"):
        return experiment.running(status)
    return bool(status.canary_version) and (status.canary_weight > 0 or bool(status.shadow_percent))


def guard_spec(status: RolloutStatus) -> ModelDeploymentSpec | None:
    """The spec a canary that serves users is held under while the spec is invalid: the last valid
    one, paused. None when there is nothing to guard (or no spec was kept)."""
    if not guarded(status) or not status.last_valid_spec:
        return None
    try:
        return parse_spec(status.last_valid_spec).model_copy(update={"paused": True})
    except SpecError:  # kept by an operator that accepted more than this one does
        return None


def _guarded(spec: ModelDeploymentSpec, status: RolloutStatus) -> list[str | None]:
    """The versions an alert rolls back: the canary, or an experiment's challengers."""
    if spec.experiment is not None and status.stable_version:
        return list(experiment.challengers(spec, status.stable_version))
    return [spec.canary]


class Reconciler:
    def __init__(self, ports: Ports, metrics: OperatorMetrics | None = None,
                 analyzer: Analyzer | None = None, clock: Callable[[], float] = time.time,
                 runtime_image: str = DEFAULT_IMAGE) -> None:
        self.ports = ports
        self.runtime_image = runtime_image
        self.metrics = metrics or OperatorMetrics()
        self.analyzer = analyzer
        self.clock = clock
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock(self, uid: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(uid, threading.Lock())

    def reconcile(self, body: dict[str, Any], fresh: bool = False) -> Outcome | None:
        """Reconcile the object ``body`` names. The live object is re-read under a per-object lock
        (unless the caller just read it: ``fresh``), so a handler holding an older body never
        decides from a newer status; a status decided from an older version than the stored one
        meets a 409 (the write's resourceVersion precondition) and is decided again. Returns None
        when the object is gone."""
        meta = body["metadata"]
        with self._lock(meta["uid"]):
            started = time.perf_counter()
            try:
                live = body if fresh else self.ports.read(meta["namespace"], meta["name"])
                if live is None or live["metadata"].get("uid") != meta["uid"]:
                    return None
                outcome = self._reconcile(live)
            except Exception:
                self.metrics.reconciles.labels("error").inc()
                raise
            finally:
                self.metrics.reconcile_duration.observe(time.perf_counter() - started)
            self.metrics.reconciles.labels("invalid_spec" if outcome.status.phase == Phase.INVALID_SPEC
                                           else "ok").inc()
            return outcome

    def _reconcile(self, body: dict[str, Any]) -> Outcome:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        now = self.clock()
        generation = meta.get("generation")
        status = replace(RolloutStatus.from_dict(body.get("status")), observed_generation=generation)
        # An invalid spec (or name) changes nothing that serves traffic; but a canary that serves users
        # is held under the spec it follows (spec.paused: no step moves), and its checks, alerts and
        # abort still roll it back. Before, nothing did until the spec was fixed.
        invalid = name_problem(name)  # an object created before names were checked may have a canary
        try:
            spec = parse_spec(body.get("spec")) if invalid is None else None
        except SpecError as exc:
            spec, invalid = None, str(exc)
        target = children.Target(name, namespace, children.owner_reference(body))
        annotations = meta.get("annotations") or {}
        if spec is not None:
            model, observation, world = self._look(spec, status, target, annotations)
            invalid = unlisted_stable(spec, status, world)
        if invalid is not None:
            guard = guard_spec(status)
            if guard is None:  # nothing to guard: before any child is written
                return self._invalid(body, status, invalid, now)
            spec, invalid = guard, f"{invalid}; held under the last valid spec: checks, alerts and abort still roll back"
            model, observation, world = self._look(spec, status, target, annotations)  # its model, port, versions
        assert spec is not None
        # as the analysis sees it: held under the last valid spec, in the phase it had
        held = replace(status, phase=status.phase_in_effect or Phase.PAUSED) if invalid is not None else status
        analysis = self._analyse(spec, held, body, observation, now)
        new, events = decide(spec, status, world, analysis, now)
        new = replace(new, versions=[observation.version(spec.version(v)).as_status()
                                     for v in routed_versions(spec, new)],
                      last_alert=annotations.get(ALERT_ANNOTATION) if world.alert else new.last_alert,
                      selector=children.selector_text(target),
                      last_valid_spec=(status.last_valid_spec if invalid is not None else dict(body["spec"]))
                      if guarded(new) else None)
        invalid_events = []
        if invalid is not None:
            if status.phase != Phase.INVALID_SPEC or status.message != invalid:
                invalid_events.append(Event("Warning", "InvalidSpec", invalid))
            new = mark_invalid(new, invalid, now)

        first = not (body.get("status") or {}).get("observedGeneration")
        if new.rolled_back_at is not None and new.rolled_back_at != status.rolled_back_at:
            try:
                body = self._record_pending_rollback(body, spec, status, new, now)
            except ApiError as exc:
                if exc.status != 409:
                    raise
                return Outcome(status, [], {}, False, None, conflict=True)  # nothing written yet: decide again

        config = children.runtime_config(spec, model, new.weights, new.stable_version or "",
                                         routed_versions(spec, new), self.ports.published_table(target),
                                         shadow_of(new))
        written = self.ports.write_children(children.render_all(target, spec, config, self.runtime_image))
        written.update(self.ports.delete_children(children.unrendered(target, spec), children.owner_uid(target)))
        published = config.routing.table  # the table the pods must route by (with new.weights)
        if written.get(f"ConfigMap/{target.routing}", "").startswith(REJECTED):
            published = None  # the pods keep the table they had: judged by its weights alone
            # The routing was not written: the pods serve what the status said before. Claiming the
            # decision (a rollback done, a step's weight) would say what no pod serves; the stored status
            # stays (with a pending rollback, if one was recorded: the next try finishes it), and
            # neither the decision nor its events stand.
            # The checks' record stays (it claims nothing about routing) while it is the same rollout's:
            # failures still add up to a rollback. A decision that restarted it (a new file) keeps the old.
            stored = RolloutStatus.from_dict(body.get("status"))
            same = (new.canary_version, new.canary_file, new.rollout_started_at) == \
                (stored.canary_version, stored.canary_file, stored.rollout_started_at)
            kept = new if same else stored
            new, events = replace(stored, observed_generation=generation, analysis=kept.analysis,
                                  failures=kept.failures, sequential=kept.sequential), []
        new = self._rejected(new, written, now)
        new = self._served(new, observation, now, published)
        child_events = self._child_events(first, status, new, written)
        try:
            wrote = self._write_status(body, new)
        except ApiError as exc:
            if exc.status != 409:
                raise
            if not (exc.ambiguous and self._stored(body, new)):
                # Decided from an older version of the object: the next reconcile decides again
                # from the fresh one (and emits the decision's events then). What was written to
                # the children happened, and is said now, or never.
                return Outcome(status, child_events, written, False, None, conflict=True)
            # The echo of our own write (it landed, its answer was lost, the retry met the new
            # version): the decision is recorded, and its events are said now, as they would be.
            wrote = True
        events.extend(child_events)
        events.extend(invalid_events)
        events.extend(self._engine_events(status, new))
        self._count(namespace, name, status, new, analysis, events)
        return Outcome(new, events, written, wrote, analysis)

    def _look(self, spec: ModelDeploymentSpec, status: RolloutStatus, target: children.Target,
              annotations: dict[str, str]) -> tuple[str, Observation, World]:
        """The model name ``spec`` serves, its pods as observed, and the world the decision sees."""
        model = spec.model_name(target.name)
        observation = self.ports.observe_pods(target, spec.runtime.port, model)
        return model, observation, self._world(spec, status, observation, annotations, self._desired_pods(spec, target))

    def _desired_pods(self, spec: ModelDeploymentSpec, target: children.Target) -> int:
        """The runtime pods wanted: ``runtime.replicas``, or with autoscaling what the HPA set on
        the Deployment (before there is one, its minimum)."""
        scaling = spec.runtime.autoscaling
        if scaling is None:
            return spec.runtime.replicas
        replicas = self.ports.runtime_replicas(target)
        return scaling.min_replicas if replicas is None else replicas

    def _world(self, spec: ModelDeploymentSpec, status: RolloutStatus, observation: Observation,
               annotations: dict[str, str], desired_pods: int) -> World:
        views = {v.name: observation.version(v) for v in spec.versions}
        action = annotations.get(ACTION_ANNOTATION)
        new_action = action if action and action != status.last_action else None
        return World(
            versions_ready={k: v.ready for k, v in views.items()},
            reasons={k: v.reason for k, v in views.items() if v.reason},
            ready_pods=observation.ready_pods,
            desired_pods=desired_pods,
            action=new_action.split(":", 1)[0] if new_action else None,
            action_token=new_action,
            alert=next((a for v in _guarded(spec, status) if (a := firing_alert(annotations.get(ALERT_ANNOTATION), v))),
                       None),
        )

    def _analyse(self, spec: ModelDeploymentSpec, status: RolloutStatus, body: dict[str, Any],
                 observation: Observation, now: float) -> Analysis | None:
        if self.analyzer is None or not analysing(spec, status):
            return None
        analysis = self.analyzer(spec, status, body, observation, now)
        due = next_due(spec, status)
        if analysis is not None and due is not None and status.analysis.get("checkedAt"):
            self.metrics.analysis_lateness.observe(max(0.0, now - due))  # after the previous check
        return analysis

    def _invalid(self, body: dict[str, Any], status: RolloutStatus, message: str, now: float) -> Outcome:
        new = mark_invalid(status, message, now)
        events = []
        if status.phase != Phase.INVALID_SPEC or status.message != message:
            events.append(Event("Warning", "InvalidSpec", message))
        wrote = self._write_status(body, new)
        return Outcome(new, events, {}, wrote)

    @staticmethod
    def _rejected(new: RolloutStatus, written: dict[str, str], now: float) -> RolloutStatus:
        """Condition ChildRejected: the children the API refused as invalid, with its message."""
        rejected = {k: v.removeprefix(REJECTED) for k, v in written.items() if v.startswith(REJECTED)}
        if rejected:
            message = "; ".join(f"{k}: {v}" for k, v in rejected.items())
            return with_condition(new, "ChildRejected", "True", "Invalid", message, now)
        if condition(new, "ChildRejected") is None:
            return new
        return with_condition(new, "ChildRejected", "False", "Accepted", "every child was accepted", now)

    @staticmethod
    def _served(new: RolloutStatus, observation: Observation, now: float,
                table: Mapping[str, object] | None) -> RolloutStatus:
        """Condition WeightsServed: whether every ready pod routes by ``new.weights`` and the
        published ``table``, and shadows what ``new`` asks (as seen before this reconcile's writes: a
        change is confirmed by the next look, polled meanwhile)."""
        shadow = shadow_of(new)
        serving, detail = observation.serving(new.weights, table, shadow)
        if serving is None:  # no pod says (none answers, or an older runtime): nothing is claimed, nor polled for
            if condition(new, "WeightsServed") is None:
                return new
            return with_condition(new, "WeightsServed", "Unknown", "NotReported", "no ready pod reports its weights",
                                  now)
        text = weights_text({k: v for k, v in new.weights.items() if v})
        if shadow is not None:
            text += f" and shadows {shadow_text({'version': shadow[0], 'percent': shadow[1]})}"
        if serving:
            return with_condition(new, "WeightsServed", "True", "Served", f"every pod serves {text}", now)
        return with_condition(new, "WeightsServed", "False", "Applying", f"{detail}; applying {text}", now)

    @staticmethod
    def _child_events(first: bool, old: RolloutStatus, new: RolloutStatus, written: dict[str, str]) -> list[Event]:
        events = []
        rejected = condition(new, "ChildRejected")
        if rejected and rejected["status"] == "True" and rejected != condition(old, "ChildRejected"):
            events.append(Event("Warning", "ChildRejected", str(rejected["message"])))
        repaired = {k: v.removeprefix(REPAIRED) for k, v in written.items() if v.startswith(REPAIRED)}
        if repaired:
            events.append(Event("Warning", "DriftRepaired", "put back fields edited by hand: " + "; ".join(
                f"{k} {v}" for k, v in repaired.items())))
        undone = {k: v.removeprefix(NOT_REPAIRED) for k, v in written.items() if v.startswith(NOT_REPAIRED)}
        if undone:  # said once (ports.ClusterPorts.write_children): another actor rewrites what was applied
            events.append(Event("Warning", "DriftNotRepaired", "the API server kept other values than applied "
                                "(another actor, such as a mutating webhook, rewrites them): " + "; ".join(
                                    f"{k} {v}" for k, v in undone.items())))
        adopted = {k: v.removeprefix(ADOPTED) for k, v in written.items() if v.startswith(ADOPTED)}
        if adopted:
            events.append(Event("Warning", "DriftAdopted", "; ".join(f"{k} {v}" for k, v in adopted.items())))
        created = [k for k, v in written.items() if v == "created" or (v.startswith(NOT_REPAIRED)
                                                                        and v.endswith(CREATED_AS))]
        if created:
            reason = "ChildrenCreated" if first else "ChildrenRecreated"
            events.append(Event("Normal" if first else "Warning", reason, f"created {', '.join(created)}"))
        deleted = [k for k, v in written.items() if v == DELETED]
        if deleted:
            events.append(Event("Normal", "ChildrenDeleted", f"deleted {', '.join(deleted)} (no longer in the spec)"))
        old_versions = [v.get("name") for v in old.versions]
        new_versions = [v.get("name") for v in new.versions]
        if not first and old_versions and old_versions != new_versions:
            events.append(Event("Normal", "VersionsChanged", f"versions {old_versions} -> {new_versions}"))
        return events

    @staticmethod
    def _engine_events(old: RolloutStatus, new: RolloutStatus) -> list[Event]:
        """A Warning for each version whose pods now run it on another backend than its engine
        settings ask for (a backend the node lacks: the runtime falls back to CPU), once per change:
        the pair is kept in the status."""
        before = {v.get("name"): (v.get("requestedBackend"), v.get("backend")) for v in old.versions}
        return [Event("Warning", "EngineFallback",
                      f"version {v['name']}: requested backend {v['requestedBackend']}, runs on {v['backend']} "
                      f"({v.get('engineFallback')})")
                for v in new.versions
                if v.get("requestedBackend") and before.get(v.get("name")) != (v["requestedBackend"], v.get("backend"))]

    def _record_pending_rollback(self, body: dict[str, Any], spec: ModelDeploymentSpec, old: RolloutStatus,
                                 new: RolloutStatus, now: float) -> dict[str, Any]:
        """Store ``old`` (what the routing still serves) with the rollback ``new`` decided as
        pending; returns ``body`` as stored. Already recorded (this finishes it): nothing to store."""
        why = condition(new, "Progressing") or {}
        pending = (str(why.get("reason") or "RolledBack"), str(why.get("message") or new.abort_reason or ""),
                   rollback_target(spec, new.canary_version) or "")
        if pending_rollback(old) == pending:
            return body
        intent = with_pending_rollback(old, pending, now).to_dict()
        version = self.ports.store_status(body, intent)
        return {**body, "metadata": {**body["metadata"], "resourceVersion": version}, "status": intent}

    def _stored(self, body: dict[str, Any], new: RolloutStatus) -> bool:
        """Whether the object's status is now exactly ``new`` (only this operator writes it)."""
        meta = body["metadata"]
        live = self.ports.read(meta["namespace"], meta["name"])
        return (live is not None and live["metadata"].get("uid") == meta.get("uid")
                and (live.get("status") or {}) == new.to_dict())

    def _write_status(self, body: dict[str, Any], new: RolloutStatus) -> bool:
        """Write the whole status, only when it changed, and only over the version it was decided
        from (resourceVersion precondition: a concurrent writer makes this a 409, retried later)."""
        old = body.get("status") or {}
        desired = new.to_dict()
        if old == desired:
            return False
        self.ports.store_status(body, desired)
        return True

    def _count(self, namespace: str, name: str, old: RolloutStatus, new: RolloutStatus,
               analysis: Analysis | None, events: list[Event]) -> None:
        m = self.metrics
        m.set_state(namespace, name, new.phase, new.weights, new.canary_weight)
        if analysis is not None:
            for metric in analysis.metrics:
                m.verdicts.labels(namespace, name, metric.name, metric.verdict).inc()
        for event in events:
            if event.reason == "RolloutAborted":
                m.rollbacks.labels(namespace, name, (new.abort_reason or "removed").split(":", 1)[0]).inc()
            elif event.reason == "RolloutPromoted":
                m.promotions.labels(namespace, name, "full" if "fully" in event.message else "steps").inc()
        if old.step_started_at and new.step_started_at != old.step_started_at and old.current_step is not None:
            m.step_seconds.labels(namespace, name).observe(self.clock() - old.step_started_at)
