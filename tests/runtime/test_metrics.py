"""/metrics, read with prometheus-client's own parser."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.runtime_server import RuntimeServer

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


def test_every_child_exists_at_zero_before_the_first_request(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    text = httpx.get(server.url + "/metrics").text
    for version in ("v1", "v2"):
        for outcome in ("success", "client_error", "server_error"):
            assert value(text, "mnn_inference_requests_total", model="scorer", version=version, outcome=outcome) == 0
        assert value(text, "mnn_inference_duration_seconds_count", model="scorer", version=version) == 0
        assert value(text, "mnn_inference_in_flight_requests", model="scorer", version=version) == 0
        assert value(text, "mnn_version_loaded", model="scorer", version=version) == 1
        assert value(text, "mnn_version_load_duration_seconds", model="scorer", version=version) > 0
    assert value(text, "mnn_version_traffic_weight_ratio", model="scorer", version="v1") == 0.9
    assert value(text, "mnn_version_traffic_weight_ratio", model="scorer", version="v2") == 0.1
    buckets = {dict(k[1])["le"] for k in samples(text) if k[0] == "mnn_inference_duration_seconds_bucket"}
    assert {"0.0005", "10.0", "+Inf"} <= buckets


def test_requests_are_counted_by_version_and_outcome(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    with httpx.Client(base_url=server.url) as c:
        for _ in range(7):
            assert c.post("/v2/models/scorer/versions/v2/infer", json=BODY).status_code == 200
        for _ in range(3):
            bad = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 80], "data": [0.5] * 80}]}
            assert c.post("/v2/models/scorer/versions/v2/infer", json=bad).status_code == 400
        for _ in range(2):
            assert c.post("/v2/models/scorer/infer", content=b"{oops").status_code == 400
        for _ in range(5):
            assert c.post("/v2/models/scorer/versions/v1/infer", json=BODY).status_code == 200
        text = c.get("/metrics").text
    assert value(text, "mnn_inference_requests_total", model="scorer", version="v2", outcome="success") == 7
    assert value(text, "mnn_inference_requests_total", model="scorer", version="v2", outcome="client_error") == 3
    assert value(text, "mnn_inference_requests_total", model="scorer", version="v1", outcome="success") == 5
    assert value(text, "mnn_inference_requests_total", model="scorer", version="unrouted", outcome="client_error") == 2
    assert value(text, "mnn_inference_duration_seconds_count", model="scorer", version="v2") == 7
    assert value(text, "mnn_inference_duration_seconds_sum", model="scorer", version="v2") > 0
    assert value(text, "mnn_inference_in_flight_requests", model="scorer", version="v2") == 0


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_memory_per_version_and_of_the_serving_processes(large_dir: Path, start_server, workers: int) -> None:  # type: ignore[no-untyped-def]
    server: RuntimeServer = start_server(large_dir / "runtime.yaml", extra_args=["--workers", str(workers)])
    size = (large_dir / "large.mnn").stat().st_size
    text = httpx.get(server.url + "/metrics").text
    large = value(text, "mnn_version_memory_bytes", model="scorer", version="large")
    small = value(text, "mnn_version_memory_bytes", model="scorer", version="v1")
    assert 0.8 * size <= large <= 2.0 * size, (large, size)
    assert small < size / 10, small
    processes = value(text, "mnn_runtime_processes", model="scorer")
    pss = value(text, "mnn_runtime_memory_pss_bytes", model="scorer")
    rss = value(text, "mnn_runtime_memory_rss_bytes", model="scorer")
    assert processes == (1 if workers == 1 else workers + 1)
    assert pss >= size  # the weights are in there once
    if workers > 1:  # shared with the supervisor: counted once by PSS, in every process by RSS
        assert rss - pss >= workers * 0.8 * size, (rss, pss, size)
    cpu = value(text, "mnn_runtime_cpu_seconds_total", model="scorer")
    assert cpu > 0
