"""The provider factory: one provider per source, secrets re-read so rotated tokens apply."""

from __future__ import annotations

import pytest

from rollout_operator.providers.direct import DirectProvider
from rollout_operator.providers.factory import SECRET_TTL_SECONDS, ProviderFactory
from rollout_operator.providers.prometheus import PrometheusProvider
from rollout_operator.spec import ProviderSpec

PROM = ProviderSpec.model_validate({"type": "prometheus", "address": "http://127.0.0.1:9090",
                                    "secretRef": {"name": "prom-auth"}})


def test_the_direct_provider_is_shared_so_it_keeps_its_baselines() -> None:
    factory = ProviderFactory()
    a = factory.get(ProviderSpec(), "default")
    assert isinstance(a, DirectProvider) and factory.get(ProviderSpec(), "other") is a


def test_a_rotated_secret_is_picked_up_after_the_ttl() -> None:
    secret = {"value": None}
    now = [1000.0]
    reads: list[tuple[str, str]] = []

    def read(namespace: str, name: str) -> str | None:
        reads.append((namespace, name))
        return secret["value"]

    factory = ProviderFactory(read, clock=lambda: now[0])
    first = factory.get(PROM, "ml")
    assert isinstance(first, PrometheusProvider) and first.headers == {}
    secret["value"] = "Bearer rotated"
    assert factory.get(PROM, "ml").headers == {}  # cached within the TTL
    now[0] += SECRET_TTL_SECONDS + 1
    assert factory.get(PROM, "ml").headers == {"Authorization": "Bearer rotated"}
    assert reads == [("ml", "prom-auth"), ("ml", "prom-auth")]


def test_an_unknown_provider_type_is_refused() -> None:
    with pytest.raises(ValueError):
        ProviderSpec.model_validate({"type": "datadog"})
