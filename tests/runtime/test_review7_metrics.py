"""The pod's metrics across a worker's or a whole server's death (seventh review)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mnn_rollout.local.net import wait_for
from mnn_runtime.workers_metrics import PREFIX
from tests.runtime.test_workers import all_serving, children, two_workers
from tests.runtime_server import RuntimeServer

pytestmark = pytest.mark.timeout(120)

# A supervisor stand-in (this process) with two children: a "worker" that burns 0.6 s of CPU and
# exits, left unreaped (a zombie) until told, and one that reads the pod's counter as a worker
# answering /metrics does (ProcessTreeCollector, multi: its parent and the parent's children):
# while the burner runs, once it is a zombie, and once it is reaped. Prints the three and its CPU.
TREE = """
import json, os, sys, time
from mnn_rollout.local.process import stat_fields
from mnn_runtime.metrics import ProcessTreeCollector

burner = os.fork()
if burner == 0:
    began = time.process_time()
    while time.process_time() - began < 0.6:
        pass
    os._exit(0)
reap_r, reap_w = os.pipe()
reader = os.fork()
if reader == 0:
    collector = ProcessTreeCollector("scorer", multi=True)

    def cpu():
        return next(f for f in collector.collect() if f.name == "mnn_runtime_cpu_seconds").samples[0].value

    def burned():
        fields = stat_fields(burner)
        return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    until = time.monotonic() + 60
    while burned()[1] < 0.3 and burned()[0] != "Z" and time.monotonic() < until:
        time.sleep(0.01)
    running = cpu()
    while burned()[0] != "Z" and time.monotonic() < until:
        time.sleep(0.01)
    zombie, used = cpu(), burned()[1]
    os.write(reap_w, b"r")
    while os.path.exists(f"/proc/{burner}") and time.monotonic() < until:
        time.sleep(0.01)
    print(json.dumps({"running": running, "zombie": zombie, "reaped": cpu(), "burner": used}), flush=True)
    os._exit(0)
os.read(reap_r, 1)
os.waitpid(burner, 0)
os.waitpid(reader, 0)
"""


def test_the_cpu_counter_keeps_a_dead_workers_seconds_until_it_is_reaped() -> None:
    """A worker that had exited but was not reaped yet (a zombie: no memory map) was left out of
    ``mnn_runtime_cpu_seconds_total`` altogether (its memory was read first, and failed), then came
    back in the supervisor's cutime once reaped: the counter went back for that while, a reset and
    a spike to ``rate()``. Repro: 0.46 s while the burner ran, 0.16 s once it was a zombie, 0.75 s
    reaped. Now the zombie's own CPU is counted: the counter never goes back."""
    out = subprocess.run([sys.executable, "-c", TREE], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    assert seen["burner"] >= 0.5, seen
    assert seen["running"] >= 0.3, seen  # the burner's seconds, while it runs
    assert seen["running"] <= seen["zombie"] <= seen["reaped"], seen


def test_a_killed_pods_metrics_directory_is_removed_by_the_next_server_and_a_live_ones_kept(
        model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve --workers`` keeps its metric files in a directory under TMPDIR, removed when it
    exits; killed (SIGKILL, an OOM kill) it left it behind, and in a pod /tmp is an emptyDir that
    outlives the container: a container restarted again and again gathered one directory of ~1 MB
    files per worker each time. Repro: after a kill and a restart, two directories, the dead one's
    files intact. Now the next server removes those whose processes are all gone, and no other."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    config = model_dir / "runtime.yaml"
    with two_workers(config, tmp_path / "live.log"):  # a live neighbour's directory: kept
        live = set(tmp.glob(PREFIX + "*"))
        assert len(live) == 1, live
        killed = RuntimeServer(config, log_path=tmp_path / "killed.log", extra_args=["--workers", "2"])
        killed.start()
        assert killed.proc is not None
        all_serving(killed, tmp_path / "killed.log")
        dead = set(tmp.glob(PREFIX + "*")) - live
        assert len(dead) == 1, dead
        workers = children(killed.proc.pid)
        os.kill(killed.proc.pid, signal.SIGKILL)
        killed.proc.wait(10)
        wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in workers), 30, "its workers gone")
        assert all(d.exists() for d in dead), "left behind by the kill"
        with two_workers(config, tmp_path / "next.log"):
            now = set(tmp.glob(PREFIX + "*"))
            assert not dead & now, f"the killed server's directory is still there: {now}"
            assert live <= now and len(now - live) == 1, now
        killed.stop()
