"""Render helm/mnn-rollout with the real Helm engine (helm-python-sdk) and look into the result."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "mnn-rollout"
RELEASE = "mnn-rollout"
NAMESPACE = "mnn-rollout"

# Values for a non-default install: namespaced, every monitoring object on, an existing webhook
# Secret, 3 replicas, and a few other knobs changed.
NON_DEFAULT: dict[str, Any] = {
    "replicas": 3,
    "watchNamespaces": ["team-a", "team-b"],
    "peering": {"priority": 0},
    "resyncSeconds": 0.5,
    "webhook": {"existingSecret": "alertmanager-token", "secretKey": "bearer"},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "runtimeMonitor": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "alertmanagerConfig": {"enabled": True},
    "grafanaDashboard": {"enabled": True},
    "image": {"tag": "0.1.0-rc1", "digest": "sha256:" + "a" * 64},
    "extraEnv": [{"name": "LOG_FORMAT", "value": "json"}],
    "podLabels": {"team": "ml-platform"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}],
}


@dataclass(frozen=True)
class Rendered:
    values: dict[str, Any]
    files: dict[str, str]  # template path -> rendered text
    objects: tuple[dict[str, Any], ...]  # every object of every template, in template order
    crds: tuple[dict[str, Any], ...]  # the objects under crds/
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"{len(found)} {kind} objects named {name!r}"
        return found[0]

    @property
    def deployment(self) -> dict[str, Any]:
        return self.one("Deployment")

    @property
    def operator_container(self) -> dict[str, Any]:
        containers = self.deployment["spec"]["template"]["spec"]["containers"]
        return next(c for c in containers if c["name"] == "operator")


def _freeze(values: dict[str, Any] | None) -> str:
    return json.dumps(values or {}, sort_keys=True)


@functools.lru_cache(maxsize=32)
def _render(frozen: str, name: str, namespace: str) -> Rendered:
    import helm_python as helm

    values = json.loads(frozen)
    with helm.Chart.load(CHART) as chart:
        files = chart.render(values, name=name, namespace=namespace)
        crd_files = chart.crds
    objects: list[dict[str, Any]] = []
    notes = ""
    for path in sorted(files):
        if path.endswith("NOTES.txt"):
            notes = files[path]
            continue
        objects.extend(d for d in yaml.safe_load_all(files[path]) if d)
    crds = [d for f in crd_files for d in yaml.safe_load_all(f["data"]) if d]
    return Rendered(values, files, tuple(objects), tuple(crds), notes)


def render(values: dict[str, Any] | None = None, name: str = RELEASE, namespace: str = NAMESPACE) -> Rendered:
    """The chart rendered as `helm template` would (cached per arguments; do not mutate)."""
    return _render(_freeze(values), name, namespace)


def validate_values(values: dict[str, Any]) -> None:
    """Raise helm_python.HelmValuesError when values.schema.json refuses ``values``."""
    import helm_python as helm

    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)


def expand_rules(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """RBAC rules -> {(apiGroup, resource, verb)}; refuses what this expansion cannot express."""
    out = set()
    for rule in rules:
        assert not rule.get("resourceNames") and not rule.get("nonResourceURLs"), rule
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    out.add((group, resource, verb))
    return out
