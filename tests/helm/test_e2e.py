"""End to end: install the chart's manifests into the Kubernetes API emulator as `helm install`
would (crds/ first, then every template, default values), start the operator process exactly as
the rendered Deployment runs it, and roll a canary out with it.

What differs from a pod, and why (everything else - command, every other arg, env - is taken from
the rendered Deployment as is):

* `mnn-rollout` runs as `python -m mnn_rollout.cli` from this checkout (as the kubelet stand-in
  does for runtime pods: no image here);
* `--metrics-host`, `--webhook-host` and the host of `--liveness` 0.0.0.0 -> 127.0.0.1, and
  `--metrics-port`, `--webhook-port` and the port of `--liveness` -> free ports (tests run in
  parallel on one machine, loopback only);
* `--webhook-token-file` /etc/mnn-rollout/webhook/<key> -> a file in the test's temp dir holding
  the rendered Secret's value (what the kubelet would mount there);
* credentials: KUBECONFIG of the emulator instead of the in-cluster service account.

The kubelet stand-in runs only the runtime Deployments (label component=runtime); the operator
Deployment stays a stored object, its process is the one started here.

Afterwards, every request the operator (kopf and the operator's client, told apart by their
User-Agent) made is checked against the chart's RBAC: a real cluster would have refused nothing.
"""

from __future__ import annotations

import base64
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import yaml

from mnn_rollout.local.net import free_port
from mnn_rollout.local.traffic import Traffic
from tests.helm import rbac
from tests.helm.chart import NAMESPACE, RELEASE, Rendered, render
from tests.k8s.fixtures import k8s_emulator_factory  # noqa: F401
from testbed.k8s.harness import EmulatorProcess
from testbed.k8s.kubelet import Kubelet
from tests.k8s.kubelet_fixtures import kubelet_factory  # noqa: F401
from testbed.cluster import Cluster, OperatorProcess, wait_for
from tests.operator.test_e2e_rollout import canary, start_stable

pytestmark = pytest.mark.timeout(180)

# The defaults fit the emulator as they are (monitoring is off by default); the namespaced install
# watches the namespace the rollout helpers use.
INSTALLS: dict[str, dict[str, Any]] = {"cluster-wide": {}, "namespaced": {"watchNamespaces": ["default"]}}
OPERATOR_AGENTS = ("kopf/", "mnn-rollout-operator/")
COMMANDS = {"mnn-rollout": [sys.executable, "-m", "mnn_rollout.cli"]}


def _with_value(arg: str, value: str) -> str:
    return arg.split("=", 1)[0] + "=" + value


class ChartOperatorProcess(OperatorProcess):
    """The operator container of the rendered Deployment, as a local process."""

    def __init__(self, emu: EmulatorProcess, workdir: Path, token: str, container: dict[str, Any],
                 index: int = 0) -> None:
        super().__init__(emu, workdir, token, index=index)
        self.container = container
        self.liveness_port = free_port()
        self.liveness_url = ""
        self.argv: list[str] = []
        self.rewritten: dict[str, tuple[str, str]] = {}  # flag -> (rendered value, local value)

    def local_args(self) -> list[str]:
        args = []
        for arg in self.container["args"]:
            flag, _, value = arg.partition("=")
            new = value
            if flag in ("--metrics-host", "--webhook-host"):
                new = "127.0.0.1"
            elif flag == "--metrics-port":
                new = str(self.metrics_port)
            elif flag == "--webhook-port":
                new = str(self.webhook_port)
            elif flag == "--liveness":
                parts = urlsplit(value)
                new = urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.liveness_port}"))
                self.liveness_url = new
            elif flag == "--webhook-token-file":
                new = str(self.token_file)
            if new != value:
                self.rewritten[flag] = (value, new)
                arg = _with_value(arg, new)
            args.append(arg)
        return args

    def start(self) -> ChartOperatorProcess:
        command = self.container["command"]
        self.argv = [*COMMANDS.get(command[0], command[:1]), *command[1:], *self.local_args()]
        env = dict(self.emu.env())
        for var in self.container.get("env", []):
            assert "value" in var, f"env {var['name']}: only literal values are rendered by the chart"
            env[var["name"]] = var["value"]
        self.proc = subprocess.Popen(self.argv, stdout=self.log_path.open("ab"), stderr=subprocess.STDOUT, env=env)
        wait_for(lambda: self._metrics_up(), 30, "operator metrics endpoint")
        return self


class ChartCluster(Cluster):
    def __init__(self, emu: EmulatorProcess, kubelet: Kubelet, models: Path, workdir: Path, rendered: Rendered,
                 token: str) -> None:
        super().__init__(emu, kubelet, models, workdir)
        self.rendered = rendered
        self.token = token

    def start_operator(self, *extra: str) -> OperatorProcess:
        assert not extra, "the chart decides the operator's flags"
        op = ChartOperatorProcess(self.emu, self.workdir, self.token, self.rendered.operator_container,
                                  index=len(self.operators))
        self.operators.append(op)
        return op.start()


def helm_install(emu: EmulatorProcess, rendered: Rendered) -> None:
    """What `helm install` does: the CRDs under crds/, then every rendered template."""
    emu.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(list(rendered.crds)))
    emu.kubectl("create", "namespace", NAMESPACE)
    emu.kubectl("apply", "--validate=false", "-f", "-", input=yaml.safe_dump_all(list(rendered.objects)))


@pytest.fixture(params=list(INSTALLS))
def chart_cluster(request: pytest.FixtureRequest, k8s_emulator_factory: Callable[..., EmulatorProcess],  # noqa: F811
                  kubelet_factory: Callable[..., Kubelet], examples_dir: Path,  # noqa: F811
                  tmp_path: Path) -> Iterator[ChartCluster]:
    rendered = render(INSTALLS[request.param], name=RELEASE, namespace=NAMESPACE)
    emu = k8s_emulator_factory()  # no CRDs: they come from the chart
    helm_install(emu, rendered)
    secret = rendered.one("Secret")
    token = base64.b64decode(next(iter(secret["data"].values()))).decode()
    kubelet = kubelet_factory(emu, tmp_path / "kubelet", label_selector="app.kubernetes.io/component=runtime")
    cluster = ChartCluster(emu, kubelet, examples_dir, tmp_path, rendered, token)
    yield cluster
    cluster.stop()


def test_the_installed_chart_runs_a_canary_rollout(chart_cluster: ChartCluster) -> None:
    cluster = chart_cluster
    emu = cluster.emu
    namespaced = bool(cluster.rendered.values.get("watchNamespaces"))
    # the installed objects are there (the peering object kopf will use among them)
    peering = "kopfpeering.kopf.dev/mnn-rollout" if namespaced else "clusterkopfpeering.kopf.dev/mnn-rollout"
    assert emu.kubectl("get", peering.split("/")[0], "mnn-rollout", "-n", "default", "-o", "name").stdout.strip() \
        == peering
    assert emu.kubectl("get", "crd", "modeldeployments.mnnrollout.io", "-o", "name").returncode == 0

    started = time.monotonic()
    start_stable(cluster)  # the operator from the chart; scorer v1 Ready
    op = cluster.operators[0]
    assert isinstance(op, ChartOperatorProcess)
    assert set(op.rewritten) == {"--metrics-host", "--metrics-port", "--webhook-host", "--webhook-port",
                                 "--liveness", "--webhook-token-file"}, op.rewritten
    assert op.argv[3] == "operator" and "--peering=mnn-rollout" in op.argv
    assert [a for a in op.argv if a.startswith("--namespace")] == (["--namespace=default"] if namespaced else [])

    # the probes' endpoint answers
    probe = cluster.rendered.operator_container["livenessProbe"]["httpGet"]
    assert urlsplit(op.liveness_url).path == probe["path"]
    assert httpx.get(op.liveness_url, timeout=5).status_code == 200

    # one canary rollout, promoted through every step under traffic
    with Traffic(cluster.pods, users=500, rate=120, connections=2):
        cluster.apply(canary(cluster))
        wait_for(lambda: cluster.status().get("phase") == "Succeeded", 90, "phase Succeeded", interval=0.2)
    st = cluster.status()
    assert st["stableVersion"] == "v2" and st["weights"] == {"v2": 100}
    assert "RolloutPromoted" in cluster.event_reasons()

    # the webhook takes the token of the chart's Secret, and only that
    hook = f"http://127.0.0.1:{op.webhook_port}/alerts"
    assert httpx.post(hook, json={"alerts": []}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.post(hook, json={"alerts": []}, headers={"Authorization": f"Bearer {cluster.token}"})
    assert ok.status_code == 200, ok.text
    assert time.monotonic() - started < 120

    # RBAC audit: every request the operator made is one the chart's RBAC allows
    rules = rbac.bound_rules(cluster.rendered.objects, NAMESPACE, cluster.rendered.deployment["spec"]["template"][
        "spec"]["serviceAccountName"])
    used, refused = set(), []
    for req in emu.requests():
        if not req["userAgent"].startswith(OPERATOR_AGENTS) or req["resource"] is None:
            continue  # kubectl, the kubelet stand-in, runtime pods; discovery (allowed to everyone)
        resource = req["resource"] + (f"/{req['subresource']}" if req["subresource"] else "")
        for verb in rbac.request_verbs(req):
            used.add((req["group"] or "", resource, verb))
            if not rbac.allowed(rules, req["group"] or "", resource, verb, req["namespace"], req["name"]):
                refused.append(f"{req['userAgent'].split()[0]} {req['method']} {req['path']} ({verb})")
    print("operator API use:", sorted(used))
    assert refused == [], "requests the chart's RBAC would refuse:\n" + "\n".join(sorted(set(refused)))
    # the run exercised the bulk of what is granted
    for needed in [("mnnrollout.io", "modeldeployments", "watch"), ("mnnrollout.io", "modeldeployments/status", "update"),
                   ("apps", "deployments", "create"), ("apps", "deployments", "patch"), ("", "pods", "list"),
                   ("", "events", "create"), ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
                   ("kopf.dev", "kopfpeerings" if namespaced else "clusterkopfpeerings", "patch"),
                   *([("", "namespaces", "watch")] if namespaced else [])]:
        assert needed in used, f"{needed} was never used: {sorted(used)}"
