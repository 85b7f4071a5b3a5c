"""The compile cache (``versions[].engine.cacheDir``): MNN's runtime manager gets the version's
cache file before the load and writes it after the warm-up; a corrupt or unwritable cache never
stops a version from loading. Real MNN throughout (on CPU, where MNN caches nothing: what a GPU
gains from the cache is not measured on these machines)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mnn_rollout.contract.config import EngineSpec
from mnn_runtime import engine
from mnn_runtime.model import LoadedModel, ModelLoadError, file_sha256

X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)


def cache_file(directory: Path, model: Path, version: str = "v1") -> Path:
    return directory / f"{version}-{file_sha256(model)[:12]}-CPU.cache"


def test_the_cache_is_handed_to_mnn_before_the_load_and_written_after_the_warm_up(
        examples_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime manager cannot be wrapped (MNN takes only its own type and silently loads
    without one otherwise), so the seam is ``engine.Runtime``: spied here, calling the real MNN
    methods, around the real load and warm-up."""
    import MNN.nn

    calls: list[tuple[str, Any]] = []
    runtime_set, runtime_update = engine.Runtime.set_cache, engine.Runtime.update_cache
    load, probe = MNN.nn.load_module_from_file, LoadedModel._probe.__func__  # type: ignore[attr-defined]

    def set_cache(self: engine.Runtime) -> None:
        calls.append(("set_cache", self.cache.path if self.cache else None))
        runtime_set(self)

    def update_cache(self: engine.Runtime) -> None:
        calls.append(("update_cache", self.cache.path if self.cache else None))
        runtime_update(self)

    def loading(*args: Any, **kwargs: Any) -> Any:
        calls.append(("load", kwargs["runtime_manager"] is not None))
        return load(*args, **kwargs)

    def warming(cls: Any, *args: Any) -> Any:
        calls.append(("warm-up", None))
        return probe(cls, *args)

    monkeypatch.setattr(engine.Runtime, "set_cache", set_cache)
    monkeypatch.setattr(engine.Runtime, "update_cache", update_cache)
    monkeypatch.setattr(MNN.nn, "load_module_from_file", loading)
    monkeypatch.setattr(LoadedModel, "_probe", classmethod(warming))
    directory = tmp_path / "cache"
    model = LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(cacheDir=str(directory)), name="v1")
    expected = cache_file(directory, examples_dir / "v1.mnn")
    assert calls == [("set_cache", expected), ("load", True), ("warm-up", None), ("update_cache", expected)]
    assert model.engine.cache_file == str(expected)
    assert model.engine.as_parameters()["cache_file"] == str(expected)
    assert list(directory.iterdir()) == []  # CPU compiles nothing to cache; no private copy is left behind


class FakeCompiler:
    """Stands in for the runtime manager's two cache calls only (what a GPU backend does: read
    the file given, write what it compiled on update), to test how the file is put in place."""

    def __init__(self, compiled: bytes | None) -> None:
        self.compiled = compiled
        self.read: bytes | None = None
        self.path: str | None = None

    def set_cache(self, path: str) -> None:
        self.path = path
        self.read = Path(path).read_bytes() if os.path.exists(path) else None

    def update_cache(self) -> None:
        if self.compiled is not None and self.path is not None:
            Path(self.path).write_bytes(self.compiled)


def test_what_mnn_compiled_replaces_the_cache_whole_and_nothing_is_left_behind(tmp_path: Path) -> None:
    final = tmp_path / "v1-abc-OpenCL.cache"
    first = FakeCompiler(b"kernels")
    cache = engine.CompileCache(final)
    cache.open(first)
    assert first.path != str(final) and first.read == b""  # MNN writes a private copy, not the file others read
    cache.close(first)
    assert final.read_bytes() == b"kernels" and sorted(tmp_path.iterdir()) == [final]
    again = FakeCompiler(None)  # a restart: reads what the last run compiled, compiles nothing new
    cache = engine.CompileCache(final)
    cache.open(again)
    cache.close(again)
    assert again.read == b"kernels" and final.read_bytes() == b"kernels" and sorted(tmp_path.iterdir()) == [final]


def test_copies_a_killed_load_left_behind_are_removed_and_a_live_load_keeps_its_own(
        examples_dir: Path, tmp_path: Path) -> None:
    """A load killed between open and close leaves its private copy; the next load in the directory
    removes those not written for an hour, never the younger copy of a load still running."""
    directory = tmp_path / "cache"
    directory.mkdir()
    final = cache_file(directory, examples_dir / "v1.mnn")
    final.write_bytes(b"kernels")
    old = time.time() - engine.STALE_CACHE_COPY_SECONDS - 60
    stale = [directory / f"{final.name}.k1ll3d_0.tmp", directory / "v0-123456789abc-OpenCL.cache.abcd1234.tmp"]
    others = [directory / "notes.tmp", directory / "v0.cache.tmp"]  # not names a cache's private copy has
    for path in stale + others:
        path.write_bytes(b"half written")
        os.utime(path, (old, old))
    running = FakeCompiler(b"newer kernels")  # another worker, loading meanwhile
    live = engine.CompileCache(final)
    live.open(running)
    LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(cacheDir=str(directory)), name="v1")
    assert running.path is not None and Path(running.path).exists()
    assert sorted(directory.iterdir()) == sorted([final, Path(running.path), *others])
    live.close(running)
    assert final.read_bytes() == b"newer kernels" and sorted(directory.iterdir()) == sorted([final, *others])


def test_a_file_that_fails_to_load_leaves_no_cache_behind(tmp_path: Path) -> None:
    bad = tmp_path / "bad.mnn"
    bad.write_bytes(b"not a model" * 100)
    directory = tmp_path / "cache"
    with pytest.raises(ModelLoadError):
        LoadedModel.load(bad, engine=EngineSpec(cacheDir=str(directory)), name="v1")
    assert list(directory.iterdir()) == []


def test_a_corrupt_cache_never_stops_a_version_from_loading(examples_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    directory.mkdir()
    garbage = np.random.default_rng(7).bytes(4096)
    cache_file(directory, examples_dir / "v1.mnn").write_bytes(garbage)
    plain = LoadedModel.load(examples_dir / "v1.mnn")
    model = LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(cacheDir=str(directory)), name="v1")
    np.testing.assert_allclose(model.infer([X])[0], plain.infer([X])[0], rtol=1e-6)
    assert [p.name for p in directory.iterdir()] == [cache_file(directory, examples_dir / "v1.mnn").name]


def test_a_cache_dir_that_cannot_be_made_never_stops_a_version_from_loading(
        examples_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    directory = tmp_path / "a-file" / "cache"  # not creatable, not even by root
    model = LoadedModel.load(examples_dir / "v1.mnn", engine=EngineSpec(cacheDir=str(directory)), name="v1")
    assert model.infer([X])[0].shape == (1, 32)
    assert "cannot be written to" in caplog.text


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can read (pytest's tmp_path is private to its user)."""
    path = Path(tempfile.mkdtemp(prefix="mnn-cache-test-"))
    path.chmod(0o755)
    yield path
    for sub in path.rglob("*"):
        if sub.is_dir():
            sub.chmod(0o755)
    shutil.rmtree(path, ignore_errors=True)


def test_a_read_only_cache_dir_never_stops_a_version_from_loading(examples_dir: Path, shared_dir: Path) -> None:
    """The directory is read-only (mode 0555). Root may write there anyway, so the load runs in a
    child forked from this process that, as root, first becomes nobody (an exec would not do:
    the interpreter lives under root's private home)."""
    model = shared_dir / "v1.mnn"
    shutil.copy(examples_dir / "v1.mnn", model)
    model.chmod(0o644)
    directory = shared_dir / "cache"
    directory.mkdir()
    kept = cache_file(directory, model)
    kept.write_bytes(b"an older cache")
    kept.chmod(0o644)
    directory.chmod(0o555)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one line of JSON on the pipe, then exit without running pytest's teardown
        code = 1
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            logs = _LogLines()
            logging.getLogger("mnn_runtime").addHandler(logs)
            loaded = LoadedModel.load(model, engine=EngineSpec(cacheDir=str(directory)), name="v1")
            answer = {"shape": list(loaded.infer([X])[0].shape), "engine": loaded.engine.as_parameters(),
                      "uid": os.geteuid(), "logs": logs.lines}
            os.write(write_end, json.dumps(answer).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        output = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and output
    answer = json.loads(output)
    assert answer["uid"] != 0
    assert answer["shape"] == [1, 32] and answer["engine"]["cache_file"] == str(kept)
    assert any("cannot be written to" in line for line in answer["logs"]), answer["logs"]
    assert kept.read_bytes() == b"an older cache" and sorted(directory.iterdir()) == [kept]


class _LogLines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
