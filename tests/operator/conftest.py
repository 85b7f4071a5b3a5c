"""Fixtures for operator tests against the emulator and the kubelet stand-in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.k8s.fixtures import k8s_emulator, k8s_emulator_factory  # noqa: F401
from testbed.k8s.harness import EmulatorProcess
from testbed.k8s.kubelet import Kubelet
from tests.k8s.kubelet_fixtures import kubelet_factory  # noqa: F401
from testbed.cluster import CRD, PEERING_CRD, Cluster


def lenient_crd(tmp_path: Path) -> Path:
    """The CRD with no schema on spec: what a cluster that enforces none of it looks like."""
    crd = yaml.safe_load(CRD.read_text())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True}
    path = tmp_path / "lenient-crd.yaml"
    path.write_text(yaml.safe_dump(crd))
    return path


@pytest.fixture
def lenient_cluster(k8s_emulator_factory: Callable[..., EmulatorProcess],  # noqa: F811
                    kubelet_factory: Callable[..., Kubelet], examples_dir: Path,  # noqa: F811
                    tmp_path: Path) -> Iterator[Cluster]:
    yield from _cluster(k8s_emulator_factory(crds=[lenient_crd(tmp_path), PEERING_CRD]), kubelet_factory,
                        examples_dir, tmp_path)


@pytest.fixture
def cluster(k8s_emulator_factory: Callable[..., EmulatorProcess],  # noqa: F811
            kubelet_factory: Callable[..., Kubelet], examples_dir: Path, tmp_path: Path) -> Iterator[Cluster]:  # noqa: F811
    yield from _cluster(k8s_emulator_factory(crds=[CRD, PEERING_CRD]), kubelet_factory, examples_dir, tmp_path)


def _cluster(emu: EmulatorProcess, kubelet_factory: Callable[..., Kubelet], examples_dir: Path,  # noqa: F811
             tmp_path: Path) -> Iterator[Cluster]:
    emu.kubectl("apply", "--validate=false", "-f", "-",
                input="apiVersion: kopf.dev/v1\nkind: KopfPeering\nmetadata: {name: mnn-rollout, namespace: default}\n")
    kubelet = kubelet_factory(emu, tmp_path / "kubelet")
    c = Cluster(emu, kubelet, examples_dir, tmp_path)
    yield c
    c.stop()
