"""``kubectl mnn-rollout`` (the kubectl-mnn_rollout plugin) steering a real rollout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mnn_rollout.local.traffic import Traffic
from testbed.cluster import Cluster, wait_for
from tests.operator.test_e2e_rollout import canary, phase, start_stable

pytestmark = pytest.mark.timeout(300)
BIN = str(Path(sys.executable).parent)


def plugin(cluster: Cluster, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(cluster.emu.env(), PATH=BIN + os.pathsep + os.environ.get("PATH", ""))
    result = subprocess.run(["kubectl", "mnn-rollout", *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_the_kubectl_plugin_steers_a_rollout_and_reports_it(cluster: Cluster) -> None:
    start_stable(cluster)
    with Traffic(cluster.pods, users=500, rate=120, connections=2):
        cluster.apply(canary(cluster, steps=[{"weight": 10}, {"weight": 40}, {"weight": 70}]))
        wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 10, 60, "step 1 waits")
        tree = plugin(cluster, "status", "scorer").stdout
        assert "default/scorer  phase Paused" in tree and "canary  v2  weight 10%  step 1/3" in tree
        assert "✔ v2" in tree and "Ready" in tree
        assert "├─ pods (2)" in tree and tree.count("scorer-runtime-") == 2
        assert "scorer" in plugin(cluster, "list").stdout
        assert "default/scorer  phase Paused" in plugin(cluster, "-n", "default", "status", "scorer").stdout  # as kubectl
        promoted = plugin(cluster, "promote", "scorer")  # it waits for the operator's answer and prints it
        assert "modeldeployment.mnnrollout.io/scorer promote: applied" in promoted.stdout
        wait_for(lambda: cluster.status()["canaryWeight"] == 40, 20, "promote -> step 2")
        refused = plugin(cluster, "retry", "scorer", check=False)  # nothing to retry while it progresses
        assert refused.returncode == 1 and "retry: ignored: nothing to retry" in refused.stderr
        assert "ActionIgnored" in cluster.event_reasons() and cluster.status()["canaryWeight"] == 40
        plugin(cluster, "pause", "scorer")
        wait_for(lambda: cluster.md()["spec"]["paused"] is True and "paused" in cluster.status()["message"], 20,
                 "paused")
        plugin(cluster, "resume", "scorer")
        wait_for(lambda: cluster.md()["spec"]["paused"] is False, 10, "resumed")
        plugin(cluster, "abort", "scorer")
        wait_for(lambda: phase(cluster) == "RolledBack", 20, "aborted")
        done = plugin(cluster, "status", "scorer", "--watch", "--timeout", "30", check=False)
        assert done.returncode == 1 and "phase RolledBack" in done.stdout  # scripts see the failure
        plugin(cluster, "retry", "scorer")
        wait_for(lambda: phase(cluster) == "Paused" and cluster.status()["canaryWeight"] == 10, 20, "retried")
        waiting = plugin(cluster, "status", "scorer", "--watch", "--timeout", "2", check=False)
        assert waiting.returncode == 2 and "timed out" in waiting.stderr
        plugin(cluster, "promote", "scorer", "--full")
        ok = plugin(cluster, "status", "scorer", "--watch", "--timeout", "60", check=False)
        assert ok.returncode == 0 and "phase Succeeded" in ok.stdout
    missing = plugin(cluster, "promote", "nope", check=False)
    assert missing.returncode != 0 and "default/nope not found" in missing.stderr + missing.stdout
