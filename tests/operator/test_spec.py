"""The CRD and the operator's own spec validation agree, and the examples are valid for both."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from rollout_operator.spec import SpecError, parse_duration, parse_spec
from testbed.k8s.schema import prune_and_default, validate

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "crds" / "modeldeployment.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if "kind: ModelDeployment" in p.read_text())


def test_the_crd_names_scope_and_subresources() -> None:
    names = CRD["spec"]["names"]
    assert (CRD["spec"]["group"], VERSION["name"], names["kind"], names["plural"]) == (
        "mnnrollout.io", "v1alpha1", "ModelDeployment", "modeldeployments")
    assert names["shortNames"] == ["md"] and CRD["spec"]["scope"] == "Namespaced"
    assert VERSION["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.runtime.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}}
    columns = [c["name"] for c in VERSION["additionalPrinterColumns"]]
    assert columns == ["Phase", "Stable", "Canary", "Weight", "Step", "Ready", "Age"]


def test_the_crd_carries_the_cross_field_rules_as_cel() -> None:
    rules = " ".join(r["rule"] for r in SCHEMA["properties"]["spec"]["x-kubernetes-validations"])
    assert "sum() == 100" in rules and "self.versions.exists(v, v.name == k)" in rules
    assert "self.versions.exists(v, v.name == self.canary)" in rules


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_valid_for_the_crd_schema_and_the_operator(path: Path) -> None:
    obj = yaml.safe_load(path.read_text())
    assert validate(obj, SCHEMA) == []
    parse_spec(prune_and_default(obj, SCHEMA)["spec"])


def _crd_default(path: list[str]) -> Any:
    node = SCHEMA["properties"]["spec"]
    for part in path:
        node = node["properties"][part]
    return node["default"]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (["progressDeadlineSeconds"], lambda s: s.progress_deadline_seconds),
        (["paused"], lambda s: s.paused),
        (["runtime", "replicas"], lambda s: s.runtime.replicas),
        (["runtime", "port"], lambda s: s.runtime.port),
        (["runtime", "maxBodyBytes"], lambda s: s.runtime.max_body_bytes),
        (["routing", "header"], lambda s: s.routing.header),
        (["routing", "parameter"], lambda s: s.routing.parameter),
        (["strategy", "scaleDownDelaySeconds"], lambda s: s.strategy.scale_down_delay_seconds),
        (["strategy", "analysis", "interval"], lambda s: s.strategy.analysis.interval),
        (["strategy", "analysis", "minRequests"], lambda s: s.strategy.analysis.min_requests),
        (["strategy", "analysis", "failureLimit"], lambda s: s.strategy.analysis.failure_limit),
    ],
)
def test_crd_defaults_match_the_operators_defaults(path: list[str], value: Any) -> None:
    spec = parse_spec({"versions": [{"name": "v1", "uri": "v1.mnn"}]})
    assert _crd_default(path) == value(spec)


BASE: dict[str, Any] = {"versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weights": {"v1": 120, "v2": -20}}, "spec.weights.v1: 120 is outside 0-100"),
        ({"weights": {"v1": 50, "v2": 40}}, "spec.weights: {'v1': 50, 'v2': 40} sum to 90; must sum to 100"),
        ({"weights": {"v1": 50, "v9": 50}}, "spec.weights.v9: 'v9' is not a listed version; valid: ['v1', 'v2']"),
        ({"versions": [{"name": "v1", "uri": "a"}, {"name": "v1", "uri": "b"}]},
         "spec.versions: duplicate version names ['v1']"),
        ({"canary": "v9"}, "spec.canary: 'v9' is not a listed version"),
        ({"canary": "v2", "weights": {"v1": 100}}, "set either weights (a static split) or canary, not both"),
        ({"canary": "v2", "stable": "v2"}, "spec.canary: 'v2' is also the stable version"),
        ({"runtime": {"idleUnloadSeconds": 0.5}}, "spec.runtime.idleUnloadSeconds"),
        ({"versions": [{"name": "V2", "uri": "a"}]}, "spec.versions.0.name: version name 'V2' is not a DNS-1123"),
        ({"versions": [{"name": "v1", "uri": "gs://b/v1.mnn"}]}, "unsupported scheme 'gs'"),
        ({"strategy": {"steps": [{"weight": 10, "pause": "soon"}]}}, "'soon' is not a duration"),
        ({"strategy": {"analysis": {"interval": "500ms"}}}, "interval '500ms' is below the minimum of 1s"),
        ({"strategy": {"analysis": {"metrics": [{"name": "error-rate"}]}}}, "metric 'error-rate' needs a threshold"),
        ({"strategy": {"analysis": {"metrics": [{"name": "gpu-temp", "max": 1}]}}},
         "metric 'gpu-temp' is not built in"),
        ({"strategy": {"analysis": {"provider": {"type": "prometheus"}}}}, "address: required when provider type"),
        ({"strategy": {"analysis": {"provider": {"type": "datadog"}}}}, "spec.strategy.analysis.provider.type"),
        ({"runtime": {"replicas": -1}}, "spec.runtime.replicas"),
        ({"surprise": 1}, "spec.surprise: Extra inputs are not permitted"),
    ],
)
def test_invalid_specs_are_refused_naming_field_and_value(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, **change})
    assert message in str(info.value), str(info.value)


def test_durations_parse_like_kubernetes_durations() -> None:
    assert parse_duration("1h30m") == 5400 and parse_duration("500ms") == 0.5 and parse_duration("2.5s") == 2.5
    with pytest.raises(ValueError, match="'5 minutes' is not a duration"):
        parse_duration("5 minutes")


CANARY = {**BASE, "canary": "v2"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"strategy": {"steps": []}}, "spec.strategy.steps: List should have at least 1 item"),
        ({"strategy": {"analysis": {"metrics": [{"name": "conv", "query": "sum(x)", "max": 1}]}}},
         "spec.strategy.analysis.metrics.0.query: 'sum(x)' is PromQL, which the direct provider cannot run"),
        ({"strategy": {"analysis": {"provider": {"type": "prometheus", "address": "http://p:9090"}, "metrics": [
            {"name": "conv", "query": "sum(x)", "metric": "x_total", "max": 1}]}}}, "either query (PromQL) or metric"),
        ({"strategy": {"analysis": {"metrics": [{"name": "conv", "metric": "not a name", "max": 1}]}}},
         "'not a name' is not a Prometheus metric name"),
        ({"strategy": {"analysis": {"metrics": [{"name": "error-rate", "metric": "x_total", "max": 1}]}}},
         "metric 'error-rate' is built in"),
        ({"progressDeadlineSeconds": 10, "strategy": {"analysis": {"interval": "30s"}}},
         "spec.progressDeadlineSeconds: 10 is not longer than strategy.analysis.interval (30s)"),
    ],
)
def test_impossible_rollouts_are_refused_naming_the_field(change: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**CANARY, **change})
    assert message in str(info.value), str(info.value)


def test_the_crd_refuses_empty_steps_and_a_metric_with_both_query_and_metric() -> None:
    def md(spec: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"},
                "spec": spec}

    assert validate(md({**CANARY, "strategy": {"steps": [{"weight": 10}]}}), SCHEMA) == []
    assert [path for path, _ in validate(md({**CANARY, "strategy": {"steps": []}}), SCHEMA)] == ["spec.strategy.steps"]
    both = {"analysis": {"metrics": [{"name": "c", "query": "q", "metric": "x_total", "max": 1}]}}
    assert any("either query" in message for _, message in validate(md({**CANARY, "strategy": both}), SCHEMA))


def test_a_direct_custom_metric_by_series_name_is_accepted() -> None:
    spec = parse_spec({**CANARY, "strategy": {"analysis": {"metrics": [
        {"name": "conversion", "metric": "mnn_feedback_value_sum", "labels": {"kind": "click"}, "perRequest": True,
         "min": 0.02}]}}})
    metric = spec.strategy.analysis.metrics[0]
    assert (metric.metric, metric.labels, metric.per_request) == ("mnn_feedback_value_sum", {"kind": "click"}, True)


@pytest.mark.parametrize(("metric", "field"), [
    ({"name": "latency-p99", "max": float("nan")}, "max"), ({"name": "shadow-agreement", "min": float("inf")}, "min"),
    ({"name": "conversion", "compare": "stable", "margin": float("-inf")}, "margin")])
def test_a_threshold_that_is_not_a_finite_number_is_refused_naming_it(metric: dict[str, Any], field: str) -> None:
    """YAML (a local spec, the demo) can write .nan and .inf, which JSON cannot: a NaN threshold
    would fail every look, an infinite one pass every look."""
    with pytest.raises(SpecError, match=rf"metrics\.0\.{field}: Input should be a finite number"):
        parse_spec({**CANARY, "strategy": {"analysis": {"metrics": [metric]}}})


GOOD_POD_FIELDS = {
    "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"cpu": 2, "memory": "1.5Gi"}},
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
                {"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}}],
    "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
}


@pytest.mark.parametrize(
    ("runtime", "message", "crd_path"),
    [
        ({"volumes": [{"name": "m", "emptyDir": "oops"}]},
         "spec.runtime.volumes.0.emptyDir: 'oops' is not of type 'object'", "spec.runtime.volumes[0].emptyDir"),
        ({"volumes": [{"persistentVolumeClaim": {"claimName": "c"}}]},
         "spec.runtime.volumes.0: 'name' is a required property", "spec.runtime.volumes[0].name"),
        ({"volumes": [{"name": "m", "persistentVolumeClaim": {}}]},
         "spec.runtime.volumes.0.persistentVolumeClaim: 'claimName' is a required property",
         "spec.runtime.volumes[0].persistentVolumeClaim.claimName"),
        ({"resources": {"limits": {"memory": "lots"}}},
         "spec.runtime.resources.limits.memory: 'lots' is not a quantity", "spec.runtime.resources.limits.memory"),
        ({"tolerations": [{"key": "gpu", "tolerationSeconds": "soon"}]},
         "spec.runtime.tolerations.0.tolerationSeconds: 'soon' is not of type 'integer'",
         "spec.runtime.tolerations[0].tolerationSeconds"),
        ({"volumeMounts": [{"name": "models"}]},
         "spec.runtime.volumeMounts.0: 'mountPath' is a required property", "spec.runtime.volumeMounts[0].mountPath"),
    ],
)
def test_pass_through_pod_fields_are_refused_by_the_crd_and_the_operator(
        runtime: dict[str, Any], message: str, crd_path: str) -> None:
    """What goes into the pods as it is, is checked against the Kubernetes schemas twice: by the API
    server (the CRD) when the object is applied, and by the operator before it writes anything."""
    with pytest.raises(SpecError) as info:
        parse_spec({**CANARY, "runtime": runtime})
    assert message in str(info.value), str(info.value)
    md = {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"},
          "spec": {**CANARY, "runtime": runtime}}
    assert crd_path in [path for path, _ in validate(md, SCHEMA)], validate(md, SCHEMA)


@pytest.mark.parametrize(
    ("runtime", "message"),
    [
        ({"volumes": [{"name": "models", "emptydir": {}}]}, "'emptydir' was unexpected"),
        ({"volumeMounts": [{"name": "models", "mountPath": "/models"}]},
         "spec.runtime.volumeMounts.0.name: 'models' names no volume in runtime.volumes"),
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "spec.runtime.volumes.0.name: 'tmp' is the runtime's own"),
        ({"volumes": [{"name": "a", "emptyDir": {}}, {"name": "a", "emptyDir": {}}]},
         "spec.runtime.volumes.1.name: 'a' is used by another volume"),
        ({"volumes": [{"name": "a", "emptyDir": {}}], "volumeMounts": [{"name": "a", "mountPath": "/tmp"}]},
         "spec.runtime.volumeMounts.0.mountPath: '/tmp' is already mounted"),
        ({"tolerations": [{"key": "gpu", "operator": "Exist"}]},
         "spec.runtime.tolerations.0.operator: 'Exist' is not supported; valid: Equal, Exists"),
        ({"tolerations": [{"key": "gpu", "operator": "Exists", "value": "yes"}]},
         "spec.runtime.tolerations.0.value: 'yes': must be empty when operator is Exists"),
        ({"tolerations": [{"operator": "Equal", "value": "x"}]},
         "spec.runtime.tolerations.0.operator: 'Equal': must be Exists when key is empty"),
        ({"tolerations": [{"key": "gpu", "effect": "NoSchedul"}]},
         "spec.runtime.tolerations.0.effect: 'NoSchedul' is not supported"),
        ({"tolerations": [{"key": "gpu", "effect": "NoSchedule", "tolerationSeconds": 30}]},
         "spec.runtime.tolerations.0.tolerationSeconds: only with effect NoExecute"),
    ],
)
def test_the_operator_refuses_what_the_api_server_would_refuse_in_the_pods(runtime: dict[str, Any],
                                                                           message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**CANARY, "runtime": runtime})
    assert message in str(info.value), str(info.value)


def test_valid_pod_fields_pass_both() -> None:
    spec = parse_spec({**CANARY, "runtime": GOOD_POD_FIELDS})
    assert spec.runtime.volumes[0]["persistentVolumeClaim"]["claimName"] == "models"
    md = {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"},
          "spec": {**CANARY, "runtime": GOOD_POD_FIELDS}}
    assert validate(md, SCHEMA) == []


def test_the_generated_pod_field_schemas_are_current() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(ROOT / "crds" / "podfields.py"), "--check"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _md(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "mnnrollout.io/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}, "spec": spec}


CPU_TARGET = {"maxReplicas": 5, "targetCPUUtilizationPercentage": 70}


@pytest.mark.parametrize(
    ("runtime", "message", "crd_path"),
    [
        ({"autoscaling": {**CPU_TARGET, "minReplicas": 6}},
         "spec.runtime.autoscaling.minReplicas: 6 is above maxReplicas (5); valid: 1 to 5", "spec.runtime.autoscaling"),
        ({"autoscaling": {**CPU_TARGET, "targetInFlightPerPod": 4}},
         "spec.runtime.autoscaling: targetCPUUtilizationPercentage (70) and targetInFlightPerPod (4.0): set one "
         "target, not both", "spec.runtime.autoscaling"),
        ({"autoscaling": {"maxReplicas": 5}}, "spec.runtime.autoscaling: a target is required",
         "spec.runtime.autoscaling"),
        ({"autoscaling": {"targetInFlightPerPod": 4}}, "spec.runtime.autoscaling.maxReplicas: Field required",
         "spec.runtime.autoscaling.maxReplicas"),
        ({"autoscaling": {**CPU_TARGET, "minReplicas": 0}},
         "spec.runtime.autoscaling.minReplicas: Input should be greater than or equal to 1 (got 0)",
         "spec.runtime.autoscaling.minReplicas"),
        ({"autoscaling": {**CPU_TARGET, "maxReplicas": 1001}},
         "spec.runtime.autoscaling.maxReplicas: Input should be less than or equal to 1000 (got 1001)",
         "spec.runtime.autoscaling.maxReplicas"),
        ({"autoscaling": {**CPU_TARGET, "targetCPUUtilizationPercentage": 0}},
         "spec.runtime.autoscaling.targetCPUUtilizationPercentage: Input should be greater than or equal to 1 (got 0)",
         "spec.runtime.autoscaling.targetCPUUtilizationPercentage"),
        ({"autoscaling": {"maxReplicas": 5, "targetInFlightPerPod": -2}},
         "spec.runtime.autoscaling.targetInFlightPerPod: Input should be greater than or equal to 0.001 (got -2)",
         "spec.runtime.autoscaling.targetInFlightPerPod"),
        ({"autoscaling": CPU_TARGET, "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "2Gi"}}},
         "spec.runtime.autoscaling.targetCPUUtilizationPercentage: 70 needs a CPU request, and resources "
         "{'requests': {'memory': '1Gi'}, 'limits': {'memory': '2Gi'}} has neither requests.cpu nor limits.cpu",
         "spec.runtime.autoscaling.targetCPUUtilizationPercentage"),
    ],
)
def test_invalid_autoscaling_is_refused_by_the_operator_and_the_crd(runtime: dict[str, Any], message: str,
                                                                    crd_path: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec({**BASE, "runtime": runtime})
    assert message in str(info.value), str(info.value)
    assert crd_path in [path for path, _ in validate(_md({**BASE, "runtime": runtime}), SCHEMA)]


@pytest.mark.parametrize("runtime", [
    {"autoscaling": CPU_TARGET},  # the default resources request 250m of CPU
    {"autoscaling": CPU_TARGET, "resources": {"requests": {"cpu": "500m"}}},
    {"autoscaling": CPU_TARGET, "resources": {"limits": {"cpu": "2"}}},  # the request defaults to the limit
    {"autoscaling": {**CPU_TARGET, "targetCPUUtilizationPercentage": 150}},  # above the request: a higher limit
    {"autoscaling": {"minReplicas": 5, "maxReplicas": 5, "targetInFlightPerPod": 0.5},
     "resources": {"requests": {"memory": "1Gi"}}},  # no CPU request needed
])
def test_valid_autoscaling_passes_both(runtime: dict[str, Any]) -> None:
    assert validate(_md({**BASE, "runtime": runtime}), SCHEMA) == []
    spec = parse_spec(prune_and_default(_md({**BASE, "runtime": runtime}), SCHEMA)["spec"])
    assert spec.runtime.autoscaling is not None
    assert spec.runtime.autoscaling.max_replicas == runtime["autoscaling"]["maxReplicas"]


def test_the_autoscaling_defaults_match() -> None:
    spec = parse_spec({**BASE, "runtime": {"autoscaling": CPU_TARGET}})
    assert spec.runtime.autoscaling is not None
    assert _crd_default(["runtime", "autoscaling", "minReplicas"]) == spec.runtime.autoscaling.min_replicas == 1
    assert parse_spec(BASE).runtime.autoscaling is None


# -- model sources: https:// and s3:// versions, spec.modelSource ------------------------------------------------

DIGEST = "0" * 64


@pytest.mark.parametrize(
    ("version", "message", "crd_path"),
    [
        ({"uri": "https://models.example.com/v1.mnn"},
         "spec.versions.0.sha256: required for the remote uri 'https://models.example.com/v1.mnn'",
         "spec.versions[0].sha256"),
        ({"uri": "s3://models/v1.mnn"}, "spec.versions.0.sha256: required for the remote uri 's3://models/v1.mnn'",
         "spec.versions[0].sha256"),
        ({"uri": "s3://m/v1.mnn", "sha256": DIGEST}, "spec.versions.0.uri: uri 's3://m/v1.mnn' is not s3://BUCKET/KEY",
         "spec.versions[0].uri"),
        ({"uri": "s3://models/scorer/", "sha256": DIGEST}, "is not s3://BUCKET/KEY", "spec.versions[0].uri"),
        ({"uri": "http://models.example.com/v1.mnn", "sha256": DIGEST},
         "spec.versions.0.uri: uri 'http://models.example.com/v1.mnn' is plain http", "spec.versions[0].uri"),
        ({"uri": "gs://models/v1.mnn", "sha256": DIGEST}, "unsupported scheme 'gs'", "spec.versions[0].uri"),
        ({"uri": "https://models.example.com/" + "a" * 2048, "sha256": DIGEST}, "valid: at most 2048",
         "spec.versions[0].uri"),
    ],
)
def test_remote_versions_are_refused_by_the_operator_and_the_crd_without_a_digest_or_with_a_bad_uri(
        version: dict[str, Any], message: str, crd_path: str) -> None:
    spec = {"versions": [{"name": "v1", **version}]}
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert message in str(info.value), str(info.value)
    assert crd_path in [path for path, _ in validate(_md(spec), SCHEMA)]


@pytest.mark.parametrize("uri", ["https://models.example.com/scorer/v1.mnn", "s3://models/scorer/v1.mnn",
                                 "http://127.0.0.1:8000/v1.mnn", "file:///models/v1.mnn", "v1.mnn"])
def test_remote_versions_with_a_digest_pass_both(uri: str) -> None:
    spec = {"versions": [{"name": "v1", "uri": uri, "sha256": DIGEST}],
            "modelSource": {"s3": {"endpoint": "http://minio.storage:9000", "region": "eu-west-1",
                                   "secretName": "s3-credentials"}}}
    assert validate(_md(spec), SCHEMA) == []
    parsed = parse_spec(prune_and_default(_md(spec), SCHEMA)["spec"])
    assert parsed.versions[0].remote == ("://" in uri and not uri.startswith("file://"))
    assert parsed.model_source is not None and parsed.model_source.s3 is not None
    assert parsed.model_source.s3.secret_name == "s3-credentials"


@pytest.mark.parametrize(
    ("source", "message", "crd_path"),
    [
        ({"s3": {"endpoint": "minio.storage:9000"}}, "spec.modelSource.s3.endpoint: endpoint 'minio.storage:9000' is "
         "not an http(s)://HOST[:PORT] URL", "spec.modelSource.s3.endpoint"),
        ({"s3": {"endpoint": "https://minio/bucket"}}, "spec.modelSource.s3.endpoint", "spec.modelSource.s3.endpoint"),
        ({"s3": {"secretName": "S3_Creds"}}, "spec.modelSource.s3.secretName: secretName 'S3_Creds' is not a Secret "
         "name", "spec.modelSource.s3.secretName"),
        ({"s3": {"region": "us east"}}, "spec.modelSource.s3.region", "spec.modelSource.s3.region"),
        ({"timeoutSeconds": 0}, "spec.modelSource.timeoutSeconds", "spec.modelSource.timeoutSeconds"),
        ({"maxBytes": 0}, "spec.modelSource.maxBytes", "spec.modelSource.maxBytes"),
        ({"s3": {"bucket": "models"}}, "spec.modelSource.s3.bucket: Extra inputs are not permitted", None),
    ],
)
def test_an_invalid_model_source_is_refused_by_the_operator_and_the_crd(source: dict[str, Any], message: str,
                                                                        crd_path: str | None) -> None:
    spec = {**BASE, "modelSource": source}
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    assert message in str(info.value), str(info.value)
    if crd_path is not None:  # (an unknown field is pruned by the API server, not refused)
        assert crd_path in [path for path, _ in validate(_md(spec), SCHEMA)]


def test_the_model_source_defaults_match() -> None:
    source = parse_spec({**BASE, "modelSource": {}}).model_source
    assert source is not None
    assert _crd_default(["modelSource", "timeoutSeconds"]) == source.timeout_seconds == 600
    assert _crd_default(["modelSource", "maxBytes"]) == source.max_bytes == 4 * 1024**3
    assert parse_spec(BASE).model_source is None


@pytest.mark.parametrize(("runtime", "message"), [
    ({"volumes": [{"name": "model-cache", "emptyDir": {}}]}, "volumes.0.name: 'model-cache' is the runtime's own"),
    ({"volumes": [{"name": "cache", "emptyDir": {}}],
      "volumeMounts": [{"name": "cache", "mountPath": "/var/cache/mnn-rollout"}]},
     "volumeMounts.0.mountPath: '/var/cache/mnn-rollout' is already mounted"),
])
def test_the_download_cache_volume_and_path_are_reserved(runtime: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        parse_spec({**BASE, "runtime": runtime})


@pytest.mark.parametrize(("runtime", "message"), [
    ({"podLabels": {"team": "ml platform"}}, "spec.runtime.podLabels: value 'ml platform' of key 'team' is not a label "
                                             "value; valid: empty, or up to 63 letters"),
    ({"podLabels": {"team/a/b": "ml"}}, "spec.runtime.podLabels: key 'team/a/b': its prefix 'team/a' is not a DNS"),
    ({"podLabels": {"x" * 64: "ml"}}, "spec.runtime.podLabels: key 'x{64}' is not a qualified name"),
    ({"podAnnotations": {"not a key!": "x"}}, "spec.runtime.podAnnotations: key 'not a key!' is not a qualified name"),
    ({"nodeSelector": {"pool": "gpu nodes"}}, "spec.runtime.nodeSelector: value 'gpu nodes' of key 'pool' is not a "
                                              "label value"),
    ({"nodeSelector": {"bad key": "x"}}, "spec.runtime.nodeSelector: key 'bad key' is not a qualified name"),
    ({"resources": {"requests": {"memory": "4Gi"}, "limits": {"memory": "1Gi"}}},
     r"spec.runtime.resources.requests.memory: '4Gi' must be less than or equal to limits.memory \('1Gi'\)"),
    ({"resources": {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 2}}},
     r"spec.runtime.resources: requests.nvidia.com/gpu: 1 must be equal to limits.nvidia.com/gpu \(2\)"),
])
def test_pod_fields_the_api_server_would_refuse_are_an_invalid_spec_naming_the_field_and_value(
        runtime: dict[str, Any], message: str) -> None:
    """Copied into the runtime pods as given, each would make the API refuse the Deployment (422)
    after the other children were written: refused up front instead, before anything is written."""
    with pytest.raises(SpecError, match=message):
        parse_spec({**BASE, "runtime": runtime})


def test_valid_pod_labels_annotations_node_selectors_and_resources_are_accepted() -> None:
    runtime = {"podLabels": {"example.com/team": "ml", "tier": ""}, "podAnnotations": {"Example.com/Key_1": "any x"},
               "nodeSelector": {"kubernetes.io/arch": "amd64"},
               "resources": {"requests": {"cpu": "1", "memory": "1Gi", "nvidia.com/gpu": "1"},
                             "limits": {"cpu": "1000m", "memory": "1024Mi", "nvidia.com/gpu": 1}}}
    assert parse_spec({**BASE, "runtime": runtime}).runtime.pod_labels == {"example.com/team": "ml", "tier": ""}
