"""The Alertmanager webhook: ``POST /alerts`` rolls back the canary a firing alert names (or aborts
the A/B experiment one of whose challengers it names).

An alert names a ModelDeployment by labels ``namespace`` + ``modeldeployment`` (or ``name``), or by
``model`` + ``version`` (the canary being rolled out, or a challenger of a running experiment); a
``version`` label beside ``namespace`` + ``modeldeployment`` must name one of those too. The
webhook only marks the object (the ``mnnrollout.io/alert`` annotation,
``alertname@startsAt@instance@canary``, or ``@v2,v3``: an experiment's challengers; instance: the
hash of the alert's labels, as one rule fires an alert per label set; one mark per alert firing,
``;``-separated) while the alert fires, and removes that alert's mark when Alertmanager reports it
resolved (another alert still firing keeps its own: a retried canary is rolled back again while any
fires). It remembers that resolve (``mnnrollout.io/alert-resolved``: ``alertname@startsAt@instance``,
the last ``MAX_RESOLVED``) on each object it marked and each it names, even one it never marked (Alertmanager
retries, and an HA pair each sends, so a resolve can arrive before its firing), and for each alert
keeps its latest start only, so a notification arriving late never marks again: a firing that
started before, or at, what was already handled for that alert changes nothing, while a new firing
(a later startsAt) marks. The operator reads the alert annotation only (the resolved one wakes
nothing). Each write carries the object's resourceVersion, so two webhook calls at once never lose a
mark; the replica that holds the peering lease acts on it at once through its update handler, so any
replica may receive the webhook. Bad payloads get 400, a
missing or wrong bearer token 401, and neither changes anything. A connection has ``idle_timeout_s`` from
its accept to send its whole request (request line, headers, body; a byte at a time does not extend it)
or is closed, and at most ``max_connections`` are served at once: at the cap a new connection closes the
oldest one whose bearer token has not checked out yet and is served in its place, so clients without the
token cannot keep Alertmanager out by reconnecting; only when every slot holds a connection whose token
checked out is one more answered 503 and closed.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from .kube import ApiError, KubeClient
from .reconcile import ALERT_ANNOTATION, ALERT_MARK_SEPARATOR

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)
MAX_BODY = 1 << 20
IDLE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64
EVICTED_THREADS = 8  # threads of closed-for-a-newer-one connections still ending, beyond max_connections
RESOLVED_ANNOTATION = f"{ALERT_ANNOTATION}-resolved"  # alerts resolved, so a late firing of one marks nothing
MAX_RESOLVED = 16  # resolved alerts remembered per object, the latest


class PayloadError(ValueError):
    pass


def parse_payload(body: bytes) -> list[dict[str, Any]]:
    """The alerts of an Alertmanager webhook (version 4) payload; PayloadError says what is wrong."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise PayloadError(f"body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PayloadError("body: expected an object")
    alerts = data.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("alerts: required, a list")
    for i, alert in enumerate(alerts):
        if not isinstance(alert, dict) or not isinstance(alert.get("labels"), dict):
            raise PayloadError(f"alerts[{i}].labels: required, an object")
        if alert.get("status") not in ("firing", "resolved"):
            raise PayloadError(f"alerts[{i}].status: {alert.get('status')!r} is not firing or resolved")
        if not isinstance(alert.get("startsAt"), str) or _start(alert["startsAt"]) is None:  # part of its mark
            raise PayloadError(f"alerts[{i}].startsAt: {alert.get('startsAt')!r} is not an RFC 3339 time")
    return alerts


IN_FLIGHT = ("Progressing", "Paused")


def in_flight(md: dict[str, Any]) -> bool:
    """A canary or an experiment in flight; a canary held under its last valid spec while the spec is
    invalid too (its alerts still roll it back: reconcile.guard_spec)."""
    status = md.get("status") or {}
    phase = status.get("phaseBeforeInvalid") if status.get("phase") == "InvalidSpec" else status.get("phase")
    return phase in IN_FLIGHT and bool(status.get("canaryVersion") or challengers(status))


def challengers(status: dict[str, Any]) -> list[str]:
    """The challengers of a running experiment (none otherwise)."""
    exp = status.get("experiment") or {}
    if exp.get("state") != "Running":
        return []
    return sorted(v for v in (exp.get("weights") or {}) if v != exp.get("control"))


def targets(kube: KubeClient, labels: dict[str, str], namespaces: list[str] | None) -> list[dict[str, Any]]:
    """ModelDeployments an alert's labels name, among those with a canary in flight and in the
    namespaces this operator watches. An alert with a ``version`` label names that version only: the
    alert of a canary rolled back (or promoted) never rolls back the next canary, nor one on stable."""
    name = labels.get("modeldeployment") or labels.get("name")
    namespace = labels.get("namespace")
    model, version = labels.get("model"), labels.get("version")
    if name and namespace:
        if namespaces and namespace not in namespaces:
            return []
        md = kube.get("ModelDeployment", namespace, name)
        return [md] if md and in_flight(md) and (version is None or is_rolled_out(md, version)) else []
    if not model or not version:
        return []
    found = []
    for md in list_modeldeployments(kube, namespaces):
        spec = md.get("spec") or {}
        if (spec.get("model") or md["metadata"]["name"]) == model and in_flight(md) and is_rolled_out(md, version):
            if namespace in (None, md["metadata"]["namespace"]):
                found.append(md)
    return found


def is_rolled_out(md: dict[str, Any], version: str) -> bool:
    """Whether ``version`` is the object's canary or a challenger of its running experiment."""
    status = md.get("status") or {}
    return status.get("canaryVersion") == version or version in challengers(status)


def list_modeldeployments(kube: KubeClient, namespaces: list[str] | None) -> list[dict[str, Any]]:
    if namespaces:
        return [md for ns in namespaces for md in kube.list("ModelDeployment", ns)]
    return list(kube.request("GET", "/apis/mnnrollout.io/v1alpha1/modeldeployments").get("items", []))


def handle(kube: KubeClient, alerts: list[dict[str, Any]], namespaces: list[str] | None) -> list[str]:
    """Mark every ModelDeployment a firing alert names (``alertname@startsAt@instance@canary``, beside
    the marks of other alerts firing), and take a resolved alert's mark off those it marked, remembering
    the resolve there and on those it names; returns ``namespace/name`` of each object marked, once. A
    mark stays while its alert fires, so a retried canary is rolled back again until every alert on it
    resolves."""
    marked: list[str] = []
    for alert in alerts:
        labels = {str(k): str(v) for k, v in alert["labels"].items()}
        alertname = labels.get("alertname", "alert")
        # '@' and ';' separate a mark's parts and the marks: kept out of the name. One rule fires an
        # alert per label set (per pod, per route): each is its own mark, named by its labels' hash
        prefix = (f"{alertname.replace('@', '_').replace(ALERT_MARK_SEPARATOR, '_')}@{alert['startsAt']}@"
                  f"{instance(labels)}@")
        if alert["status"] == "resolved":
            log.info("alert %s resolved: %s", alertname, labels)
            # the objects it marked, and those it names though it marked nothing there (yet): its
            # firing notification may still arrive, late, and must then find the resolve
            found = {(md["metadata"]["namespace"], md["metadata"]["name"]): md
                     for md in [*marked_by(kube, prefix, labels.get("namespace"), namespaces),
                                *targets(kube, labels, namespaces)]}
            for md in found.values():
                meta = md["metadata"]
                had = any(_of(m, prefix) for m in marks_of(md))
                if _remark(kube, md, lambda marks: _resolve(marks, prefix)):  # noqa: B023
                    log.log(logging.INFO if had else logging.DEBUG, "alert %s %s %s/%s", alertname,
                            "mark removed from" if had else "remembered as resolved on", meta["namespace"],
                            meta["name"])
            continue
        for md in targets(kube, labels, namespaces):
            meta = md["metadata"]
            status = md.get("status") or {}
            # the canary; in an experiment the challenger the alert names, else all of them (a mark
            # names versions, so a later canary of another version is not rolled back by it)
            named = labels.get("version") if labels.get("version") in challengers(status) else \
                ",".join(challengers(status))
            value = prefix + str(status.get("canaryVersion") or named)
            if not _remark(kube, md, lambda marks: _with_mark(marks, value)):  # noqa: B023
                continue  # marked already, or a late notification of a firing already handled
            log.warning("alert %s firing for %s/%s: rolling back its canary", alertname, meta["namespace"],
                        meta["name"])
            if f"{meta['namespace']}/{meta['name']}" not in marked:
                marked.append(f"{meta['namespace']}/{meta['name']}")
    return marked


def instance(labels: dict[str, str]) -> str:
    """Which alert this is among those one rule fires (its label set), in 8 hex digits."""
    return hashlib.sha256(json.dumps(sorted(labels.items())).encode()).hexdigest()[:8]


def _of(mark: str, prefix: str) -> bool:
    """Whether ``mark`` is the one an alert's ``name@startsAt@instance@`` prefix wrote (not the
    prefix alone: that alert resolved); or, written by an operator before marks had an instance
    (``name@startsAt@versions``), the one of its name and start."""
    parts = mark.split("@")
    return (mark.startswith(prefix) and mark != prefix) or (len(parts) == 3
                                                            and prefix.startswith(f"{parts[0]}@{parts[1]}@"))


def _resolve(marks: list[str], prefix: str) -> list[str]:
    """``marks`` once the alert of the ``name@startsAt@instance@`` prefix resolved: without its firing
    mark, and with the prefix alone (resolved) in place of any earlier resolve of that alert, even when
    it marked nothing here (its firing notification may arrive after the resolve, and must then mark
    nothing). Not remembered when the alert has a later start there (this resolve arrived late); the
    firing mark of another, earlier start stays (that start's own resolve takes it off)."""
    name, start, same, _ = prefix.split("@", 3)

    def alert(m: str) -> bool:
        parts = m.split("@")
        return len(parts) == 4 and parts[0] == name and parts[2] == same

    kept = [m for m in marks if not _of(m, prefix)]
    if any(alert(m) and not _not_before(start, m.split("@")[1]) for m in kept) or (kept == marks and prefix in marks):
        return kept  # a later start there, or this resolve remembered already
    return [*(m for m in kept if not (alert(m) and m.endswith("@"))), prefix]


START = re.compile(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d{1,9}))?(Z|[+-]\d\d:\d\d)",
                   re.IGNORECASE | re.ASCII)


def _start(text: str) -> tuple[int, int] | None:
    """An RFC 3339 time (Alertmanager's startsAt: nanoseconds, trailing zeros trimmed) as seconds
    and nanoseconds since the epoch; None when it is not one."""
    found = START.fullmatch(text)
    if found is None:
        return None
    zone = "+00:00" if found[3].upper() == "Z" else found[3]
    try:
        seconds = datetime.fromisoformat(found[1] + zone).timestamp()
    except ValueError:
        return None
    return int(seconds), int((found[2] or "0").ljust(9, "0"))


def _not_before(start: str, other: str) -> bool:
    """Whether ``start`` is ``other`` or later (as text when either is not a time)."""
    ours, theirs = _start(start), _start(other)
    return start == other if ours is None or theirs is None else ours >= theirs


def _with_mark(marks: list[str], mark: str) -> list[str]:
    """``marks`` with ``mark`` (``name@startsAt@instance@versions``) in, in place of the same alert's
    earlier firings or resolve (same name and instance, an earlier start; a mark without an instance,
    of the same name and start, too). Unchanged when the alert has a later start there, or resolved
    at this one: this firing's notification arrived late."""
    name, start, same, _ = mark.split("@", 3)

    def alert(m: str) -> bool:
        parts = m.split("@")
        return len(parts) == 4 and parts[0] == name and parts[2] == same

    for m in filter(alert, marks):
        other, versions = m.split("@")[1], m.split("@")[3]
        if m != mark and _not_before(other, start) and (not versions or not _not_before(start, other)):
            log.info("alert %s: a firing from %s arrived after %s of %s, left as it is", name, start,
                     "the resolve" if not versions else "the firing", other)
            return marks

    def earlier(m: str) -> bool:
        parts = m.split("@")
        return alert(m) or (len(parts) == 3 and parts[:2] == [name, start])

    kept = [m for m in marks if m == mark or not earlier(m)]
    return kept if mark in kept else [*kept, mark]


def marks_of(md: dict[str, Any]) -> list[str]:
    """The alert marks an object holds, in order, then the resolved alerts it remembers
    (``name@startsAt@instance@``: no versions)."""
    annotations = md["metadata"].get("annotations") or {}
    return [m for m in (annotations.get(ALERT_ANNOTATION) or "").split(ALERT_MARK_SEPARATOR) if m] + [
        f"{m}@" for m in (annotations.get(RESOLVED_ANNOTATION) or "").split(ALERT_MARK_SEPARATOR) if m]


def _remark(kube: KubeClient, md: dict[str, Any], change: Callable[[list[str]], list[str]], tries: int = 5) -> bool:
    """Write ``change(marks)`` as the object's marks (``marks_of``: the firing ones in the alert
    annotation, the last ``MAX_RESOLVED`` resolved ones in their own, so that the reconcile reads firing
    marks only), over the version it was read at (a webhook call marking or unmarking it meanwhile:
    read again and redo); False when nothing changed."""
    meta = md["metadata"]
    for _ in range(tries):
        marks = change(marks_of(md))
        if marks == marks_of(md):
            return False
        firing = [m for m in marks if not m.endswith("@")]
        resolved = [m.removesuffix("@") for m in marks if m.endswith("@")][-MAX_RESOLVED:]
        try:
            kube.patch("ModelDeployment", meta["namespace"], meta["name"], {"metadata": {
                "resourceVersion": md["metadata"]["resourceVersion"], "annotations": {
                    ALERT_ANNOTATION: ALERT_MARK_SEPARATOR.join(firing) or None,
                    RESOLVED_ANNOTATION: ALERT_MARK_SEPARATOR.join(resolved) or None}}})
            return True
        except ApiError as exc:
            if exc.status != 409:
                raise
        fresh = kube.get("ModelDeployment", meta["namespace"], meta["name"])
        if fresh is None:
            return False
        md = fresh
    raise ApiError(409, f"{meta['namespace']}/{meta['name']}: its alert marks changed {tries} times while "
                        f"being written", "Conflict")


def marked_by(kube: KubeClient, prefix: str, namespace: str | None,
              namespaces: list[str] | None) -> list[dict[str, Any]]:
    """ModelDeployments holding a mark that starts with ``prefix`` (one alert, any canary)."""
    scope = [namespace] if namespace else namespaces
    if namespace and namespaces and namespace not in namespaces:
        return []
    return [md for md in list_modeldeployments(kube, scope) if any(_of(m, prefix) for m in marks_of(md))]


class RequestReader(io.RawIOBase):
    """A connection's reads, each timed out at what is left of ``seconds`` from the accept: a per-read
    timeout let a client sending a byte every few seconds hold its connection (and a slot) for good.
    Once ``evicted`` is set (the server closed the connection for a newer one) reads raise."""

    def __init__(self, sock: socket.socket, seconds: float, evicted: threading.Event | None = None) -> None:
        self.sock, self.seconds = sock, seconds
        self.deadline = time.monotonic() + seconds
        self.evicted = evicted or threading.Event()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not received within {self.seconds:g} s")
        self.sock.settimeout(left)
        try:
            received = 0 if self.evicted.is_set() else self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.seconds)  # for the writes (the reply)
        if self.evicted.is_set():  # what was sent before, or the end the shutdown gave: not a request
            raise ConnectionAbortedError("closed for a newer connection before its bearer token checked out")
        return received


def make_handler(kube: KubeClient, token: Callable[[], str], namespaces: list[str] | None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S) -> type:
    class Handler(BaseHTTPRequestHandler):
        timeout = idle_timeout_s  # each write; the reads share one deadline (RequestReader)

        def setup(self) -> None:
            # HTTP/1.0 (protocol_version): one request per connection, closed once answered, so the
            # deadline from the accept is the request's
            super().setup()
            self.rfile.close()  # the socket's own file: reads go through the deadline instead
            self.rfile = io.BufferedReader(RequestReader(self.connection, idle_timeout_s,
                                                         self._server().evicted(self.connection)))

        def _server(self) -> BoundedHTTPServer:
            assert isinstance(self.server, BoundedHTTPServer)
            return self.server

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("webhook: " + fmt, *args)

        def _reply(self, code: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            self._reply(200 if self.path == "/healthz" else 404, {"ok": self.path == "/healthz"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/alerts":
                return self._reply(404, {"error": f"no such endpoint {self.path}"})
            expected = token()
            given = self.headers.get("Authorization", "")
            if not expected or not hmac.compare_digest(given.encode(), f"Bearer {expected}".encode()):
                return self._reply(401, {"error": "missing or wrong bearer token"})
            if not self._server().authenticated(self.connection):
                return None  # closed for a newer connection just before: nobody to answer
            given_length = (self.headers.get("Content-Length") or "0").strip()
            if not (given_length.isascii() and given_length.isdigit()):
                return self._reply(400, {"error": f"Content-Length: {given_length!r} is not a whole number of "
                                                  f"bytes (0 to {MAX_BODY})"})
            digits = given_length.lstrip("0")
            if len(digits) > 9:  # over MAX_BODY anyway; int() refuses over 4,300 digits (ValueError)
                return self._reply(413, {"error": f"Content-Length: {len(digits)} digits, a body over "
                                                  f"{MAX_BODY} bytes"})
            length = int(digits or "0")
            if length > MAX_BODY:
                return self._reply(413, {"error": f"Content-Length: {length}, a body over {MAX_BODY} bytes"})
            try:
                alerts = parse_payload(self.rfile.read(length))
            except PayloadError as exc:
                return self._reply(400, {"error": str(exc)})
            try:
                marked = handle(kube, alerts, namespaces)
            except ApiError as exc:
                log.error("webhook could not mark a ModelDeployment: %s", exc)
                return self._reply(503, {"error": str(exc)})
            return self._reply(200, {"rolledBack": marked})

    return Handler


class Slot:
    """A connection being served: closable for a newer one (evicted) until its bearer token checks out."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.authenticated = False
        self.evicted = threading.Event()


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, up to ``max_connections`` served at once. At the cap a new connection
    closes the oldest one whose token has not checked out (its socket shut down, so its reads end at
    once) and is served instead: clients without the token, reconnecting as fast as they are closed,
    cannot keep Alertmanager out. Only when every slot holds an authenticated connection is a new one
    answered 503 and closed without a thread. Threads: at most ``max_connections`` plus
    ``EVICTED_THREADS`` of closed connections still ending. The listen backlog holds a burst of that
    many (socketserver's default, 5, dropped the rest's SYN: each waited ~1 s for its client's retry)."""

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        self.request_queue_size = max(max_connections + EVICTED_THREADS, 128)  # read by server_activate: listen()
        super().__init__(address, handler)
        self.max_connections = max_connections
        self.lock = threading.Condition()
        self.slots: dict[socket.socket, Slot] = {}  # oldest first; evicted ones until their thread ends

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            admitted = self._make_room() and self.lock.wait_for(
                lambda: len(self.slots) < self.max_connections + EVICTED_THREADS, timeout=1.0)
            if admitted:
                self.slots[request] = Slot(request)
        if not admitted:
            log.warning("webhook: %d connections open, their tokens checked, refusing one from %s",
                        self.max_connections, client_address)
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def _make_room(self) -> bool:
        """Under the lock: whether a connection may be served now, evicting the oldest unauthenticated
        one at the cap; False when every served connection is authenticated."""
        served = [slot for slot in self.slots.values() if not slot.evicted.is_set()]
        if len(served) < self.max_connections:
            return True
        oldest = next((slot for slot in served if not slot.authenticated), None)
        if oldest is None:
            return False
        oldest.evicted.set()
        try:
            oldest.sock.shutdown(socket.SHUT_RDWR)  # its blocked read returns now
        except OSError:  # closed by its thread already
            pass
        log.debug("webhook: %d connections open, closed the oldest without a checked token", self.max_connections)
        return True

    def evicted(self, request: socket.socket) -> threading.Event:
        """Set once ``request`` is closed for a newer connection."""
        with self.lock:
            return self.slots[request].evicted

    def authenticated(self, request: socket.socket) -> bool:
        """Mark ``request``'s token as checked: no newer connection closes it now. False when one
        already has."""
        with self.lock:
            slot = self.slots[request]
            slot.authenticated = not slot.evicted.is_set()
            return slot.authenticated

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self.lock:
            self.slots.pop(request, None)
            self.lock.notify_all()

    def handle_error(self, request: Any, client_address: Any) -> None:
        with self.lock:
            slot = self.slots.get(request)
        if slot is not None and slot.evicted.is_set():
            log.debug("webhook: a connection from %s closed for a newer one", client_address)
            return
        super().handle_error(request, client_address)

    def _refuse(self, request: socket.socket) -> None:
        body = json.dumps({"error": f"over {self.max_connections} connections at once; retry"}).encode()
        try:
            request.settimeout(1.0)
            request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            request.setblocking(False)
            while request.recv(1 << 16):  # what the client sent already: read, so closing does not reset
                pass
        except OSError:  # nothing more to read (BlockingIOError), or the client is gone
            pass
        self.shutdown_request(request)


class AlertWebhook:
    """A threaded HTTP server beside kopf's event loop, its connections capped and timed out."""

    def __init__(self, kube: KubeClient, host: str, port: int, token: Callable[[], str],
                 namespaces: list[str] | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.server = BoundedHTTPServer((host, port), make_handler(kube, token, namespaces, idle_timeout_s),
                                        max_connections)
        self.thread = threading.Thread(target=self.server.serve_forever, name="alert-webhook", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
