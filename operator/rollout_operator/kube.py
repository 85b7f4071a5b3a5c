"""The operator's (and the CLI's) one Kubernetes client: a thin layer over the official
``kubernetes`` package's ``ApiClient``.

The library does the transport: credentials (in-cluster service account with token refresh,
KUBECONFIG with tokens, exec plugins or client certificates), TLS, proxies, the urllib3 connection
pool and JSON serialization. This module adds what the operator needs on top, for the few calls it
makes (which keeps the RBAC it needs derivable from the code, see tests/helm/rbac.py):

* plain dicts in and out, by kind (``RESOURCES``), errors as :class:`ApiError` (status, reason,
  message of the server's Status);
* retries with exponential backoff and jitter on 429 (no sooner than its Retry-After), on
  500/502/503/504 and on connection errors, for a bounded number of attempts. A request the server
  may have acted on before failing (a 5xx, a connection lost after sending) is repeated only when
  repeating it is harmless: every verb but a POST without a name. A PUT carries its
  resourceVersion and a named POST its name, so a repeat after a lost success answers 409; a
  server-side apply (how the operator writes its children) is idempotent;
* a client-side rate limit shared by every thread using the client (a token bucket: ``burst``
  requests at once, ``qps`` per second sustained; client-go's defaults for controllers are 20/30);
* server-side apply (:meth:`KubeClient.apply`; :meth:`KubeClient.apply_created` also says whether
  it created the object, from the answer's status: 201 or 200);
* counters for metrics: ``writes``, ``retries`` (and ``retries_by_reason``), ``throttled`` and
  ``throttle_seconds``.

``kubernetes`` is imported when a client is built, not with this module: it costs ~0.35 s.
"""

from __future__ import annotations

import copy
import email.utils
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any


log = logging.getLogger(__name__)

USER_AGENT = "mnn-rollout-operator/0.1.0"
FIELD_MANAGER = "mnn-rollout"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_QPS = 20.0
DEFAULT_BURST = 30
RETRY_STATUSES = frozenset({500, 502, 503, 504})  # and 429, which is always safe to repeat

# kind -> (API prefix, plural)
RESOURCES: dict[str, tuple[str, str]] = {
    "ConfigMap": ("/api/v1", "configmaps"),
    "Service": ("/api/v1", "services"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "Secret": ("/api/v1", "secrets"),
    "Deployment": ("/apis/apps/v1", "deployments"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "ModelDeployment": ("/apis/mnnrollout.io/v1alpha1", "modeldeployments"),
    "KopfPeering": ("/apis/kopf.dev/v1", "kopfpeerings"),
    "ClusterKopfPeering": ("/apis/kopf.dev/v1", "clusterkopfpeerings"),
}


class ApiError(Exception):
    """A failed API request: the HTTP status (0: no HTTP answer, e.g. the connection failed), the
    Status reason and message. ``attempts`` is how many times the request was sent; ``ambiguous``
    is true when an earlier attempt failed after the server may have acted on it (a 5xx, a lost
    connection), so this answer may be the echo of our own earlier success (a 409 AlreadyExists)."""

    def __init__(self, status: int, message: str, reason: str = "", *, retry_after: float | None = None,
                 attempts: int = 1, ambiguous: bool = False) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after
        self.attempts = attempts
        self.ambiguous = ambiguous


def load_configuration() -> Any:
    """The kubernetes package's Configuration: in-cluster first, then KUBECONFIG."""
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(client_configuration=configuration)
    return configuration


class RateLimiter:
    """A token bucket: up to ``burst`` requests at once, then ``qps`` per second on average
    (client-go's flowcontrol token bucket). Thread-safe: a caller reserves its token under the lock
    (the bucket may go negative: reservations) and sleeps outside it, so waiting threads are served
    in arrival order. ``qps <= 0`` disables the limit."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.qps = float(qps)
        self.burst = max(1, int(burst))
        self.clock = clock
        self.sleep = sleep
        self._tokens = float(self.burst)
        self._last = clock()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Take a token; the seconds to wait before using it."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            self._tokens -= 1.0
            return -self._tokens / self.qps if self._tokens < 0 else 0.0

    def acquire(self) -> float:
        """Take a token, waiting for it; the seconds waited."""
        wait = self.reserve()
        if wait > 0:
            self.sleep(wait)
        return wait


def _retry_after(headers: Any, status: dict[str, Any]) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), else from the Status's
    details.retryAfterSeconds."""
    value = headers.get("Retry-After") if headers is not None else None
    if value is not None:
        value = str(value).strip()
        if value.isascii() and value.isdigit():  # str.isdigit() alone takes '²', which float() refuses
            return float(value)
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None:
            return max(0.0, when.timestamp() - time.time())
    seconds = (status.get("details") or {}).get("retryAfterSeconds") if isinstance(status, dict) else None
    return float(seconds) if isinstance(seconds, (int, float)) and seconds >= 0 else None


def _error_from(code: int, raw: bytes, headers: Any) -> ApiError:
    try:
        status = json.loads(raw) if raw else {}
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return ApiError(code, raw[:300].decode(errors="replace"), retry_after=_retry_after(headers, {}))
    return ApiError(code, str(status.get("message", raw[:300].decode(errors="replace"))),
                    str(status.get("reason", "")), retry_after=_retry_after(headers, status))


def _repeatable(method: str, body: Any) -> bool:
    """Whether repeating a request the server may already have acted on is harmless: every verb
    but a POST that does not name its object (generateName would create a second one)."""
    if method != "POST":
        return True
    meta = body.get("metadata") if isinstance(body, dict) else None
    return isinstance(meta, dict) and bool(meta.get("name"))


class KubeClient:
    """See the module docstring. Safe to share between threads."""

    def __init__(self, configuration: Any | None = None, timeout: float = 10.0, *,
                 qps: float = DEFAULT_QPS, burst: int = DEFAULT_BURST, max_attempts: int = 5,
                 backoff_base: float = 0.2, backoff_max: float = 10.0, max_retry_after: float = 60.0,
                 connections: int = 16) -> None:
        """``connections``: kept-alive connections to the API server, at least one per thread that
        uses this client at once (the kubernetes package keeps 5 per CPU: 10 on 2 cores, fewer than
        the 16 reconcile threads, so connections were dropped and opened again under load)."""
        from kubernetes import client

        self.configuration = configuration or load_configuration()
        # A private copy for the transport: urllib3's own retries off (they would repeat connection
        # errors at once and uncounted); this client retries with backoff itself.
        transport = copy.copy(self.configuration)
        transport.retries = False
        transport.client_go_retries = False
        transport.connection_pool_maxsize = max(transport.connection_pool_maxsize or 0, connections)
        self.api = client.ApiClient(transport)
        self.api.user_agent = USER_AGENT
        self.timeout = timeout
        self.limiter = RateLimiter(qps, burst)
        self.max_attempts = max(1, int(max_attempts))
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_retry_after = max_retry_after
        self._stopped = threading.Event()
        self.sleep: Callable[[float], object] = self._stopped.wait  # a retry's pause; ends early on stop()
        self._stats_lock = threading.Lock()
        self.writes = 0  # create/replace/patch/apply/delete calls made (not attempts), for tests and metrics
        self.retries = 0  # attempts repeated, all reasons
        self.retries_by_reason: dict[str, int] = {}  # "429", "503", ..., "connection"
        self.throttled = 0  # attempts that waited for the rate limit
        self.throttle_seconds = 0.0  # total time waited for it

    def close(self) -> None:
        self.api.close()

    def stop(self) -> None:
        """The operator is exiting: every request from now on fails at once (ApiError reason
        "Stopped") before it is sent, and retry pauses end now. A request already sent is answered."""
        self._stopped.set()

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return {"writes": self.writes, "retries": self.retries, "retries_by_reason": dict(self.retries_by_reason),
                    "throttled": self.throttled, "throttle_seconds": self.throttle_seconds}

    # -- plumbing ------------------------------------------------------------------------------

    def backoff(self, attempt: int) -> float:
        """The pause after failed attempt ``attempt`` (1-based): base * 2^(attempt-1), capped, plus
        up to 50% jitter (so each pause is still longer than the one before, until the cap)."""
        delay = min(self.backoff_max, self.backoff_base * 2.0 ** (attempt - 1))
        return delay * (1 + 0.5 * random.random())

    def _throttle(self) -> None:
        waited = self.limiter.acquire()
        if waited > 0:
            with self._stats_lock:
                self.throttled += 1
                self.throttle_seconds += waited

    def _send(self, method: str, path: str, body: Any, params: dict[str, str] | None,
              content_type: str) -> tuple[int, Any, bytes]:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        _, url, headers, data, post = self.api.param_serialize(
            method, path, query_params=list(params.items()) if params else None, header_params=headers,
            body=body, auth_settings=["BearerToken"])
        resp = self.api.call_api(method, url, headers, data, post, _request_timeout=self.timeout)
        return int(resp.status), resp.headers, resp.read() or b""

    def request(self, method: str, path: str, body: Any = None, params: dict[str, str] | None = None,
                content_type: str = "application/json") -> Any:
        """One API call, retried as the module docstring says; the decoded JSON answer (or None)."""
        return self._exchange(method, path, body, params, content_type)[1]

    def _exchange(self, method: str, path: str, body: Any, params: dict[str, str] | None,
                  content_type: str) -> tuple[int, Any, bool]:
        """``request``: the answer's HTTP status, its decoded JSON (or None), and whether an earlier
        attempt failed after the server may have acted on it (as ``ApiError.ambiguous``)."""
        import urllib3.exceptions
        from kubernetes.client.exceptions import ApiException

        if method != "GET":
            with self._stats_lock:
                self.writes += 1
        repeatable = _repeatable(method, body)
        ambiguous = False
        attempt = 0
        while True:
            attempt += 1
            self._throttle()
            if self._stopped.is_set():
                raise ApiError(0, f"{method} {path}: not sent, the operator is exiting", "Stopped",
                               attempts=attempt - 1, ambiguous=ambiguous)
            try:
                code, headers, raw = self._send(method, path, body, params, content_type)
            except urllib3.exceptions.HTTPError as exc:
                inner = exc.reason if isinstance(exc, urllib3.exceptions.MaxRetryError) else exc
                unsent = isinstance(inner, urllib3.exceptions.ConnectTimeoutError)  # incl. NewConnectionError
                error = ApiError(0, f"{method} {path}: {inner}", "ConnectionError", attempts=attempt,
                                 ambiguous=ambiguous)
                if not (unsent or repeatable) or attempt >= self.max_attempts:
                    raise error from exc
                ambiguous = ambiguous or not unsent
                reason, delay = "connection", self.backoff(attempt)
            except ApiException as exc:  # the library's own failures, e.g. TLS: not retried
                raise ApiError(exc.status or 0, str(exc.reason), "ClientError", attempts=attempt) from exc
            else:
                if code < 400:
                    return code, json.loads(raw) if raw else None, ambiguous
                error = _error_from(code, raw, headers)
                error.attempts, error.ambiguous = attempt, ambiguous
                retryable = code == 429 or (code in RETRY_STATUSES and repeatable)
                if not retryable or attempt >= self.max_attempts:
                    raise error
                delay = self.backoff(attempt)
                if error.retry_after is not None:
                    if error.retry_after > self.max_retry_after:
                        raise error  # not retrying sooner than asked, and not sleeping that long here
                    delay = max(delay, error.retry_after)
                ambiguous = ambiguous or code != 429
                reason = str(code)
            with self._stats_lock:
                self.retries += 1
                self.retries_by_reason[reason] = self.retries_by_reason.get(reason, 0) + 1
            log.info("%s %s failed (%s, attempt %d of %d); retrying in %.2fs", method, path, reason, attempt,
                     self.max_attempts, delay)
            self.sleep(delay)

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path of a kind in a namespace, or across all namespaces (``namespace=None``)."""
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace is not None else f"{prefix}/{plural}"
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

    def list(self, kind: str, namespace: str | None, label_selector: str | None = None) -> list[dict[str, Any]]:
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
                                 content_type=MERGE_PATCH))

    def apply(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER, force: bool = True,
              subresource: str | None = None) -> dict[str, Any]:
        """Server-side apply: the server merges ``obj`` (the fields this manager wants, with their
        values) into the live object, creating it if absent, records the manager as their owner
        and removes the fields this manager applied before and no longer does. ``force`` takes
        over fields another manager owns with a different value instead of failing with 409."""
        return self.apply_created(obj, field_manager, force, subresource)[0]

    def apply_created(self, obj: dict[str, Any], field_manager: str = FIELD_MANAGER, force: bool = True,
                      subresource: str | None = None) -> tuple[dict[str, Any], bool]:
        """``apply``, and whether it created the object, at no extra request: the API server answers
        201 Created when the apply created it, 200 when it was there (kube-apiserver's PatchResource,
        ``wasCreated``). An apply repeated after an attempt the server may have acted on (a 5xx, a
        connection lost after sending) answers 200 if that attempt created the object: it counts as
        created then, as it may have been. So False is sure (the object existed before this call);
        True after such a repeat may be an object that existed."""
        meta = obj["metadata"]
        params = {"fieldManager": field_manager}
        if force:
            params["force"] = "true"
        code, answer, ambiguous = self._exchange(
            "PATCH", self.path(obj["kind"], meta["namespace"], meta["name"], subresource), obj, params, APPLY_PATCH)
        return dict(answer), code == 201 or ambiguous

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
