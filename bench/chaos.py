"""The chaos soak (``make chaos``): ten minutes of faults against rollouts under traffic, with
invariants checked all along (see ``testbed/chaos.py`` for the faults and the invariants). Prints
the faults injected, the checks made and any violation; exits 1 on a violation.

    .venv/bin/python bench/chaos.py [--minutes 10] [--seed 1] [--period 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mnn_runtime.examples import build_examples  # noqa: E402
from testbed import chaos  # noqa: E402
from testbed.cluster import CRD, PEERING_CRD  # noqa: E402
from testbed.k8s.harness import EmulatorProcess  # noqa: E402
from testbed.k8s.kubelet import Kubelet  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected (default 10)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--period", type=float, default=3.0, help="mean seconds between faults (default 3)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mnn-chaos-") as tmp:
        work = Path(tmp)
        models = work / "models"
        models.mkdir()
        build_examples(models)
        started = time.monotonic()
        with EmulatorProcess(crds=[CRD, PEERING_CRD]) as emu:
            kubelet = Kubelet(emu.url, emu.kubeconfig_path, work / "kubelet").start()
            cluster, prom = chaos.build(emu, kubelet, models, work)
            try:
                soak = chaos.Soak(cluster, prom, seconds=args.minutes * 60, seed=args.seed,
                                  period=args.period).run()
            finally:
                cluster.stop()
                prom.stop()
                kubelet.stop()
        print()
        print(soak.report())
        print(f"wall time {time.monotonic() - started:.0f} s (seed {args.seed})")
        return 1 if soak.violations else 0


if __name__ == "__main__":
    sys.exit(main())
