"""What users see of a rollout: ``kubectl mnn-rollout status --watch`` against the API emulator,
with the status written as the operator would (no operator runs: the test decides when it answers)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from testbed.cluster import CRD, MD_PATH
from testbed.k8s.harness import EmulatorProcess

pytestmark = pytest.mark.timeout(120)
PLUGIN = str(Path(sys.executable).parent / "kubectl-mnn_rollout")
MD = {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "scorer"},
      "spec": {"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, {"name": "v2", "uri": "/m/v2.mnn"},
                            {"name": "v3", "uri": "/m/v3.mnn"}], "canary": "v2"}}


@pytest.fixture
def emu(k8s_emulator_factory: Callable[..., EmulatorProcess]) -> EmulatorProcess:
    return k8s_emulator_factory(crds=[CRD])


def plugin(emu: EmulatorProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in emu.env().items() if not k.startswith("KUBERNETES_")}
    return subprocess.run([PLUGIN, *args], env=env, capture_output=True, text=True, timeout=60)


def store_status(emu: EmulatorProcess, status: dict[str, Any]) -> dict[str, Any]:
    code, body = emu.request("PATCH", f"{MD_PATH}/scorer/status", {"status": status},
                             content_type="application/merge-patch+json")
    assert code == 200, body
    return dict(body)


def test_status_watch_waits_for_the_operator_to_observe_a_new_spec(emu: EmulatorProcess) -> None:
    """``kubectl apply`` of a new canary, then ``status --watch`` at once (as a CI script does): the
    status still describes the previous rollout, which ended. Before, the watch exited at once with
    that rollout's outcome (0 for Succeeded, 1 for RolledBack) for a rollout that had not started."""
    code, body = emu.request("POST", MD_PATH, MD)
    assert code == 201, body
    store_status(emu, {"phase": "Succeeded", "observedGeneration": body["metadata"]["generation"],
                       "stableVersion": "v2", "canaryVersion": "v2", "canaryWeight": 100, "weights": {"v2": 100}})
    code, body = emu.request("PATCH", f"{MD_PATH}/scorer", {"spec": {"canary": "v3"}},
                             content_type="application/merge-patch+json")
    assert code == 200, body
    generation = body["metadata"]["generation"]

    waiting = plugin(emu, "status", "scorer", "--watch", "--timeout", "2")
    assert waiting.returncode == 2 and "timed out" in waiting.stderr, waiting  # before: 0, "phase Succeeded"
    assert f"spec generation {generation} not observed yet" in waiting.stdout, waiting.stdout
    # the operator observes it and the rollout ends: the watch reports that rollout's outcome
    store_status(emu, {"phase": "RolledBack", "observedGeneration": generation, "canaryVersion": "v3",
                       "canaryWeight": 0, "weights": {"v2": 100, "v3": 0}})
    done = plugin(emu, "status", "scorer", "--watch", "--timeout", "10")
    assert done.returncode == 1 and "phase RolledBack" in done.stdout and "not observed" not in done.stdout, done
