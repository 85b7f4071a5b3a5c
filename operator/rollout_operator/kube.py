"""A small synchronous Kubernetes REST client for the operator and the CLI.

Credentials come from the kubernetes package's config loaders (in-cluster service account, or
KUBECONFIG), requests go through httpx. Only the calls the operator makes live here, which keeps
the RBAC it needs easy to derive from the code.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import httpx

from .children import HASH_ANNOTATION

USER_AGENT = "mnn-rollout-operator/0.1.0"

# kind -> (API prefix, plural)
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "ModelDeployment": ("/apis/mnnrollout.io/v1alpha1", "modeldeployments"),
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, reason: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


def load_configuration() -> Any:
    """The kubernetes package's Configuration: in-cluster first, then KUBECONFIG."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


class KubeClient:
    def __init__(self, configuration: Any | None = None, timeout: float = 10.0) -> None:
        self.configuration = configuration or load_configuration()
        cfg = self.configuration
        verify: Any = cfg.ssl_ca_cert if (cfg.verify_ssl and cfg.ssl_ca_cert) else bool(cfg.verify_ssl)
        cert = (cfg.cert_file, cfg.key_file) if cfg.cert_file else None
        self.http = httpx.Client(base_url=cfg.host, verify=verify, cert=cert, timeout=timeout,
                                 headers={"User-Agent": USER_AGENT})
        self.writes = 0  # create/replace/patch/delete calls made, for tests and metrics

    def close(self) -> None:
        self.http.close()

    # -- plumbing ------------------------------------------------------------------------------

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        cfg = self.configuration
        if cfg.refresh_api_key_hook is not None:
            cfg.refresh_api_key_hook(cfg)
        headers = {"Accept": "application/json"}
        token = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
        if token:
            headers["Authorization"] = token
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        if method != "GET":
            self.writes += 1
        resp = self.http.request(method, path, json=body if body is not None else None, params=params,
                                 headers=self._headers(content_type if body is not None else None))
        if resp.status_code >= 400:
            try:
                status = resp.json()
                raise ApiError(resp.status_code, str(status.get("message", resp.text)), str(status.get("reason", "")))
            except ValueError:
                raise ApiError(resp.status_code, resp.text[:300]) from None
        return resp.json() if resp.content else None

    @staticmethod
    def path(kind: str, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path

    # -- verbs ---------------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.request("GET", self.path(kind, namespace, name)))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        params = {"labelSelector": label_selector} if label_selector else None
        return list(self.request("GET", self.path(kind, namespace), params=params).get("items", []))

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return dict(self.request("POST", self.path(obj["kind"], meta["namespace"]), body=obj))

    def replace(self, obj: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        meta = obj["metadata"]
        return dict(self.request("PUT", self.path(obj["kind"], meta["namespace"], meta["name"], subresource),
                                 body=obj))

    def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
              subresource: str | None = None) -> dict[str, Any]:
        return dict(self.request("PATCH", self.path(kind, namespace, name, subresource), body=patch,
                                 content_type="application/merge-patch+json"))

    def delete(self, kind: str, namespace: str, name: str) -> None:
        try:
            self.request("DELETE", self.path(kind, namespace, name))
        except ApiError as exc:
            if exc.status != 404:
                raise

    def secret_value(self, namespace: str, name: str, key: str = "authorization") -> str | None:
        import base64

        secret = self.get("Secret", namespace, name)
        raw = ((secret or {}).get("data") or {}).get(key)
        return base64.b64decode(raw).decode().strip() if raw else None

    # -- reconcile helpers ---------------------------------------------------------------------

    def ensure(self, obj: dict[str, Any], attempts: int = 5) -> str:
        """Create ``obj`` or bring the live object to it; no write when its spec-hash matches.

        Returns "created", "updated" or "unchanged". A 409 (someone else wrote in between) is
        retried on a fresh read.
        """
        meta = obj["metadata"]
        for attempt in range(attempts):
            live = self.get(obj["kind"], meta["namespace"], meta["name"])
            try:
                if live is None:
                    self.create(obj)
                    return "created"
                annotations = live.get("metadata", {}).get("annotations") or {}
                if annotations.get(HASH_ANNOTATION) == meta["annotations"][HASH_ANNOTATION]:
                    return "unchanged"
                desired = _merge_for_replace(live, obj)
                self.replace(desired)
                return "updated"
            except ApiError as exc:
                if exc.status == 409 and attempt < attempts - 1:
                    time.sleep(0.05 * (attempt + 1))
                    continue
                raise
        raise AssertionError("unreachable")

    def ensure_all(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        return {f"{o['kind']}/{o['metadata']['name']}": self.ensure(o) for o in objs}


def _merge_for_replace(live: dict[str, Any], desired: dict[str, Any]) -> dict[str, Any]:
    """The desired object carrying the live identity (resourceVersion, uid, owners, others'
    labels/annotations), so a PUT replaces our fields and keeps everyone else's."""
    out = dict(desired)
    lm, dm = live.get("metadata", {}), desired["metadata"]
    meta = dict(dm)
    meta["resourceVersion"] = lm.get("resourceVersion")
    for key in ("uid", "creationTimestamp", "finalizers"):
        if key in lm:
            meta[key] = lm[key]
    meta["ownerReferences"] = dm.get("ownerReferences") or lm.get("ownerReferences", [])
    meta["labels"] = {**(lm.get("labels") or {}), **(dm.get("labels") or {})}
    meta["annotations"] = {**(lm.get("annotations") or {}), **(dm.get("annotations") or {})}
    out["metadata"] = meta
    if desired["kind"] == "Service" and "clusterIP" in live.get("spec", {}):
        out["spec"] = {**desired["spec"], "clusterIP": live["spec"]["clusterIP"]}
    return out
