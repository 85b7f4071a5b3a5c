"""Fixtures shared by every test: example models built once, real runtime servers on loopback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from mnn_rollout.local.net import own_ports
from testbed.k8s.kubelet_pods import own_addresses
from tests.runtime_server import RuntimeServer

XDIST_PORTS = 2500  # ports of each pytest-xdist worker's own (below the ephemeral range, 32768+)
XDIST_OCTETS = 28  # second octets of each worker's own pod addresses (127.B.*.*, B in 20-250)


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``make test``), worker gwN takes its ports and its stand-in pods'
    addresses from ranges of its own, so two workers never get the same port between
    ``free_port`` and the bind (see ``own_ports``), nor the same pod address."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        slot = int(worker[2:]) % 8
        own_ports(range(10000 + slot * XDIST_PORTS, 10000 + (slot + 1) * XDIST_PORTS))
        own_addresses(range(20 + slot * XDIST_OCTETS, 20 + (slot + 1) * XDIST_OCTETS))


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
