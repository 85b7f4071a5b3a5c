"""A config file edited in place (seventh review)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml

from mnn_rollout.local.net import wait_for
from tests.runtime.test_reload import expected, routes
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)


def test_a_config_file_read_while_it_is_rewritten_in_place_is_not_refused(  # type: ignore[no-untyped-def]
        model_dir: Path, start_server) -> None:
    """An editor or a script rewriting the config file in place truncates it, then writes it: the
    server's poll could read it empty in between and refuse that (an error in the log, a rejection
    in ``mnn_config_reloads_total``) before applying the new text. Repro (held empty 0.5 s): rejected
    1.0. Now an empty file is waited out: the current config stays, a warning says why, nothing is
    counted rejected, and the written config is applied."""
    path = model_dir / "runtime.yaml"
    config = yaml.safe_load(path.read_text())
    server: RuntimeServer = start_server(path)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        before = routes(client)
        with path.open("w") as fh:  # truncated now, written 0.5 s later: more than one poll (0.2 s) between
            fh.flush()
            log = wait_for(lambda: ("is empty" in (text := server.log()) or "refused new config" in text) and text,
                           10, "the empty file seen")
            assert "refused new config" not in log, log
            assert routes(client) == before
            time.sleep(0.5)
            fh.write(yaml.safe_dump({**config, "weights": {"v1": 30, "v2": 70}}))
        wait_for(lambda: routes(client) == expected({"v1": 30, "v2": 70}), 10, "the new weights applied")
        metrics = client.get("/metrics").text
    assert 'mnn_config_reloads_total{model="scorer",result="rejected"} 0.0' in metrics, metrics
    assert 'mnn_config_reloads_total{model="scorer",result="applied"} 1.0' in metrics, metrics
    assert "refused new config" not in server.log(), server.log()
