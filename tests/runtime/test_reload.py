"""Routing changes live: new weights within 2 s, no dropped request, bad configs refused."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import yaml

from mnn_rollout.contract.routing import RoutingTable
from mnn_rollout.local.net import wait_for, write_atomic
from mnn_rollout.local.traffic import Traffic
from tests.runtime_server import RuntimeServer

INFER = "/v2/models/scorer/infer"
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
KEYS = [f"user-{i}" for i in range(300)]


def write(path: Path, config: dict[str, object]) -> None:
    write_atomic(path, yaml.safe_dump(config))  # like a ConfigMap symlink swap


def routes(client: httpx.Client, keys: list[str] = KEYS) -> dict[str, str]:
    return {k: client.post(INFER, json=BODY, headers={"X-User-Id": k}).headers["x-model-version"] for k in keys}


def expected(weights: dict[str, int], keys: list[str] = KEYS) -> dict[str, str]:
    table = RoutingTable.build("scorer", weights, "v1")  # from stable: the path does not matter with one canary
    return {k: table.route(k) for k in keys}


def load(url: str) -> Traffic:
    """Steady background traffic, unpaced on one keep-alive connection, every status counted."""
    return Traffic(url, keys=[f"load-{i}" for i in range(500)], rate=None, connections=1, max_seconds=60)


def test_new_weights_apply_within_seconds_without_dropping_a_request(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    with httpx.Client(base_url=server.url, timeout=10) as client, load(server.url) as traffic:
        assert routes(client) == expected({"v1": 90, "v2": 10})
        for weights in ({"v1": 70, "v2": 30}, {"v1": 0, "v2": 100}, {"v1": 100, "v2": 0}):
            write(model_dir / "runtime.yaml", {**config, "weights": weights})
            started = time.monotonic()
            wait_for(lambda w=weights: routes(client, KEYS[:50]) == expected(w, KEYS[:50]), 10, f"weights {weights}",
                     interval=0.02)
            took = time.monotonic() - started
            assert routes(client) == expected(weights)
            print(f"weights {weights} applied in {took:.2f} s")
    codes = traffic.statuses()
    assert set(codes) == {200}, codes
    assert codes[200] > 50


def test_an_invalid_config_is_refused_and_the_old_routing_kept(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    with httpx.Client(base_url=server.url, timeout=10) as client:
        before = routes(client)
        for bad in ({**config, "weights": {"v1": 120, "v2": -20}}, {**config, "weights": {"v1": 90, "v9": 10}}):
            write(model_dir / "runtime.yaml", bad)
            wait_for(lambda: "refused new config" in server.log() and "v9" in server.log()
                     if "v9" in str(bad) else "refused new config" in server.log(), timeout=10)
            assert routes(client) == before
        write_atomic(model_dir / "runtime.yaml", "model: [broken\n")  # not truncated then written: read empty between
        wait_for(lambda: "not valid YAML" in server.log(), timeout=10)
        assert routes(client) == before
        metrics = client.get("/metrics").text
        assert 'mnn_config_reloads_total{model="scorer",result="rejected"} 3.0' in metrics
    assert "weights.v1: 120 is outside 0-100" in server.log()


def test_a_version_added_live_is_loaded_before_it_takes_traffic(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    with httpx.Client(base_url=server.url, timeout=10) as client, load(server.url) as traffic:
        new = {**config, "versions": config["versions"] + [{"name": "v3", "uri": "v2-slow.mnn"}],
               "weights": {"v1": 50, "v2": 0, "v3": 50}}
        write(model_dir / "runtime.yaml", new)
        wait_for(lambda: client.get("/v2/models/scorer/versions/v3/ready").status_code == 200, timeout=20)
        before = RoutingTable.build("scorer", config["weights"], "v1")  # what it served: evolved from there
        table = RoutingTable.build("scorer", new["weights"], "v1", previous=before)
        want = {k: table.route(k) for k in KEYS}
        wait_for(lambda: routes(client) == want, timeout=10)
    assert set(traffic.statuses()) == {200}, traffic.statuses()


def test_a_bad_file_for_a_serving_version_never_replaces_the_good_one(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    server: RuntimeServer = start_server(model_dir / "runtime.yaml")
    (model_dir / "v2-corrupt.mnn").write_bytes((model_dir / "v2.mnn").read_bytes()[:20_000])
    with httpx.Client(base_url=server.url, timeout=10) as client:
        good = client.post("/v2/models/scorer/versions/v2/infer", json=BODY).json()["outputs"]
        versions = [dict(v) for v in config["versions"]]
        versions[1] = {"name": "v2", "uri": "v2-corrupt.mnn"}
        write(model_dir / "runtime.yaml", {**config, "versions": versions})
        wait_for(lambda: "still serving v2.mnn" in server.log(), timeout=10)
        r = client.post("/v2/models/scorer/versions/v2/infer", json=BODY)
        assert r.status_code == 200 and r.json()["outputs"] == good
        assert client.get("/v2/health/ready").status_code == 200


def test_a_weighted_version_that_fails_to_load_sends_its_users_to_stable(model_dir: Path, start_server) -> None:  # type: ignore[no-untyped-def]
    config = yaml.safe_load((model_dir / "runtime.yaml").read_text())
    config["versions"].append({"name": "v3", "uri": "nowhere.mnn"})
    config["weights"] = {"v1": 70, "v2": 0, "v3": 30}
    write(model_dir / "runtime.yaml", config)
    server: RuntimeServer = start_server(model_dir / "runtime.yaml", wait_ready=False)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        ready = client.get("/v2/health/ready")
        assert ready.status_code == 503
        served = routes(client)
        assert set(served.values()) == {"v1"}
        r = client.post("/v2/models/scorer/versions/v3/infer", json=BODY)
        assert r.status_code == 503 and "nowhere.mnn" in r.json()["error"]
