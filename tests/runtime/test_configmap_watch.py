"""The runtime's ConfigMap watch against the API emulator: while the API fails it backs off (every
pod of every ModelDeployment watches its ConfigMap; after an outage they must not all retry twice a
second), and once the API answers again a change reaches it at once."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mnn_rollout.local.net import wait_for
from mnn_runtime.config_source import ConfigApplier, ConfigMapSource
from mnn_runtime.kube import KubeAPI
from testbed.k8s.harness import EmulatorProcess
from tests.k8s.fixtures import k8s_emulator, k8s_emulator_factory  # noqa: F401

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


def test_the_configmap_watch_backs_off_while_the_api_fails_and_follows_at_once_after(
        k8s_emulator: EmulatorProcess, model_dir: Path) -> None:  # noqa: F811
    emu = k8s_emulator
    text = (model_dir / "runtime.yaml").read_text()
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "routing"}, "data": {"runtime.yaml": text}}
    assert emu.request("POST", CONFIGMAPS, body)[0] == 201
    applied: list[Any] = []
    source = ConfigMapSource(KubeAPI(emu.url), "default", "routing", ConfigApplier(applied.append), watch_timeout=5,
                             retry_delay=0.05, max_retry_delay=0.4)
    source.start()
    try:
        wait_for(lambda: len(applied) == 1, 10, "the first config applied")
        emu.inject_fault(code=500, path="/configmaps", times=-1)
        emu.drop_watches()
        emu.reset_requests()
        time.sleep(3)
        tries = [r for r in emu.requests() if "/configmaps" in r.get("path", "")]
        # 0.05 s between tries would be ~60; doubling to 0.4 s (times 0.5-1) ~10
        assert 3 <= len(tries) <= 20, len(tries)
        assert emu.request("DELETE", "/_emulator/faults")[0] == 200
        changed = text.replace("weights:", "weights:  ", 1)
        assert changed != text
        assert emu.request("PATCH", CONFIGMAPS + "/routing", {"data": {"runtime.yaml": changed}},
                           "application/merge-patch+json")[0] == 200
        started = time.monotonic()
        wait_for(lambda: len(applied) == 2, 10, "the change applied once the API answers")
        assert time.monotonic() - started < 2.0  # the wait is bounded by max_retry_delay, not grown for ever
    finally:
        source.stop()
