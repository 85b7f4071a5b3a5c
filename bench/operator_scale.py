"""The operator at cluster scale, against the Kubernetes API emulator.

For each N (default 100, 300, 1000) a fresh emulator and a real ``mnn-rollout operator`` process:

1. N idle ModelDeployments (no pods: ``runtime.replicas: 0``) are created and reconciled once.
2. Idle API traffic: the operator's requests over a quiet window, watches and kopf's peering
   keep-alives aside, per second and per 100 objects (target <= 0.1).
3. Spec-change-to-status latency: ``spec.paused`` toggled on objects one after another; the time
   until ``status.observedGeneration`` shows the change (target p99 <= 2 s at 1,000).
4. 50 rollouts in flight: ModelDeployments whose one "pod" (a Pod object this bench writes, Ready,
   at 127.0.0.1) is a real ``mnn-rollout serve`` process with v1 and v2 under traffic, analysed
   every 2 s; the lateness of each analysis after its due time, from the operator's
   ``mnn_rollout_analysis_lateness_seconds`` (target p99 <= 1 s), and the spec-change latency again.
5. The operator's RSS and CPU, and the emulator's CPU: when the emulator's CPU is near one core, the
   figures measure the emulator, and the bench says so.

The emulator is the test bed's (``tests/k8s/emulator.py``); it runs as its own process, started
with ``python -m testbed.k8s.emulator``: nothing of the tests is imported here.

    .venv/bin/python bench/operator_scale.py [--sizes 100 300 1000] [--in-flight 50]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "common"), str(ROOT / "runtime"), str(ROOT / "operator")]

from mnn_rollout.local.net import free_port, wait_for  # noqa: E402
from mnn_rollout.local.process import LocalRuntime, cpu_seconds  # noqa: E402
from mnn_rollout.local.traffic import Traffic  # noqa: E402
from mnn_runtime.examples import build_examples  # noqa: E402
from rollout_operator.children import OWNER_LABEL  # noqa: E402

MD_PATH = "/apis/mnnrollout.io/v1alpha1/namespaces/default/modeldeployments"
PODS_PATH = "/api/v1/namespaces/default/pods"
OPERATOR_AGENTS = ("mnn-rollout-operator", "kopf")


class Api:
    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self, method: str, path: str, body: Any = None,
                 content_type: str = "application/json") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=30) as rsp:
                return rsp.status, json.loads(rsp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")


def rss_mb(pid: int) -> float:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def start_emulator(workdir: Path) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "testbed.k8s.emulator", "--host", "127.0.0.1", "--port", "0",
           "--crd", str(ROOT / "crds" / "modeldeployment.yaml"), "--crd", str(ROOT / "testbed" / "k8s" / "peering-crd.yaml")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=(workdir / "emulator.log").open("w"), text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        raise RuntimeError(f"the emulator did not start: {(workdir / 'emulator.log').read_text()[-2000:]}")
    return proc, line.split(None, 1)[1].strip()


def start_operator(workdir: Path, url: str, qps: float, burst: int) -> tuple[subprocess.Popen[bytes], int]:
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "e",
        "clusters": [{"name": "e", "cluster": {"server": url}}], "users": [{"name": "e", "user": {"token": "t"}}],
        "contexts": [{"name": "e", "context": {"cluster": "e", "user": "e", "namespace": "default"}}]}))
    port = free_port()
    env = dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "mnn_rollout.cli", "operator", "--namespace", "default",
                             "--standalone", "--metrics-host", "127.0.0.1", "--metrics-port", str(port),
                             "--webhook-port", "0", "--resync-seconds", "2", "--kube-qps", str(qps),
                             "--kube-burst", str(burst)],
                            env=env, stdout=(workdir / "operator.log").open("wb"), stderr=subprocess.STDOUT)
    return proc, port


def idle_md(i: int, models: Path) -> dict[str, Any]:
    return {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": f"idle-{i:04d}", "namespace": "default"},
            "spec": {"model": f"idle-{i:04d}", "versions": [{"name": "v1", "uri": str(models / "v1.mnn")}],
                     "runtime": {"replicas": 0}}}


def rollout_md(i: int, models: Path, port: int) -> dict[str, Any]:
    return {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment",
            "metadata": {"name": f"canary-{i:03d}", "namespace": "default"},
            "spec": {"model": "scorer", "stable": "v1", "canary": "v2",
                     "versions": [{"name": "v1", "uri": str(models / "v1.mnn")},
                                  {"name": "v2", "uri": str(models / "v2.mnn")}],
                     "strategy": {"steps": [{"weight": 10, "pause": "1h"}],
                                  "analysis": {"interval": "2s", "minRequests": 1, "failureLimit": 1000,
                                               "metrics": [{"name": "error-rate", "max": 0.5}]}},
                     "progressDeadlineSeconds": 7200, "runtime": {"replicas": 1, "port": port}}}


def pod_for(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-runtime-0", "namespace": "default",
                         "labels": {OWNER_LABEL: name, "app.kubernetes.io/component": "runtime"}},
            "spec": {"containers": [{"name": "runtime", "image": "bench"}]}}


def generation_seen(api: Api, name: str) -> tuple[int, int]:
    status, body = api("GET", f"{MD_PATH}/{name}")
    if status != 200:
        return 0, 0
    return int(body["metadata"].get("generation") or 0), int((body.get("status") or {}).get("observedGeneration") or 0)


def spec_change_latencies(api: Api, names: list[str], count: int, timeout: float = 30.0) -> list[float]:
    out = []
    for name in random.Random(7).sample(names, min(count, len(names))):
        _, body = api("GET", f"{MD_PATH}/{name}")
        paused = not (body.get("spec") or {}).get("paused", False)
        started = time.monotonic()
        status, patched = api("PATCH", f"{MD_PATH}/{name}", {"spec": {"paused": paused}},
                              content_type="application/merge-patch+json")
        assert status == 200, patched
        generation = int(patched["metadata"]["generation"])
        wait_for(lambda: generation_seen(api, name)[1] >= generation, timeout, f"{name} reconciled",  # noqa: B023
                 interval=0.02)
        out.append(time.monotonic() - started)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def histogram_p99(metrics: str, name: str) -> tuple[float, int]:
    """p99 upper bound and count of a Prometheus histogram in the text format."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return float("nan"), 0
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= 0.99 * total), int(total)


def reconciles(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mnn_rollout_reconciles_total{"))


def operator_calls(api: Api) -> list[dict[str, Any]]:
    _, requests = api("GET", "/_emulator/requests")
    return [r for r in requests if r.get("userAgent", "").startswith(OPERATOR_AGENTS)
            and str((r.get("query") or {}).get("watch", "")).lower() not in ("1", "true")
            and "kopfpeerings" not in r.get("path", "")]


def run(n: int, in_flight: int, idle_window: float, models: Path, workdir: Path, qps: float) -> dict[str, Any]:
    emulator, url = start_emulator(workdir)
    api = Api(url)
    api("POST", "/apis/kopf.dev/v1/namespaces/default/kopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": "mnn-rollout"}})
    operator, metrics_port = start_operator(workdir, url, qps, int(qps * 1.5))
    runtime: LocalRuntime | None = None
    traffic: Traffic | None = None
    result: dict[str, Any] = {"n": n}
    try:
        wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).status == 200,
                 60, "operator up", retry_on=(OSError,))
        names = [f"idle-{i:04d}" for i in range(n)]
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            assert all(s == 201 for s, _ in pool.map(lambda i: api("POST", MD_PATH, idle_md(i, models)), range(n)))
        wait_for(lambda: all(generation_seen(api, name)[1] >= 1 for name in names[-20:]) and
                 sum(1 for name in names if generation_seen(api, name)[1] >= 1) == n,
                 max(120.0, n * 0.6), f"{n} reconciled", interval=2.0)
        result["create_s"] = time.monotonic() - started
        result["emulator_create_cpu"] = cpu_seconds(emulator.pid) / result["create_s"]
        seen: list[float] = []

        def quiet() -> bool:  # the creation burst is over: no reconcile for 3 s
            seen.append(reconciles(metrics_port))
            return len(seen) > 6 and seen[-7] == seen[-1]

        wait_for(quiet, 300, "the operator quiet after creating", interval=0.5)
        result["settle_s"] = time.monotonic() - started - result["create_s"]
        api("DELETE", "/_emulator/requests")
        cpu0, emu0, t0 = cpu_seconds(operator.pid), cpu_seconds(emulator.pid), time.monotonic()
        time.sleep(idle_window)
        calls = operator_calls(api)
        span = time.monotonic() - t0
        result.update(idle_rps=len(calls) / span, idle_rps_per_100=len(calls) / span / (n / 100),
                      idle_cpu=(cpu_seconds(operator.pid) - cpu0) / span,
                      emulator_idle_cpu=(cpu_seconds(emulator.pid) - emu0) / span, rss_mb=rss_mb(operator.pid))
        lat = spec_change_latencies(api, names, 50)
        result.update(change_p50=pct(lat, 50), change_p99=pct(lat, 99))
        if in_flight:
            config = workdir / "runtime.yaml"
            config.write_text(yaml.safe_dump({"model": "scorer", "versions": [
                {"name": "v1", "uri": str(models / "v1.mnn")}, {"name": "v2", "uri": str(models / "v2.mnn")}],
                "weights": {"v1": 50, "v2": 50}}))
            runtime = LocalRuntime(config, workdir / "runtime.log")
            runtime.start()
            traffic = Traffic(runtime.url, "scorer", users=500, rate=100, connections=2, max_seconds=600).start()
            rollouts = [f"canary-{i:03d}" for i in range(in_flight)]
            for i, name in enumerate(rollouts):
                assert api("POST", MD_PATH, rollout_md(i, models, runtime.port))[0] == 201
                status, pod = api("POST", PODS_PATH, pod_for(name))
                assert status == 201, pod
                pod["status"] = {"phase": "Running", "podIP": "127.0.0.1",
                                 "conditions": [{"type": "Ready", "status": "True"}]}
                assert api("PUT", f"{PODS_PATH}/{pod['metadata']['name']}/status", pod)[0] == 200
            wait_for(lambda: all((api("GET", f"{MD_PATH}/{r}")[1].get("status") or {}).get("canaryWeight") == 10
                                 for r in rollouts), 180, "every canary at step 1", interval=1.0)
            cpu0, emu0, t0 = cpu_seconds(operator.pid), cpu_seconds(emulator.pid), time.monotonic()
            before = histogram_p99(urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode(),
                                   "mnn_rollout_analysis_lateness_seconds")[1]
            lat = spec_change_latencies(api, names, 30)
            time.sleep(max(0.0, 30 - (time.monotonic() - t0)))
            text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read().decode()
            p99, count = histogram_p99(text, "mnn_rollout_analysis_lateness_seconds")
            result["lateness_buckets"] = [line.split("{", 1)[1] for line in text.splitlines()
                                          if line.startswith("mnn_rollout_analysis_lateness_seconds_bucket")]
            span = time.monotonic() - t0
            result.update(lateness_p99=p99, analyses=count - before, busy_change_p50=pct(lat, 50),
                          busy_change_p99=pct(lat, 99), busy_cpu=(cpu_seconds(operator.pid) - cpu0) / span,
                          emulator_busy_cpu=(cpu_seconds(emulator.pid) - emu0) / span,
                          busy_rss_mb=rss_mb(operator.pid))
    finally:
        if traffic is not None:
            traffic.stop()
        if runtime is not None:
            runtime.stop()
        stopping = time.monotonic()
        operator.terminate()
        try:
            operator.wait(timeout=60)
        except subprocess.TimeoutExpired:
            operator.kill()
            operator.wait()
        result["stop_s"] = time.monotonic() - stopping  # SIGTERM to exit (60: killed)
        emulator.terminate()
        emulator.wait(timeout=30)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--in-flight", type=int, default=50)
    ap.add_argument("--idle-window", type=float, default=20.0)
    ap.add_argument("--kube-qps", type=float, default=100.0,
                    help="the operator's --kube-qps for the run (creating 1,000 objects at the default 20 takes minutes)")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="operator-scale-") as tmp:
        models = Path(tmp) / "models"
        build_examples(models)
        for n in args.sizes:
            workdir = Path(tmp) / f"n{n}"
            workdir.mkdir()
            rows.append(run(n, args.in_flight, args.idle_window, models, workdir, args.kube_qps))
            print(json.dumps(rows[-1]), flush=True)
    print(f"\nkube-qps {args.kube_qps:g}; idle window {args.idle_window:g} s; {args.in_flight} rollouts in flight, "
          "analysed every 2 s")
    print(f"{'N':>5} {'create+settle s':>15} {'idle req/s/100':>15} {'change p50/p99 s':>17} {'busy p50/p99 s':>15} "
          f"{'lateness p99 s':>15} {'RSS MB':>7} {'CPU idle/busy':>14} {'emulator CPU idle/busy':>23}")
    for r in rows:
        print(f"{r['n']:>5} {r['create_s']:>7.1f}+{r['settle_s']:<7.1f} {r['idle_rps_per_100']:>15.3f} "
              f"{r['change_p50']:>8.2f}/{r['change_p99']:<8.2f} {r.get('busy_change_p50', float('nan')):>7.2f}/"
              f"{r.get('busy_change_p99', float('nan')):<7.2f} {r.get('lateness_p99', float('nan')):>15.2f} "
              f"{r.get('busy_rss_mb', r['rss_mb']):>7.0f} {r['idle_cpu']:>6.2f}/{r.get('busy_cpu', float('nan')):<7.2f} "
              f"{r['emulator_idle_cpu']:>11.2f}/{r.get('emulator_busy_cpu', float('nan')):<11.2f}")
        for key in ("emulator_idle_cpu", "emulator_busy_cpu"):
            if r.get(key, 0) > 0.85:
                print(f"  N={r['n']}: the emulator used {r[key]:.2f} of a core ({key}): these figures measure the "
                      "emulator as much as the operator")
    print("targets: idle <= 0.1 req/s per 100 objects; change p99 <= 2 s at 1,000; lateness p99 <= 1 s")


if __name__ == "__main__":
    main()
