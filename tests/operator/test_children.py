"""Rendered children: names, owners, security, probes, and what changes when."""

from __future__ import annotations

from typing import Any

import pytest

from rollout_operator import children
from rollout_operator.spec import SpecError, parse_spec

BODY = {"apiVersion": "mnnrollout.io/v1alpha1", "metadata": {"name": "scorer", "uid": "u-1"}}
SPEC = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, {"name": "v2", "uri": "/m/v2.mnn"}],
                   "runtime": {"replicas": 3, "port": 9000, "nodeSelector": {"pool": "cpu"},
                               "tolerations": [{"key": "k", "operator": "Exists"}]}})
TARGET = children.Target("scorer", "ml", children.owner_reference(BODY))


def render(weights: dict[str, int], versions: list[str] | None = None) -> dict[str, dict[str, Any]]:
    config = children.runtime_config(SPEC, "scorer", weights, "v1", versions or ["v1", "v2"])
    return {o["kind"]: o for o in children.render_all(TARGET, SPEC, config)}


def test_every_child_is_named_labelled_and_owned() -> None:
    objs = render({"v1": 100})
    names = {k: o["metadata"]["name"] for k, o in objs.items()}
    assert names == {"ServiceAccount": "scorer-runtime", "Role": "scorer-runtime", "RoleBinding": "scorer-runtime",
                     "ConfigMap": "scorer-routing", "Deployment": "scorer-runtime", "Service": "scorer",
                     "PodDisruptionBudget": "scorer-runtime"}
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "ml"
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u-1"
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "mnn-rollout"
        assert children.HASH_ANNOTATION in obj["metadata"]["annotations"]


def test_the_runtime_pods_are_locked_down_and_probed() -> None:
    dep = render({"v1": 100})["Deployment"]
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"]["drop"] == ["ALL"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["args"][:3] == ["serve", "--configmap", "$(POD_NAMESPACE)/scorer-routing"]
    assert dep["spec"]["replicas"] == 3 and pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"]
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9000"


def test_a_weight_change_rewrites_the_configmap_but_does_not_roll_the_pods() -> None:
    a, b = render({"v1": 100}), render({"v1": 70, "v2": 30})
    assert a["ConfigMap"]["data"] != b["ConfigMap"]["data"]
    assert a["Deployment"] == b["Deployment"]


def test_adding_or_retiring_a_version_goes_through_the_configmap_and_never_rolls_the_pods() -> None:
    """The pods load and unload versions in place from the ConfigMap: the template changes only for
    what needs a restart (image, resources, workers, volumes)."""
    one, two = render({"v1": 100}, ["v1"]), render({"v1": 90, "v2": 10})
    assert one["ConfigMap"]["data"] != two["ConfigMap"]["data"]
    assert one["Deployment"] == two["Deployment"]


def test_a_disruption_budget_keeps_all_but_one_runtime_pod_through_a_drain() -> None:
    pdb = render({"v1": 100})["PodDisruptionBudget"]
    deployment = render({"v1": 100})["Deployment"]
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}


def test_a_pod_that_rolls_drains_first() -> None:
    """preStop keeps a terminating pod serving while endpoints drop it; then SIGTERM stops accepting
    and finishes what is in flight within the grace period; a roll never takes a pod away first."""
    deployment = render({"v1": 100})["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop == ["sleep", str(children.PRESTOP_SECONDS)]
    assert pod["terminationGracePeriodSeconds"] == children.PRESTOP_SECONDS + children.DRAIN_SECONDS
    assert pod["terminationGracePeriodSeconds"] > children.PRESTOP_SECONDS + 10  # the runtime drains 10 s
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_runtime_may_read_only_its_own_configmap() -> None:
    role = render({"v1": 100})["Role"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["scorer-routing"],
                              "verbs": ["get", "watch"]}]


def test_workers_follow_the_containers_cpu_unless_given() -> None:
    def args(runtime: dict[str, Any]) -> list[str]:
        spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}], "runtime": runtime})
        config = children.runtime_config(spec, "scorer", {"v1": 100}, "v1", ["v1"])
        dep = next(o for o in children.render_all(TARGET, spec, config) if o["kind"] == "Deployment")
        return dep["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]

    def workers(runtime: dict[str, Any]) -> str:
        a = args(runtime)
        return a[a.index("--workers") + 1]

    assert workers({}) == "1"  # the default resources request 250m and set no CPU limit
    assert workers({"workers": 3}) == "3"
    assert workers({"resources": {"limits": {"cpu": "2"}, "requests": {"cpu": "500m"}}}) == "2"
    assert workers({"resources": {"requests": {"cpu": "1500m"}}}) == "2"
    assert workers({"resources": {"requests": {"cpu": 4}}}) == "4"
    assert workers({"resources": {"limits": {"memory": "1Gi"}}}) == "auto"  # no CPU at all: the runtime counts


def test_a_bad_cpu_quantity_is_refused_naming_the_field() -> None:
    import pytest

    from rollout_operator.spec import SpecError

    with pytest.raises(SpecError, match=r"spec\.runtime\.resources\.limits\.cpu: 'two' is not a quantity"):
        parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}], "runtime": {"resources": {"limits": {"cpu": "two"}}}})


def test_drift_names_the_rendered_fields_edited_and_ignores_the_rest() -> None:
    import copy

    import yaml

    rendered = render({"v1": 90, "v2": 10})
    deployment, cm = rendered["Deployment"], rendered["ConfigMap"]
    live = copy.deepcopy(deployment)
    # what the API server and other tools add is not drift
    live["metadata"].update(uid="x", resourceVersion="7", annotations={**live["metadata"]["annotations"], "a/b": "c"})
    live["spec"]["revisionHistoryLimit"] = 10
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/termination-log"
    live["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "0.25"  # = 250m
    live["status"] = {"replicas": 3}
    assert children.drift(live, deployment) == []
    live["spec"]["replicas"] = 5
    live["spec"]["template"]["spec"]["containers"][0]["image"] = "other:1"
    del live["metadata"]["labels"][children.OWNER_LABEL]
    assert children.drift(live, deployment) == [
        f"metadata.labels[{children.OWNER_LABEL}]", "spec.replicas", "spec.template.spec.containers[0].image"]
    # the routing config compares as data: the edited keys are named, not the whole text
    edited = copy.deepcopy(cm)
    config = yaml.safe_load(edited["data"]["runtime.yaml"])
    config["weights"]["v1"], config["weights"]["v2"] = 10, 90
    edited["data"]["runtime.yaml"] = yaml.safe_dump(config)  # another key order: not drift by itself
    assert children.drift(edited, cm) == ["data[runtime.yaml].weights.v1", "data[runtime.yaml].weights.v2"]
    edited["data"]["runtime.yaml"] = "not: [yaml"
    assert children.drift(edited, cm) == ["data[runtime.yaml]"]


def test_the_configmap_publishes_a_table_evolved_from_the_one_it_published_before() -> None:
    """Every pod serves the table in the ConfigMap; the next one is evolved from it, so a version
    whose weight did not change keeps its users and each canary draws its own."""
    from collections import Counter

    three = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}, {"name": "v2", "uri": "/m/v2.mnn"},
                                     {"name": "v3", "uri": "/m/v3.mnn"}]})
    first = children.runtime_config(three, "scorer", {"v1": 80, "v2": 10, "v3": 10}, "v1", ["v1", "v2", "v3"])
    cm = children.render_configmap(TARGET, first)
    before = children.published_owners(cm)
    assert before is not None and Counter(before) == {"v1": 8000, "v2": 1000, "v3": 1000}
    second = children.runtime_config(three, "scorer", {"v1": 70, "v2": 20, "v3": 10}, "v1", ["v1", "v2", "v3"],
                                     previous=before)
    after = children.published_owners(children.render_configmap(TARGET, second))
    assert after is not None and Counter(after) == {"v1": 7000, "v2": 2000, "v3": 1000}
    assert {(a, b) for a, b in zip(before, after) if a != b} == {("v1", "v2")}  # only stable -> v2 moved
    # the same weights again publish the same table: no write, no drift
    again = children.runtime_config(three, "scorer", {"v1": 70, "v2": 20, "v3": 10}, "v1", ["v1", "v2", "v3"],
                                    previous=after)
    assert children.render_configmap(TARGET, again) == children.render_configmap(TARGET, second)
    # a table that does not parse (edited by hand) is no history: the next one starts from stable
    broken = {"data": {"runtime.yaml": "routing: {table: {versions: [v1], buckets: '@@'}}"}}
    assert children.published_owners(broken) is None and children.published_owners(None) is None


SCALED = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}],
                     "runtime": {"replicas": 3, "autoscaling": {"minReplicas": 2, "maxReplicas": 8,
                                                                "targetCPUUtilizationPercentage": 70}}})


def render_spec(spec: Any) -> dict[str, dict[str, Any]]:
    config = children.runtime_config(spec, "scorer", {"v1": 100}, "v1", ["v1"])
    return {o["kind"]: o for o in children.render_all(TARGET, spec, config)}


def test_autoscaling_adds_an_hpa_on_the_runtime_deployment_after_it() -> None:
    import kubernetes_validate

    rendered = children.render_all(TARGET, SCALED, children.runtime_config(SCALED, "scorer", {"v1": 100}, "v1", ["v1"]))
    assert [o["kind"] for o in rendered][-2:] == ["PodDisruptionBudget", "HorizontalPodAutoscaler"]
    hpa = rendered[-1]
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["metadata"]["name"] == "scorer-runtime"
    assert hpa["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    assert children.HASH_ANNOTATION in hpa["metadata"]["annotations"]
    assert hpa["metadata"]["labels"][children.OWNER_LABEL] == "scorer"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "scorer-runtime"},
        "minReplicas": 2, "maxReplicas": 8,
        "metrics": [{"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                                                                                 "averageUtilization": 70}}}]}
    kubernetes_validate.validate(hpa, "1.30", strict=True)
    assert "HorizontalPodAutoscaler" not in render({"v1": 100})  # none without autoscaling


def test_an_in_flight_target_is_a_pods_metric_averaged_over_the_pods() -> None:
    import kubernetes_validate

    for target, quantity in ((8, "8"), (2.5, "2500m"), (0.25, "250m")):
        spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}],
                           "runtime": {"autoscaling": {"maxReplicas": 4, "targetInFlightPerPod": target}}})
        hpa = render_spec(spec)["HorizontalPodAutoscaler"]
        assert hpa["spec"]["minReplicas"] == 1 and hpa["spec"]["maxReplicas"] == 4
        assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
            "metric": {"name": "mnn_inference_in_flight_requests"},
            "target": {"type": "AverageValue", "averageValue": quantity}}}]
        kubernetes_validate.validate(hpa, "1.30", strict=True)


def test_the_in_flight_metric_is_the_one_the_runtime_exports() -> None:
    from mnn_runtime.metrics import RuntimeMetrics

    names = {m.name for m in RuntimeMetrics("scorer").registry.collect()}
    assert children.IN_FLIGHT_METRIC in names


def test_with_autoscaling_the_deployment_leaves_its_replicas_to_the_hpa() -> None:
    unscaled = SCALED.model_copy(update={"runtime": SCALED.runtime.model_copy(update={"autoscaling": None})})
    scaled, fixed = render_spec(SCALED)["Deployment"], render_spec(unscaled)["Deployment"]
    assert "replicas" not in scaled["spec"] and fixed["spec"]["replicas"] == 3
    assert {k: v for k, v in fixed["spec"].items() if k != "replicas"} == scaled["spec"]  # nothing else differs
    # whatever the HPA sets is not drift; neither is a target quantity the API server wrote canonically
    live = {**scaled, "spec": {**scaled["spec"], "replicas": 7}}
    assert children.drift(live, scaled) == [] and "spec.replicas" in children.drift(live, fixed)
    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}],
                       "runtime": {"autoscaling": {"maxReplicas": 4, "targetInFlightPerPod": 0.5}}})
    hpa = render_spec(spec)["HorizontalPodAutoscaler"]
    live_hpa = {**hpa, "spec": {**hpa["spec"], "metrics": [{"type": "Pods", "pods": {
        "metric": {"name": "mnn_inference_in_flight_requests"},
        "target": {"type": "AverageValue", "averageValue": "0.5"}}}]}}
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "500m"
    assert children.drift(live_hpa, hpa) == []
    live_hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] = "2"
    assert children.drift(live_hpa, hpa) == ["spec.metrics[0].pods.target.averageValue"]


def test_an_hpa_no_longer_rendered_is_named_for_deletion() -> None:
    unscaled = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}]})
    assert children.unrendered(TARGET, SCALED) == []
    (stub,) = children.unrendered(TARGET, unscaled)
    assert stub["kind"] == "HorizontalPodAutoscaler"
    assert stub["metadata"] == {"name": "scorer-runtime", "namespace": "ml"}
    assert stub["kind"] in children.OPTIONAL_KINDS and children.owner_uid(TARGET) == "u-1"


def test_replicas_the_operator_owns_are_handed_over_before_it_lets_go() -> None:
    """Switching to autoscaling: the operator's field manager stops applying spec.replicas; applied
    first under a second manager, the live value stays (else the API server would drop it to 1)."""
    desired = render_spec(SCALED)["Deployment"]

    def live(manager: str, replicas: int | None = 5) -> dict[str, Any]:
        fields = {"f:spec": {"f:replicas": {}, "f:template": {}}}
        spec = {} if replicas is None else {"replicas": replicas}
        return {"metadata": {"managedFields": [{"manager": manager, "operation": "Apply", "fieldsV1": fields}]},
                "spec": spec}

    assert children.replicas_handover(desired, live("mnn-rollout"), "mnn-rollout") == {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "scorer-runtime", "namespace": "ml"},
        "spec": {"replicas": 5}}
    assert children.replicas_handover(desired, live("horizontal-pod-autoscaler"), "mnn-rollout") is None
    assert children.replicas_handover(desired, live("mnn-rollout", None), "mnn-rollout") is None
    assert children.replicas_handover(desired, None, "mnn-rollout") is None  # created: nothing to hand over
    fixed = render({"v1": 100})["Deployment"]
    assert children.replicas_handover(fixed, live("mnn-rollout"), "mnn-rollout") is None  # replicas still rendered


def test_idle_unload_reaches_the_runtime_config_only_when_set() -> None:
    versions = [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}]
    idle = parse_spec({"versions": versions, "runtime": {"idleUnloadSeconds": 300}})
    config = children.runtime_config(idle, "scorer", {"v1": 100, "v2": 0}, "v1", ["v1"])
    assert config.server.idle_unload_seconds == 300
    plain = children.runtime_config(parse_spec({"versions": versions}), "scorer", {"v1": 100, "v2": 0}, "v1", ["v1"])
    assert plain.server.idle_unload_seconds is None


S3_SPEC = {"versions": [{"name": "v1", "uri": "/m/v1.mnn"},
                        {"name": "v2", "uri": "s3://models/scorer/v2.mnn", "sha256": "0" * 64}],
           "modelSource": {"s3": {"endpoint": "http://minio.storage:9000", "region": "eu-west-1",
                                  "secretName": "s3-credentials"}, "timeoutSeconds": 120}}


def _deployment(raw: dict[str, Any]) -> dict[str, Any]:
    spec = parse_spec(raw)
    config = children.runtime_config(spec, "scorer", {"v1": 100}, "v1", [v.name for v in spec.versions])
    return children.render_deployment(TARGET, spec, config)


def test_an_s3_model_source_gives_the_pods_the_secrets_keys_the_endpoint_and_a_download_cache() -> None:
    import kubernetes_validate

    dep = _deployment(S3_SPEC)
    kubernetes_validate.validate(dep, "1.30", strict=True)
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key] == {"name": key, "valueFrom": {"secretKeyRef": {"name": "s3-credentials", "key": key}}}
    assert env["AWS_SESSION_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "s3-credentials", "key": "AWS_SESSION_TOKEN", "optional": True}
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage:9000"
    assert env["AWS_REGION"]["value"] == "eu-west-1"
    assert env["MNN_ROLLOUT_MODEL_CACHE"]["value"] == "/var/cache/mnn-rollout"
    assert env["MNN_ROLLOUT_DOWNLOAD_TIMEOUT_SECONDS"]["value"] == "120"
    assert env["MNN_ROLLOUT_DOWNLOAD_MAX_BYTES"]["value"] == str(4 * 1024**3)
    assert {"name": "model-cache", "mountPath": "/var/cache/mnn-rollout"} in container["volumeMounts"]
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert container["securityContext"]["readOnlyRootFilesystem"]  # the cache is the emptyDir, not the image
    # what the runtime reads is what the operator renders
    from mnn_runtime.sources import SourceSettings

    settings = SourceSettings.from_env({e["name"]: e["value"] for e in container["env"] if "value" in e})
    assert (str(settings.cache_dir), settings.timeout, settings.max_bytes) == ("/var/cache/mnn-rollout", 120,
                                                                               4 * 1024**3)


def test_token_secrets_give_the_runtime_its_tokens_through_the_kubelet() -> None:
    import kubernetes_validate

    dep = _deployment({"versions": S3_SPEC["versions"][:1], "runtime": {
        "feedback": {"secretName": "outcomes"}, "admin": {"secretName": "ops", "key": "profiling"}}})
    kubernetes_validate.validate(dep, "1.30", strict=True)
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MNN_ROLLOUT_FEEDBACK_TOKEN"] == {"name": "MNN_ROLLOUT_FEEDBACK_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "outcomes", "key": "token"}}}
    assert env["MNN_ROLLOUT_ADMIN_TOKEN"] == {"name": "MNN_ROLLOUT_ADMIN_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "ops", "key": "profiling"}}}
    plain = _deployment({"versions": S3_SPEC["versions"][:1]})
    plain_env = plain["spec"]["template"]["spec"]["containers"][0]["env"]
    assert not {"MNN_ROLLOUT_FEEDBACK_TOKEN", "MNN_ROLLOUT_ADMIN_TOKEN"} & {e["name"] for e in plain_env}
    for field in ("feedback", "admin"):
        for bad, message in (({"secretName": "Outcomes"}, "secretName 'Outcomes' is not a Secret name"),
                             ({"secretName": "o", "key": "a/b"}, "key 'a/b' is not a Secret key"), ({}, "secretName")):
            with pytest.raises(SpecError, match=f"spec.runtime.{field}.*{message}"):
                parse_spec({"versions": S3_SPEC["versions"][:1], "runtime": {field: bad}})


def test_without_a_model_source_the_pods_get_no_source_settings() -> None:
    plain = {"versions": S3_SPEC["versions"]}
    dep = _deployment(plain)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    # the download cache (the pod's /tmp) is the pod's own: the runtime prunes it
    assert {e["name"]: e.get("value") for e in container["env"][2:]} == {"MNN_ROLLOUT_MODEL_CACHE_PRUNE": "true"}
    assert [e["name"] for e in container["env"][:2]] == ["POD_NAMESPACE", "POD_NAME"]
    assert [m["name"] for m in container["volumeMounts"]] == ["tmp"]
    assert [v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]] == ["tmp"]
    # (an https:// version without modelSource downloads into the runtime's /tmp emptyDir)
    with_source = _deployment({**plain, "modelSource": {}})
    env = [e["name"] for e in with_source["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert "AWS_ACCESS_KEY_ID" not in env and "MNN_ROLLOUT_MODEL_CACHE" in env  # no s3: no keys, a cache all the same
    assert dep["metadata"]["annotations"] != with_source["metadata"]["annotations"]  # a change rolls the pods


@pytest.mark.parametrize(("source", "mount", "pruned"), [
    (None, None, True),
    (None, "/tmp/mnn-rollout-models", False),  # a volume of the user's (other pods may share it)
    (None, "/tmp/mnn-rollout-models/", False),
    (None, "/data", True),
    ({}, None, True),
    ({}, "/var/cache", True),  # the operator's cache volume, deeper, is mounted over it
    ({}, "/tmp/mnn-rollout-models", True),  # with modelSource the cache is elsewhere
])
def test_the_runtime_prunes_its_download_cache_only_when_the_pod_owns_it(
        source: dict[str, Any] | None, mount: str | None, pruned: bool) -> None:
    runtime = {"volumes": [{"name": "data", "emptyDir": {}}], "volumeMounts": [{"name": "data", "mountPath": mount}]}
    dep = _deployment({"versions": S3_SPEC["versions"], **({"modelSource": source} if source is not None else {}),
                       **({"runtime": runtime} if mount else {})})
    env = {e["name"]: e.get("value") for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env.get("MNN_ROLLOUT_MODEL_CACHE_PRUNE") == ("true" if pruned else None)


def test_a_secret_less_s3_source_uses_the_pods_own_identity() -> None:
    dep = _deployment({**S3_SPEC, "modelSource": {"s3": {"region": "us-east-2"}}})
    env = {e["name"]: e for e in dep["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "AWS_ACCESS_KEY_ID" not in env and "AWS_ENDPOINT_URL" not in env
    assert env["AWS_REGION"]["value"] == "us-east-2"


def test_children_written_back_canonically_by_the_api_server_are_not_drift(k8s_emulator: Any) -> None:
    """The API server stores quantities in canonical form (``sizeLimit: 1024Mi`` as ``1Gi``, ``cpu:
    0.5`` as ``500m``): the next reconcile finds every child as rendered, repairs nothing and writes
    nothing. Were one compared as text, every reconcile would re-apply it with a DriftRepaired Event."""
    import kubernetes

    from rollout_operator.kube import KubeClient
    from rollout_operator.ports import ClusterPorts

    spec = parse_spec({"versions": [{"name": "v1", "uri": "/m/v1.mnn"}], "runtime": {
        "resources": {"requests": {"cpu": 0.5, "memory": "1024Mi"}, "limits": {"memory": "2048Mi"}},
        "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "1024Mi"}},
                    {"name": "info", "downwardAPI": {"items": [{"path": "mem", "resourceFieldRef": {
                        "containerName": "runtime", "resource": "limits.memory", "divisor": "1024Ki"}}]}}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}, {"name": "info", "mountPath": "/info"}],
        "autoscaling": {"maxReplicas": 4, "targetInFlightPerPod": 2}}})
    target = children.Target("cache", "default")
    objs = children.render_all(target, spec, children.runtime_config(spec, "cache", {"v1": 100}, "v1", ["v1"]))
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(k8s_emulator.kubeconfig_path), client_configuration=cfg)
    kube = KubeClient(cfg, backoff_base=0.02)
    try:
        ports = ClusterPorts(kube)
        assert set(ports.write_children(objs).values()) == {"created"}
        live = kube.get("Deployment", "default", "cache-runtime")
        assert live is not None
        pod = live["spec"]["template"]["spec"]
        assert pod["volumes"][1]["emptyDir"] == {"sizeLimit": "1Gi"}  # as a real API server stores it
        assert pod["volumes"][2]["downwardAPI"]["items"][0]["resourceFieldRef"]["divisor"] == "1Mi"
        assert pod["containers"][0]["resources"]["requests"] == {"cpu": "500m", "memory": "1Gi"}
        writes = len(k8s_emulator.write_requests())
        assert set(ports.write_children(objs).values()) == {"unchanged"}  # no "repaired: ..."
        assert len(k8s_emulator.write_requests()) == writes
    finally:
        kube.close()
