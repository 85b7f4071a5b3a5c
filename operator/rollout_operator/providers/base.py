"""The provider interface: sample canary and stable over the last interval."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ..verdicts import Sample
from ..spec import MetricSpec

QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


@dataclass(frozen=True)
class SampleContext:
    """What a provider needs to know about one ModelDeployment."""

    key: str  # uid of the ModelDeployment: providers keep per-object state under it
    namespace: str
    name: str
    model: str
    versions: Sequence[str]  # canary first, then stable
    interval_seconds: float
    metrics: Sequence[MetricSpec]  # the metrics judging this step (compare: stable ones read counts per role)
    pod_urls: Sequence[str] = field(default_factory=tuple)
    shadow: bool = False  # a shadow step: read the canary's mnn_shadow_* series (labelled with its version)
    since: float | None = None  # when the step started (epoch s): counts since then, for providers that can
    # Every metric of the analysis, whichever this step is judged by: a provider that keeps a baseline per
    # series (direct) keeps one for each, so the first look of the next step (a weighted step after a
    # shadow one) counts only its own interval. Empty: ``metrics``.
    tracked: Sequence[MetricSpec] = field(default_factory=tuple)


class MetricProvider(Protocol):
    def sample(self, ctx: SampleContext) -> dict[str, Sample]:
        """A Sample per version in ``ctx.versions``; a Sample with ``error`` when there is no data."""

    def is_online(self) -> bool:
        """Whether the backing source answers at all."""
