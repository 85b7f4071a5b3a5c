"""Build the provider a ModelDeployment asks for; one entry per provider type."""

from __future__ import annotations

from collections.abc import Callable

from ..spec import ProviderSpec, parse_duration
from .base import MetricProvider
from .direct import DirectProvider
from .prometheus import PrometheusProvider

SecretReader = Callable[[str, str], str | None]  # (namespace, secret name) -> its `authorization` value


class ProviderFactory:
    """Providers are cached: the direct provider keeps the previous scrape between checks."""

    def __init__(self, read_secret: SecretReader | None = None) -> None:
        self.read_secret = read_secret
        self._direct = DirectProvider()
        self._prometheus: dict[tuple[str, float, str, str | None], PrometheusProvider] = {}

    def get(self, spec: ProviderSpec, namespace: str) -> MetricProvider:
        if spec.type == "direct":
            return self._direct
        if spec.type == "prometheus":
            assert spec.address is not None
            secret = (spec.secret_ref or {}).get("name")
            key = (spec.address, parse_duration(spec.timeout), namespace, secret)
            if key not in self._prometheus:
                headers = {}
                if secret and self.read_secret is not None:
                    value = self.read_secret(namespace, secret)
                    if value:
                        headers["Authorization"] = value
                self._prometheus[key] = PrometheusProvider(spec.address, key[1], headers)
            return self._prometheus[key]
        raise ValueError(f"provider type {spec.type!r} is not known; valid: direct, prometheus")
