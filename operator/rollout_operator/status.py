"""The ModelDeployment status: phases, the typed status, and conditions by API conventions."""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any


class Phase(str, Enum):
    INITIALIZING = "Initializing"  # children created; the stable version is not serving yet
    READY = "Ready"  # no rollout in progress: the static split is serving
    PROGRESSING = "Progressing"  # a canary is at a step and being analysed
    PAUSED = "Paused"  # held by spec.paused, or a step waiting for a manual promote
    PROMOTING = "Promoting"  # the canary is stable at 100%; the old stable is retiring
    SUCCEEDED = "Succeeded"  # the canary was promoted and the old stable unloaded
    ROLLED_BACK = "RolledBack"  # the canary failed (or was aborted); stable serves 100%
    FAILED = "Failed"  # the progress deadline passed; rolled back
    INVALID_SPEC = "InvalidSpec"  # the spec cannot be acted on; nothing serving was changed


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    # Milliseconds: analysis scheduling and "checked during this step" compare these times.
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def epoch(text: Any) -> float | None:
    if not text:
        return None
    if isinstance(text, (int, float)):
        return float(text)
    return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()


# field name -> (status key, kind) ; kind "time" stored as RFC 3339 text
_KEYS: dict[str, tuple[str, str]] = {
    "phase": ("phase", "phase"),
    "phase_before_invalid": ("phaseBeforeInvalid", "phase"),
    "last_valid_spec": ("lastValidSpec", "plain"),
    "rollback_pending_for": ("rollbackPendingFor", "plain"),
    "observed_generation": ("observedGeneration", "plain"),
    "stable_version": ("stableVersion", "plain"),
    "canary_version": ("canaryVersion", "plain"),
    "canary_file": ("canaryFile", "plain"),
    "canary_weight": ("canaryWeight", "plain"),
    "weights": ("weights", "plain"),
    "retired": ("retiredVersions", "tuple"),
    "current_step": ("currentStep", "plain"),
    "total_steps": ("totalSteps", "plain"),
    "step_text": ("stepText", "plain"),
    "ready_text": ("readyText", "plain"),
    "replicas": ("replicas", "plain"),
    "selector": ("selector", "plain"),
    "step_started_at": ("stepStartedAt", "time"),
    "step_served_at": ("stepServedAt", "time"),
    "rollout_started_at": ("rolloutStartedAt", "time"),
    "promoted_at": ("promotedAt", "time"),
    "rolled_back_at": ("rolledBackAt", "time"),
    "previous_stable": ("previousStable", "plain"),
    "declared_stable": ("declaredStable", "plain"),
    "failures": ("failures", "plain"),
    "analysis": ("analysis", "plain"),
    "shadow_percent": ("shadowPercent", "plain"),
    "sequential": ("sequential", "plain"),
    "experiment": ("experiment", "plain"),
    "abort_reason": ("abortReason", "plain"),
    "last_action": ("lastAction", "plain"),
    "action_result": ("actionResult", "plain"),
    "pending_action": ("pendingAction", "plain"),
    "paused_at": ("pausedAt", "time"),
    "last_alert": ("lastAlert", "plain"),
    "message": ("message", "plain"),
    "versions": ("versions", "plain"),
    "conditions": ("conditions", "tuple"),
}


@dataclass(frozen=True)
class RolloutStatus:
    phase: Phase = Phase.INITIALIZING
    phase_before_invalid: Phase | None = None  # while InvalidSpec: the phase a valid spec resumes from
    # while a canary serves users: the spec it follows, which guards it (checks, alerts, abort) should
    # the spec become invalid meanwhile
    last_valid_spec: dict[str, Any] | None = None
    rollback_pending_for: str | None = None  # with condition RollbackPending: the rollout it rolls back
    observed_generation: int | None = None
    stable_version: str | None = None
    canary_version: str | None = None
    canary_file: str | None = None  # "uri@sha256" of the canary this rollout analyses
    canary_weight: int = 0
    weights: dict[str, int] = field(default_factory=dict)
    retired: tuple[str, ...] = ()
    current_step: int | None = None
    total_steps: int = 0
    step_text: str = ""
    ready_text: str = ""
    replicas: int = 0  # ready runtime pods: the scale subresource's status.replicas
    selector: str = ""  # the runtime pods' label selector: the scale subresource's selector
    step_started_at: float | None = None  # the step's weights written: its progress deadline counts from here
    # every ready pod seen routing by them (condition WeightsServed): its pause and analysis count from here
    step_served_at: float | None = None
    rollout_started_at: float | None = None
    promoted_at: float | None = None
    rolled_back_at: float | None = None
    previous_stable: str | None = None
    declared_stable: str | None = None
    failures: int = 0
    analysis: dict[str, Any] = field(default_factory=dict)
    shadow_percent: int | None = None  # a shadow step is running: this percent of stable's requests run on the canary
    # compare: stable metrics of this rollout, by name: the counts per step and the last decision
    sequential: dict[str, Any] | None = None
    experiment: dict[str, Any] | None = None  # the A/B test: its split, state, comparisons and outcome
    abort_reason: str | None = None
    last_action: str | None = None  # the last action annotation handled (applied or ignored)
    action_result: str | None = None  # what became of it
    pending_action: str | None = None  # an action that will apply once it can, and why it waits
    paused_at: float | None = None  # when spec.paused froze the step clock
    last_alert: str | None = None
    message: str = ""
    versions: list[dict[str, Any]] = field(default_factory=list)
    conditions: tuple[dict[str, Any], ...] = ()

    @property
    def phase_in_effect(self) -> Phase | None:
        """The phase the rollout is in: while InvalidSpec, the one it had (``phase_before_invalid``),
        which a held rollout goes on in and a valid spec resumes from."""
        return self.phase_before_invalid if self.phase == Phase.INVALID_SPEC else self.phase

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> RolloutStatus:
        raw = raw or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            key, kind = _KEYS[f.name]
            if key not in raw or raw[key] is None:
                continue
            value = raw[key]
            if kind == "time":
                value = epoch(value)
            elif kind == "tuple":
                value = tuple(value)
            elif kind == "phase":
                try:
                    value = Phase(value)
                except ValueError:
                    continue
            values[f.name] = value
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            key, kind = _KEYS[f.name]
            value = getattr(self, f.name)
            if kind == "time":
                value = iso(value)
            elif kind == "tuple":
                value = list(value)
            elif kind == "phase" and value is not None:
                value = value.value
            if value is not None:  # absent, not null: the schema types every field
                out[key] = json_safe(value)
        return out


def json_safe(value: Any) -> Any:
    """``value`` with every float that is not finite (a metric's +Inf, a NaN) made None: JSON has no
    such numbers, and the API server refuses a body that writes them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def with_condition(st: RolloutStatus, type_: str, status: str, reason: str, message: str,
                   now: float) -> RolloutStatus:
    """Set one condition; lastTransitionTime changes only when its status does."""
    conditions = list(st.conditions)
    new: dict[str, Any] = {"type": type_, "status": status, "reason": reason, "message": message, "lastTransitionTime": iso(now)}
    if st.observed_generation is not None:
        new["observedGeneration"] = st.observed_generation
    for i, cond in enumerate(conditions):
        if cond.get("type") == type_:
            if cond.get("status") == status:
                new["lastTransitionTime"] = cond.get("lastTransitionTime") or new["lastTransitionTime"]
            conditions[i] = new
            return replace(st, conditions=tuple(conditions))
    conditions.append(new)
    return replace(st, conditions=tuple(conditions))


def condition(st: RolloutStatus, type_: str) -> dict[str, Any] | None:
    return next((c for c in st.conditions if c.get("type") == type_), None)


def without_condition(st: RolloutStatus, type_: str) -> RolloutStatus:
    return replace(st, conditions=tuple(c for c in st.conditions if c.get("type") != type_))


# Written before the children of a rollback, with the rollback's reason and message, and gone from
# the status written after them: an operator cut between the two writes (a crash, an exit) leaves
# it, and the next reconcile finishes that rollback instead of deciding again from weights the
# routing no longer serves (see reconcile.py).
ROLLBACK_PENDING = "RollbackPending"


def pending_rollback(st: RolloutStatus) -> tuple[str, str, str] | None:
    """(reason, message, the rollout it is for) of a rollback decided and not yet recorded as
    done, if any. The rollout may not be the one the status describes: a decision can start a
    canary and roll it back at once (an alert already firing for it)."""
    cond = condition(st, ROLLBACK_PENDING)
    if cond is None or cond.get("status") != "True" or not st.rollback_pending_for:
        return None
    return str(cond.get("reason") or "RollbackPending"), str(cond.get("message") or ""), st.rollback_pending_for


def with_pending_rollback(st: RolloutStatus, pending: tuple[str, str, str], now: float) -> RolloutStatus:
    reason, message, target = pending
    return replace(with_condition(st, ROLLBACK_PENDING, "True", reason, message, now), rollback_pending_for=target)


def without_pending_rollback(st: RolloutStatus) -> RolloutStatus:
    return replace(without_condition(st, ROLLBACK_PENDING), rollback_pending_for=None)
