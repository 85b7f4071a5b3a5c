"""Run an analysis when one is due: pick the provider, sample canary and stable, evaluate."""

from __future__ import annotations

import logging
from typing import Any

from .verdicts import Analysis, Sample, evaluate
from .observe import Observation
from .providers.base import SampleContext
from .providers.factory import ProviderFactory
from .spec import ModelDeploymentSpec
from .status import RolloutStatus, epoch

log = logging.getLogger(__name__)


def next_due(spec: ModelDeploymentSpec, status: RolloutStatus) -> float | None:
    """When the next check is due (epoch seconds); None when no rollout is being analysed."""
    if not spec.canary or status.canary_version != spec.canary:
        return None
    last = epoch(status.analysis.get("checkedAt")) if status.analysis else None
    return (last or 0.0) + spec.strategy.analysis.interval_seconds


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
        ctx = SampleContext(
            # A new key per rollout (retry, a new canary): its first check takes a fresh baseline
            # instead of counting traffic from before the rollout started.
            key=f"{meta['uid']}@{status.rollout_started_at}", namespace=meta["namespace"], name=meta["name"], model=spec.model_name(meta["name"]),
            versions=(canary, stable), interval_seconds=spec.strategy.analysis.interval_seconds,
            metrics=spec.strategy.analysis.metrics,
            pod_urls=tuple(p.url for p in observation.pods if p.ip),
        )
        try:
            samples = self.factory.get(spec.strategy.analysis.provider, meta["namespace"]).sample(ctx)
        except Exception as exc:  # a provider bug must hold the rollout, not crash the reconcile
            log.exception("provider failed for %s/%s", meta["namespace"], meta["name"])
            samples = {canary: Sample(error=f"provider failed: {exc}")}
        return evaluate(spec.strategy.analysis, samples.get(canary, Sample(error="no sample")), samples.get(stable),
                        now)
