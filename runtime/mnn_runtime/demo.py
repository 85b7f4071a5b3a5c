"""``mnn-rollout demo``: build the examples, serve v1:90 / v2:10, play many users, show the split."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np

from .examples import FEATURES, build_examples


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def start_server(config: Path, host: str, port: int, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``mnn-rollout serve`` in a child process and wait until it reports ready."""
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mnn_runtime.cli", "serve", "--config", str(config), "--host", host,
         "--port", str(port), "--log-level", "warning"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://{host}:{port}/v2/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server not ready within 60 s; see {log_path}")


def stop_server(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


async def play_users(url: str, requests: int, users: int, concurrency: int = 8) -> list[tuple[str, str, float]]:
    """Send ``requests`` requests spread over ``users`` ids; returns (user, version, seconds)."""
    rng = np.random.default_rng(7)
    features = rng.random((users, FEATURES), dtype=np.float32)
    results: list[tuple[str, str, float]] = []
    queue = iter(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        for i in queue:
            user = i % users
            body = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES],
                                "data": features[user].tolist()}]}
            started = time.perf_counter()
            resp = await client.post(url, json=body, headers={"X-User-Id": f"user-{user}"})
            elapsed = time.perf_counter() - started
            version = resp.json().get("model_version", f"error {resp.status_code}")
            results.append((f"user-{user}", version, elapsed))

    async with httpx.AsyncClient(timeout=30) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return results


def summarise(results: list[tuple[str, str, float]]) -> str:
    by_version: dict[str, list[float]] = defaultdict(list)
    users_by_version: dict[str, set[str]] = defaultdict(set)
    for user, version, seconds in results:
        by_version[version].append(seconds)
        users_by_version[version].add(user)
    lines = [f"{'version':<10} {'requests':>9} {'share':>7} {'users':>6} {'p50 ms':>8} {'p99 ms':>8}"]
    for version in sorted(by_version):
        times = np.array(by_version[version]) * 1000
        lines.append(
            f"{version:<10} {len(times):>9} {len(times) / len(results):>7.1%} {len(users_by_version[version]):>6} "
            f"{np.percentile(times, 50):>8.2f} {np.percentile(times, 99):>8.2f}"
        )
    return "\n".join(lines)


def run_demo(requests: int = 3000, users: int = 1000, workdir: str | None = None) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(workdir or tmp)
        print(f"building example models in {root} ...", flush=True)
        build_examples(root)
        port = free_port()
        proc = start_server(root / "runtime.yaml", "127.0.0.1", port, root / "server.log")
        print(f"serving v1:90 / v2:10 on http://127.0.0.1:{port}; sending {requests} requests "
              f"from {users} users ...", flush=True)
        try:
            url = f"http://127.0.0.1:{port}/v2/models/scorer/infer"
            results = asyncio.run(play_users(url, requests, users))
        finally:
            code = stop_server(proc)
        print(summarise(results))
        sticky = _sticky(results)
        print(f"every user was served by one version only: {sticky}")
        print(f"server stopped (exit {code})")
        errors = [r for r in results if r[1].startswith("error")]
        return 0 if sticky and not errors and code == 0 else 1


def _sticky(results: list[tuple[str, str, float]]) -> bool:
    seen: dict[str, str] = {}
    for user, version, _ in results:
        if seen.setdefault(user, version) != version:
            return False
    return True


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_demo())
