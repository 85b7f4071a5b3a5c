"""
Pytest fixtures for the Kubernetes API emulator (function-scoped: every test gets a fresh,
empty cluster in its own process, ~0.5 s to start).

* ``k8s_emulator`` -> :class:`testbed.k8s.harness.EmulatorProcess` with no CRDs registered:
  ``.url``, ``.kubeconfig_path``, ``.env()`` (KUBECONFIG + KUBECACHEDIR for subprocesses),
  ``.kubectl(*args, check=True, timeout=30, input=None)``, ``.api_client()`` (kubernetes client),
  ``.request(method, path, body=None, content_type=..., headers=None) -> (status, json)``,
  ``.requests()`` / ``.write_requests(resource=None)`` / ``.reset_requests()`` (the request log),
  ``.inject_fault(code, method, path, times)``, ``.connection_info()`` (for ``@kopf.on.login``),
  ``.stderr()``, ``.stop()``.
* ``k8s_emulator_factory(crds=[...], args=[...])`` -> starts more/other emulators, all stopped at
  teardown (e.g. ``crds=[ROOT / 'crds/modeldeployment.yaml']``, ``args=['--history-size', '5']`` to
  provoke 410 Gone, ``args=['--bookmark-interval', '0.5']``).

Use them from other test folders with ``from tests.k8s.fixtures import k8s_emulator`` (importing
a fixture into a test module or conftest makes it available there).
"""
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from testbed.k8s.harness import EmulatorProcess


@pytest.fixture
def k8s_emulator_factory() -> Iterator[Callable[..., EmulatorProcess]]:
    started: list[EmulatorProcess] = []

    def factory(**kwargs: Any) -> EmulatorProcess:
        emu = EmulatorProcess(**kwargs)
        started.append(emu)
        return emu.start()

    yield factory
    for emu in started:
        emu.cleanup()


@pytest.fixture
def k8s_emulator(k8s_emulator_factory: Callable[..., EmulatorProcess]) -> EmulatorProcess:
    return k8s_emulator_factory()
