"""Fixtures shared by every test: example models built once, real runtime servers on loopback."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime_server import RuntimeServer


@pytest.fixture(scope="session")
def examples_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example models, built once per session with ``mnn-rollout examples``'s code."""
    from mnn_runtime.examples import build_examples

    out = tmp_path_factory.mktemp("examples")
    build_examples(out)
    return out


@pytest.fixture(scope="session")
def large_dir(tmp_path_factory: pytest.TempPathFactory, examples_dir: Path) -> Path:
    """v1 (stable, 100%) beside ``large``, the ~56 MB example (fp32 weights packed at load: what
    it holds is about its file), at weight 0, in ``runtime.yaml``."""
    import yaml
    from mnn_runtime.examples import LARGE, build_example

    out = tmp_path_factory.mktemp("large")
    build_example(LARGE, out)
    shutil.copy(examples_dir / "v1.mnn", out / "v1.mnn")
    (out / "runtime.yaml").write_text(yaml.safe_dump({
        "model": "scorer", "stable": "v1", "weights": {"v1": 100, "large": 0},
        "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "large", "uri": "large.mnn"}]}))
    return out


@pytest.fixture
def model_dir(tmp_path: Path, examples_dir: Path) -> Path:
    """A private copy of the examples that a test may change or break."""
    dst = tmp_path / "models"
    shutil.copytree(examples_dir, dst)
    return dst


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[object]:
    """Factory: ``start_server(config_path)`` -> a running RuntimeServer, stopped after the test."""
    servers: list[RuntimeServer] = []

    def start(config: Path, **kwargs: object) -> RuntimeServer:
        server = RuntimeServer(config, log_path=tmp_path / f"server-{len(servers)}.log", **kwargs)  # type: ignore[arg-type]
        servers.append(server)
        server.start()
        return server

    yield start
    for server in servers:
        server.stop()
