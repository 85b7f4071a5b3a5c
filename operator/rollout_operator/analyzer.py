"""Run an analysis when one is due: pick the provider, sample canary and stable (or the versions
of an experiment), evaluate."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from . import experiment
from .verdicts import INCONCLUSIVE, Analysis, Sample, evaluate
from .observe import Observation
from .providers.base import SampleContext
from .providers.factory import ProviderFactory
from .spec import ModelDeploymentSpec
from .strategy import MetricSpec
from .status import Phase, RolloutStatus, epoch

log = logging.getLogger(__name__)


def analysing(spec: ModelDeploymentSpec, status: RolloutStatus) -> bool:
    """Whether anything is being analysed: a canary at a step with weight or a shadow, or an
    experiment whose split is served. A paused canary too (spec.paused, or a step waiting for a
    manual promote): it still serves its users, so a failing one is still rolled back (as Argo
    Rollouts' background analysis runs through a pause)."""
    if spec.experiment is not None:
        return status.phase == Phase.PROGRESSING and experiment.running(status) and status.step_started_at is not None
    if status.phase not in (Phase.PROGRESSING, Phase.PAUSED):
        return False
    return bool(spec.canary) and status.canary_version == spec.canary and (
        status.canary_weight > 0 or bool(status.shadow_percent))


def next_due(spec: ModelDeploymentSpec, status: RolloutStatus) -> float | None:
    """When the next check is due (epoch seconds); None when no rollout or experiment is in flight."""
    if spec.experiment is not None:
        if not experiment.running(status):
            return None
    elif not spec.canary or status.canary_version != spec.canary:
        return None
    last = epoch(status.analysis.get("checkedAt")) if status.analysis else None
    return (last or 0.0) + spec.strategy.analysis.interval_seconds


def counted_since(status: RolloutStatus) -> float | None:
    """Where a step's counts begin for the providers that read a window (Prometheus's, and the
    per-step counts of ``compare: stable`` metrics): when every pod was seen serving the step's
    weights (``stepServedAt``), else when they were written, while no pod has been seen taking them."""
    return status.step_served_at if status.step_served_at is not None else status.step_started_at


class Analyzer:
    def __init__(self, factory: ProviderFactory) -> None:
        self.factory = factory

    def __call__(self, spec: ModelDeploymentSpec, status: RolloutStatus, body: dict[str, Any],
                 observation: Observation, now: float) -> Analysis | None:
        due = next_due(spec, status)
        if due is None or now + 0.05 < due:
            return None
        meta = body["metadata"]
        stable, canary = status.stable_version or "", status.canary_version or ""
        analysis = spec.strategy.analysis
        shadow = bool(status.shadow_percent)
        if spec.experiment is not None:
            versions: tuple[str, ...] = (*experiment.challengers(spec, stable), stable)
            # its metric, and the threshold metrics that guard the challengers
            metrics = [m for m in analysis.metrics_for(False) if m.name == spec.experiment.metric or not m.is_compare]
        else:
            versions, metrics = (canary, stable), analysis.metrics_for(shadow)
        ctx = SampleContext(
            # A new key per rollout (retry, a new canary): its first check takes a fresh baseline
            # instead of counting traffic from before the rollout started.
            key=f"{meta['uid']}@{status.rollout_started_at}", namespace=meta["namespace"], name=meta["name"],
            model=spec.model_name(meta["name"]), versions=versions, interval_seconds=analysis.interval_seconds,
            metrics=metrics, pod_urls=tuple(p.url for p in observation.pods if p.ip), shadow=shadow,
            since=counted_since(status), tracked=analysis.metrics,
        )
        try:
            samples = self.factory.get(analysis.provider, meta["namespace"]).sample(ctx)
        except Exception as exc:  # a provider bug must hold the rollout, not crash the reconcile
            log.exception("provider failed for %s/%s", meta["namespace"], meta["name"])
            samples = {v: Sample(error=f"provider failed: {exc}") for v in versions}
        if spec.experiment is not None:
            look = experiment.evaluate(spec, status, samples, now)
        else:
            look = evaluate(analysis, samples.get(canary, Sample(error="no sample")), samples.get(stable), now,
                            step=status.current_step or 0, shadow=shadow, sequential=status.sequential)
        refusing = [p.name for p in observation.answering if (p.status or {}).get("feedback") is False]
        unfed = reads_feedback(metrics) if refusing and look.verdict == INCONCLUSIVE else []
        if unfed:  # held for want of feedback no pod takes: say so (an upgrade from a runtime without a token)
            who = f"{refusing[0]} and {len(refusing) - 1} more pods refuse" if len(refusing) > 1 else \
                f"{refusing[0]} refuses"
            look = replace(look, message=f"{look.message}; {', '.join(unfed)} read feedback, which {who} without a "
                                         "token: set spec.runtime.feedback")
        return look


def reads_feedback(metrics: list[MetricSpec]) -> list[str]:
    """The metrics that read the runtime's feedback counters (``mnn_feedback_*``)."""
    def series(m: MetricSpec) -> list[str]:
        return [s.name for s in m.role_series().values()] if m.is_compare else [m.metric or ""]

    return [m.name for m in metrics if any(name.startswith("mnn_feedback") for name in series(m))]
