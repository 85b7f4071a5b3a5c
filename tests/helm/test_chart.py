"""The chart renders with the real Helm engine, lints clean, and every object it renders is valid:
built-in kinds against the Kubernetes 1.30 OpenAPI schemas (kubernetes-validate, strict), the
kopf peering objects against their CRD's schema, the Prometheus Operator kinds against the
minimal shapes below (no upstream schema ships with any package here)."""

from __future__ import annotations

import base64
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm.chart import CHART, NON_DEFAULT, ROOT, Rendered, render, validate_values


K8S_VERSION = "1.30"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")

# Kinds that come from CRDs, hence have no upstream schema in kubernetes-validate.
PEERING_KINDS = {"KopfPeering", "ClusterKopfPeering"}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {"type": "object", "required": ["name", "namespace"],
         "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS}}
_SELECTOR = {"type": "object", "properties": {"matchLabels": {**_LABELS, "minProperties": 1}},
             "required": ["matchLabels"]}
_NS_SELECTOR = {"type": "object", "minProperties": 1,
                "properties": {"any": {"type": "boolean"},
                               "matchNames": {"type": "array", "items": {"type": "string"}}}}
_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"}
_ENDPOINT = {"type": "object", "required": ["port"],
             "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "interval": _DURATION}}


def _kind(api_version: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
            "properties": {"apiVersion": {"const": api_version}, "kind": {"const": kind}, "metadata": _META,
                           "spec": spec}}


# The fields of each Prometheus Operator kind the chart uses, as that operator's CRDs type them.
MONITORING_SHAPES = {
    "ServiceMonitor": _kind("monitoring.coreos.com/v1", "ServiceMonitor", {
        "type": "object", "required": ["selector", "endpoints"],
        "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                       "endpoints": {"type": "array", "minItems": 1, "items": _ENDPOINT}}}),
    "PodMonitor": _kind("monitoring.coreos.com/v1", "PodMonitor", {
        "type": "object", "required": ["selector", "podMetricsEndpoints"],
        "properties": {"selector": _SELECTOR, "namespaceSelector": _NS_SELECTOR,
                       "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {**_ENDPOINT, "properties": {
                           **_ENDPOINT["properties"], "relabelings": {"type": "array", "items": {
                               "type": "object", "required": ["targetLabel"], "properties": {
                                   "sourceLabels": {"type": "array", "items": {"type": "string",
                                                                               "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                                   "targetLabel": {"type": "string"}}}}}}}}}),
    "PrometheusRule": _kind("monitoring.coreos.com/v1", "PrometheusRule", {
        "type": "object", "required": ["groups"],
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "rules"], "properties": {
                "name": {"type": "string"}, "rules": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["alert", "expr"], "additionalProperties": False, "properties": {
                        "alert": {"type": "string"}, "expr": {"type": "string"}, "for": _DURATION,
                        "labels": _LABELS, "annotations": _LABELS}}}}}}}}),
    "AlertmanagerConfig": _kind("monitoring.coreos.com/v1alpha1", "AlertmanagerConfig", {
        "type": "object", "required": ["route", "receivers"],
        "properties": {
            "route": {"type": "object", "required": ["receiver"], "properties": {
                "receiver": {"type": "string"}, "groupBy": {"type": "array", "items": {"type": "string"}},
                "groupWait": _DURATION, "groupInterval": _DURATION, "repeatInterval": _DURATION,
                "matchers": {"type": "array", "items": {"type": "object", "required": ["name", "value"], "properties": {
                    "name": {"type": "string"}, "value": {"type": "string"},
                    "matchType": {"enum": ["=", "!=", "=~", "!~"]}}}}}},
            "receivers": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"},
                    "webhookConfigs": {"type": "array", "items": {"type": "object", "required": ["url"], "properties": {
                        "url": {"type": "string", "pattern": "^https?://"}, "sendResolved": {"type": "boolean"},
                        "httpConfig": {"type": "object", "properties": {"authorization": {
                            "type": "object", "properties": {
                                "type": {"type": "string"},
                                "credentials": {"type": "object", "required": ["name", "key"]}}}}}}}}}}}}}),
}


def _validate(obj: dict[str, Any], crds: tuple[dict[str, Any], ...]) -> None:
    kind = obj["kind"]
    where = f"{kind} {obj['metadata'].get('namespace', '')}/{obj['metadata']['name']}"
    try:
        if kind in MONITORING_SHAPES:
            jsonschema.validate(obj, MONITORING_SHAPES[kind])
        elif kind in PEERING_KINDS:
            crd = next(c for c in crds if c["spec"]["names"]["kind"] == kind)
            group, version = obj["apiVersion"].split("/")
            assert group == crd["spec"]["group"] and version in [v["name"] for v in crd["spec"]["versions"]]
            assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced"), where
            jsonschema.validate({k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")},
                                crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except (jsonschema.ValidationError, kubernetes_validate.ValidationError) as exc:
        path = "/".join(str(p) for p in exc.absolute_path)
        raise AssertionError(f"{where}: {path}: {exc.message}") from None
    meta = obj["metadata"]
    assert DNS_SUBDOMAIN.match(meta["name"]) and len(meta["name"]) <= 63, where
    if "namespace" in meta:
        assert DNS_LABEL.match(meta["namespace"]), where


CASES = {
    "defaults": ({}, "mnn-rollout", "mnn-rollout"),
    "non-default": (NON_DEFAULT, "prod", "ops"),
    "webhook-off-single-standalone": ({"webhook": {"enabled": False}, "replicas": 1, "peering": {"enabled": False},
                                       "rbac": {"clusterScopedReads": False}, "serviceAccount": {"name": "op"},
                                       "affinity": {"nodeAffinity": {}}}, "x", "default"),
}


@pytest.fixture(params=list(CASES), scope="module")
def case(request: pytest.FixtureRequest) -> Rendered:
    values, name, namespace = CASES[request.param]
    return render(values, name=name, namespace=namespace)


def test_helm_lint_reports_no_errors_or_warnings() -> None:
    import helm_python as helm

    for values in ({}, NON_DEFAULT):
        report = helm.lint(CHART, values, namespace="mnn-rollout", kube_version="v1.30.0", strict=True)
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_every_rendered_object_is_valid(case: Rendered) -> None:
    assert case.objects
    for obj in case.objects:
        _validate(obj, case.crds)
    for crd in case.crds:
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def test_default_install_is_cluster_wide_with_two_peered_replicas() -> None:
    r = render()
    kinds = sorted(o["kind"] for o in r.objects)
    assert kinds == sorted(["ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "Service",
                            "Secret", "ClusterKopfPeering", "PodDisruptionBudget"])
    assert r.deployment["spec"]["replicas"] == 2
    args = r.operator_container["args"]
    assert args[0] == "operator" and "--peering=mnn-rollout" in args
    assert not any(a.startswith("--namespace") for a in args)  # all namespaces
    assert r.one("ClusterKopfPeering")["metadata"]["name"] == "mnn-rollout"
    services = {s["metadata"]["name"]: s["spec"]["ports"] for s in r.of_kind("Service")}
    assert services == {
        "mnn-rollout-webhook": [{"name": "webhook", "port": 8092, "targetPort": "webhook", "protocol": "TCP"}],
        "mnn-rollout-metrics": [{"name": "metrics", "port": 8090, "targetPort": "metrics", "protocol": "TCP"}],
    }
    # examples/prometheus-rules.yaml tells users to point Alertmanager at this Service.
    assert "http://mnn-rollout-webhook.mnn-rollout:8092/alerts" in (ROOT / "examples/prometheus-rules.yaml").read_text()


def test_non_default_install_is_namespaced_with_monitoring() -> None:
    r = render(NON_DEFAULT, name="prod", namespace="ops")
    assert r.deployment["spec"]["replicas"] == 3
    args = r.operator_container["args"]
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    assert "--priority=0" in args and "--resync-seconds=0.5" in args
    assert r.operator_container["image"] == "ghcr.io/mnn-rollout/mnn-rollout:0.1.0-rc1@sha256:" + "a" * 64
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in r.of_kind("KopfPeering")} == {
        ("team-a", "prod-mnn-rollout"), ("team-b", "prod-mnn-rollout")}
    assert not r.of_kind("ClusterKopfPeering")
    assert {(o["metadata"]["namespace"]) for o in r.of_kind("Role")} == {"team-a", "team-b"}
    for binding in r.of_kind("RoleBinding"):
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "prod-mnn-rollout", "namespace": "ops"}]
    assert {o["kind"] for o in r.objects} >= {"ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig",
                                              "ConfigMap"}
    assert r.one("ServiceMonitor")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert r.one("PodMonitor")["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b"]}
    assert "team-a" in r.notes and "kubectl mnn-rollout status scorer -n team-a --watch" in r.notes


def test_standard_labels_on_every_object(case: Rendered) -> None:
    for obj in case.objects:
        labels = obj["metadata"]["labels"]
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/version",
                    "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/managed-by",
                    "helm.sh/chart"):
            assert labels.get(key), (obj["kind"], obj["metadata"]["name"], key)
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"] == "mnn-rollout-0.1.0"
    pod_labels = case.deployment["spec"]["template"]["metadata"]["labels"]
    selector = case.deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items() and selector["app.kubernetes.io/component"] == "operator"
    for svc in case.of_kind("Service"):
        assert svc["spec"]["selector"] == selector


def test_probes_target_the_kopf_liveness_endpoint(case: Rendered) -> None:
    c = case.operator_container
    liveness = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--liveness="))
    m = re.fullmatch(r"http://0\.0\.0\.0:(\d+)(/\S+)", liveness)
    assert m, liveness
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert (ports[get["port"]], get["path"]) == (int(m.group(1)), m.group(2)), probe
    for svc in case.of_kind("Service"):
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in ports


def test_webhook_token_secret_is_mounted_as_the_token_file(case: Rendered) -> None:
    c = case.operator_container
    args = c["args"]
    if not case.values.get("webhook", {}).get("enabled", True):
        assert "--webhook-port=0" in args and not any(a.startswith("--webhook-token-file") for a in args)
        assert not case.of_kind("Secret")
        return
    token_file = next(a.split("=", 1)[1] for a in args if a.startswith("--webhook-token-file="))
    mount = next(m for m in c["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    assert mount["readOnly"] is True
    volume = next(v for v in case.deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    key = token_file.rsplit("/", 1)[1]
    assert volume["secret"]["items"] == [{"key": key, "path": key}]
    existing = case.values.get("webhook", {}).get("existingSecret")
    if existing:
        assert volume["secret"]["secretName"] == existing and not case.of_kind("Secret")
    else:
        secret = case.one("Secret", volume["secret"]["secretName"])
        assert len(base64.b64decode(secret["data"][key])) >= 32


def test_webhook_token_is_random_unless_given() -> None:
    def token(values: dict[str, Any]) -> str:
        r = render(values)
        return base64.b64decode(r.one("Secret")["data"]["token"]).decode()

    assert token({}) != token({"replicas": 2})  # two installs, two random tokens (lookup finds nothing offline)
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token({}))
    assert token({"webhook": {"token": "s3cret-from-values"}}) == "s3cret-from-values"
    # On upgrades `lookup` reads the live Secret back, so the token stays stable:
    assert "lookup \"v1\" \"Secret\"" in (CHART / "templates/secret.yaml").read_text()


def test_standalone_with_several_replicas_is_refused() -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmRenderError, match="standalone"):
        render({"peering": {"enabled": False}, "replicas": 2})
    args = render({"peering": {"enabled": False}, "replicas": 1}).operator_container["args"]
    assert "--standalone" in args and not any(a.startswith("--peering") for a in args)


@pytest.mark.parametrize("bad", [
    {"replicas": "two"},
    {"replicas": -1},
    {"watchNamespaces": "default"},
    {"watchNamespaces": ["Not_A_Namespace"]},
    {"image": {"pullPolicy": "Sometimes"}},
    {"image": {"digest": "latest"}},
    {"webhook": {"port": 70000}},
    {"webhook": {"enabled": "yes"}},
    {"metrics": {"port": "8090"}},
    {"service": {"type": "ExternalName"}},
    {"serviceMonitor": {"enabled": True, "interval": "soon"}},
    {"peering": {"priority": "high"}},
    {"resyncSeconds": 0},
    {"unknownKey": 1},
    {"rbac": {"create": True, "wildcards": True}},
])
def test_schema_rejects_bad_values(bad: dict[str, Any]) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError):
        validate_values(bad)
    with pytest.raises(helm.HelmValuesError):
        render(bad)


def test_schema_accepts_the_defaults_and_the_non_default_values() -> None:
    validate_values({})
    validate_values(NON_DEFAULT)


def test_crd_copies_equal_the_sources_byte_for_byte() -> None:
    assert (CHART / "crds/modeldeployment.yaml").read_bytes() == (ROOT / "crds/modeldeployment.yaml").read_bytes()
    assert (CHART / "crds/kopf-peerings.yaml").read_bytes() == (ROOT / "testbed/k8s/peering-crd.yaml").read_bytes()
    rules = (CHART / "files/prometheus-rules.yaml").read_bytes()
    assert rules == (ROOT / "examples/prometheus-rules.yaml").read_bytes()
    names = sorted(c["metadata"]["name"] for c in render().crds)
    assert names == ["clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev", "modeldeployments.mnnrollout.io"]


def test_the_operator_gives_runtime_pods_the_charts_own_image() -> None:
    from rollout_operator.spec import DEFAULT_IMAGE

    container = render().operator_container
    assert container["image"] == DEFAULT_IMAGE
    assert f"--runtime-image={container['image']}" in container["args"]


def _comment_above(lines: list[str], index: int) -> bool:
    indent = len(lines[index]) - len(lines[index].lstrip())
    j = index - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    return j >= 0 and lines[j].lstrip().startswith("#") and len(lines[j]) - len(lines[j].lstrip()) == indent


def test_every_value_has_a_comment_and_a_schema_entry() -> None:
    """Every leaf of values.yaml (a scalar, a list, or a free-form object such as resources) has a
    comment right above it and a type in values.schema.json."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text())
    lines = (CHART / "values.yaml").read_text().splitlines()
    values = yaml.safe_load("\n".join(lines))
    missing = []

    def walk(node: dict[str, Any], node_schema: dict[str, Any], start: int, path: str) -> None:
        for key, value in node.items():
            index = next(i for i in range(start, len(lines)) if re.match(rf"^\s*{re.escape(key)}:", lines[i]))
            sub_schema = node_schema.get("properties", {}).get(key)
            assert sub_schema is not None, f"{path}{key} is not in values.schema.json"
            assert "type" in sub_schema, f"{path}{key} has no type in values.schema.json"
            if isinstance(value, dict) and value and "properties" in sub_schema:
                walk(value, sub_schema, index + 1, f"{path}{key}.")
            elif not _comment_above(lines, index):
                missing.append(f"{path}{key}")

    walk(values, schema, 0, "")
    assert missing == [], f"values without a comment: {missing}"


def test_notes_tell_the_next_steps() -> None:
    notes = render().notes
    assert "kubectl apply -n default -f examples/scorer.yaml" in notes
    assert "kubectl mnn-rollout status scorer -n default --watch" in notes
    assert "mnn-rollout-webhook.mnn-rollout.svc:8092/alerts" in notes
    assert "get secret mnn-rollout-webhook-token" in notes


def test_notes_tell_template_based_deploys_to_set_the_webhook_token_when_the_chart_generates_it() -> None:
    """Under `helm template` (Argo CD) `lookup` finds nothing: a generated token changes every render."""
    hint = "set webhook.existingSecret (or webhook.token) instead"
    assert hint in " ".join(render().notes.split())
    assert hint not in " ".join(render({"webhook": {"existingSecret": "alertmanager-token"}}).notes.split())
    assert hint not in " ".join(render({"webhook": {"token": "s3cret-from-values"}}).notes.split())
    assert hint not in " ".join(render({"webhook": {"enabled": False}}).notes.split())
    readme = " ".join((CHART / "README.md").read_text().split())
    assert "must set `webhook.existingSecret`" in readme and "runtime pods default to the chart's `image.*`" in readme
