"""A clear start: without kopf's peering CRD or object the operator says what is missing and how to
fix it within seconds, instead of waiting silently; once the object exists it starts working."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.k8s.fixtures import k8s_emulator_factory  # noqa: F401
from testbed.k8s.harness import EmulatorProcess
from testbed.cluster import CRD, PEERING_CRD, OperatorProcess, wait_for

pytestmark = pytest.mark.timeout(120)
PEERING = "apiVersion: kopf.dev/v1\nkind: KopfPeering\nmetadata: {name: mnn-rollout, namespace: default}\n"


def error_lines(op: OperatorProcess) -> list[str]:
    return [line for line in op.log().splitlines() if " ERROR " in line and "kopf peering" in line]


@pytest.mark.parametrize("install_crd, missing", [
    (False, "the CRD kopfpeerings.kopf.dev is missing"),
    (True, "KopfPeering 'mnn-rollout' in namespace default is missing"),
])
def test_a_missing_peering_crd_or_object_is_an_error_naming_it_and_both_fixes(
        k8s_emulator_factory: Callable[..., EmulatorProcess], tmp_path: Path,  # noqa: F811
        install_crd: bool, missing: str) -> None:
    emu = k8s_emulator_factory(crds=[CRD, PEERING_CRD] if install_crd else [CRD])
    op = OperatorProcess(emu, tmp_path, "token")
    started = time.monotonic()
    op.start()
    try:
        line = wait_for(lambda: error_lines(op), 5, "the peering ERROR")[0]
        assert time.monotonic() - started < 5 + 2  # the process start, then within 5 s
        assert missing in line and "--standalone" in line and "peering.enabled=true" in line
        if install_crd:  # the fix: the object appears, the operator says so and goes to work
            emu.kubectl("apply", "--validate=false", "-f", "-", input=PEERING)
            wait_for(lambda: "kopf peering 'mnn-rollout' found" in op.log(), 45, "peering found")
    finally:
        op.stop()


def test_a_present_peering_object_gives_no_error(k8s_emulator_factory: Callable[..., EmulatorProcess],  # noqa: F811
                                                 tmp_path: Path) -> None:
    emu = k8s_emulator_factory(crds=[CRD, PEERING_CRD])
    emu.kubectl("apply", "--validate=false", "-f", "-", input=PEERING)
    op = OperatorProcess(emu, tmp_path, "token")
    op.start()
    try:
        wait_for(lambda: "operator starting" in op.log(), 10, "the operator started")
        # the positive signal that the check ran: the peering list request was made
        wait_for(lambda: any(r.get("resource") == "kopfpeerings" and r.get("method") == "GET"
                             and r.get("userAgent", "").startswith("mnn-rollout-operator")
                             for r in emu.requests()), 10, "the peering check's request")
        assert error_lines(op) == []
    finally:
        op.stop()
