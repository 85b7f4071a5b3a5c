"""
Pytest fixtures for the kubelet stand-in (``kubelet.py``). Use them from another folder with
``pytest_plugins = ['tests.k8s.kubelet_fixtures']`` in a conftest (that registers the emulator
fixtures too), or import them into a module next to ``k8s_emulator``.

* ``kubelet_factory(emu, workdir=None, **kwargs)`` -> a started :class:`Kubelet` for an
  ``EmulatorProcess``; every one is stopped at teardown (processes killed) even when the test fails.
* ``kubelet`` -> one started for ``k8s_emulator`` (all namespaces), workdir ``tmp_path/'kubelet-0'``.

Stopping happens before the emulator's own teardown (the fixtures depend on it), and
``Kubelet.start`` also registers an ``atexit`` stop.
"""
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .fixtures import k8s_emulator, k8s_emulator_factory  # noqa: F401
from testbed.k8s.harness import EmulatorProcess
from testbed.k8s.kubelet import Kubelet


@pytest.fixture
def kubelet_factory(tmp_path: Path) -> Iterator[Callable[..., Kubelet]]:
    started: list[Kubelet] = []

    def factory(emu: EmulatorProcess, workdir: Path | None = None, **kwargs: Any) -> Kubelet:
        kubelet = Kubelet(emu.url, emu.kubeconfig_path, workdir or tmp_path / f'kubelet-{len(started)}', **kwargs)
        started.append(kubelet)
        return kubelet.start()

    yield factory
    for kubelet in reversed(started):
        kubelet.stop()
        if kubelet.errors:
            print(f'kubelet stand-in errors ({kubelet.workdir}):\n' + '\n'.join(kubelet.errors[-3:]))


@pytest.fixture
def kubelet(k8s_emulator: EmulatorProcess, kubelet_factory: Callable[..., Kubelet]) -> Kubelet:  # noqa: F811
    return kubelet_factory(k8s_emulator)
