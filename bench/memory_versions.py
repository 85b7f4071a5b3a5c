"""Many versions in bounded memory: 1, 4, 8 and 16 versions of the ~52 MB example in one runtime
(`serve --workers 2`), all resident against idle ones unloaded (`server.idle_unload_seconds`).
Two versions serve (weights 90/10), the others sit at weight 0. Prints the pod's PSS (supervisor
and workers summed, shared weights counted once) both ways, the load time of an unloaded version
when a request asks for it, and the latency of that first request against a request to a
resident version measured in the same run. Target: with 16 versions of which 2 serve, at least
60% less memory than all resident.

    .venv/bin/python bench/memory_versions.py [--counts 1,4,8,16] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mnn_rollout.local.net import wait_for  # noqa: E402
from mnn_rollout.local.process import LocalRuntime  # noqa: E402
from mnn_runtime.examples import LARGE, build_example  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
IDLE = 1.0


def metric(url: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


def states(url: str) -> dict[str, str]:
    versions = httpx.get(url + "/v2/models/scorer/status", timeout=10).json()["versions"]
    return {name: v["state"] for name, v in versions.items()}


def config(model: Path, n: int, idle: bool) -> dict[str, object]:
    names = [f"v{i}" for i in range(n)]
    weights = {name: 0 for name in names}
    weights["v0"] = 90 if n > 1 else 100
    if n > 1:
        weights["v1"] = 10
    return {"model": "scorer", "stable": "v0", "weights": weights,
            "versions": [{"name": name, "uri": str(model)} for name in names],
            **({"server": {"idle_unload_seconds": IDLE}} if idle else {})}


def pinned(client: httpx.Client, version: str) -> float:
    started = time.perf_counter()
    r = client.post(f"/v2/models/scorer/versions/{version}/infer", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return time.perf_counter() - started


def run(work: Path, model: Path, n: int, idle: bool, workers: int) -> dict[str, float]:
    path = work / f"runtime-{n}-{'idle' if idle else 'resident'}.yaml"
    path.write_text(yaml.safe_dump(config(model, n, idle)))
    server = LocalRuntime(path, work / f"{path.stem}.log", extra_args=["--workers", str(workers)], stop_timeout=30)
    server.start(timeout=300)
    try:
        url = server.url
        out: dict[str, float] = {}
        if idle and n > 2:
            wait_for(lambda: sum(s == "offloaded" for s in states(url).values()) == n - 2, 60, "idle versions unloaded")
        time.sleep(1.5)  # settle (freed pages, a scrape after the last change)
        out["pss"] = metric(url, "mnn_runtime_memory_pss_bytes", model="scorer")
        if idle and n > 2:
            with httpx.Client(base_url=url) as client:  # one kept-alive connection for both
                resident = [pinned(client, "v1") for _ in range(20)]  # a loaded version: the baseline
                out["resident_ms"] = statistics.median(resident) * 1000
                out["first_ms"] = pinned(client, f"v{n - 1}") * 1000  # loads it again
            out["load_s"] = metric(url, "mnn_version_load_duration_seconds", model="scorer", version=f"v{n - 1}")
        return out
    finally:
        server.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="1,4,8,16")
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    with tempfile.TemporaryDirectory(prefix="mnn-memory-versions-") as tmp:
        work = Path(tmp)
        model = build_example(LARGE, work)
        size = model.stat().st_size
        print(f"model {model.name}: {size / 1e6:.1f} MB; --workers {args.workers}; idle unload after {IDLE:g} s")
        print(f"{'versions':>8} {'all resident':>14} {'idle unloaded':>14} {'less':>6} "
              f"{'load again':>11} {'1st request':>12} {'resident req':>13}")
        result = 0
        for n in counts:
            resident = run(work, model, n, False, args.workers)
            idle = run(work, model, n, True, args.workers)
            less = 1 - idle["pss"] / resident["pss"]
            extra = (f"{idle['load_s'] * 1000:>9.0f} ms {idle['first_ms']:>9.0f} ms {idle['resident_ms']:>10.1f} ms"
                     if "first_ms" in idle else f"{'-':>11} {'-':>12} {'-':>13}")
            print(f"{n:>8} {resident['pss'] / 1e6:>11.0f} MB {idle['pss'] / 1e6:>11.0f} MB {less:>6.0%} {extra}",
                  flush=True)
            if n == 16 and less < 0.60:
                result = 1
        print("target: 16 versions, 2 serving: >= 60% less than all resident")
        return result


if __name__ == "__main__":
    sys.exit(main())
