"""The pod's CPU counter across a worker's death (seventh review)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
