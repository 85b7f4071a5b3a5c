"""Steady user traffic against the runtime pods, like a Service spreading requests (bounded)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}


class Traffic:
    """``threads`` closed loops, each at most ``rate`` requests/s, for at most ``limit`` seconds."""

    def __init__(self, pods: Callable[[], list[Any]], users: int = 500, threads: int = 2, rate: float = 60,
                 limit: float = 180) -> None:
        self.pods = pods
        self.users = users
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        self.rate = rate
        self.limit = limit
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.by_version: Counter[tuple[str, int]] = Counter()  # (version, status) -> count
        self.log: list[tuple[float, str, int]] = []  # (time, version, status)

    def _run(self, index: int) -> None:
        deadline = time.monotonic() + self.limit
        i = index
        with httpx.Client(timeout=10) as client:
            while not self.stop_event.is_set() and time.monotonic() < deadline:
                pods = self.pods()
                if not pods:
                    time.sleep(0.1)
                    continue
                pod = pods[i % len(pods)]
                started = time.monotonic()
                try:
                    r = client.post(f"http://{pod.ip}:{pod.port}/v2/models/scorer/infer", json=BODY,
                                    headers={"X-User-Id": f"user-{i % self.users}"})
                    version, code = r.headers.get("x-model-version", "?"), r.status_code
                except httpx.HTTPError:
                    version, code = "?", 0
                with self.lock:
                    self.by_version[(version, code)] += 1
                    self.log.append((time.monotonic(), version, code))
                i += len(self.threads)
                time.sleep(max(0.0, 1 / self.rate - (time.monotonic() - started)))

    def since(self, t: float) -> Counter[tuple[str, int]]:
        with self.lock:
            return Counter((v, c) for ts, v, c in self.log if ts >= t)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(timeout=15)
