"""
Fixtures for the tests under tests/k8s/: the public ones from fixtures.py, plus ``api`` (one
emulator with the Widget CRD per test module) and ``ns`` (a fresh namespace in it per test).
"""
from collections.abc import Iterator

import pytest

from .fixtures import k8s_emulator, k8s_emulator_factory  # noqa: F401
from testbed.k8s.harness import WIDGET_CRD, EmulatorProcess
from .helpers import create_namespace, unique


@pytest.fixture(scope='module')
def api() -> Iterator[EmulatorProcess]:
    with EmulatorProcess(crds=[WIDGET_CRD]) as emu:
        yield emu


@pytest.fixture
def ns(api: EmulatorProcess) -> str:
    return create_namespace(api, unique('ns'))
