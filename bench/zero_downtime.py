"""Failed / total requests per event, under continuous traffic through the runtime's Service: a full
rollout, a rollback, a pod roll forced by an image change, scaling up and down (target: zero
failed), and a SIGKILLed runtime pod (failures bounded; reported). See testbed/zero_downtime.py for
the events and how requests are counted. The baseline, in the same run: one round in which the
kubelet stand-in runs no preStop hook (SIGTERM as soon as a pod is deleted, while the Service
still sends it new connections), as the runtime pods had no preStop before.

    .venv/bin/python bench/zero_downtime.py [--rounds 3] [--rate 200] [--connections 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mnn_runtime.examples import build_examples  # noqa: E402
from testbed.chaos import write_peering  # noqa: E402
from testbed.cluster import CRD, PEERING_CRD, Cluster  # noqa: E402
from testbed.k8s.harness import EmulatorProcess  # noqa: E402
from testbed.k8s.kubelet import Kubelet  # noqa: E402
from testbed.k8s.kubelet_containers import Timing  # noqa: E402
from testbed.zero_downtime import EVENTS, GRACEFUL, EventResult, Scenario  # noqa: E402


def one_round(work: Path, models: Path, rate: float, connections: int,
              pre_stop: bool = True) -> tuple[list[EventResult], int]:
    with EmulatorProcess(crds=[CRD, PEERING_CRD]) as emu:
        kubelet = Kubelet(emu.url, emu.kubeconfig_path, work / "kubelet", timing=Timing(pre_stop=pre_stop)).start()
        cluster = Cluster(emu, kubelet, models, work)
        write_peering(cluster)
        scenario = Scenario(cluster, rate=rate, connections=connections)
        try:
            scenario.start().run()
        finally:
            scenario.stop()
            cluster.stop()
            kubelet.stop()
        print(scenario.report(), flush=True)
        return scenario.results, scenario.killed_connections


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="fresh clusters, each through every event (default 3)")
    p.add_argument("--rate", type=float, default=200.0, help="requests/s through the Service (default 200)")
    p.add_argument("--connections", type=int, default=16, help="kept-alive connections (default 16)")
    args = p.parse_args()
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    killed = 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mnn-zero-downtime-") as tmp:
        models = Path(tmp) / "models"
        models.mkdir()
        build_examples(models)
        for n in range(args.rounds):
            print(f"--- round {n + 1} of {args.rounds} ({args.rate:.0f} req/s, {args.connections} connections)")
            results, held = one_round(Path(tmp) / f"round-{n}", models, args.rate, args.connections)
            killed += held
            for r in results:
                totals[r.name][0] += r.failed
                totals[r.name][1] += r.total
        print("--- baseline: no preStop hook")
        baseline, _ = one_round(Path(tmp) / "baseline", models, args.rate, args.connections, pre_stop=False)
    base = {r.name: r for r in baseline}
    print(f"\nall {args.rounds} rounds ({time.monotonic() - started:.0f} s), failed / total:")
    print(f"{'event':<11} {'this build':>16}   {'target':<8} {'baseline (no preStop, 1 round)':>30}")
    bad = 0
    for name in EVENTS:
        failed, total = totals[name]
        target = "0" if name in GRACEFUL else "bounded"
        print(f"{name:<11} {failed:>6} / {total:<7}   {target:<8} {base[name].failed:>20} / {base[name].total}")
        bad += name in GRACEFUL and failed > 0
    print(f"(the SIGKILLed pods held {killed} of the {args.rounds * args.connections} connections in all)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
