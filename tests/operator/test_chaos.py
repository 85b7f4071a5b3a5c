"""The chaos soak's two-minute version (``make chaos`` runs ten): rollouts under traffic while
operator replicas, pods, the API, its watches, Prometheus and the alert webhook misbehave; every
invariant of ``testbed/chaos.py`` holds, and the soak shows that it did what it claims."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from testbed import chaos
from testbed.cluster import CRD, PEERING_CRD
from testbed.k8s.harness import EmulatorProcess
from testbed.k8s.kubelet import Kubelet

pytestmark = pytest.mark.timeout(900)


def test_a_two_minute_chaos_soak_keeps_every_invariant(
        k8s_emulator_factory: Callable[..., EmulatorProcess], kubelet_factory: Callable[..., Kubelet],
        examples_dir: Path, tmp_path: Path) -> None:
    emu = k8s_emulator_factory(crds=[CRD, PEERING_CRD])
    cluster, prom = chaos.build(emu, kubelet_factory(emu, tmp_path / "kubelet"), examples_dir, tmp_path)
    try:
        soak = chaos.Soak(cluster, prom, seconds=120, seed=11, period=2.5).run()
    finally:
        cluster.stop()
        prom.stop()
    report = soak.report()
    print(report)
    assert not soak.violations, report
    # It did what it claims: every kind of fault, every invariant looked at, rollouts both ways.
    # (a firing alert needs the failing canary in flight at that moment: every other kind must show)
    assert set(soak.faults) >= set(chaos.FAULTS) - {"alert-firing"}, report
    assert soak.checks["(a) advances checked"] >= 1 and soak.checks["(b) weights compared"] >= 100, report
    assert soak.checks["(c) child lists"] >= 20 and soak.checks["(e) actions with an outcome"] >= 2, report
    good = [s for s in soak.subjects if not s.failing]
    assert sum(s.rollouts["Succeeded"] for s in good) >= 1, report
    assert soak.checks["(d) failing canaries ended"] >= 1, report
