"""Seconds from a canary's first failing request to every pod routing 100% to stable.

Runs the real operator against the Kubernetes API emulator with real runtime pods (the kubelet
stand-in), a failing canary (v2-breaking: every v1-shaped request it gets fails), and steady
traffic. Each run: `retry` puts the canary back on its first step; the clock starts at the first
failed response and stops when every pod's /status reports stable at 100%. Two paths:

- direct: the operator's own analysis, direct provider, interval 1 s, failureLimit 1;
- alertmanager: real Prometheus (1 s scrapes) and Alertmanager firing a rule to the operator's
  webhook, the operator's analysis effectively off (interval 1 h).

    .venv/bin/python bench/rollback_latency.py [--runs 5] [--paths direct,alertmanager]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mnn_rollout.local.traffic import Traffic  # noqa: E402
from mnn_runtime.examples import build_examples  # noqa: E402
from testbed.k8s.harness import EmulatorProcess  # noqa: E402
from testbed.k8s.kubelet import Kubelet  # noqa: E402
from testbed.cluster import CRD, PEERING_CRD, Cluster, wait_for  # noqa: E402

FLAGGER_INTERVAL, FLAGGER_THRESHOLD = 60.0, 1
TARGET_P95 = 5.0


def all_pods_stable(cluster: Cluster) -> bool:
    for pod in cluster.pods():
        weights = httpx.get(f"http://{pod.ip}:{pod.port}/v2/models/scorer/status", timeout=2).json()["weights"]
        if weights.get("v1") != 100:
            return False
    return True


def spec(cluster: Cluster, path: str) -> dict[str, Any]:
    obj = cluster.manifest("scorer-breaking.yaml")
    obj["spec"]["versions"][1]["uri"] = f"file://{cluster.models}/v2-breaking.mnn"
    interval = "1s" if path == "direct" else "1h"
    obj["spec"]["strategy"] = {"steps": [{"weight": 20, "pause": "1h"}],
                               "analysis": {"interval": interval, "minRequests": 3, "failureLimit": 1,
                                            "metrics": [{"name": "error-rate", "max": 0.05}]}}
    obj["spec"]["progressDeadlineSeconds"] = 7200  # longer than the 1 h interval of the alertmanager path
    obj["spec"]["weights"] = None  # kubectl apply: drop the static split for the canary
    return obj


def one_run(cluster: Cluster, traffic: Traffic, path: str, first: bool) -> float:
    """Seconds from the first failed answer after the canary starts to every pod at stable 100%."""
    armed = time.monotonic()
    if first:
        cluster.apply(spec(cluster, path))
    else:
        cluster.emu.kubectl("annotate", "md", "scorer", "--overwrite", f"mnnrollout.io/action=retry:{time.time()}")
    onset = wait_for(lambda: traffic.first_failure(armed), 60, "first failed request", interval=0.01)
    wait_for(lambda: cluster.status().get("phase") == "RolledBack" and all_pods_stable(cluster), 60,
             "every pod at stable 100%", interval=0.02)
    return time.monotonic() - onset.done


def run_path(path: str, runs: int, models: Path, workdir: Path) -> list[float]:
    emu = EmulatorProcess(crds=[CRD, PEERING_CRD]).start()
    kubelet = Kubelet(emu.url, emu.kubeconfig_path, workdir / f"kubelet-{path}").start()
    cluster = Cluster(emu, kubelet, models, workdir)
    stack: list[Any] = []
    try:
        emu.kubectl("apply", "--validate=false", "-f", "-",
                    input="apiVersion: kopf.dev/v1\nkind: KopfPeering\nmetadata: {name: mnn-rollout, namespace: default}\n")
        op = cluster.start_operator()
        # v2-breaking listed (loaded, weight 0) from the start: the pods, and so Prometheus's
        # targets, stay the same through every run.
        first = cluster.manifest("scorer.yaml")
        first["spec"]["versions"] = [{"name": "v1", "uri": f"file://{models}/v1.mnn"},
                                     {"name": "v2-breaking", "uri": f"file://{models}/v2-breaking.mnn"}]
        first["spec"]["weights"] = {"v1": 100, "v2-breaking": 0}
        cluster.apply(first)
        cluster.wait_ready()
        wait_for(lambda: cluster.status().get("phase") == "Ready", 60, "Ready")
        if path == "alertmanager":
            stack = start_alerting(cluster, op, workdir)
        # steady traffic spread over the pods, as a Service would: ~200 requests/s, one at a time
        traffic = Traffic(cluster.pods, users=1000, rate=200, connections=1, max_seconds=1800, timeout=5).start()
        stack.append(traffic)
        times = []
        for i in range(runs):
            if path == "alertmanager" and i:
                wait_for(lambda: not firing(stack[1]), 120, "alert resolved", interval=0.5)
            if not traffic.running:
                raise RuntimeError(f"the traffic stopped: {traffic.error!r}")
            times.append(one_run(cluster, traffic, path, first=i == 0))
            print(f"  {path} run {i + 1}: {times[-1]:.2f} s", flush=True)
        return times
    finally:
        for proc in stack:
            proc.stop()
        cluster.stop()
        kubelet.stop()
        emu.stop()


def start_alerting(cluster: Cluster, op: Any, workdir: Path) -> list[Any]:
    from testbed.promstack import Alertmanager, Prometheus

    rules = workdir / "rules.yaml"
    rules.write_text(
        "groups:\n- name: canary\n  rules:\n  - alert: CanaryErrors\n"
        "    expr: sum by (model, version) (rate(mnn_inference_requests_total{outcome!=\"success\"}[5s])) > 0\n"
        "    for: 0s\n")
    am = Alertmanager(workdir, webhook_url=f"http://127.0.0.1:{op.webhook_port}/alerts",
                      bearer_token=cluster.token)
    am.start()
    targets = [f"{p.ip}:{p.port}" for p in cluster.pods()]
    prom = Prometheus(workdir, scrape_targets=targets, rule_files=[rules], alertmanager_url=am.url)
    prom.start()
    prom.wait_for_up(60)
    return [prom, am]


def firing(am: Any) -> bool:
    alerts = httpx.get(f"{am.url}/api/v2/alerts", timeout=5).json()
    return any(a.get("status", {}).get("state") == "active" for a in alerts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--paths", default="direct,alertmanager")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root / "models")
        results = {path: run_path(path, args.runs, root / "models", root) for path in args.paths.split(",")}
    flagger = FLAGGER_INTERVAL * FLAGGER_THRESHOLD
    print(f"\n{'path':<14} {'runs':>4} {'p50 s':>7} {'p95 s':>7} {'max s':>7} {'target p95':>11} "
          f"{'Flagger default s':>18} {'Flagger / ours (p50)':>21}")
    for path, times in results.items():
        arr = np.array(times)
        p50, p95 = float(np.percentile(arr, 50)), float(np.percentile(arr, 95))
        verdict = "ok" if p95 <= TARGET_P95 else "MISSED"
        print(f"{path:<14} {len(arr):>4} {p50:>7.2f} {p95:>7.2f} {arr.max():>7.2f} {f'<= {TARGET_P95:g} {verdict}':>11} "
              f"{flagger:>18.0f} {flagger / p50:>20.0f}x")
    print(f"\nFlagger's default: analysis interval {FLAGGER_INTERVAL:.0f} s x threshold {FLAGGER_THRESHOLD} "
          "(its documented example rolls back ~10 min after failures start).")


if __name__ == "__main__":
    main()
