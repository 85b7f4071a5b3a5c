"""A test cluster: the API emulator, the kubelet stand-in, the CRD, and real operator processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml

from mnn_rollout.local import net
from mnn_rollout.local.net import free_port
from testbed.k8s.harness import EmulatorProcess
from testbed.k8s.kubelet import Kubelet

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "modeldeployment.yaml"
PEERING_CRD = ROOT / "testbed" / "k8s" / "peering-crd.yaml"
EXAMPLE_PREFIX = "file:///opt/mnn-rollout/examples/"
MD_PATH = "/apis/mnnrollout.io/v1alpha1/namespaces/default/modeldeployments"


# The shared wait_for, also retrying while the cluster's answers are still incomplete (a missing
# status field, an API or pod request that failed), polling every 0.1 s.
wait_for = partial(net.wait_for, interval=0.1, retry_on=(AssertionError, KeyError, TypeError, httpx.HTTPError))


class OperatorProcess:
    """``mnn-rollout operator`` as a real process against the emulator."""

    def __init__(self, emu: EmulatorProcess, workdir: Path, token: str, extra: list[str] | None = None,
                 index: int = 0) -> None:
        self.emu = emu
        self.log_path = workdir / f"operator-{index}.log"
        self.metrics_port = free_port()
        self.webhook_port = free_port()
        self.token_file = workdir / "webhook-token"
        self.token_file.write_text(token)
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        env = dict(self.emu.env(), PYTHONUNBUFFERED="1")
        args = [sys.executable, "-m", "mnn_rollout.cli", "operator", "--namespace", "default",
                "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port),
                "--webhook-host", "127.0.0.1", "--webhook-port", str(self.webhook_port),
                "--webhook-token-file", str(self.token_file), "--resync-seconds", "1", *self.extra]
        self.proc = subprocess.Popen(args, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: self._metrics_up(), 30, "operator metrics endpoint")
        return self

    def _metrics_up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, self.log()
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=1).status_code == 200

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Cluster:
    def __init__(self, emu: EmulatorProcess, kubelet: Kubelet, models: Path, workdir: Path) -> None:
        self.emu = emu
        self.kubelet = kubelet
        self.models = models
        self.workdir = workdir
        self.operators: list[OperatorProcess] = []
        self.token = "test-token-" + os.urandom(8).hex()

    # -- operator ------------------------------------------------------------------------------

    def start_operator(self, *extra: str) -> OperatorProcess:
        op = OperatorProcess(self.emu, self.workdir, self.token, list(extra), index=len(self.operators))
        self.operators.append(op)
        return op.start()

    def stop(self) -> None:
        for op in self.operators:
            op.stop()

    # -- objects -------------------------------------------------------------------------------

    def manifest(self, example: str, **spec_changes: Any) -> dict[str, Any]:
        """An examples/ manifest with its model URIs pointing at this test's built models."""
        text = (ROOT / "examples" / example).read_text().replace(EXAMPLE_PREFIX, f"file://{self.models}/")
        obj = yaml.safe_load(text)
        obj["spec"].update(spec_changes)
        return dict(obj)

    def apply(self, obj: dict[str, Any]) -> None:
        self.emu.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump(obj))

    def md(self, name: str = "scorer") -> dict[str, Any]:
        status, body = self.emu.request("GET", f"{MD_PATH}/{name}")
        assert status == 200, body
        return dict(body)

    def status(self, name: str = "scorer") -> dict[str, Any]:
        return dict(self.md(name).get("status") or {})

    def condition(self, type_: str, name: str = "scorer") -> dict[str, Any]:
        return next(c for c in self.status(name).get("conditions", []) if c["type"] == type_)

    def events(self, name: str = "scorer") -> list[dict[str, Any]]:
        status, body = self.emu.request("GET", "/api/v1/namespaces/default/events")
        assert status == 200
        return [e for e in body.get("items", []) if e.get("involvedObject", {}).get("name") == name]

    def event_reasons(self, name: str = "scorer") -> list[str]:
        return [e.get("reason", "") for e in self.events(name)]

    def configmap_weights(self, name: str = "scorer") -> dict[str, int]:
        status, body = self.emu.request("GET", f"/api/v1/namespaces/default/configmaps/{name}-routing")
        assert status == 200, body
        return dict(yaml.safe_load(body["data"]["runtime.yaml"])["weights"])

    def published_table(self, name: str = "scorer") -> Any:
        """The bucket table the routing ConfigMap publishes (what every pod must serve)."""
        from mnn_rollout.contract.config import parse_config_text
        from mnn_rollout.contract.routing import RoutingTable

        status, body = self.emu.request("GET", f"/api/v1/namespaces/default/configmaps/{name}-routing")
        assert status == 200, body
        config = parse_config_text(body["data"]["runtime.yaml"])
        assert config.routing.table is not None, "the ConfigMap publishes no table"
        return RoutingTable.published(config.salt, config.effective_weights(), config.routing.table)

    def pods(self, name: str = "scorer") -> list[Any]:
        return [p for p in self.kubelet.pods(f"{name}-runtime", "default") if p.ready]

    def wait_ready(self, name: str = "scorer", replicas: int = 2, timeout: float = 90) -> list[Any]:
        return list(self.kubelet.wait_ready(f"{name}-runtime", "default", replicas=replicas, timeout=timeout))
