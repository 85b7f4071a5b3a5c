"""Real Prometheus and Alertmanager processes on loopback ports, for tests.

    prom = Prometheus(workdir, ["127.0.0.1:8081"], rule_files=[rules], alertmanager_url=am.url)
    prom.start(); prom.wait_for_up(30); prom.query('up')  # -> the result list of an instant query
    prom.stop(); prom.start()                               # same port, same storage
    am = Alertmanager(workdir, "http://127.0.0.1:8092/alerts", bearer_token="s3cret").start()

Both classes are context managers (``with Prometheus(...) as prom:`` starts and always stops).
Pytest fixtures ``prometheus_factory`` and ``alertmanager_factory`` start instances with the
test's ``tmp_path`` as the default workdir and kill every one at teardown, even when the test
failed. The binaries come from the Debian packages ``prometheus`` and ``prometheus-alertmanager``
(``make test`` environment); when they are missing the fixtures FAIL with how to install them.
Children get PR_SET_PDEATHSIG, so even a SIGKILLed pytest leaves no Prometheus behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mnn_rollout.local.net import WaitTimeout, free_port, wait_for

PROMETHEUS_BIN = os.environ.get("PROMETHEUS_BIN", "prometheus")
ALERTMANAGER_BIN = os.environ.get("ALERTMANAGER_BIN", "prometheus-alertmanager")
INSTALL_HINT = ("run the tests with `make test` in an environment that has them, or install them with "
                "`apt-get install -y --no-install-recommends prometheus prometheus-alertmanager`")
JOB = "mnn-runtime"


class PromStackError(RuntimeError):
    pass


def require_binary(name: str) -> str:
    """The binary's full path; a PromStackError naming how to install it when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise PromStackError(f"`{name}` is not installed (not on PATH): {INSTALL_HINT}")
    return path


try:  # resolved once here: between fork and exec the child only calls it
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the process that started it dies."""
    if _prctl is not None:
        _prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class _Process:
    """A loopback server process with a log file, a readiness URL, and a sure stop."""

    name = "process"
    ready_path = "/-/ready"

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"{self.name}.log"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 30.0) -> Any:
        if self.alive():
            return self
        cmd = self.command()
        with self.log_path.open("ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.workdir, preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise PromStackError(f"{self.name} exited with {self.proc.returncode} while starting:\n{self.log()}")
            try:
                resp = httpx.get(self.url + self.ready_path, timeout=1.0)
                if resp.status_code == 200:
                    return self
                last = resp.status_code
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.05)
        self.stop()
        raise PromStackError(f"{self.name} not ready at {self.url} within {timeout} s (last: {last!r}):\n{self.log()}")

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Prometheus(_Process):
    """``prometheus`` scraping ``scrape_targets`` (host:port, job ``mnn-runtime``, path /metrics);
    ``target_labels`` gives a target labels of its own (as the chart's PodMonitor sets ``namespace``
    and ``modeldeployment``)."""

    name = "prometheus"

    def __init__(self, workdir: Path, scrape_targets: Sequence[str], rule_files: Sequence[Path] | None = None,
                 alertmanager_url: str | None = None, scrape_interval: str = "1s",
                 evaluation_interval: str = "1s", port: int | None = None,
                 target_labels: Mapping[str, Mapping[str, str]] | None = None) -> None:
        self.binary = require_binary(PROMETHEUS_BIN)
        self.target_labels = {target: dict(labels) for target, labels in (target_labels or {}).items()}
        super().__init__(Path(tempfile.mkdtemp(prefix="prometheus-", dir=workdir)), port)
        self.targets = list(scrape_targets)
        self.rule_files = [Path(p).resolve() for p in rule_files or ()]
        self.alertmanager_url = alertmanager_url
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.config_path = self.workdir / "prometheus.yml"
        self.storage = self.workdir / "data"  # kept across stop()/start()
        self.write_config()

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "scrape_configs": [{"job_name": JOB, "metrics_path": "/metrics", "static_configs": [
                {"targets": [t], "labels": self.target_labels[t]} if t in self.target_labels else {"targets": [t]}
                for t in self.targets]}],
        }
        if self.rule_files:
            cfg["rule_files"] = [str(p) for p in self.rule_files]
        if self.alertmanager_url:
            am = httpx.URL(self.alertmanager_url)
            cfg["alerting"] = {"alertmanagers": [{
                "scheme": am.scheme, "path_prefix": am.path or "/",
                "static_configs": [{"targets": [f"{am.host}:{am.port}"]}]}]}
        return cfg

    def write_config(self) -> None:
        for target in self.targets:
            host = target.rsplit(":", 1)[0].strip("[]")
            if not (host.startswith("127.") or host in ("localhost", "::1")):
                raise ValueError(f"scrape target {target!r} is not a loopback address")
        self.config_path.write_text(yaml.safe_dump(self.config(), sort_keys=False))

    def command(self) -> list[str]:
        return [self.binary, f"--config.file={self.config_path}", f"--storage.tsdb.path={self.storage}",
                f"--web.listen-address={self.host}:{self.port}", "--web.enable-lifecycle",
                "--storage.tsdb.retention.time=1d", "--log.level=info"]

    def reload(self) -> None:
        resp = httpx.post(self.url + "/-/reload", timeout=10)
        if resp.status_code != 200:
            raise PromStackError(f"prometheus reload failed: {resp.status_code} {resp.text}")

    def set_targets(self, targets: Sequence[str]) -> None:
        """Scrape these targets instead (rewrites the config and reloads)."""
        self.targets = list(targets)
        self.write_config()
        self.reload()

    def query(self, promql: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The ``result`` of an instant query; PromStackError when Prometheus says it failed."""
        resp = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=timeout)
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise PromStackError(f"query {promql!r} failed: {resp.status_code} {body}")
        return list(body["data"]["result"])

    def value(self, promql: str) -> float | None:
        """The value of a one-series instant query; None when it returns nothing."""
        result = self.query(promql)
        return float(result[0]["value"][1]) if result else None

    def wait_until(self, check: Callable[[], Any], timeout: float, what: str, interval: float = 0.2) -> Any:
        """``wait_for`` retrying while Prometheus is unreachable or its answer is incomplete; a
        PromStackError with Prometheus's log when it times out."""
        try:
            return wait_for(check, timeout, what, interval,
                            retry_on=(httpx.HTTPError, PromStackError, ValueError, KeyError, IndexError))
        except WaitTimeout as exc:
            raise PromStackError(f"{exc}:\n{self.log()}") from None

    def wait_for_up(self, timeout: float = 30.0) -> float:
        """Wait until ``up`` is 1 for every configured target (and only those); returns the seconds waited."""
        started = time.monotonic()
        wanted = set(self.targets)

        def check() -> bool:
            up = {r["metric"].get("instance"): r["value"][1] for r in self.query(f'up{{job="{JOB}"}}')}
            return set(up) == wanted and all(v == "1" for v in up.values())

        self.wait_until(check, timeout, f"up == 1 for {sorted(wanted)}")
        return time.monotonic() - started

    def alerts(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/api/v1/alerts", timeout=10).json()["data"]["alerts"])


class Alertmanager(_Process):
    """``prometheus-alertmanager`` sending every alert at once to one webhook with a bearer token."""

    name = "alertmanager"

    def __init__(self, workdir: Path, webhook_url: str, bearer_token: str, group_wait: str = "0s",
                 group_interval: str = "1s", repeat_interval: str = "1h", port: int | None = None) -> None:
        self.binary = require_binary(ALERTMANAGER_BIN)
        super().__init__(Path(tempfile.mkdtemp(prefix="alertmanager-", dir=workdir)), port)
        self.webhook_url = webhook_url
        self.config_path = self.workdir / "alertmanager.yml"
        self.storage = self.workdir / "data"
        self.token_path = self.workdir / "webhook-token"
        self.token_path.write_text(bearer_token)
        self.token_path.chmod(0o600)
        self.config_path.write_text(yaml.safe_dump({
            "route": {"receiver": "mnn-rollout", "group_by": ["..."], "group_wait": group_wait,
                      "group_interval": group_interval, "repeat_interval": repeat_interval},
            "receivers": [{"name": "mnn-rollout", "webhook_configs": [{
                "url": webhook_url, "send_resolved": True,
                "http_config": {"authorization": {"type": "Bearer", "credentials_file": str(self.token_path)}},
            }]}],
        }, sort_keys=False))

    def command(self) -> list[str]:
        # An empty --cluster.listen-address turns gossip off: without it Alertmanager holds its first
        # notification until the gossip has settled (it logs "gossip settled; proceeding" after ~10 s).
        return [self.binary, f"--config.file={self.config_path}", f"--storage.path={self.storage}",
                f"--web.listen-address={self.host}:{self.port}", "--cluster.listen-address=",
                "--log.level=info"]

    def post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        """POST /api/v2/alerts (each alert: labels, optional annotations/startsAt/endsAt)."""
        resp = httpx.post(self.url + "/api/v2/alerts", json=alerts, timeout=10)
        if resp.status_code != 200:
            raise PromStackError(f"alertmanager refused the alerts: {resp.status_code} {resp.text}")

    def alerts(self) -> list[dict[str, Any]]:
        return list(httpx.get(self.url + "/api/v2/alerts", timeout=10).json())


# -- pytest fixtures ---------------------------------------------------------------------------


def _factory(cls: type[_Process], default_dir: Path) -> Iterator[Callable[..., Any]]:
    started: list[_Process] = []

    def make(*args: Any, workdir: Path | None = None, start: bool = True, **kwargs: Any) -> Any:
        require_promstack()
        instance = cls(workdir or default_dir, *args, **kwargs)  # type: ignore[call-arg]
        started.append(instance)
        return instance.start() if start else instance

    try:
        yield make
    finally:
        for instance in started:
            instance.stop()


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[..., Prometheus]]:
    """``prometheus_factory(scrape_targets, rule_files=None, alertmanager_url=None, scrape_interval='1s',
    evaluation_interval='1s', workdir=tmp_path, start=True)`` -> a ready Prometheus, stopped at teardown."""
    yield from _factory(Prometheus, tmp_path)


@pytest.fixture
def alertmanager_factory(tmp_path: Path) -> Iterator[Callable[..., Alertmanager]]:
    """``alertmanager_factory(webhook_url, bearer_token, workdir=tmp_path, start=True)`` -> a ready
    Alertmanager, stopped at teardown."""
    yield from _factory(Alertmanager, tmp_path)


def require_promstack() -> None:
    """Fail (never skip) the calling test when either binary is missing."""
    missing = [name for name in (PROMETHEUS_BIN, ALERTMANAGER_BIN) if shutil.which(name) is None]
    if missing:
        pytest.fail(f"{' and '.join(f'`{m}`' for m in missing)} not installed (not on PATH): {INSTALL_HINT}",
                    pytrace=False)


# -- runtime servers and known traffic, for the tests that scrape them -------------------------

GOOD_BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
BAD_BODY = {"inputs": []}  # 400 "inputs: required": a client_error counted for the pinned version


def write_runtime_config(examples_dir: Path, path: Path, model: str = "scorer",
                         versions: Sequence[str] = ("v1", "v2", "v2-breaking"),
                         weights: dict[str, int] | None = None) -> Path:
    """A runtime config serving ``versions`` of the example models (absolute uris)."""
    config: dict[str, Any] = {
        "model": model,
        "versions": [{"name": v, "uri": str(Path(examples_dir) / f"{v}.mnn")} for v in versions],
        "stable": versions[0],
    }
    if weights:  # else the stable version gets 100 (pinned requests reach every loaded version)
        config["weights"] = weights
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def send(url: str, version: str, good: int = 0, bad: int = 0, model: str = "scorer") -> dict[int, int]:
    """``good`` well-formed and ``bad`` malformed requests pinned to ``version``; returns {status: count}."""
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        for body in [GOOD_BODY] * good + [BAD_BODY] * bad:
            code = client.post(f"/v2/models/{model}/versions/{version}/infer", json=body).status_code
            statuses[code] = statuses.get(code, 0) + 1
    return statuses
