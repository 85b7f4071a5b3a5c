"""The ModelDeployment spec as pydantic models, and the operator's own validation of it.

The CRD schema (crds/modeldeployment.yaml) says the same things, but it is not enforced
everywhere (older clusters without CEL, `--validate=false`, the test emulator), so the operator
validates every spec itself before acting. Messages name the field, the value and what is valid.
"""

from __future__ import annotations

import functools
import json
import math
import re
from importlib import resources as package_files
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mnn_rollout.contract.config import DNS1123_LABEL, VersionSpec, check_versions, format_validation_error

DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(ms|s|m|h))+$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
BUILTIN_METRICS = ("error-rate", "latency-p50", "latency-p95", "latency-p99")
DEFAULT_IMAGE = "ghcr.io/mnn-rollout/mnn-rollout:0.1.0"
MAX_REPLICAS = 1000
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


class SpecError(ValueError):
    """An invalid ModelDeployment spec; the message names field and value."""


def parse_duration(text: str) -> float:
    """'1h30m' -> 5400.0 seconds; raises ValueError naming the text."""
    if not isinstance(text, str) or not DURATION.match(text):
        raise ValueError(f"{text!r} is not a duration; valid: e.g. 500ms, 30s, 5m, 1h30m")
    return sum(float(n) * _UNIT[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", text))


def cpu_quantity(value: Any) -> float:
    """A Kubernetes CPU quantity ("2", "1.5", "500m", 2) in CPUs; ValueError naming the value."""
    text = str(value).strip()
    try:
        cpus = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        cpus = -1.0
    if not cpus > 0:
        raise ValueError(f"{value!r} is not a CPU quantity; valid: e.g. 2, 1.5, 500m")
    return cpus


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Step(_Model):
    weight: int = Field(ge=0, le=100)
    pause: str | None = None

    @field_validator("pause")
    @classmethod
    def _pause(cls, value: str | None) -> str | None:
        if value is not None:
            parse_duration(value)
        return value

    @property
    def pause_seconds(self) -> float | None:
        return None if self.pause is None else parse_duration(self.pause)


class ProviderSpec(_Model):
    type: Literal["direct", "prometheus"] = "direct"
    address: str | None = None
    timeout: str = "5s"
    secret_ref: dict[str, str] | None = Field(default=None, alias="secretRef")

    @model_validator(mode="after")
    def _address(self) -> ProviderSpec:
        parse_duration(self.timeout)
        if self.type == "prometheus" and not self.address:
            raise ValueError("address: required when provider type is prometheus (e.g. http://prometheus:9090)")
        return self


class MetricSpec(_Model):
    name: str
    max: float | None = None
    min: float | None = None
    max_error_rate_increase: float | None = Field(default=None, alias="maxErrorRateIncrease", ge=0)
    max_latency_ratio: float | None = Field(default=None, alias="maxLatencyRatio", ge=0)
    query: str | None = None  # PromQL (prometheus provider)
    metric: str | None = None  # a series on the runtime pods' /metrics (either provider)
    labels: dict[str, str] = Field(default_factory=dict)  # more exact label matchers for ``metric``
    per_request: bool = Field(default=False, alias="perRequest")

    @model_validator(mode="after")
    def _shape(self) -> MetricSpec:
        if self.name not in BUILTIN_METRICS and not self.query and not self.metric:
            raise ValueError(
                f"metric {self.name!r} is not built in ({', '.join(BUILTIN_METRICS)}) and has neither query "
                "(PromQL) nor metric (a series the runtime pods export)"
            )
        if self.query and self.metric:
            raise ValueError(f"metric {self.name!r}: set either query (PromQL) or metric (a series name), not both")
        if self.metric is not None and not METRIC_NAME.match(self.metric):
            raise ValueError(f"metric {self.name!r}: {self.metric!r} is not a Prometheus metric name")
        if self.name in BUILTIN_METRICS and (self.query or self.metric):
            raise ValueError(f"metric {self.name!r} is built in: it takes no query or metric; give a custom name")
        if self.max is None and self.min is None and self.max_error_rate_increase is None \
                and self.max_latency_ratio is None:
            raise ValueError(f"metric {self.name!r} needs a threshold: max, min, maxErrorRateIncrease "
                             "or maxLatencyRatio")
        if self.max_error_rate_increase is not None and self.name != "error-rate":
            raise ValueError(f"maxErrorRateIncrease applies to error-rate, not {self.name!r}")
        if self.max_latency_ratio is not None and not self.name.startswith("latency-"):
            raise ValueError(f"maxLatencyRatio applies to latency-p50/p95/p99, not {self.name!r}")
        return self


class AnalysisSpec(_Model):
    interval: str = "10s"
    min_requests: int = Field(default=20, ge=0, alias="minRequests")
    failure_limit: int = Field(default=2, ge=1, alias="failureLimit")
    provider: ProviderSpec = Field(default_factory=ProviderSpec)
    metrics: list[MetricSpec] = Field(default_factory=lambda: [MetricSpec(name="error-rate", max=0.05)])

    @model_validator(mode="after")
    def _provider_can_read_every_metric(self) -> AnalysisSpec:
        if self.provider.type == "direct":
            for i, m in enumerate(self.metrics):
                if m.query:
                    raise ValueError(
                        f"metrics.{i}.query: {m.query!r} is PromQL, which the direct provider cannot run; set "
                        "provider.type: prometheus, or name a series the pods export with metric (and labels)")
        return self

    @field_validator("interval")
    @classmethod
    def _interval(cls, value: str) -> str:
        if parse_duration(value) < 1:
            raise ValueError(f"interval {value!r} is below the minimum of 1s")
        return value

    @property
    def interval_seconds(self) -> float:
        return parse_duration(self.interval)


class StrategySpec(_Model):
    steps: list[Step] = Field(
        default_factory=lambda: [Step(weight=10, pause="30s"), Step(weight=50, pause="30s")], min_length=1,
        max_length=50,
    )
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)
    scale_down_delay_seconds: float = Field(default=30, ge=0, alias="scaleDownDelaySeconds")


class RoutingSpec(_Model):
    header: str = "X-User-Id"
    parameter: str = "user_id"
    salt: str | None = None


RESERVED_VOLUME = "tmp"  # the runtime's own emptyDir at /tmp (its root filesystem is read-only)
# with spec.modelSource: the emptyDir the runtime downloads remote model files into
MODEL_CACHE_VOLUME, MODEL_CACHE_DIR = "model-cache", "/var/cache/mnn-rollout"


@functools.cache
def _pod_field_validators() -> dict[str, Any]:
    """A JSON-schema validator per pass-through field, from the Kubernetes schemas in
    podfields.json (generated by crds/podfields.py)."""
    from jsonschema import Draft202012Validator

    doc = json.loads(package_files.files(__package__).joinpath("podfields.json").read_text())
    return {field: Draft202012Validator({"$defs": doc["$defs"], **schema}) for field, schema in doc["fields"].items()}


def pod_field_errors(raw: dict[str, Any]) -> list[str]:
    """Problems with the fields of ``runtime`` that go into the pods as they are, checked as the API
    server would check them (its schemas: types, required fields, unknown fields, quantities; and
    that every mount names a volume), each ``field.path: message``."""
    errors = []
    for field, validator in _pod_field_validators().items():
        if field not in raw:
            continue
        found = sorted(validator.iter_errors(raw[field]), key=lambda e: [str(p) for p in e.absolute_path])
        for err in found[:3]:
            where = "".join(f".{p}" for p in err.absolute_path)
            message = f"{err.instance!r} is not a quantity; valid: e.g. 500m, 2, 1.5, 512Mi, 2Gi" \
                if err.validator == "pattern" else err.message
            errors.append(f"{field}{where}: {message}")
    if errors:
        return errors
    errors.extend(_toleration_errors(raw.get("tolerations") or []))
    names = [v.get("name") for v in raw.get("volumes") or []]
    for n, name in enumerate(names):
        if name in (RESERVED_VOLUME, MODEL_CACHE_VOLUME):
            errors.append(f"volumes.{n}.name: {name!r} is the runtime's own volume; choose another name")
        elif name in names[:n]:
            errors.append(f"volumes.{n}.name: {name!r} is used by another volume")
    paths: list[str] = ["/tmp", MODEL_CACHE_DIR]
    for n, mount in enumerate(raw.get("volumeMounts") or []):
        if mount.get("name") not in names:
            errors.append(f"volumeMounts.{n}.name: {mount.get('name')!r} names no volume in runtime.volumes "
                          f"(valid: {', '.join(map(repr, names)) or 'none'})")
        if mount.get("mountPath") in paths:
            errors.append(f"volumeMounts.{n}.mountPath: {mount.get('mountPath')!r} is already mounted")
        paths.append(mount.get("mountPath"))
    return errors


TOLERATION_OPERATORS = ("Equal", "Exists")
TOLERATION_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _toleration_errors(tolerations: list[dict[str, Any]]) -> list[str]:
    """What the API server's Go validation of tolerations refuses (its schema has no enums)."""
    errors = []
    for n, t in enumerate(tolerations):
        op, effect = t.get("operator") or "Equal", t.get("effect") or ""
        if op not in TOLERATION_OPERATORS:
            errors.append(f"tolerations.{n}.operator: {op!r} is not supported; valid: Equal, Exists")
        if op == "Exists" and t.get("value"):
            errors.append(f"tolerations.{n}.value: {t['value']!r}: must be empty when operator is Exists")
        if not t.get("key") and op != "Exists":
            errors.append(f"tolerations.{n}.operator: {op!r}: must be Exists when key is empty")
        if effect and effect not in TOLERATION_EFFECTS:
            errors.append(f"tolerations.{n}.effect: {effect!r} is not supported; valid: "
                          + ", ".join(TOLERATION_EFFECTS))
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            errors.append(f"tolerations.{n}.tolerationSeconds: only with effect NoExecute (effect is {effect!r})")
    return errors


class AutoscalingSpec(_Model):
    """A HorizontalPodAutoscaler on the runtime Deployment, on one target (the HPA's own bounds:
    replicas at least 1, a utilization or an average value above 0)."""

    min_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS, alias="minReplicas")
    max_replicas: int = Field(ge=1, le=MAX_REPLICAS, alias="maxReplicas")
    # percent of the runtime container's CPU request; above 100 is valid when its limit is higher
    target_cpu_utilization_percentage: int | None = Field(default=None, ge=1, alias="targetCPUUtilizationPercentage")
    # inference requests in flight per pod, on average (rendered in thousandths: a quantity in m)
    target_in_flight_per_pod: float | None = Field(default=None, ge=0.001, alias="targetInFlightPerPod")

    @model_validator(mode="after")
    def _shape(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"minReplicas: {self.min_replicas} is above maxReplicas ({self.max_replicas}); "
                             f"valid: 1 to {self.max_replicas}")
        cpu, in_flight = self.target_cpu_utilization_percentage, self.target_in_flight_per_pod
        if cpu is not None and in_flight is not None:
            raise ValueError(f"targetCPUUtilizationPercentage ({cpu}) and targetInFlightPerPod ({in_flight}): set "
                             "one target, not both")
        if cpu is None and in_flight is None:
            raise ValueError("a target is required: targetCPUUtilizationPercentage (percent of the CPU request) or "
                             "targetInFlightPerPod (requests in flight per pod)")
        return self


def has_cpu_request(resources: dict[str, Any]) -> bool:
    """Whether the runtime container gets a CPU request: its own, one defaulted from its CPU limit
    (as the API server does), or the operator's default resources (when none are given)."""
    if not resources:
        return True
    return any("cpu" in (resources.get(kind) or {}) for kind in ("requests", "limits"))


class RuntimeSpec(_Model):
    image: str | None = None  # None: the operator's --runtime-image
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = Field(default=None,
                                                                                 alias="imagePullPolicy")
    replicas: int = Field(default=2, ge=0, le=MAX_REPLICAS)  # ignored while autoscaling is set
    autoscaling: AutoscalingSpec | None = None
    workers: int | None = Field(default=None, ge=1, le=64)  # None: one per CPU of the pod's limit
    port: int = Field(default=8080, ge=1024, le=65535)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, alias="maxBodyBytes")
    # unload a version with weight 0 (not stable) after this long without a request; None: never
    idle_unload_seconds: float | None = Field(default=None, ge=1, alias="idleUnloadSeconds")
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    volumes: list[dict[str, Any]] = Field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = Field(default_factory=list, alias="volumeMounts")
    pod_annotations: dict[str, str] = Field(default_factory=dict, alias="podAnnotations")
    pod_labels: dict[str, str] = Field(default_factory=dict, alias="podLabels")

    @model_validator(mode="before")
    @classmethod
    def _pod_fields(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            errors = pod_field_errors(raw)
            if errors:
                raise ValueError("; ".join(errors))
        return raw

    @field_validator("resources")
    @classmethod
    def _cpu_quantities(cls, value: dict[str, Any]) -> dict[str, Any]:
        for kind in ("limits", "requests"):
            section = value.get(kind)
            if isinstance(section, dict) and "cpu" in section:
                try:
                    cpu_quantity(section["cpu"])
                except ValueError as exc:
                    raise ValueError(f"{kind}.cpu: {exc}") from None
        return value

    @model_validator(mode="after")
    def _cpu_target_needs_a_request(self) -> RuntimeSpec:
        """The HPA computes CPU utilization against the container's CPU request."""
        cpu = self.autoscaling.target_cpu_utilization_percentage if self.autoscaling else None
        if cpu is not None and not has_cpu_request(self.resources):
            raise ValueError(f"autoscaling.targetCPUUtilizationPercentage: {cpu} needs a CPU request, and resources "
                             f"{self.resources!r} has neither requests.cpu nor limits.cpu; add one (e.g. "
                             "requests.cpu: 500m) or use targetInFlightPerPod")
        return self


SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # DNS-1123 subdomain
S3_ENDPOINT = re.compile(r"^https?://[^/\s?#@]+/?$")


class S3SourceSpec(_Model):
    """Where ``s3://`` versions come from: an S3-compatible endpoint and the Secret holding the keys
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, optionally ``AWS_SESSION_TOKEN``, as KServe's
    S3 Secrets). Without ``secretName`` the pod's own identity is used (IRSA, pod identity)."""

    endpoint: str | None = None  # None: AWS S3 of the region
    region: str | None = None
    secret_name: str | None = Field(default=None, alias="secretName")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None and not S3_ENDPOINT.match(value):
            raise ValueError(f"endpoint {value!r} is not an http(s)://HOST[:PORT] URL; valid: e.g. "
                             "https://s3.eu-west-1.amazonaws.com, http://minio.storage:9000")
        return value

    @field_validator("region")
    @classmethod
    def _region(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[A-Za-z0-9_-]{1,64}$", value):
            raise ValueError(f"region {value!r} is not a region name; valid: e.g. us-east-1")
        return value

    @field_validator("secret_name")
    @classmethod
    def _secret_name(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 253 or not SECRET_NAME.match(value)):
            raise ValueError(f"secretName {value!r} is not a Secret name (a DNS-1123 subdomain)")
        return value


class ModelSourceSpec(_Model):
    """How the runtime pods fetch remote versions (``https://``, ``s3://``): the S3 endpoint and
    credentials, and the bounds of one download. The pods download into an emptyDir of their own."""

    s3: S3SourceSpec | None = None
    timeout_seconds: int = Field(default=600, ge=1, le=86400, alias="timeoutSeconds")
    max_bytes: int = Field(default=4 * 1024**3, ge=1, alias="maxBytes")


class ModelDeploymentSpec(_Model):
    model: str | None = None
    versions: list[VersionSpec] = Field(min_length=1, max_length=16)
    stable: str | None = None
    weights: dict[str, int] = Field(default_factory=dict)
    canary: str | None = None
    strategy: StrategySpec = Field(default_factory=StrategySpec)
    progress_deadline_seconds: int = Field(default=600, ge=1, alias="progressDeadlineSeconds")
    paused: bool = False
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)
    model_source: ModelSourceSpec | None = Field(default=None, alias="modelSource")

    @model_validator(mode="after")
    def _cross_field(self) -> ModelDeploymentSpec:
        check_versions(self.versions, self.weights, {"stable": self.stable, "canary": self.canary})
        if self.canary is not None and self.weights:
            raise ValueError("weights and canary: set either weights (a static split) or canary, not both")
        if self.canary is not None and self.canary == self.stable:
            raise ValueError(f"canary: {self.canary!r} is also the stable version; choose another version")
        interval = self.strategy.analysis.interval_seconds
        if self.canary is not None and self.progress_deadline_seconds <= interval:
            raise ValueError(f"progressDeadlineSeconds: {self.progress_deadline_seconds} is not longer than "
                             f"strategy.analysis.interval ({self.strategy.analysis.interval}): no step could ever "
                             "be analysed before the deadline")
        self._threads_fit_the_cpu_limit()
        return self

    def _threads_fit_the_cpu_limit(self) -> None:
        """``runtime.workers`` x the most ``engine.threads`` of a version must fit the CPU limit
        (rounded up, as the runtime counts CPUs): more threads than CPUs only wait for each other."""
        threads = self.max_threads()
        cpu = (self.runtime.resources.get("limits") or {}).get("cpu")
        if threads <= 1 or cpu is None:
            return
        cpus = math.ceil(cpu_quantity(cpu))
        workers = self.runtime.workers if self.runtime.workers is not None else max(1, cpus // threads)
        if workers * threads > cpus:
            index = next(i for i, v in enumerate(self.versions) if v.engine and v.engine.threads == threads)
            given = f"runtime.workers {workers}" if self.runtime.workers is not None else "1 worker (the least)"
            cpus_text = f"{cpus} CPU{'s' if cpus > 1 else ''}"
            raise ValueError(
                f"versions.{index}.engine.threads: {threads} (version {self.versions[index].name!r}) x {given} = "
                f"{workers * threads} threads, more than runtime.resources.limits.cpu {cpu!r} allows ({cpus_text}, "
                "rounded up); lower the threads or runtime.workers, or raise the CPU limit")

    def max_threads(self) -> int:
        """The most CPU threads one forward of any version uses (``versions[].engine.threads``)."""
        return max(v.engine.threads if v.engine else 1 for v in self.versions)

    def model_name(self, default: str) -> str:
        return self.model or default

    def version(self, name: str) -> VersionSpec:
        return next(v for v in self.versions if v.name == name)


def parse_spec(raw: Any) -> ModelDeploymentSpec:
    """Validate a spec dict from the API; SpecError lists every problem with its field path."""
    if not isinstance(raw, dict):
        raise SpecError(f"spec: expected an object, got {type(raw).__name__}")
    try:
        return ModelDeploymentSpec.model_validate(raw)
    except ValidationError as exc:
        raise SpecError(format_validation_error(exc, prefix="spec.")) from None


def is_dns_label(text: str) -> bool:
    return bool(DNS1123_LABEL.match(text)) and len(text) <= 63
