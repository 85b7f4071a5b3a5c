"""Loading real .mnn files: failures carry reasons, the signature is right, clones never mix outputs."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from mnn_rollout.contract.config import EngineSpec, RuntimeConfig, parse_config
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.model import LoadedModel, ModelLoadError
from mnn_runtime.registry import Registry


def test_the_example_scorer_has_a_dynamic_batch_and_its_declared_signature(examples_dir: Path) -> None:
    model = LoadedModel.load(examples_dir / "v1.mnn")
    assert [(s.name, s.datatype, s.shape) for s in model.inputs] == [("features", "FP32", (-1, 64))]
    assert [(s.name, s.datatype, s.shape) for s in model.outputs] == [("scores", "FP32", (-1, 32))]
    out = model.infer([np.ones((5, 64), np.float32)])
    assert out[0].shape == (5, 32)
    assert np.all((out[0] > 0) & (out[0] < 1))  # sigmoid scores


def test_v2_breaking_declares_its_wider_input(examples_dir: Path) -> None:
    model = LoadedModel.load(examples_dir / "v2-breaking.mnn")
    assert model.inputs[0].shape == (-1, 80)


def test_a_missing_file_is_reported_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"'.*nope\.mnn' does not exist"):
        LoadedModel.load(tmp_path / "nope.mnn")


@pytest.fixture
def unreadable(tmp_path: Path) -> Path:
    """A model file whose reading fails with an OSError for any user, root included (the tests
    run as root here, past any chmod): it is /proc/self/mem, which answers a read at offset 0 with
    EIO."""
    assert Path("/proc/self/mem").is_file(), "the tests run on Linux: /proc/self/mem is where a read fails"
    path = tmp_path / "unreadable.mnn"
    path.symlink_to("/proc/self/mem")
    return path


def test_a_file_that_cannot_be_read_is_reported_with_its_path_and_the_cause(unreadable: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model file '.*unreadable\.mnn' cannot be read: Input/output error"):
        LoadedModel.load(unreadable)


def test_a_cache_dir_no_file_can_have_fails_that_version_with_the_reason(examples_dir: Path) -> None:
    """The config refuses such a cacheDir; a spec that skipped its validation still fails only its version."""
    spec = EngineSpec.model_construct(cache_dir="/tmp/bad\x00cache")
    with pytest.raises(ModelLoadError, match=r"its compile cache '/tmp/bad\\x00cache/v1-.*' cannot be opened: "
                                             r"ValueError: embedded null byte"):
        LoadedModel.load(examples_dir / "v1.mnn", engine=spec, name="v1")


def test_a_new_file_that_cannot_be_read_fails_its_version_only_and_the_old_file_keeps_serving(
        model_dir: Path, unreadable: Path) -> None:
    def config(uri: str, weights: dict[str, int]) -> RuntimeConfig:
        return parse_config({"model": "scorer", "stable": "v1", "weights": weights,
                             "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": uri}]})

    registry = Registry(config("v2.mnn", {"v1": 90, "v2": 10}), model_dir, RuntimeMetrics("scorer"))
    registry.apply(config(str(unreadable), {"v1": 100, "v2": 0}))  # a rollback that ships a file it cannot read
    v2 = registry.snapshot.versions["v2"]
    assert registry.snapshot.weights == {"v1": 100, "v2": 0}
    assert v2.ready and v2.spec.uri == "v2.mnn" and "cannot be read: Input/output error" in (v2.reason or "")
    started = Registry(config(str(unreadable), {"v1": 100, "v2": 0}), model_dir, RuntimeMetrics("scorer"))
    assert started.snapshot.versions["v1"].ready and not started.snapshot.versions["v2"].ready


def test_a_truncated_file_is_reported_not_a_crash(tmp_path: Path, examples_dir: Path) -> None:
    bad = tmp_path / "v1.mnn"
    bad.write_bytes((examples_dir / "v1.mnn").read_bytes()[:50_000])
    with pytest.raises(ModelLoadError, match="is not a valid MNN model"):
        LoadedModel.load(bad)


def test_a_file_that_is_not_a_model_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "v1.mnn"
    bad.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match="is not a valid MNN model"):
        LoadedModel.load(bad)


def test_a_sha256_mismatch_is_reported_with_both_digests(tmp_path: Path, examples_dir: Path) -> None:
    path = examples_dir / "v1.mnn"
    with pytest.raises(ModelLoadError, match=r"has sha256 [0-9a-f]{64}, expected 0{64}"):
        LoadedModel.load(path, sha256="0" * 64)


def external_weights_model(folder: Path) -> Path:
    """The example scorer converted with its weights in ``ext.mnn.weight`` beside ``ext.mnn``."""
    from mnn_runtime.convert import _run_converter
    from mnn_runtime.examples import EXAMPLES, scorer_onnx

    import onnx

    src = folder / "v1.onnx"
    onnx.save(scorer_onnx(EXAMPLES[0]), src)
    dst = folder / "ext.mnn"
    _run_converter(["MNNConvert", "-f", "ONNX", "--modelFile", str(src), "--MNNModel", str(dst),
                    "--saveExternalData"])
    assert (folder / "ext.mnn.weight").is_file()
    return dst


def test_a_missing_external_weight_file_is_reported(tmp_path: Path) -> None:
    dst = external_weights_model(tmp_path)
    LoadedModel.load(dst)  # loads with its weight file
    (tmp_path / "ext.mnn.weight").unlink()
    with pytest.raises(ModelLoadError, match=r"needs a file that cannot be opened: .*ext\.mnn\.weight"):
        LoadedModel.load(dst)


def test_two_loads_at_once_each_read_their_own_mnn_messages_and_leave_fd_1_as_it_was(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two offloaded versions loaded again at once (two pinned requests): MNN reports a missing
    weight file only on fd 1, which a load points at a file of its own meanwhile (process-wide).
    Forced here: ``ext`` (its weight file gone) starts its load first, ``v2`` (good) starts its own
    before ext's ends and ends after it. Loads that overlapped there gave ext's message to v2 (v2
    failed, ext served zeros) and left fd 1 on ext's deleted file for good (stdout lost)."""
    import MNN.nn as nn

    ext = external_weights_model(model_dir)
    config = parse_config({"model": "scorer", "stable": "v1", "weights": {"v1": 100, "ext": 0, "v2": 0},
                           "versions": [{"name": n, "uri": f"{n}.mnn"} for n in ("v1", "ext", "v2")]})
    registry = Registry(config, model_dir, RuntimeMetrics("scorer"))
    assert sorted(registry.offload(["ext", "v2"], "idle")) == ["ext", "v2"]
    (model_dir / "ext.mnn.weight").unlink()
    ext_loading, v2_loading, ext_loaded = threading.Event(), threading.Event(), threading.Event()
    load = nn.load_module_from_file

    def interleaved(path: str, *args: object, **kwargs: object) -> object:
        if path == str(ext):  # waits (at most 1 s: a serialised v2 cannot start) for v2 to start its load
            ext_loading.set()
            v2_loading.wait(1.0)
        elif path == str(model_dir / "v2.mnn"):
            v2_loading.set()
            ext_loaded.wait(10)  # and ends after ext's load
        return load(path, *args, **kwargs)

    monkeypatch.setattr(nn, "load_module_from_file", interleaved)
    fd_1, before = os.dup(1), os.fstat(1)
    try:
        ext_reload = registry.reload("ext")
        assert ext_loading.wait(10)
        v2_reload = registry.reload("v2")
        ext_reload.result(10)
        ext_loaded.set()
        v2_reload.result(10)
        after = os.fstat(1)
    finally:
        os.dup2(fd_1, 1)  # stdout back for the other tests, whatever happened
        os.close(fd_1)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    versions = registry.snapshot.versions
    assert versions["v2"].state == "ready", versions["v2"].reason
    assert versions["ext"].state == "failed" and "ext.mnn.weight" in (versions["ext"].reason or "")


def test_concurrent_requests_each_get_their_own_output(examples_dir: Path) -> None:
    """MNN (measured with 3.6.1): one module used from two threads at once returns the other
    thread's output, silently. The clone pool must make that impossible."""
    model = LoadedModel.load(examples_dir / "v1.mnn")
    rng = np.random.default_rng(0)
    inputs = [rng.random((1, 64), dtype=np.float32) for _ in range(8)]
    expected = [model.infer([x])[0] for x in inputs]
    mismatches: list[int] = []

    def worker(i: int) -> None:
        for _ in range(300):
            if not np.array_equal(model.infer([inputs[i]])[0], expected[i]):
                mismatches.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mismatches == []
    assert 1 <= model.pool_size <= 8


def test_int8_weights_v2_differs_from_v1_but_has_the_same_interface(examples_dir: Path) -> None:
    v1 = LoadedModel.load(examples_dir / "v1.mnn")
    v2 = LoadedModel.load(examples_dir / "v2.mnn")
    assert v1.inputs == v2.inputs and v1.outputs == v2.outputs
    x = np.ones((1, 64), np.float32)
    assert not np.allclose(v1.infer([x])[0], v2.infer([x])[0])
    assert (examples_dir / "v2.mnn").stat().st_size * 3 < (examples_dir / "v1.mnn").stat().st_size


def test_a_worker_forked_after_loading_runs_the_model_without_hanging(examples_dir: Path) -> None:
    """MNN (measured with 3.6.1): a child forked from a parent whose MNN runtime had more than one
    thread hangs forever in forward. The runtime's single one-thread runtime manager keeps
    `serve --workers` safe."""
    import os
    import time

    model = LoadedModel.load(examples_dir / "v2-slow.mnn")
    x = np.random.default_rng(3).random((4, 64), dtype=np.float32)
    expected = model.infer([x])[0]
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only with the parent's answer
        code = 1
        try:
            code = 0 if np.allclose(model.infer([x])[0], expected, atol=1e-6) else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung in forward")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0


def two_versions(v2_uri: str, weights: dict[str, int]) -> RuntimeConfig:
    return parse_config({"model": "scorer", "stable": "v1", "weights": weights,
                         "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": v2_uri}]})


def test_an_unforeseen_error_while_loading_fails_that_version_only_and_is_logged_with_its_traceback(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A bug, or an engine error no handler foresaw, must not refuse the whole config (weights,
    rollbacks) nor stop the pod: it fails the version whose file raised it, like a bad file."""
    load = LoadedModel.load

    def buggy(path: Path, *args: object, **kwargs: object) -> LoadedModel:
        if path.name == "v2-bug.mnn":
            raise RuntimeError("an engine error nobody foresaw")
        return load(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(LoadedModel, "load", buggy)
    (model_dir / "v2-bug.mnn").write_bytes((model_dir / "v2.mnn").read_bytes())
    registry = Registry(two_versions("v2.mnn", {"v1": 90, "v2": 10}), model_dir, RuntimeMetrics("scorer"))
    with caplog.at_level("ERROR", logger="mnn_runtime.registry"):
        registry.apply(two_versions("v2-bug.mnn", {"v1": 100, "v2": 0}))  # a rollback that ships it
    v2 = registry.snapshot.versions["v2"]
    assert registry.snapshot.weights == {"v1": 100, "v2": 0}
    assert v2.state == "failed" and v2.ready and v2.spec.uri == "v2.mnn"  # the old file keeps serving
    assert "RuntimeError: an engine error nobody foresaw" in (v2.reason or "")
    logged = [r for r in caplog.records if "v2-bug.mnn" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    started = Registry(two_versions("v2-bug.mnn", {"v1": 100, "v2": 0}), model_dir, RuntimeMetrics("scorer"))
    v2 = started.snapshot.versions["v2"]
    assert started.snapshot.versions["v1"].ready and v2.state == "failed" and not v2.ready
    assert v2.reason == ("model file v2-bug.mnn could not be loaded: RuntimeError: an engine error nobody foresaw "
                         "(an unexpected error: its traceback is in the runtime's log)")


def test_naming_again_the_file_a_version_still_serves_makes_it_ready_again(model_dir: Path) -> None:
    """Good file, bad file, good file again: the version never stopped serving the good file, so
    it is ready with no reason, as /status shows it, and idle offload (which takes ready versions
    only) applies to it again. The same in a worker, where the new file was pending."""
    from mnn_runtime.dataplane import DataPlane

    (model_dir / "bad.mnn").write_text("this is not a model\n")
    registry = Registry(two_versions("v2.mnn", {"v1": 100, "v2": 0}), model_dir, RuntimeMetrics("scorer"))
    registry.apply(two_versions("bad.mnn", {"v1": 100, "v2": 0}))
    assert registry.snapshot.versions["v2"].state == "failed"
    registry.apply(two_versions("v2.mnn", {"v1": 100, "v2": 0}))
    status = DataPlane(registry, RuntimeMetrics("scorer")).model_status("scorer")["versions"]["v2"]
    assert {k: status[k] for k in ("ready", "state", "reason", "uri")} == {
        "ready": True, "state": "ready", "reason": None, "uri": "v2.mnn"}
    assert registry.offload(["v2"], "idle") == ["v2"]
    worker = Registry(two_versions("v2.mnn", {"v1": 100, "v2": 0}), model_dir, RuntimeMetrics("scorer"))
    worker.load_new = False  # as in a worker of serve --workers: the supervisor loads new files
    worker.apply(two_versions("v2-other.mnn", {"v1": 100, "v2": 0}))
    assert worker.snapshot.versions["v2"].state == "pending"
    worker.apply(two_versions("v2.mnn", {"v1": 100, "v2": 0}))
    v2 = worker.snapshot.versions["v2"]
    assert v2.state == "ready" and v2.reason is None and v2.ready
