"""The import boundaries: a serving process never loads the operator's side (kopf, the Kubernetes
client, ``rollout_operator``), the shared contract imports neither side, and the operator never
loads MNN. Checked on real processes through CPython's own import log (``-X importtime``)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from mnn_rollout.local.net import free_port, wait_for

OPERATOR_SIDE = ("kopf", "kubernetes", "rollout_operator", "aiohttp", "mnn_rollout.demo")
RUNTIME_SIDE = ("MNN", "_mnncengine", "mnn_runtime", "uvicorn", "fastapi", "grpc")


def imported(stderr: str) -> set[str]:
    """Module names from ``-X importtime`` lines: ``import time: self | cumulative | name``."""
    return {m.group(1).strip() for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(.+)$", stderr, re.M)}


def offending(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def imports_of(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return imported(r.stderr)


def test_a_serving_process_and_its_workers_never_import_the_operator_side(tmp_path: Path, examples_dir: Path) -> None:
    config = tmp_path / "runtime.yaml"
    config.write_text(yaml.safe_dump({"model": "scorer", "versions": [
        {"name": "v1", "uri": str(examples_dir / "v1.mnn")}, {"name": "v2", "uri": str(examples_dir / "v2.mnn")}],
        "weights": {"v1": 50, "v2": 50}}))
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mnn_rollout.cli", "serve", "--config",
                                 str(config), "--port", str(port), "--workers", "2", "--log-level", "warning"],
                                stderr=out, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/v2/health/ready", timeout=1).status_code == 200, 60, "runtime ready",
                 retry_on=(httpx.HTTPError,))
        body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
        for user in range(20):  # both workers and both versions answer
            r = httpx.post(url + "/v2/models/scorer/infer", json=body, headers={"X-User-Id": f"u{user}"}, timeout=10)
            assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    modules = imported(log.read_text())
    # the log is real: the runtime's own modules and MNN are in it
    assert {"mnn_runtime.server", "mnn_rollout.contract.config", "MNN"} <= modules, sorted(modules)[:50]
    assert offending(modules, OPERATOR_SIDE) == []


def test_the_shared_contract_imports_neither_side() -> None:
    modules = imports_of("import mnn_rollout.contract.config, mnn_rollout.contract.routing")
    assert "mnn_rollout.contract.routing" in modules
    assert offending(modules, OPERATOR_SIDE + RUNTIME_SIDE) == []


def test_the_operator_never_imports_the_runtime_or_mnn() -> None:
    modules = imports_of("import rollout_operator.main, rollout_operator.runner, rollout_operator.ctl, "
                         "rollout_operator.alerts, rollout_operator.providers.factory")
    assert {"kopf", "rollout_operator.reconcile"} <= modules
    assert offending(modules, RUNTIME_SIDE) == []


def test_the_top_level_help_imports_no_side() -> None:
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "mnn_rollout.cli", "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "operator" in r.stdout and "serve" in r.stdout
    assert offending(imported(r.stderr), OPERATOR_SIDE + RUNTIME_SIDE) == []
