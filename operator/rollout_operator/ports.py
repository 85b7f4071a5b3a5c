"""The ports through which the ``Reconciler`` touches the world, and their cluster implementation.

The reconcile loop needs four things besides the pure ``decide()``: read the live object, write
its children, store its status and observe its pods (metrics are read by the ``Analyzer``'s
providers). In a cluster they are Kubernetes API calls; the local demo implements the same
protocol against a config file and one runtime process (``mnn_rollout.demo.ports``), so both run
the same reconcile code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from . import children
from .kube import KubeClient
from .observe import Observation, pod_views, scrape



class Ports(Protocol):
    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The live ModelDeployment, or None when it is gone."""

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        """Create or update each rendered child; ``Kind/name`` -> created, updated or unchanged."""

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        """Replace the whole status of ``body`` (decided from its resourceVersion)."""

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        """The runtime pods of ``target`` and what each has loaded."""


class ClusterPorts:
    """The ports over the Kubernetes API."""

    def __init__(self, kube: KubeClient) -> None:
        self.kube = kube

    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.kube.get("ModelDeployment", namespace, name)

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        return self.kube.ensure_all(objs)

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> None:
        # PUT, not a merge patch: a merge patch would keep map keys (weights) that were removed;
        # the body's resourceVersion makes a concurrent writer's change a 409, retried later.
        self.kube.replace({**body, "status": status}, subresource="status")

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        pods = self.kube.list("Pod", target.namespace, children.selector_text(target))
        return scrape(pod_views(pods, port), model)
