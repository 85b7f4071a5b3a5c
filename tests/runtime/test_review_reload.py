"""Idle unloading and loading again on demand (review): what an unloaded version still holds, the
file it loads again, and the requests that wait for that load."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mnn_rollout.contract.config import RuntimeConfig, VersionSpec, parse_config_text
from mnn_rollout.local.net import wait_for
from mnn_runtime.dataplane import DataPlane
from mnn_runtime.errors import VersionNotReady
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.registry import Registry, VersionState
from mnn_runtime.server import build_runtime
from tests.runtime.test_idle import BODY, config_with, metric, versions

pytestmark = pytest.mark.timeout(180)


def test_an_unloaded_version_is_ready_and_described_and_a_failed_one_is_not(examples_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Readiness and metadata said an idle-unloaded version was unavailable (REST ready 503, gRPC
    ModelReady False, ModelMetadata UNAVAILABLE): a client that checks readiness first never sent
    the request that would load it. Now it is ready and described as it was loaded, over REST and
    gRPC, without being loaded for that; a version that failed to load stays not ready."""
    from tests.runtime.test_grpc import Served, pb

    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump({
        "model": "scorer", "stable": "v1", "weights": {"v1": 100, "v2": 0, "v3": 0},
        "versions": [{"name": "v1", "uri": str(examples_dir / "v1.mnn")},
                     {"name": "v2", "uri": str(examples_dir / "v2.mnn")}, {"name": "v3", "uri": "missing.mnn"}]}))
    served = Served(build_runtime(config), with_rest=True)
    try:
        registry = served.runtime.registry
        loaded = served.rest.get("/v2/models/scorer/versions/v2").json()
        assert registry.offload(["v2"], "idle") == ["v2"]
        rest = served.rest.get("/v2/models/scorer/versions/v2/ready")
        assert rest.status_code == 200 and rest.json()["ready"] is True, rest.text
        assert served.stub.ModelReady(pb.ModelReadyRequest(name="scorer", version="v2"), timeout=5).ready
        meta = served.rest.get("/v2/models/scorer/versions/v2")
        assert meta.status_code == 200 and meta.json() == loaded, meta.text
        grpc_meta = served.stub.ModelMetadata(pb.ModelMetadataRequest(name="scorer", version="v2"), timeout=5)
        assert [(t.name, list(t.shape)) for t in grpc_meta.inputs] == [("features", [-1, 64])]
        assert registry.snapshot.versions["v2"].state == "offloaded"  # described, not loaded for it
        # A failed version is not ready, and has no metadata.
        assert served.rest.get("/v2/models/scorer/versions/v3/ready").status_code == 503
        assert served.rest.get("/v2/models/scorer/versions/v3").status_code == 503
        assert not served.stub.ModelReady(pb.ModelReadyRequest(name="scorer", version="v3"), timeout=5).ready
    finally:
        served.close()


def two_versions(examples_dir: Path, spare: Path | None = None) -> RuntimeConfig:
    """v1 stable at 100%, v2 (or ``spare``, named v2) at weight 0."""
    return parse_config_text(yaml.safe_dump({
        "model": "scorer", "stable": "v1", "weights": {"v1": 100, "v2": 0},
        "versions": [{"name": "v1", "uri": str(examples_dir / "v1.mnn")},
                     {"name": "v2", "uri": str(spare or examples_dir / "v2.mnn")}]}))


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_an_idle_version_with_batching_frees_its_memory(large_dir: Path, tmp_path: Path, start_server: Any,
                                                         workers: int) -> None:
    """With ``batching`` configured, a version unloaded while idle kept all its memory (the data
    plane's batcher cache held its model): PSS 104 MB loaded, 105 MB 'offloaded' (52 MB model, 1
    worker; 133 -> 131 MB with 2), against 102 -> 54 MB without batching."""
    listed = yaml.safe_load((large_dir / "runtime.yaml").read_text())["versions"]
    listed = [{**v, "uri": str(large_dir / v["uri"])} for v in listed]
    listed[1]["batching"] = {"max_batch_size": 8}
    config = config_with(large_dir, tmp_path, versions=listed, server={"idle_unload_seconds": 3})
    server = start_server(config, extra_args=["--workers", str(workers)])
    size = (large_dir / "large.mnn").stat().st_size
    url = server.url
    with httpx.Client(base_url=url) as c:
        for _ in range(5 * workers):  # a batcher made in each worker
            assert c.post("/v2/models/scorer/versions/large/infer", json=BODY).status_code == 200
    for _ in range(2 * workers):  # each worker's first /metrics allocates what it keeps: not in the baseline
        metric(url, "mnn_runtime_memory_pss_bytes")
    loaded = metric(url, "mnn_runtime_memory_pss_bytes")
    wait_for(lambda: versions(url)["large"]["state"] == "offloaded", 30, "large offloaded")
    wait_for(lambda: loaded - metric(url, "mnn_runtime_memory_pss_bytes") >= 0.7 * size, 20,
             f"{size} bytes freed")


def test_a_version_loads_again_only_from_the_file_it_had_loaded(examples_dir: Path, tmp_path: Path) -> None:
    """Unloaded while idle, then its file replaced on disk by another model (no sha256 in the spec,
    as the examples and most configs): the next pinned request loaded and served the other model
    under the version's name. A loaded version never changes model without a config; an unloaded
    one must not either: it fails, saying so, until a config names the file again."""
    spare = tmp_path / "spare.mnn"
    shutil.copy(examples_dir / "v2.mnn", spare)
    registry = Registry(two_versions(examples_dir, spare), None, RuntimeMetrics("scorer"))
    loaded = registry.snapshot.versions["v2"].model
    assert loaded is not None and registry.offload(["v2"], "idle") == ["v2"]
    shutil.copy(examples_dir / "v2-slow.mnn", spare)
    assert registry.reload_now(["v2"]) == []
    state = registry.snapshot.versions["v2"]
    assert state.model is None and state.state == "failed", "another model is served as 'v2'"
    assert state.reason and "changed on disk since it was loaded" in state.reason, state.reason
    assert f"sha256 {loaded.sha256}, now " in state.reason
    with pytest.raises(VersionNotReady, match="changed on disk"):  # a pinned request: 503 with the reason
        asyncio.run(DataPlane(registry, registry.metrics)._loaded(registry.snapshot, "v2"))
    status = DataPlane(registry, registry.metrics).model_status("scorer")["versions"]["v2"]
    assert status["ready"] is False and "changed on disk" in status["reason"] and status["sha256"] == loaded.sha256
    # A config naming the file again accepts the new file.
    registry.apply(two_versions(examples_dir, spare).model_copy(update={"salt": "new"}))
    now = registry.snapshot.versions["v2"]
    assert now.ready and now.model is not None and now.model.sha256 != loaded.sha256


def test_a_request_that_gives_up_does_not_fail_the_others_waiting_for_the_same_load(examples_dir: Path) -> None:
    """Two pinned requests wait for an unloaded version's load (``DataPlane._loaded``: one shared
    Future). The first gives up (a gRPC client's 0.05 s deadline): that cancelled the shared Future,
    so the second (30 s deadline) failed too, and the load's thread died on InvalidStateError."""
    registry = Registry(two_versions(examples_dir), None, RuntimeMetrics("scorer"))
    assert registry.offload(["v2"], "idle") == ["v2"]
    load, loading, gave_up = registry._load, threading.Event(), threading.Event()

    def slow_load(spec: VersionSpec, old: VersionState | None) -> VersionState:
        loading.set()
        gave_up.wait(20)  # under way until the first request has given up
        return load(spec, old)

    registry._load = slow_load  # type: ignore[method-assign]
    plane = DataPlane(registry, registry.metrics)

    async def two_waiters() -> VersionState:
        snap = registry.snapshot
        hasty = asyncio.ensure_future(plane._loaded(snap, "v2"))
        patient = asyncio.ensure_future(plane._loaded(snap, "v2"))
        # the load runs on a thread of the registry's: the first gives up while it is under way
        assert await asyncio.to_thread(loading.wait, 20), "the load did not start in 20 s"
        hasty.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hasty
        gave_up.set()
        return await patient

    assert asyncio.run(two_waiters()).ready
    assert registry.snapshot.versions["v2"].ready


LOAD_LINE = re.compile(r"model (\S+): MNN's load ran from ([0-9.]+) to ([0-9.]+) \(pid (\d+)\)")


def test_a_burst_of_requests_for_an_unloaded_version_loads_it_one_process_at_a_time(
        large_dir: Path, tmp_path: Path, start_server: Any) -> None:
    """20 pinned requests at once for an unloaded version with 2 workers: each worker loaded its
    own copy and the supervisor its, at the same time (each load peaks at ~3.2x the model inside
    MNN: a burst could take ~3.2 x 3 x the model and OOM the pod). Now MNN's part of a load runs in
    one process of the pod at a time; each worker still loads its own copy to answer at once."""
    server = start_server(config_with(large_dir, tmp_path), extra_args=["--workers", "2"])
    url = server.url
    wait_for(lambda: versions(url)["large"]["state"] == "offloaded", 30, "large offloaded")
    codes: list[int] = []

    def pinned() -> None:
        codes.append(httpx.post(url + "/v2/models/scorer/versions/large/infer", json=BODY, timeout=60).status_code)

    burst = [threading.Thread(target=pinned) for _ in range(20)]
    for t in burst:
        t.start()
    for t in burst:
        t.join()
    assert codes == [200] * 20

    def loads() -> list[tuple[float, float, int]]:
        found = LOAD_LINE.findall(server.log_path.read_text())
        return sorted((float(b), float(e), int(pid)) for path, b, e, pid in found if path.endswith("large.mnn"))

    # at start (the supervisor), then both workers for the requests and the supervisor again
    every = wait_for(lambda: len(found := loads()) >= 4 and found, 30, "the workers' and the supervisor's loads")
    assert len({pid for _, _, pid in every}) >= 3, every
    for (_, ended, _), (began, _, _) in zip(every, every[1:]):
        assert began >= ended, f"two loads at once: {every}"
