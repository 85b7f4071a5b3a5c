"""Versions nobody uses are unloaded (``server.idle_unload_seconds``) and load again on demand:
on their next pinned request (which waits for the load) or before a config gives them weight."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from mnn_rollout.contract.config import RuntimeConfig, VersionSpec, parse_config_text
from mnn_rollout.local.net import wait_for, write_atomic
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.registry import PENDING, Registry, VersionState
from tests.runtime.test_metrics import value
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(180)
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


def config_with(large_dir: Path, tmp_path: Path, **changes: object) -> Path:
    config = yaml.safe_load((large_dir / "runtime.yaml").read_text())
    config["versions"] = [{**v, "uri": str(large_dir / v["uri"])} for v in config["versions"]]
    config["server"] = {"idle_unload_seconds": 2}
    config.update(changes)
    path = tmp_path / "runtime.yaml"
    write_atomic(path, yaml.safe_dump(config))
    return path


def versions(url: str) -> dict[str, dict[str, object]]:
    return httpx.get(url + "/v2/models/scorer/status").json()["versions"]  # type: ignore[no-any-return]


def metric(url: str, name: str, **labels: str) -> float:
    return value(httpx.get(url + "/metrics").text, name, model="scorer", **labels)


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_an_idle_version_is_unloaded_and_loads_again_for_its_next_request(
        large_dir: Path, tmp_path: Path, workers: int) -> None:
    config = config_with(large_dir, tmp_path)
    server = RuntimeServer(config, tmp_path / "server.log", extra_args=["--workers", str(workers)])
    server.start()
    size = (large_dir / "large.mnn").stat().st_size
    try:
        url = server.url
        for _ in range(2 * workers):  # each worker's first /metrics allocates what it keeps: not in the baseline
            metric(url, "mnn_runtime_memory_pss_bytes")
        loaded_pss = metric(url, "mnn_runtime_memory_pss_bytes")
        # Unloaded once idle: the stable version, idle as long, stays.
        state = wait_for(lambda: versions(url)["large"]["state"] == "offloaded" and versions(url), 20,
                         "large offloaded")
        assert state["large"]["ready"] is False and "no request for 2 s" in str(state["large"]["reason"])
        assert state["v1"]["state"] == "ready"
        assert metric(url, "mnn_version_loaded", version="large") == 0
        assert metric(url, "mnn_version_memory_bytes", version="large") == 0
        assert metric(url, "mnn_version_offloaded", version="large") == 1
        assert metric(url, "mnn_version_offloaded", version="v1") == 0
        # Its memory is gone from every process (with workers: the supervisor's and theirs). Shared
        # pages stay while any one process holds them, so a process that kept its copy leaves the sum
        # near where it was. Freed in all, ~88% of the file size comes back with workers (~5 MB
        # stays in each process's heap), 97% in one process.
        freed = wait_for(lambda: (d := loaded_pss - metric(url, "mnn_runtime_memory_pss_bytes")) >= 0.7 * size
                         and d, 20, f"{size} bytes freed")
        print(f"freed {freed / 1e6:.1f} MB of a {size / 1e6:.1f} MB model")
        # Keyed traffic never reaches it (weight 0), so it stays unloaded while v1 serves.
        with httpx.Client(base_url=url) as c:
            assert all(c.post("/v2/models/scorer/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                       .headers["X-Model-Version"] == "v1" for i in range(20))
            # A pinned request waits for the load and is answered by it.
            started = time.monotonic()
            r = c.post("/v2/models/scorer/versions/large/infer", json=BODY, timeout=60)
            first = time.monotonic() - started
            assert r.status_code == 200 and r.headers["X-Model-Version"] == "large", r.text
        print(f"first request to the offloaded version: {first * 1000:.0f} ms")
        wait_for(lambda: versions(url)["large"]["state"] == "ready", 30, "large ready again")
        assert metric(url, "mnn_version_offloaded", version="large") == 0
        assert metric(url, "mnn_version_memory_bytes", version="large") >= 0.8 * size
        if workers > 1:  # the supervisor loads it too and replaces the workers: shared once more
            wait_for(lambda: metric(url, "mnn_runtime_memory_pss_bytes") - (loaded_pss - freed) < 1.5 * size,
                     30, "the workers sharing the reloaded weights")
    finally:
        server.stop()


def test_an_offloaded_version_is_loaded_before_it_gains_weight(large_dir: Path, tmp_path: Path) -> None:
    spare = {"name": "spare", "uri": str(large_dir / "v1.mnn")}  # idle at weight 0 all along
    config = config_with(large_dir, tmp_path)
    listed = [*yaml.safe_load(config.read_text())["versions"], spare]
    config_with(large_dir, tmp_path, versions=listed, weights={"v1": 100, "large": 0, "spare": 0})
    server = RuntimeServer(config, tmp_path / "server.log")
    server.start()
    try:
        url = server.url
        wait_for(lambda: versions(url)["large"]["state"] == "offloaded", 20, "large offloaded")
        config_with(large_dir, tmp_path, versions=listed, weights={"v1": 50, "large": 50, "spare": 0})
        wait_for(lambda: httpx.get(url + "/v2/models/scorer/status").json()["weights"]["large"] == 50, 30,
                 "the new weights")
        assert versions(url)["large"]["state"] == "ready"  # loaded before the swap, never routed unloaded
        with httpx.Client(base_url=url) as c:
            seen = {c.post("/v2/models/scorer/infer", json=BODY, headers={"X-User-Id": f"u{i}"})
                    .headers["X-Model-Version"] for i in range(60)}
            assert seen == {"v1", "large"}
            # spare loads again for a request, after large's last one, and idles afresh: once the
            # unloader has unloaded it again (it looked), large, idle longer but with weight, is loaded.
            wait_for(lambda: versions(url)["spare"]["state"] == "offloaded", 20, "spare offloaded")
            assert c.post("/v2/models/scorer/versions/spare/infer", json=BODY, timeout=60).status_code == 200
        assert versions(url)["spare"]["state"] == "ready"
        wait_for(lambda: versions(url)["spare"]["state"] == "offloaded", 20, "spare offloaded again")
        assert versions(url)["large"]["state"] == "ready"
    finally:
        server.stop()


def test_a_version_loading_again_never_holds_up_a_config_or_an_offload(examples_dir: Path) -> None:
    """A worker applies configs and offloads on its event loop: they must not wait for a version
    that a pinned request is loading again, and the load still lands (served, if given weight meanwhile)."""
    def config(v2: int) -> RuntimeConfig:
        return parse_config_text(yaml.safe_dump({
            "model": "scorer", "stable": "v1", "weights": {"v1": 100 - v2, "v2": v2},
            "versions": [{"name": v, "uri": str(examples_dir / f"{v}.mnn")} for v in ("v1", "v2")]}))

    registry = Registry(config(0), examples_dir, RuntimeMetrics("scorer"))
    registry.load_new = False  # as in a worker of serve --workers
    assert registry.offload(["v2"], "idle") == ["v2"]
    loading, load = threading.Event(), registry._load

    def slow_load(spec: VersionSpec, old: VersionState | None) -> VersionState:
        loading.set()
        time.sleep(1.0)
        return load(spec, old)

    registry._load = slow_load  # type: ignore[method-assign]

    def reload_meanwhile(change: Callable[[], object]) -> float:
        """Load v2 again on a thread (as for a pinned request) and, while it loads, ``change``:
        the seconds ``change`` took."""
        loading.clear()
        reload = threading.Thread(target=registry.reload_now, args=(["v2"],))
        reload.start()
        assert loading.wait(10)
        started = time.monotonic()
        change()
        took = time.monotonic() - started
        reload.join(10)
        return took

    assert reload_meanwhile(lambda: (registry.apply(config(0)), registry.offload(["v2"], "idle"))) < 0.3
    assert registry.snapshot.versions["v2"].state == "ready"  # loaded all the same
    # Given weight while it loads again: the worker lists it pending, then serves it from this load.
    assert registry.offload(["v2"], "idle") == ["v2"]
    assert reload_meanwhile(lambda: registry.apply(config(30))) < 0.3
    snap = registry.snapshot
    assert snap.versions["v2"].state == "ready" and snap.table.owners.count("v2") == 3000
