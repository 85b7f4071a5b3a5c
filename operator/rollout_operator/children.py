"""Render the objects a ModelDeployment owns, as plain dicts (no I/O).

ConfigMap ``<name>-routing`` (the runtime config), Deployment ``<name>-runtime``, Service
``<name>``, PodDisruptionBudget ``<name>-runtime``, a ServiceAccount, Role and RoleBinding
``<name>-runtime`` that let the runtime read only its own ConfigMap, and, with
``runtime.autoscaling``, a HorizontalPodAutoscaler ``<name>-runtime``. Each carries
``mnnrollout.io/spec-hash``, the hash of what was rendered, so the operator writes a child only
when its rendering changed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from mnn_rollout.contract.config import (ADMIN_TOKEN_ENV, CONFIG_KEY, DEFAULT_MODEL_CACHE, DOWNLOAD_MAX_BYTES_ENV,
                                         DOWNLOAD_TIMEOUT_ENV, DRAIN_CONNECTIONS_SECONDS, DRAIN_IN_FLIGHT_SECONDS,
                                         FEEDBACK_TOKEN_ENV, MODEL_CACHE_ENV, MODEL_CACHE_PRUNE_ENV, YAML_LOADER,
                                         RuntimeConfig, dump_config)
from mnn_rollout.contract.routing import RoutingTable, decode

from .spec import (DEFAULT_IMAGE, MODEL_CACHE_DIR, MODEL_CACHE_VOLUME, AutoscalingSpec, ModelDeploymentSpec,
                   ModelSourceSpec, clean_dir, cpu_quantity, holds)

GROUP = "mnnrollout.io"
HASH_ANNOTATION = f"{GROUP}/spec-hash"
OWNER_LABEL = f"{GROUP}/modeldeployment"
PRESTOP_SECONDS = 5  # a terminating runtime pod keeps serving this long while endpoints drop it
# then SIGTERM: the runtime's drain (kept-alive connections close, then requests in flight end)
DRAIN_SECONDS = DRAIN_CONNECTIONS_SECONDS + DRAIN_IN_FLIGHT_SECONDS
RUNTIME_UID = 65532
DEFAULT_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}
IN_FLIGHT_METRIC = "mnn_inference_in_flight_requests"  # the runtime's gauge, per pod through the custom metrics API
# Children rendered only for some specs: one the spec no longer asks for is deleted (when this
# ModelDeployment owns it), not left to garbage collection.
OPTIONAL_KINDS = ("HorizontalPodAutoscaler",)


@dataclass(frozen=True)
class Target:
    """Where the children go and what they are named after."""

    name: str
    namespace: str
    owner: tuple[tuple[str, Any], ...] = ()  # the ownerReference, as items (hashable)

    @property
    def routing(self) -> str:
        return f"{self.name}-routing"

    @property
    def runtime(self) -> str:
        return f"{self.name}-runtime"


def child_name(kind: str, owner: str) -> str:
    """The name of the child of ``kind`` that the operator makes for the ModelDeployment ``owner``
    (``render_all``): an object of another name is no child of it, whatever owns it."""
    target = Target(owner, "")
    return {"ConfigMap": target.routing, "Service": target.name}.get(kind, target.runtime)


def owner_reference(body: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The controller ownerReference to a ModelDeployment, so children are garbage-collected."""
    meta = body["metadata"]
    return (("apiVersion", body.get("apiVersion", f"{GROUP}/v1alpha1")), ("kind", "ModelDeployment"),
            ("name", meta["name"]), ("uid", meta["uid"]), ("controller", True), ("blockOwnerDeletion", True))


def labels(target: Target) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "mnn-rollout-runtime",
        "app.kubernetes.io/instance": target.name,
        "app.kubernetes.io/component": "runtime",
        "app.kubernetes.io/managed-by": "mnn-rollout",
        OWNER_LABEL: target.name,
    }


def selector(target: Target) -> dict[str, str]:
    return {OWNER_LABEL: target.name, "app.kubernetes.io/component": "runtime"}


def selector_text(target: Target) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(target).items())


def digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _meta(target: Target, name: str, extra_annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": target.namespace, "labels": labels(target)}
    if target.owner:
        meta["ownerReferences"] = [dict(target.owner)]
    if extra_annotations:
        meta["annotations"] = dict(extra_annotations)
    return meta


def spec_hash(obj: Mapping[str, Any]) -> str | None:
    """The spec-hash annotation of a child (None when it has none)."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(HASH_ANNOTATION)


def drift(live: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The fields of a rendered child whose live value differs from what was rendered, as paths
    (``spec.replicas``, ``data[runtime.yaml].weights.v2``, ``metadata.labels[app]``). Only what the
    operator renders counts: fields the server defaults or others add are not drift. Quantities
    (``QUANTITY_PATH``) compare by value (the API server writes ``0.5`` back as ``500m``, ``1024Mi``
    as ``1Gi``); the routing config's YAML compares as data, so its edited keys are named. Lists
    merged by key (``LIST_KEYS``) compare the rendered items only: a sidecar container a webhook
    adds is not drift (nor ever removed by the operator's apply), a removed ownerReference is."""
    return [path for path, _ in drift_values(live, desired)]


def drift_values(live: Mapping[str, Any], desired: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``drift`` with the live value at each path (None where absent)."""
    out: list[tuple[str, Any]] = []
    for key, want in desired.items():
        if key in ("apiVersion", "kind", "status"):
            continue
        if key == "metadata":
            meta = live.get("metadata") or {}
            for part in ("labels", "annotations"):
                _diff(meta.get(part), want.get(part) or {}, f"metadata.{part}", out)
            if want.get("ownerReferences"):
                _diff(meta.get("ownerReferences"), want["ownerReferences"], "metadata.ownerReferences", out)
            continue
        _diff(live.get(key), want, key, out)
    return out


def _diff(live: Any, want: Any, path: str, out: list[tuple[str, Any]]) -> None:
    if isinstance(want, Mapping):
        if not isinstance(live, Mapping):
            out.append((path, live))
            return
        for key, value in want.items():
            sub = f"{path}.{key}" if _plain(key) else f"{path}[{key}]"
            _diff(live.get(key), value, sub, out)
    elif isinstance(want, list):
        keys = _list_keys(path, want)
        if keys is not None and isinstance(live, list):  # each rendered item, found by its key
            items = {_item_key(item, keys): item for item in live if isinstance(item, Mapping)}
            for n, value in enumerate(want):
                _diff(items.get(_item_key(value, keys)), value, f"{path}[{n}]", out)
            return
        if not isinstance(live, list) or len(live) != len(want):
            out.append((path, live))
            return
        for n, (have, value) in enumerate(zip(live, want)):
            _diff(have, value, f"{path}[{n}]", out)
    elif isinstance(want, str) and isinstance(live, str) and want != live and "\n" in want:
        parsed = _yaml_maps(live, want)  # the routing config: name the keys that differ
        if parsed is None:
            out.append((path, live))
        else:
            _diff(parsed[0], parsed[1], path, out)
    elif not _same_scalar(live, want, path):
        out.append((path, live))


# The lists server-side apply merges item by item (listType=map), by field name -> their key fields:
# an item another field manager added stays theirs.
LIST_KEYS: dict[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "env": ("name",), "volumes": ("name",),
    "volumeMounts": ("mountPath",), "imagePullSecrets": ("name",), "ownerReferences": ("uid",),
    "ports": ("containerPort", "port", "protocol")}


def _list_keys(path: str, want: list[Any]) -> tuple[str, ...] | None:
    """The key fields of the list at ``path`` when it is merged by key and every rendered item is an
    object (None: the list is atomic, compared whole)."""
    name = path.rsplit(".", 1)[-1]
    keys = LIST_KEYS.get(name)
    return keys if keys and all(isinstance(item, Mapping) for item in want) else None


def _item_key(item: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[Any, ...]:
    # a port's protocol defaults to TCP
    return tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys)


def _plain(key: str) -> bool:
    return key.replace("_", "").replace("-", "").isalnum()


def _yaml_maps(live: str, want: str) -> tuple[Any, Any] | None:
    import yaml

    try:
        a, b = yaml.load(live, Loader=YAML_LOADER), yaml.load(want, Loader=YAML_LOADER)
    except yaml.YAMLError:
        return None
    return (a, b) if isinstance(a, dict) and isinstance(b, dict) else None


# The quantity-typed fields (resource.Quantity) among those the operator renders, by path: the
# requests and limits of resources (a container's, an ephemeral volume's claim), an emptyDir's
# sizeLimit, a downward API divisor, an HPA target's value and averageValue. The API server stores
# each in canonical form (1024Mi as 1Gi, 0.5 as 500m), so they compare by value.
QUANTITY_PATH = re.compile(r"\.resources\.(requests|limits)(\.[^.\[\]]+|\[[^\]]+\])$"
                           r"|\.(sizeLimit|divisor|averageValue)$|\.target\.value$")


def _same_scalar(live: Any, want: Any, path: str) -> bool:
    if live == want and type(live) is type(want):
        return True
    if QUANTITY_PATH.search(path):
        from kubernetes.utils.quantity import parse_quantity

        try:
            return bool(parse_quantity(live) == parse_quantity(want))
        except (TypeError, ValueError):
            return False
    return False


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """Add the spec-hash annotation computed over everything else."""
    h = digest(obj)
    obj["metadata"].setdefault("annotations", {})[HASH_ANNOTATION] = h
    return obj


def runtime_config(
    spec: ModelDeploymentSpec, model: str, weights: Mapping[str, int], stable: str, versions: list[str],
    previous: Sequence[str] | None = None, shadow: tuple[str, int] | None = None,
) -> RuntimeConfig:
    """The runtime config for the versions currently routed, with the effective weights and the
    bucket table every pod serves: ``previous`` (the published one) evolved to those weights;
    ``shadow`` (version, percent): a shadow step's share of stable's requests also run on it."""
    data: dict[str, Any] = {
        "model": model,
        "versions": [spec.version(v).model_dump(exclude_none=True) for v in versions],
        "weights": {v: int(weights.get(v, 0)) for v in versions},
        "stable": stable,
        "routing": spec.routing.model_dump(exclude_none=True),
        "server": {"max_body_bytes": spec.runtime.max_body_bytes,
                   **({"idle_unload_seconds": spec.runtime.idle_unload_seconds}
                      if spec.runtime.idle_unload_seconds else {})},
    }
    if shadow is not None:
        data["shadow"] = {"version": shadow[0], "percent": shadow[1]}
    config = RuntimeConfig.model_validate(data)
    table = RoutingTable.build(config.salt, config.effective_weights(), config.stable_version, previous)
    # the table is built from this config's own weights: no second validation of the whole config
    return config.model_copy(update={"routing": config.routing.model_copy(update={"table": table.encode()})})


def published_owners(configmap: Mapping[str, Any] | None) -> tuple[str, ...] | None:
    """The bucket table a routing ConfigMap publishes (one version per bucket); None when there is
    none or it does not parse (then the next table starts afresh from the stable version)."""
    text = ((configmap or {}).get("data") or {}).get(CONFIG_KEY)
    return _owners_in(text) if isinstance(text, str) else None


@functools.lru_cache(maxsize=512)
def _owners_in(text: str) -> tuple[str, ...] | None:
    """(Cached: every reconcile reads the ConfigMap it wrote last, unchanged most of the time.)"""
    try:
        table = ((yaml.load(text, Loader=YAML_LOADER) or {}).get("routing") or {}).get("table")
        return decode(table) if isinstance(table, Mapping) else None
    except (ValueError, yaml.YAMLError, AttributeError):
        return None


def _stamped_content(live: Mapping[str, Any]) -> dict[str, Any]:
    """What ``stamped`` hashed of a routing ConfigMap, as ``live`` holds it now: its rendered fields only."""
    meta = live.get("metadata") or {}
    have = meta.get("labels") or {}
    out_meta: dict[str, Any] = {"name": meta.get("name"), "namespace": meta.get("namespace"),
                                "labels": {k: have[k] for k in labels(Target(str(have.get(OWNER_LABEL, "")), ""))
                                           if k in have}}
    owners = [o for o in meta.get("ownerReferences") or []
              if o.get("kind") == "ModelDeployment" and o.get("controller")]
    if owners:
        out_meta["ownerReferences"] = owners
    return {"apiVersion": live.get("apiVersion", "v1"), "kind": "ConfigMap", "metadata": out_meta,
            "data": {CONFIG_KEY: (live.get("data") or {}).get(CONFIG_KEY)}}


def stamp_holds(live: Mapping[str, Any]) -> bool:
    """Whether a routing ConfigMap still holds what its spec-hash annotation was computed over
    (False: its content was edited since an operator wrote it, the annotation kept)."""
    return spec_hash(live) == digest(_stamped_content(live))


def edited_unwatched(live: Mapping[str, Any]) -> bool:
    """Whether ``live`` is a routing ConfigMap an operator stamped and someone edited since: its
    spec-hash annotation is there but no longer the digest of what it holds."""
    return live.get("kind") == "ConfigMap" and spec_hash(live) is not None and not stamp_holds(live)


def _data_writer(live: Mapping[str, Any]) -> tuple[str, str] | None:
    """(manager, operation) of the field manager that owns the routing config's text (None: unknown)."""
    for entry in (live.get("metadata") or {}).get("managedFields") or []:
        if f"f:{CONFIG_KEY}" in ((entry.get("fieldsV1") or {}).get("f:data") or {}):
            return str(entry.get("manager")), str(entry.get("operation"))
    return None


def edited_since(live: Mapping[str, Any] | None, ours: Mapping[str, Any] | None, manager: str) -> bool:
    """Whether ``live`` is ``ours`` (the child as this operator last wrote or found it) edited since by
    another hand: it carries our stamp but not our content (``kubectl edit``), or it is an older
    rendering written over ours verbatim (its own stamp holds) by another field manager than the
    operator's (a GitOps tool re-applying an old copy). Another operator instance's newer write (under
    ``manager``, or when managedFields do not say who wrote) is not an edit: it is adopted."""
    if live is None or ours is None or not drift(live, ours):
        return False
    if spec_hash(live) == spec_hash(ours):
        return True
    writer = _data_writer(live) if live.get("kind") == "ConfigMap" else None
    return writer is not None and writer != (manager, "Apply") and stamp_holds(live)


def render_configmap(target: Target, config: RuntimeConfig) -> dict[str, Any]:
    return stamped({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(target, target.routing),
        "data": {CONFIG_KEY: dump_config(config)},
    })


def workers_arg(workers: int | None, resources: Mapping[str, Any], threads: int = 1) -> str:
    """``--workers`` for the runtime: as given, else one per ``threads`` CPUs the container may
    use (``threads``: the most a version's forward uses): its CPU limit, else its CPU request
    (rounded up, 1-64); ``auto`` (the runtime counts) without either. A pod without a CPU limit
    sees every core of its node, so the runtime's own count would be too many."""
    if workers is not None:
        return str(workers)
    for kind in ("limits", "requests"):
        cpu = (resources.get(kind) or {}).get("cpu")
        if cpu is not None:
            return str(max(1, min(64, math.ceil(cpu_quantity(cpu))) // threads))
    return "auto"


def _holds(mount: str, path: str) -> bool:
    """Whether a volume mounted at ``mount`` holds ``path`` (a mount at the root aside)."""
    mount = mount.rstrip("/")
    return bool(mount) and (path == mount or path.startswith(mount + "/"))


def download_cache_is_the_pods(spec: ModelDeploymentSpec) -> bool:
    """Whether the runtime's model download cache is an emptyDir of the pod's own (its /tmp, or
    with ``modelSource`` the cache volume), not a volume of ``runtime.volumeMounts`` that other pods
    may share: only then may the runtime remove files its config no longer names. The cache is on
    the deepest mount that holds it."""
    own = MODEL_CACHE_DIR if spec.model_source is not None else "/tmp"
    path = MODEL_CACHE_DIR if spec.model_source is not None else f"/tmp/{DEFAULT_MODEL_CACHE}"
    users = [str(m.get("mountPath", "")) for m in spec.runtime.volume_mounts]
    return not any(_holds(m, path) and len(m.rstrip("/")) > len(own) for m in users)


def cache_mounts(spec: ModelDeploymentSpec) -> list[tuple[str, str]]:
    """(volume name, path) of an emptyDir for each distinct ``versions[].engine.cacheDir`` that no
    mount holds already (the runtime's /tmp, the download cache of ``modelSource``, the user's
    ``runtime.volumeMounts`` or another cache directory), so no two mounts share a path: one the
    user mounted stays theirs (a PersistentVolumeClaim keeps the cache across pods; an emptyDir
    keeps it across container restarts). The spec's validation refuses a cacheDir that would hide
    a model file or is the download cache."""
    mounted = spec.pod_mounts()
    out: list[tuple[str, str]] = []
    for path in sorted({clean_dir(v.engine.cache_dir) for v in spec.versions if v.engine and v.engine.cache_dir}):
        if any(holds(m, path) for m in mounted):
            continue
        out.append((f"mnn-cache-{hashlib.sha256(path.encode()).hexdigest()[:8]}", path))
        mounted.append(path)
    return out


def model_source_env(source: ModelSourceSpec) -> list[dict[str, Any]]:
    """The runtime's environment for remote versions: its download cache and bounds and, for S3,
    the endpoint, the region and the keys from the Secret (read by the kubelet: neither the
    operator nor the runtime's ServiceAccount may read Secrets)."""
    env: list[dict[str, Any]] = [{"name": MODEL_CACHE_ENV, "value": MODEL_CACHE_DIR},
                                 {"name": DOWNLOAD_TIMEOUT_ENV, "value": str(source.timeout_seconds)},
                                 {"name": DOWNLOAD_MAX_BYTES_ENV, "value": str(source.max_bytes)}]
    s3 = source.s3
    if s3 is None:
        return env
    if s3.endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": s3.endpoint})
    if s3.region:
        env.append({"name": "AWS_REGION", "value": s3.region})
    if s3.secret_name:
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            ref: dict[str, Any] = {"name": s3.secret_name, "key": key}
            if key == "AWS_SESSION_TOKEN":
                ref["optional"] = True  # only temporary credentials have one
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def render_deployment(target: Target, spec: ModelDeploymentSpec, config: RuntimeConfig,
                      default_image: str = DEFAULT_IMAGE) -> dict[str, Any]:
    rt = spec.runtime
    pod_labels = {**rt.pod_labels, **labels(target)}
    annotations = {
        **rt.pod_annotations,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(rt.port),
        "prometheus.io/path": "/metrics",
    }
    container: dict[str, Any] = {
        "name": "runtime",
        "image": rt.image or default_image,
        "command": ["mnn-rollout"],
        "args": ["serve", "--configmap", f"$(POD_NAMESPACE)/{target.routing}", "--host", "0.0.0.0",
                 "--port", str(rt.port), "--workers", workers_arg(rt.workers, rt.resources or DEFAULT_RESOURCES,
                                                                 spec.max_threads())],
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [{"name": "http", "containerPort": rt.port, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"},
                           "periodSeconds": 2, "failureThreshold": 2, "timeoutSeconds": 2},
        "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                          "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 2},
        "startupProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"},
                         "periodSeconds": 2, "failureThreshold": 60},
        "resources": rt.resources or DEFAULT_RESOURCES,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *rt.volume_mounts,
                         *({"name": name, "mountPath": path} for name, path in cache_mounts(spec))],
        # Endpoints take a moment to drop a terminating pod: keep serving meanwhile, then SIGTERM
        # stops accepting and finishes what is in flight (within the grace period below).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
    }
    for env, token in ((FEEDBACK_TOKEN_ENV, rt.feedback), (ADMIN_TOKEN_ENV, rt.admin)):
        if token is not None:  # read by the kubelet: the operator may not read Secrets
            container["env"].append({"name": env, "valueFrom": {"secretKeyRef": {
                "name": token.secret_name, "key": token.key}}})
    if rt.image_pull_policy:
        container["imagePullPolicy"] = rt.image_pull_policy
    pod_spec: dict[str, Any] = {
        "serviceAccountName": target.runtime,
        "automountServiceAccountToken": True,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": RUNTIME_UID,
            "runAsGroup": RUNTIME_UID,
            "fsGroup": RUNTIME_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationGracePeriodSeconds": PRESTOP_SECONDS + DRAIN_SECONDS,
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, *rt.volumes,
                    *({"name": name, "emptyDir": {}} for name, _ in cache_mounts(spec))],
    }
    if download_cache_is_the_pods(spec):  # an emptyDir living through every rollout: the runtime prunes it
        container["env"].append({"name": MODEL_CACHE_PRUNE_ENV, "value": "true"})
    if spec.model_source is not None:  # remote versions: an emptyDir to download into, the S3 settings
        container["env"] += model_source_env(spec.model_source)
        container["volumeMounts"].append({"name": MODEL_CACHE_VOLUME, "mountPath": MODEL_CACHE_DIR})
        pod_spec["volumes"].append({"name": MODEL_CACHE_VOLUME, "emptyDir": {}})
    if rt.node_selector:
        pod_spec["nodeSelector"] = dict(rt.node_selector)
    if rt.tolerations:
        pod_spec["tolerations"] = list(rt.tolerations)
    # With autoscaling, replicas are not rendered: the operator's field manager lets go of them
    # and the HPA sets them (a field in the applied configuration would be forced back each time).
    replicas = {} if rt.autoscaling else {"replicas": rt.replicas}
    return stamped({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(target, target.runtime),
        "spec": {
            **replicas,
            "selector": {"matchLabels": selector(target)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": pod_spec},
        },
    })


def render_service(target: Target, spec: ModelDeploymentSpec) -> dict[str, Any]:
    return stamped({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(target, target.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(target),
            "ports": [{"name": "http", "port": spec.runtime.port, "targetPort": "http", "protocol": "TCP"}],
        },
    })


def render_rbac(target: Target) -> list[dict[str, Any]]:
    """ServiceAccount + Role + RoleBinding: get and watch of the routing ConfigMap only (the runtime
    reads it by name and watches it with ``fieldSelector=metadata.name=...``, which RBAC authorizes
    against ``resourceNames``; it never lists)."""
    return [
        stamped({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(target, target.runtime)}),
        stamped({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _meta(target, target.runtime),
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [target.routing],
                       "verbs": ["get", "watch"]}],
        }),
        stamped({
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(target, target.runtime),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": target.runtime},
            "subjects": [{"kind": "ServiceAccount", "name": target.runtime, "namespace": target.namespace}],
        }),
    ]


def render_pdb(target: Target) -> dict[str, Any]:
    """At most one runtime pod away at a time by voluntary disruption (a node drain): with one
    replica that still lets a drain through, with more it keeps the rest serving."""
    return stamped({
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(target, target.runtime),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(target)}},
    })


def milli_quantity(value: float) -> str:
    """A positive number as a Kubernetes quantity in the API server's canonical form (``4``,
    ``2500m``), to the thousandth."""
    milli = max(1, round(value * 1000))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def hpa_metric(scaling: AutoscalingSpec) -> dict[str, Any]:
    """The autoscaling/v2 metric of the one target: CPU utilization (of the pods' CPU requests) or
    the average of the runtime's in-flight gauge over the pods (a ``Pods`` metric, served by the
    custom metrics API, e.g. prometheus-adapter)."""
    if scaling.target_cpu_utilization_percentage is not None:
        return {"type": "Resource", "resource": {"name": "cpu", "target": {
            "type": "Utilization", "averageUtilization": scaling.target_cpu_utilization_percentage}}}
    assert scaling.target_in_flight_per_pod is not None  # the spec has exactly one target
    return {"type": "Pods", "pods": {"metric": {"name": IN_FLIGHT_METRIC}, "target": {
        "type": "AverageValue", "averageValue": milli_quantity(scaling.target_in_flight_per_pod)}}}


def render_hpa(target: Target, spec: ModelDeploymentSpec) -> dict[str, Any] | None:
    """The HorizontalPodAutoscaler of the runtime Deployment (None without ``runtime.autoscaling``)."""
    scaling = spec.runtime.autoscaling
    if scaling is None:
        return None
    return stamped({
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _meta(target, target.runtime),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": target.runtime},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": [hpa_metric(scaling)],
        },
    })


def render_all(target: Target, spec: ModelDeploymentSpec, config: RuntimeConfig,
               default_image: str = DEFAULT_IMAGE) -> list[dict[str, Any]]:
    """Every child, in creation order (RBAC before the pods that need it; the HPA after the
    Deployment it scales)."""
    hpa = render_hpa(target, spec)
    return [
        *render_rbac(target),
        render_configmap(target, config),
        render_deployment(target, spec, config, default_image),
        render_service(target, spec),
        render_pdb(target),
        *([hpa] if hpa else []),
    ]


def unrendered(target: Target, spec: ModelDeploymentSpec) -> list[dict[str, Any]]:
    """The optional children (``OPTIONAL_KINDS``) this spec does not render, as stubs naming them:
    the operator deletes each one that exists and that this ModelDeployment owns."""
    stubs = []
    if spec.runtime.autoscaling is None:
        stubs.append({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                      "metadata": {"name": target.runtime, "namespace": target.namespace}})
    return stubs


def replicas_handover(desired: Mapping[str, Any], live: Mapping[str, Any] | None,
                      manager: str) -> dict[str, Any] | None:
    """When a Deployment is rendered without ``spec.replicas`` (autoscaling) while ``manager``
    still owns the live value: the value, as an apply configuration for a second field manager.
    Applied before the rendering, it keeps the field when ``manager`` lets go of it; otherwise the
    API server would remove it and default it to 1 (every pod but one gone until the HPA scales
    up again). The HPA takes the field over from there with its first change."""
    if live is None or desired.get("kind") != "Deployment" or "replicas" in (desired.get("spec") or {}):
        return None
    replicas = (live.get("spec") or {}).get("replicas")
    owned = any(entry.get("manager") == manager and entry.get("operation") == "Apply"
                and "f:replicas" in ((entry.get("fieldsV1") or {}).get("f:spec") or {})
                for entry in (live.get("metadata") or {}).get("managedFields") or [])
    if replicas is None or not owned:
        return None
    meta = desired["metadata"]
    return {"apiVersion": desired["apiVersion"], "kind": "Deployment",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]}, "spec": {"replicas": replicas}}


def owner_uid(target: Target) -> str:
    """The uid of the ModelDeployment that ``target``'s children belong to ("" when unknown)."""
    return str(dict(target.owner).get("uid", ""))
