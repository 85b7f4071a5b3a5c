"""Engine settings per version (``versions[].engine``): validated naming field and value, handed
to MNN's runtime manager as the integers it reads, a backend the node lacks falls back to CPU
(the version serves and says so), and threads > 1 work with forked workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from mnn_rollout.contract.config import ConfigError, EngineSpec, parse_config
from mnn_runtime import engine
from mnn_runtime.dataplane import DataPlane
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.model import LoadedModel
from mnn_runtime.registry import Registry
from tests.runtime_server import RuntimeServer

X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": X.ravel().tolist()}]}


@pytest.mark.parametrize(("engine_settings", "message"), [
    ({"backend": "GPU"}, "versions.0.engine.backend: Input should be 'CPU', 'OpenCL', 'Vulkan', 'CUDA', 'Metal' or "
                         "'Auto' (got 'GPU')"),
    ({"precision": "fp16"}, "versions.0.engine.precision: Input should be 'normal', 'high', 'low' or 'lowBF16' "
                            "(got 'fp16')"),
    ({"memory": "tiny"}, "versions.0.engine.memory: Input should be 'normal', 'high' or 'low' (got 'tiny')"),
    ({"threads": 0}, "versions.0.engine.threads: Input should be greater than or equal to 1 (got 0)"),
    ({"threads": 64}, "versions.0.engine.threads: Input should be less than or equal to 32 (got 64)"),
    ({"threads": True}, "versions.0.engine.threads: Input should be a valid integer (got True)"),  # not read as 1
    ({"threads": 2.0}, "versions.0.engine.threads: Input should be a valid integer (got 2.0)"),
    ({"threads": "4"}, "versions.0.engine.threads: Input should be a valid integer (got '4')"),
    ({"cacheDir": "cache"}, "versions.0.engine.cacheDir: cacheDir 'cache' is not an absolute directory"),
    ({"gpu": True}, "versions.0.engine.gpu: Extra inputs are not permitted"),
    ({"cacheDir": "/tmp/c\x00x"}, r"versions.0.engine.cacheDir: cacheDir '/tmp/c\x00x' contains the control "
                                  r"character '\x00'"),
    ({"cacheDir": "/var/cache\n/x"}, r"versions.0.engine.cacheDir: cacheDir '/var/cache\n/x' contains the control "
                                     r"character '\n'"),
    ({"cacheDir": "/."}, "versions.0.engine.cacheDir: cacheDir '/.' is not an absolute directory"),
    ({"cacheDir": "/usr"}, "versions.0.engine.cacheDir: cacheDir '/usr' is under /usr, a system directory"),
    ({"cacheDir": "/proc/self"}, "versions.0.engine.cacheDir: cacheDir '/proc/self' is under /proc, a system "),
    ({"cacheDir": "//etc/mnn"}, "versions.0.engine.cacheDir: cacheDir '//etc/mnn' is under /etc, a system "),
    ({"cacheDir": "/./lib64/"}, "versions.0.engine.cacheDir: cacheDir '/./lib64/' is under /lib64, a system "),
])
def test_bad_engine_settings_are_refused_naming_field_and_value(engine_settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"model": "m", "versions": [{"name": "v1", "uri": "v1.mnn", "engine": engine_settings}]})
    assert message in str(err.value)


@pytest.mark.parametrize("cache_dir", ["/var/cache/mnn", "/tmp/mnn", "/usrdata/cache", "/cache/dev", "/data/etc"])
def test_a_cache_dir_beside_the_system_directories_is_accepted(cache_dir: str) -> None:
    config = parse_config({"model": "m", "versions": [{"name": "v1", "uri": "v1.mnn",
                                                      "engine": {"cacheDir": cache_dir}}]})
    assert config.versions[0].engine is not None and config.versions[0].engine.cache_dir == cache_dir


@pytest.mark.parametrize(("engine_settings", "message"), [
    ({"cacheDir": "/tmp/x\x00y"}, r"spec.versions.0.engine.cacheDir: cacheDir '/tmp/x\x00y' contains the control"),
    ({"cacheDir": "/sys/mnn"}, "spec.versions.0.engine.cacheDir: cacheDir '/sys/mnn' is under /sys, a system"),
    ({"threads": "4"}, "spec.versions.0.engine.threads: Input should be a valid integer (got '4')"),
    ({"threads": True}, "spec.versions.0.engine.threads: Input should be a valid integer (got True)"),
])
def test_the_operator_refuses_the_same_engine_settings_naming_the_field(engine_settings: dict[str, Any],
                                                                   message: str) -> None:
    from rollout_operator.spec import SpecError, parse_spec

    with pytest.raises(SpecError) as err:
        parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn", "engine": engine_settings}]})
    assert message in str(err.value)


def test_the_defaults_are_what_every_version_ran_with_before() -> None:
    config = parse_config({"model": "m", "versions": [{"name": "v1", "uri": "v1.mnn", "engine": {}}]})
    assert config.versions[0].engine == EngineSpec(backend="CPU", precision="normal", memory="normal", power="normal",
                                                   threads=1, cacheDir=None)


def test_the_settings_reach_mnn_as_the_integers_it_reads(examples_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MNN ignores a mode given as a string (``"memory": "low"`` changes nothing): every mode goes
    in as its enum value. The real runtime manager is created; the seam only records its config."""
    made: list[dict[str, Any]] = []
    create = engine._create

    def recording(config: dict[str, Any]) -> tuple[Any, bool]:
        made.append(config)
        return create(config)

    monkeypatch.setattr(engine, "_create", recording)
    spec = EngineSpec(precision="low", memory="low", power="high")
    model = LoadedModel.load(examples_dir / "v1.mnn", engine=spec, name="v1")
    assert made[-1] == {"backend": "CPU", "numThread": 1, "precision": 2, "memory": 2, "power": 1}
    assert model.engine.backend == "CPU" and model.engine.threads == 1 and not model.engine.fallback


def test_a_backend_the_node_lacks_falls_back_to_cpu_and_the_version_serves(examples_dir: Path) -> None:
    """No OpenCL on these machines: MNN says so ("Can't Find type=3 backend") and runs on CPU; the
    version loads, answers like the CPU one, and its engine says what it asked for and got."""
    cpu = LoadedModel.load(examples_dir / "v1.mnn")
    opencl = LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(backend="OpenCL"), name="v1")
    np.testing.assert_allclose(opencl.infer([X])[0], cpu.infer([X])[0], rtol=1e-6)
    info = opencl.engine
    assert (info.requested.backend, info.backend, info.fallback, info.threads) == ("OpenCL", "CPU", True, 1)
    assert info.reason is not None and "no OpenCL backend" in info.reason and "runs on CPU" in info.reason


def test_auto_is_no_fallback_when_it_picks_cpu(examples_dir: Path) -> None:
    model = LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(backend="Auto"), name="v1")
    assert (model.engine.backend, model.engine.fallback) == ("CPU", False)


def _registry(model_dir: Path, versions: list[dict[str, Any]]) -> Registry:
    config = parse_config({"model": "scorer", "versions": versions, "stable": versions[0]["name"]})
    return Registry(config, model_dir, RuntimeMetrics("scorer"))


def test_metadata_and_status_show_the_requested_and_the_actual_engine(model_dir: Path) -> None:
    registry = _registry(model_dir, [{"name": "v1", "uri": "v1.mnn"},
                                     {"name": "v2", "uri": "v2.mnn", "engine": {"backend": "OpenCL", "memory": "low"}}])
    plane = DataPlane(registry, RuntimeMetrics("scorer"))
    v2 = plane.model_metadata("scorer", "v2")["parameters"]["engine"]
    assert v2["requested_backend"] == "OpenCL" and v2["backend"] == "CPU" and v2["fallback"] is True
    assert (v2["threads"], v2["memory"], v2["precision"]) == (1, "low", "normal") and "OpenCL" in v2["reason"]
    v1 = plane.model_metadata("scorer", "v1")["parameters"]["engine"]
    assert (v1["requested_backend"], v1["backend"], v1["fallback"], v1["threads"]) == ("CPU", "CPU", False, 1)
    status = plane.model_status("scorer")["versions"]
    assert status["v2"]["engine"] == v2 and status["v1"]["engine"] == v1


def test_a_changed_engine_loads_the_version_again(model_dir: Path) -> None:
    registry = _registry(model_dir, [{"name": "v1", "uri": "v1.mnn"}])
    before = registry.snapshot.versions["v1"].model
    changed = parse_config({"model": "scorer", "versions": [{"name": "v1", "uri": "v1.mnn",
                                                             "engine": {"threads": 2}}]})
    after = registry.apply(changed).versions["v1"].model
    assert after is not before and after is not None and after.engine.threads == 2


def test_a_process_that_will_fork_loads_threaded_and_gpu_versions_on_a_one_thread_stand_in(
        examples_dir: Path) -> None:
    """In the supervisor no MNN thread pool and no GPU may start (a worker forked after one would
    hang in forward): a version asking for them loads on CPU with one thread, marked for the
    workers to load again after the fork."""
    engine.fork_parent(True)
    try:
        model = LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(threads=2), name="v1")
    finally:
        engine.fork_parent(False)
    assert (model.engine.backend, model.engine.threads, model.engine.per_process) == ("CPU", 1, True)
    assert model.engine.reason is not None and "each worker loads it" in model.engine.reason


def test_an_unforeseen_error_loading_again_in_a_worker_keeps_the_stand_in_and_is_logged_with_its_traceback(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A worker just forked loads a threaded version again (``load_per_process``); an error no
    handler foresaw (a bug, an MNN error type) must not kill the worker at start, which the
    supervisor would respawn into the same death for good: it serves the supervisor's copy, as
    after a ModelLoadError, and the error is logged with its traceback."""
    engine.fork_parent(True)  # the supervisor of serve --workers
    try:
        registry = _registry(model_dir, [{"name": "v1", "uri": "v1.mnn", "engine": {"threads": 2}}])
    finally:
        engine.fork_parent(False)
    stand_in = registry.snapshot.versions["v1"].model
    assert stand_in is not None and stand_in.engine.per_process

    def buggy(*args: object, **kwargs: object) -> LoadedModel:
        raise RuntimeError("an engine error nobody foresaw")

    monkeypatch.setattr(LoadedModel, "load", buggy)
    with caplog.at_level("ERROR", logger="mnn_runtime.model"):
        registry.load_per_process()  # in the worker
    v1 = registry.snapshot.versions["v1"]
    assert v1.ready and v1.model is not None and v1.model.engine.per_process is False
    assert (v1.model.engine.backend, v1.model.engine.threads) == ("CPU", 1)
    assert "RuntimeError: an engine error nobody foresaw" in (v1.model.engine.reason or "")
    np.testing.assert_array_equal(v1.model.infer([X])[0], stand_in.infer([X])[0])
    logged = [r for r in caplog.records if "nobody foresaw" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


def _serve(model_dir: Path, start_server: Any, workers: int) -> RuntimeServer:
    config = {
        "model": "scorer", "stable": "v1", "weights": {"v1": 50, "v2": 50},
        "versions": [{"name": "v1", "uri": "v1.mnn"},
                     {"name": "v2", "uri": "v2-slow.mnn", "engine": {"threads": 2}},
                     {"name": "gpu", "uri": "v1.mnn", "engine": {"backend": "OpenCL", "threads": 2}}],
    }
    path = model_dir / "runtime.yaml"
    path.write_text(yaml.safe_dump(config))
    server: RuntimeServer = start_server(path, extra_args=["--workers", str(workers)])
    return server


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-forked-workers"])
def test_threads_above_one_serve_with_forked_workers_and_report_what_each_runs_on(
        model_dir: Path, start_server: Any, workers: int) -> None:
    """The supervisor loads the threaded and the OpenCL versions on one thread, forks, and each
    worker loads them again on two threads: every request is answered, by every worker, and the
    metadata says two threads and the OpenCL fallback. (With the supervisor's guard taken away,
    ``engine.fork_parent`` a no-op, requests to v2 hang: the workers spin in MNN's thread pool.)"""
    server = _serve(model_dir, start_server, workers)
    expected = {"v1": ("CPU", "CPU", 1), "v2": ("CPU", "CPU", 2), "gpu": ("OpenCL", "CPU", 2)}
    for version, (asked, backend, threads) in expected.items():
        for _ in range(4):  # a new connection each time: the supervisor deals them to the workers in turn
            with httpx.Client(base_url=server.url, timeout=10) as c:
                r = c.post(f"/v2/models/scorer/versions/{version}/infer", json=BODY)
                assert r.status_code == 200, r.text
                params = c.get(f"/v2/models/scorer/versions/{version}").json()["parameters"]["engine"]
            assert (params["requested_backend"], params["backend"], params["threads"]) == (asked, backend, threads)
            assert params["fallback"] is (version == "gpu"), params
