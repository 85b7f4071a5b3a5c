"""Build the provider a ModelDeployment asks for; one entry per provider type."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..spec import ProviderSpec, parse_duration
from .base import MetricProvider
from .direct import DirectProvider
from .prometheus import PrometheusProvider

SecretReader = Callable[[str, str], str | None]  # (namespace, secret name) -> its `authorization` value


SECRET_TTL_SECONDS = 30.0


class ProviderFactory:
    """Providers are cached: the direct provider keeps the previous scrape between checks. An
    auth secret is read again every ``SECRET_TTL_SECONDS``, so a rotated token is picked up."""

    def __init__(self, read_secret: SecretReader | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.read_secret = read_secret
        self.clock = clock
        self._direct = DirectProvider()
        self._prometheus: dict[tuple[str, float, str, str | None], tuple[float, PrometheusProvider]] = {}

    def get(self, spec: ProviderSpec, namespace: str) -> MetricProvider:
        if spec.type == "direct":
            return self._direct
        if spec.type == "prometheus":
            assert spec.address is not None
            secret = (spec.secret_ref or {}).get("name")
            key = (spec.address, parse_duration(spec.timeout), namespace, secret)
            cached = self._prometheus.get(key)
            if cached is None or (secret and self.clock() - cached[0] > SECRET_TTL_SECONDS):
                headers = {}
                if secret and self.read_secret is not None:
                    value = self.read_secret(namespace, secret)
                    if value:
                        headers["Authorization"] = value
                cached = (self.clock(), PrometheusProvider(spec.address, key[1], headers))
                self._prometheus[key] = cached
            return cached[1]
        raise ValueError(f"provider type {spec.type!r} is not known; valid: direct, prometheus")
