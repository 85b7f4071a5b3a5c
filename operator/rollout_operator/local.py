"""A rollout with no cluster: the operator's state machine drives a local runtime process.

``LocalRollout`` is the reconcile loop of ``reconcile.py`` with the Kubernetes API taken out: it
observes one local "pod" (``GET /v2/models/{m}/status``), runs the analyzer when it is due (the
``direct`` provider scrapes the runtime's /metrics), calls ``decide()`` and writes the runtime
config that the new status describes into the file the runtime follows. There is no other
rollout logic here: every phase change, weight and verdict comes from ``decide()``.

``LocalRuntime`` is one ``mnn-rollout serve`` child process on a loopback port; ``Traffic`` plays
many users against it (closed loop, bounded rate, count and time).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

from mnn_runtime.config import dump_config, parse_config_text

from .analysis import Analysis
from .analyzer import Analyzer
from .children import runtime_config
from .observe import Observation, PodView, scrape
from .providers.factory import ProviderFactory
from .rollout import Event, World, decide, routed_versions
from .spec import parse_spec
from .status import Phase, RolloutStatus

DONE = (Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.FAILED)


def _loopback(host: str) -> str:
    try:
        ok = ipaddress.ip_address(host) in ipaddress.ip_network("127.0.0.0/8")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{host!r}: the local rollout only talks to loopback addresses (127.0.0.0/8)")
    return host


def write_atomic(path: Path, text: str) -> None:
    """Write a file the runtime follows: a temp file beside it, then one rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalRuntime:
    """``mnn-rollout serve --config FILE`` as a child process on a loopback port."""

    def __init__(self, config: Path, log_path: Path, host: str = "127.0.0.1", port: int | None = None,
                 extra_args: list[str] | None = None, ready_path: str = "/v2/health/ready",
                 log_level: str = "warning", stop_timeout: float = 20.0) -> None:
        self.config, self.log_path, self.host = config, log_path, _loopback(host)
        self.port = port or free_port(host)
        self.extra_args = list(extra_args or [])
        if not any(a == "--workers" or a.startswith("--workers=") for a in self.extra_args):
            # one process unless asked: the demo and the tests run several runtimes on one machine
            self.extra_args += ["--workers", "1"]
        self.ready_path, self.log_level, self.stop_timeout = ready_path, log_level, stop_timeout
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60) -> None:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "mnn_runtime.cli", "serve", "--config", str(self.config), "--host",
                 self.host, "--port", str(self.port), "--log-level", self.log_level, *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the runtime exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the runtime was not ready within {timeout:g} s; see {self.log_path}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# -- traffic -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionStats:
    requests: int
    errors: int
    rate: float  # requests/s over the window
    p99: float | None  # seconds, client side, successful and failed requests alike

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


class Traffic:
    """Many users, a few keep-alive connections, closed loop, paced to ``rate`` requests/s in total.

    Bounded in time (``max_seconds``) and count (``max_requests``); loopback targets only. Each
    response is counted under the version its ``X-Model-Version`` header names (``unrouted`` when
    there is none, ``unreachable`` when the connection failed).
    """

    def __init__(self, url: str, model: str, users: int = 2000, rate: float = 300.0, connections: int = 4,
                 max_seconds: float = 180.0, max_requests: int | None = None, header: str = "X-User-Id",
                 features: int = 64, seed: int = 7) -> None:
        u = urlparse(url)
        self.host, self.port = _loopback(u.hostname or ""), int(u.port or 80)
        self.rate, self.connections, self.max_seconds = rate, connections, max_seconds
        self.max_requests = max_requests if max_requests is not None else int(rate * max_seconds) + connections
        rng = np.random.default_rng(seed)
        vectors = rng.random((min(users, 256), features), dtype=np.float32)
        self._requests = []
        for user in range(users):
            body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, features],
                                           "data": [round(float(x), 5) for x in vectors[user % len(vectors)]]}]}
                              ).encode()
            head = (f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{header}: user-{user}\r\n\r\n")
            self._requests.append(head.encode() + body)
        self._order = rng.integers(0, users, size=50_000)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, str, bool, float]] = deque(maxlen=max(1000, int(rate * 20)))
        self._latencies: dict[str, list[float]] = {}
        self.totals: dict[str, list[int]] = {}  # version -> [requests, errors]
        self._user_version: dict[int, tuple[float, str]] = {}  # user -> (sent at, version) of the latest send
        self.moves: Counter[tuple[str, str]] = Counter()  # (from, to) -> users who moved between versions
        self.users = users
        self.sent = 0
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="traffic", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _record(self, user: int, sent_at: float, version: str, ok: bool, seconds: float) -> None:
        with self._lock:
            if version not in ("unreachable", "unrouted"):
                before = self._user_version.get(user)
                if before is None or before[0] < sent_at:  # by send time: responses may overtake
                    self._user_version[user] = (sent_at, version)
                    if before is not None and before[1] != version:
                        self.moves[(before[1], version)] += 1
            self._recent.append((time.monotonic(), version, ok, seconds))
            total = self.totals.setdefault(version, [0, 0])
            total[0] += 1
            total[1] += 0 if ok else 1
            self._latencies.setdefault(version, []).append(seconds)

    async def _main(self) -> None:
        self.started_at = time.monotonic()
        stop_at = self.started_at + self.max_seconds
        pace = {"next": time.monotonic()}

        async def worker() -> None:
            conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
            try:
                while not self._stop.is_set() and time.monotonic() < stop_at and self.sent < self.max_requests:
                    now = time.monotonic()
                    pace["next"] = max(pace["next"], now - 0.5)  # never burst to catch up after a stall
                    due, pace["next"] = pace["next"], pace["next"] + 1.0 / self.rate
                    if due > now:
                        await asyncio.sleep(due - now)
                    user = int(self._order[self.sent % len(self._order)])
                    self.sent += 1
                    started = time.perf_counter()
                    try:
                        if conn is None:
                            conn = await asyncio.wait_for(asyncio.open_connection(self.host, self.port), 5)
                        conn[1].write(self._requests[user])
                        status, version = await asyncio.wait_for(_read_response(conn[0]), 10)
                    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                            ValueError):
                        if conn is not None:
                            conn[1].close()
                        conn = None
                        self._record(user, started, "unreachable", False, time.perf_counter() - started)
                        await asyncio.sleep(0.2)
                        continue
                    self._record(user, started, version or "unrouted", status < 400, time.perf_counter() - started)
            finally:
                if conn is not None:
                    conn[1].close()

        await asyncio.gather(*(worker() for _ in range(self.connections)))

    def window(self, seconds: float = 2.0) -> dict[str, VersionStats]:
        """Per-version stats over the last ``seconds`` (less if traffic started more recently)."""
        now = time.monotonic()
        span = max(1e-3, min(seconds, now - (self.started_at or now)))
        with self._lock:
            recent = [r for r in self._recent if r[0] >= now - span]
        out: dict[str, VersionStats] = {}
        for version in sorted({r[1] for r in recent}):
            mine = [r for r in recent if r[1] == version]
            out[version] = VersionStats(len(mine), sum(1 for r in mine if not r[2]), len(mine) / span,
                                        _p99([r[3] for r in mine]))
        return out

    def summary(self) -> dict[str, VersionStats]:
        """Per-version stats over the whole run."""
        seconds = max(1e-3, time.monotonic() - (self.started_at or time.monotonic()))
        with self._lock:
            return {v: VersionStats(n, e, n / seconds, _p99(self._latencies.get(v, [])))
                    for v, (n, e) in sorted(self.totals.items())}


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, str | None]:
    head = await reader.readuntil(b"\r\n\r\n")
    status, length, version = int(head[9:12]), 0, None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"x-model-version":
            version = value.strip().decode()
    if length:
        await reader.readexactly(length)
    return status, version


# -- the rollout loop --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tick:
    at: float
    status: RolloutStatus
    analysis: Analysis | None
    events: tuple[Event, ...]


class LocalRollout:
    """Drive ``decide()`` against one local runtime until the rollout ends (or ``time_limit``)."""

    def __init__(self, spec: dict[str, Any], config_path: Path, name: str = "local", tick: float = 0.2,
                 time_limit: float = 110.0, clock: Callable[[], float] = time.time) -> None:
        self.raw_spec = spec
        self.spec = parse_spec(spec)
        self.name, self.model = name, self.spec.model_name(name)
        self.config_path, self.tick, self.time_limit, self.clock = config_path, tick, time_limit, clock
        self.status = RolloutStatus()
        self.url: str | None = None
        self.body = {"metadata": {"uid": f"local-{name}-{os.getpid()}", "namespace": "local", "name": name}}
        self.analyzer = Analyzer(ProviderFactory())
        self.events: list[tuple[float, Event]] = []
        self.history: list[tuple[float, RolloutStatus]] = []  # every status that differed from the last
        self.analyses: list[Analysis] = []
        self.config_text = ""
        self.started_at = clock()
        self.timed_out = False
        self._analysed_at: float | None = None

    @property
    def done(self) -> bool:
        return self.status.phase in DONE

    def write_config(self, status: RolloutStatus) -> bool:
        """Write the runtime config the status describes; True when the file changed."""
        config = runtime_config(self.spec, self.model, status.weights, status.stable_version or "",
                                routed_versions(self.spec, status))
        text = dump_config(config)
        if text == self.config_text:
            return False
        write_atomic(self.config_path, text)
        self.config_text = text
        return True

    def prepare(self) -> None:
        """Before the runtime starts: the first decision with nothing loaded, and its config."""
        self.status, events = decide(self.spec, self.status, World(desired_pods=1), None, self.clock())
        self._note(self.clock(), events)
        self.write_config(self.status)

    def observe(self) -> Observation:
        assert self.url is not None
        u = urlparse(self.url)
        obs = scrape([PodView("local", u.hostname, int(u.port or 80), ready=True)], self.model)
        # The pod's Ready condition would be the runtime's /v2/health/ready: the same flag as /status.
        return Observation([replace(p, ready=bool((p.status or {}).get("ready"))) for p in obs.pods])

    def world(self, obs: Observation) -> World:
        views = {v.name: obs.version(v.name) for v in self.spec.versions}
        return World(versions_ready={k: v.ready for k, v in views.items()},
                     reasons={k: v.reason for k, v in views.items() if v.reason},
                     ready_pods=obs.ready_pods, desired_pods=1)

    def analyse(self, obs: Observation, now: float) -> Analysis | None:
        st = self.status  # the same gate as Reconciler._analyse
        if not self.spec.canary or st.canary_version != self.spec.canary:
            return None
        if st.phase != Phase.PROGRESSING or st.canary_weight <= 0:
            return None
        # analyzer.next_due counts from status.analysis.checkedAt, which is stored to the whole
        # second: alone it lets a check follow the last one after (interval - 1 s) or less. Keep
        # the checks a full interval apart so each one sees an interval's worth of traffic.
        if self._analysed_at is not None and now - self._analysed_at < self.spec.strategy.analysis.interval_seconds:
            return None
        analysis = self.analyzer(self.spec, st, self.body, obs, now)
        if analysis is not None:
            self._analysed_at = now
        return analysis

    def step(self) -> Tick:
        """One reconcile: observe, analyse when due, decide, write the config."""
        now = self.clock()
        obs = self.observe()
        analysis = self.analyse(obs, now)
        new, events = decide(self.spec, self.status, self.world(obs), analysis, now)
        new = replace(new, versions=[obs.version(v).as_status() for v in routed_versions(self.spec, new)])
        self.write_config(new)  # the config before the status that describes it, as the operator does
        self.status = new
        if analysis is not None:
            self.analyses.append(analysis)
        self._note(now, events)
        return Tick(now, new, analysis, tuple(events))

    def _note(self, now: float, events: list[Event]) -> None:
        self.events.extend((now, e) for e in events)
        if not self.history or self.history[-1][1].to_dict() != self.status.to_dict():
            self.history.append((now, self.status))

    def run(self, url: str, on_tick: Callable[[LocalRollout, Tick], None] | None = None) -> RolloutStatus:
        """Loop until Succeeded, RolledBack or Failed, or until ``time_limit`` seconds have passed."""
        self.url = url
        deadline = time.monotonic() + self.time_limit
        while not self.done:
            if time.monotonic() >= deadline:
                self.timed_out = True
                break
            started = time.monotonic()
            tick = self.step()
            if on_tick is not None:
                on_tick(self, tick)
            time.sleep(max(0.0, self.tick - (time.monotonic() - started)))
        return self.status

    def wait_applied(self, timeout: float = 5.0) -> bool:
        """Wait until the runtime serves the weights of the last config written (bounded)."""
        want = parse_config_text(self.config_text).effective_weights()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.observe().pods
            if pods and (pods[0].status or {}).get("weights") == want:
                return True
            time.sleep(0.1)
        return False
