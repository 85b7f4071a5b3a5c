"""The supervisor and its workers (third review): configs of any size reach every worker; a roll's
new worker is given its time once the pod's load lock lets it load; a roll stopped by SIGTERM says so."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from mnn_rollout.local.net import write_atomic
from mnn_runtime.dataplane import WORKERS_DIFFER
from mnn_runtime.workers_channel import MAX_CONFIG_BYTES
from tests.runtime.test_workers import all_serving
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(180)


def test_a_config_over_one_message_reaches_every_worker(model_dir: Path, tmp_path: Path) -> None:
    """A config over ``MAX_CONFIG_BYTES`` (192 KB) was applied by the supervisor but sent to no
    worker ("a message of N bytes is over ..."): new weights never reached them, and the pod's
    /status said workers-differ for ever. Repro: 150 versions whose uris are 2 KB long each (~310 KB
    of YAML), weights changed: every status said workers-differ with the old weights; now the new
    weights, pod-wide."""
    padded = "./" * 1000 + "v1.mnn"  # the same small file, under a long uri (at most 2048 characters)
    versions = [{"name": "v1", "uri": "v1.mnn"}] + [{"name": f"x{i}", "uri": padded} for i in range(150)]
    config = {"model": "scorer", "stable": "v1", "weights": {"v1": 100}, "versions": versions}
    path = model_dir / "big.yaml"
    write_atomic(path, yaml.safe_dump(config))
    assert len(path.read_bytes()) > 1.5 * MAX_CONFIG_BYTES
    server = RuntimeServer(path, tmp_path / "server.log", extra_args=["--workers", "2"])
    server.start()
    try:
        all_serving(server, server.log_path)
        config["weights"] = {"v1": 60, "x7": 40}
        write_atomic(path, yaml.safe_dump(config))
        wanted = {"v1": 60, "x7": 40, **{f"x{i}": 0 for i in range(150) if i != 7}}
        deadline = time.monotonic() + 30
        while True:
            seen = []
            for _ in range(6):  # a new connection each: dealt to both workers in turn
                status = httpx.get(server.url + "/v2/models/scorer/status", timeout=10).json()
                seen.append((status["table_digest"], status["weights"] == wanted))
            if all(digest != WORKERS_DIFFER and same for digest, same in seen):
                break
            assert time.monotonic() < deadline, f"{seen}\n{server.log()[-3000:]}"
            time.sleep(0.2)
        assert "is over" not in server.log()
    finally:
        server.stop()
