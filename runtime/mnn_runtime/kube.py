"""A minimal Kubernetes API reader for the runtime: get and watch one ConfigMap.

The runtime image should not carry the full kubernetes client for two GET calls, so this speaks
the API with the standard library. In a pod it uses the service account (token and CA under
/var/run/secrets/kubernetes.io/serviceaccount); ``MNN_ROLLOUT_KUBE_API`` (with optional
``MNN_ROLLOUT_KUBE_TOKEN_FILE`` and ``MNN_ROLLOUT_KUBE_CA_FILE``) points it elsewhere.
"""

from __future__ import annotations

import http.client
import json
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlparse

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubeError(Exception):
    """The API answered with an error; ``code`` is the HTTP status (410 = resourceVersion too old)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(frozen=True)
class KubeAPI:
    base_url: str
    token_file: Path | None = None
    ca_file: Path | None = None

    @classmethod
    def from_environment(cls) -> KubeAPI:
        url = os.environ.get("MNN_ROLLOUT_KUBE_API")
        if url:
            token = os.environ.get("MNN_ROLLOUT_KUBE_TOKEN_FILE")
            ca = os.environ.get("MNN_ROLLOUT_KUBE_CA_FILE")
            return cls(url.rstrip("/"), Path(token) if token else None, Path(ca) if ca else None)
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubeError(0, "not in a cluster: KUBERNETES_SERVICE_HOST and MNN_ROLLOUT_KUBE_API are unset")
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", SA_DIR / "token", SA_DIR / "ca.crt")

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        u = urlparse(self.base_url)
        if u.scheme == "https":
            ctx = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            return http.client.HTTPSConnection(u.hostname or "", u.port or 443, timeout=timeout, context=ctx)
        return http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None and self.token_file.is_file():
            # Re-read every time: bound service account tokens are rotated on disk.
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        return headers

    def get_configmap(self, namespace: str, name: str, timeout: float = 10) -> dict[str, Any]:
        conn = self._connection(timeout)
        try:
            conn.request("GET", f"/api/v1/namespaces/{quote(namespace)}/configmaps/{quote(name)}",
                         headers=self._headers())
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise KubeError(resp.status, _message(body))
        return dict(json.loads(body))

    def watch_configmap(
        self, namespace: str, name: str, resource_version: str, timeout_seconds: int = 60
    ) -> Iterator[dict[str, Any]]:
        """Yield watch events for one ConfigMap from ``resource_version`` until the server ends
        the stream; ERROR events are raised as KubeError."""
        query = urlencode({
            "watch": "true", "fieldSelector": f"metadata.name={name}", "resourceVersion": resource_version,
            "timeoutSeconds": str(timeout_seconds), "allowWatchBookmarks": "true",
        })
        conn = self._connection(timeout_seconds + 15)
        try:
            conn.request("GET", f"/api/v1/namespaces/{quote(namespace)}/configmaps?{query}", headers=self._headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise KubeError(resp.status, _message(resp.read()))
            while True:
                line = resp.readline()
                if not line:
                    return
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object", {})
                    raise KubeError(int(status.get("code", 500)), str(status.get("message", "watch error")))
                yield event
        finally:
            conn.close()


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body).get("message", body[:200]))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
