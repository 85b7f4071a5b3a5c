"""The operator's Kubernetes client (rollout_operator/kube.py) over real HTTP: retries and backoff,
Retry-After, the client-side rate limit, server-side apply, errors, credentials - against the API
emulator and a scripted local HTTP server."""

from __future__ import annotations

import argparse
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import kubernetes
import pytest

from rollout_operator import runner
from rollout_operator.children import HASH_ANNOTATION
from rollout_operator.kube import APPLY_PATCH, ApiError, KubeClient, RateLimiter
from testbed.k8s.harness import EmulatorProcess

pytestmark = pytest.mark.timeout(60)
CM_PATH = "/api/v1/namespaces/default/configmaps"


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code, "reason": reason,
            "message": message}


class Scripted:
    """A local API server answering from a script: each request takes the next (code, headers,
    body) - ``None`` drops the connection without an answer - then ``default``. It records every
    request: (monotonic time, method, path, headers with lower-case names, body)."""

    def __init__(self) -> None:
        self.script: list[tuple[int, dict[str, str], Any] | None] = []
        self.default: tuple[int, dict[str, str], Any] = (200, {}, {"kind": "ConfigMap", "metadata": {"name": "x"}})
        self.seen: list[tuple[float, str, str, dict[str, str], bytes]] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer.lock:
                    outer.seen.append((time.monotonic(), self.command, self.path,
                                       {k.lower(): v for k, v in self.headers.items()}, body))
                    answer = outer.script.pop(0) if outer.script else outer.default
                if answer is None:
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                code, headers, payload = answer
                raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", headers.pop("Content-Type", "application/json"))
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def times(self) -> list[float]:
        return [t for t, *_ in self.seen]


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    server = Scripted()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


def configuration(url: str, token: str = "t0") -> Any:
    cfg = kubernetes.client.Configuration()
    cfg.host = url
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return cfg


@pytest.fixture
def make_client() -> Iterator[Callable[..., KubeClient]]:
    made: list[KubeClient] = []

    def make(url_or_cfg: Any, **kwargs: Any) -> KubeClient:
        cfg = configuration(url_or_cfg) if isinstance(url_or_cfg, str) else url_or_cfg
        kwargs.setdefault("backoff_base", 0.02)
        client = KubeClient(cfg, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def emu(k8s_emulator: EmulatorProcess) -> EmulatorProcess:
    return k8s_emulator


def emulator_cfg(emu: EmulatorProcess) -> Any:
    cfg = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(emu.kubeconfig_path), client_configuration=cfg)
    return cfg


def fault(emu: EmulatorProcess, **spec: Any) -> None:
    code, answer = emu.request("POST", "/_emulator/faults", spec)
    assert code == 201, answer


def configmap(name: str, data: dict[str, str], **annotations: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "default", "annotations": annotations}, "data": data}


# -- retries ----------------------------------------------------------------------------------------

def test_a_429_is_retried_no_sooner_than_its_retry_after(scripted: Scripted,
                                                         make_client: Callable[..., KubeClient]) -> None:
    scripted.script = [(429, {"Retry-After": "1"}, status(429, "TooManyRequests", "slow down"))]
    kube = make_client(scripted.url)
    assert kube.get("ConfigMap", "default", "x") == scripted.default[2]
    first, second = scripted.times()
    assert 1.0 <= second - first < 1.6  # the Retry-After, not the 20 ms backoff
    assert kube.retries == 1 and kube.retries_by_reason == {"429": 1}


def test_a_retry_after_of_non_ascii_digits_is_no_retry_after(scripted: Scripted,
                                                             make_client: Callable[..., KubeClient]) -> None:
    """'²' passes str.isdigit() but not float(): the ValueError escaped the client. Now it is no
    Retry-After at all, and the usual backoff applies."""
    scripted.script = [(429, {"Retry-After": "\u00b2"}, status(429, "TooManyRequests", "slow down"))]
    kube = make_client(scripted.url)
    assert kube.get("ConfigMap", "default", "x") == scripted.default[2]
    assert kube.retries == 1 and kube.retries_by_reason == {"429": 1}


def test_the_emulator_s_429_with_retry_after_is_honoured(emu: EmulatorProcess,
                                                         make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(emulator_cfg(emu))
    kube.create(configmap("c", {"a": "1"}))
    fault(emu, code=429, reason="TooManyRequests", message="throttled", method="GET", path="configmaps/c$",
          times=2, retryAfter=1)
    started = time.monotonic()
    assert kube.get("ConfigMap", "default", "c")["data"] == {"a": "1"}  # type: ignore[index]
    assert 2.0 <= time.monotonic() - started < 3.5
    assert kube.retries_by_reason == {"429": 2}
    gets = [r for r in emu.requests() if r["method"] == "GET" and r["name"] == "c"]
    assert len(gets) == 3 and {r["userAgent"] for r in gets} == {"mnn-rollout-operator/0.1.0"}


def test_5xx_answers_are_retried_with_a_growing_backoff(scripted: Scripted,
                                                        make_client: Callable[..., KubeClient]) -> None:
    scripted.script = [(503, {}, status(503, "ServiceUnavailable", "x")), (500, {}, status(500, "InternalError", "x")),
                       (502, {}, b"bad gateway"), (504, {}, status(504, "Timeout", "x"))]
    kube = make_client(scripted.url, backoff_base=0.1)
    assert kube.replace(configmap("x", {}))["kind"] == "ConfigMap"
    t = scripted.times()
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert len(gaps) == 4
    for n, gap in enumerate(gaps):  # 0.1 * 2^n, plus up to 50% jitter
        assert 0.1 * 2 ** n <= gap < 0.15 * 2 ** n + 0.15, gaps
    assert gaps == sorted(gaps)
    assert kube.retries_by_reason == {"503": 1, "500": 1, "502": 1, "504": 1} and kube.writes == 1


def test_after_max_attempts_the_last_error_is_raised(scripted: Scripted,
                                                     make_client: Callable[..., KubeClient]) -> None:
    scripted.default = (503, {}, status(503, "ServiceUnavailable", "etcd is down"))
    kube = make_client(scripted.url, max_attempts=3)
    with pytest.raises(ApiError) as err:
        kube.get("ConfigMap", "default", "x")
    assert (err.value.status, err.value.reason, err.value.message) == (503, "ServiceUnavailable", "etcd is down")
    assert err.value.attempts == 3 and len(scripted.seen) == 3 and kube.retries == 2


def test_a_retry_after_longer_than_the_client_waits_fails_at_once(scripted: Scripted,
                                                                  make_client: Callable[..., KubeClient]) -> None:
    scripted.default = (429, {"Retry-After": "120"}, status(429, "TooManyRequests", "come back later"))
    kube = make_client(scripted.url, max_retry_after=5)
    with pytest.raises(ApiError) as err:
        kube.list("Pod", "default")
    assert err.value.status == 429 and err.value.retry_after == 120 and len(scripted.seen) == 1


def test_client_errors_are_not_retried_and_keep_status_reason_message(emu: EmulatorProcess,
                                                                     make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(emulator_cfg(emu))
    kube.create(configmap("dup", {}))
    with pytest.raises(ApiError) as err:
        kube.create(configmap("dup", {}))
    assert (err.value.status, err.value.reason) == (409, "AlreadyExists")
    assert err.value.message == 'configmaps "dup" already exists' and err.value.attempts == 1
    with pytest.raises(ApiError) as err:
        kube.create(configmap("Not_A_Name", {}))
    assert (err.value.status, err.value.reason) == (422, "Invalid") and "metadata.name" in err.value.message
    with pytest.raises(ApiError) as err:
        kube.patch("ConfigMap", "default", "absent", {"data": {}})
    assert (err.value.status, err.value.reason) == (404, "NotFound")
    assert kube.get("ConfigMap", "default", "absent") is None
    kube.delete("ConfigMap", "default", "absent")  # a 404 on delete is success
    assert kube.retries == 0
    assert str(err.value) == '404 NotFound: configmaps "absent" not found'


def test_a_non_json_error_body_is_the_message(scripted: Scripted, make_client: Callable[..., KubeClient]) -> None:
    scripted.script = [(403, {"Content-Type": "text/plain"}, b"forbidden by a proxy")]
    with pytest.raises(ApiError) as err:
        make_client(scripted.url).get("ConfigMap", "default", "x")
    assert (err.value.status, err.value.message, err.value.reason) == (403, "forbidden by a proxy", "")


def test_a_post_that_names_no_object_is_not_repeated_after_a_5xx_but_is_after_a_429(
        scripted: Scripted, make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(scripted.url)
    unnamed = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "x-"}}
    scripted.script = [(500, {}, status(500, "InternalError", "maybe it was written"))]
    with pytest.raises(ApiError) as err:
        kube.request("POST", CM_PATH, body=unnamed)
    assert err.value.status == 500 and len(scripted.seen) == 1
    scripted.script = [(429, {}, status(429, "TooManyRequests", "not written"))]
    kube.request("POST", CM_PATH, body=unnamed)
    assert len(scripted.seen) == 3
    scripted.script = [(500, {}, status(500, "InternalError", "x"))]
    kube.create(configmap("named", {}))  # a named create is repeated: a lost success answers 409
    assert len(scripted.seen) == 5


def test_connection_errors_are_retried_then_raised_with_status_0(make_client: Callable[..., KubeClient]) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed: connections are refused
    kube = make_client(f"http://127.0.0.1:{port}", max_attempts=3)
    with pytest.raises(ApiError) as err:
        kube.get("ConfigMap", "default", "x")
    assert (err.value.status, err.value.reason, err.value.attempts) == (0, "ConnectionError", 3)
    assert kube.retries_by_reason == {"connection": 2}


def test_a_connection_lost_after_sending_repeats_only_what_is_safe_to_repeat(
        scripted: Scripted, make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(scripted.url)
    scripted.script = [None]
    assert kube.get("ConfigMap", "default", "x") is not None
    assert len(scripted.seen) == 2 and kube.retries_by_reason == {"connection": 1}
    scripted.script = [None]
    with pytest.raises(ApiError) as err:
        kube.request("POST", CM_PATH, body={"metadata": {"generateName": "x-"}})
    assert err.value.status == 0 and len(scripted.seen) == 3


def test_an_apply_whose_success_was_lost_is_repeated_harmlessly(emu: EmulatorProcess,
                                                               make_client: Callable[..., KubeClient]) -> None:
    """The apply is carried out but answered 500; the client repeats it (an apply is idempotent)
    and gets the object; applying the same again changes nothing on the server."""
    kube = make_client(emulator_cfg(emu))
    fault(emu, code=500, method="PATCH", path="configmaps/lost$", after=True)
    obj = configmap("lost", {"a": "1"}, **{HASH_ANNOTATION: "h1"})
    first = kube.apply(obj)
    assert first["data"] == {"a": "1"} and kube.retries_by_reason == {"500": 1}
    assert [r["method"] for r in emu.write_requests("configmaps")] == ["PATCH", "PATCH"]
    again = kube.apply(obj)
    assert again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    managers = [(e["manager"], e["operation"]) for e in again["metadata"]["managedFields"]]
    assert managers == [("mnn-rollout", "Apply")]


# -- the rate limit -----------------------------------------------------------------------------------

def test_the_token_bucket_allows_a_burst_then_qps() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    bucket = RateLimiter(qps=10, burst=3, clock=lambda: now[0], sleep=sleep)
    assert [bucket.acquire() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.acquire() == pytest.approx(0.1)
    now[0] += 1.0  # idle: the bucket refills, but never above the burst
    assert [bucket.acquire() for _ in range(4)] == pytest.approx([0, 0, 0, 0.1])
    assert RateLimiter(qps=0, burst=1).acquire() == 0.0  # disabled
    reservations = RateLimiter(qps=10, burst=1, clock=lambda: 5.0)
    assert [reservations.reserve() for _ in range(3)] == pytest.approx([0, 0.1, 0.2])  # queued in order


def test_requests_from_many_threads_hold_the_rate_limit(scripted: Scripted,
                                                        make_client: Callable[..., KubeClient]) -> None:
    qps, burst, threads, each = 40.0, 5, 4, 10
    kube = make_client(scripted.url, qps=qps, burst=burst)
    started = time.monotonic()
    workers = [threading.Thread(target=lambda: [kube.get("ConfigMap", "default", "x") for _ in range(each)])
               for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    t = sorted(scripted.times())
    assert len(t) == threads * each
    assert t[burst - 1] - started < 0.3  # the burst goes at once
    for i in range(burst, len(t)):  # then no faster than qps
        assert t[i] - started >= (i - burst + 1) / qps - 0.02, (i, t[i] - started)
    expected = (threads * each - burst) / qps
    assert expected - 0.02 <= elapsed < expected + 0.7
    assert kube.throttled >= threads * each - burst - 1 and kube.throttle_seconds > 0


# -- server-side apply ----------------------------------------------------------------------------------

def test_apply_creates_updates_and_removes_a_field_it_no_longer_applies(emu: EmulatorProcess,
                                                                        make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(emulator_cfg(emu))
    created = kube.apply(configmap("applied", {"a": "1", "b": "2"}))
    assert created["data"] == {"a": "1", "b": "2"}
    assert [(m["manager"], m["operation"]) for m in created["metadata"]["managedFields"]] == [("mnn-rollout", "Apply")]
    updated = kube.apply(configmap("applied", {"a": "2"}))
    assert updated["data"] == {"a": "2"}
    assert kube.get("ConfigMap", "default", "applied")["data"] == {"a": "2"}  # type: ignore[index]
    patches = emu.write_requests("configmaps")
    assert [(p["method"], p["contentType"]) for p in patches] == [("PATCH", APPLY_PATCH)] * 2
    assert patches[0]["query"] == {"fieldManager": "mnn-rollout", "force": "true"} and kube.writes == 2


def test_apply_conflicts_with_another_manager_unless_forced(emu: EmulatorProcess,
                                                           make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(emulator_cfg(emu))
    kube.create(configmap("shared", {"a": "theirs"}))  # an Update by mnn-rollout-operator (the User-Agent)
    with pytest.raises(ApiError) as err:
        kube.apply(configmap("shared", {"a": "mine"}), force=False)
    assert (err.value.status, err.value.reason) == (409, "Conflict")
    assert err.value.message == 'Apply failed with 1 conflict: conflict with "mnn-rollout-operator" using v1: .data.a'
    assert kube.retries == 0
    assert kube.apply(configmap("shared", {"a": "mine"}))["data"] == {"a": "mine"}  # force (the default)


def test_apply_of_a_status_goes_through_the_subresource(emu: EmulatorProcess,
                                                        make_client: Callable[..., KubeClient]) -> None:
    kube = make_client(emulator_cfg(emu))
    kube.create(configmap("s", {"a": "1"}))
    with pytest.raises(ApiError) as err:  # a ConfigMap has no /status
        kube.apply(configmap("s", {}), subresource="status")
    assert err.value.status == 404


# -- credentials, configuration, flags --------------------------------------------------------------------

def test_the_bearer_token_comes_from_the_configuration_and_its_refresh_hook(
        scripted: Scripted, make_client: Callable[..., KubeClient]) -> None:
    cfg = configuration(scripted.url, token="first")
    refreshed = iter(["second", "third"])
    cfg.refresh_api_key_hook = lambda c: c.api_key.update(authorization=f"Bearer {next(refreshed)}")
    kube = make_client(cfg)
    kube.get("ConfigMap", "default", "x")
    kube.apply(configmap("x", {}))
    (_, _, path1, h1, _), (_, method2, path2, h2, body2) = scripted.seen
    assert h1["authorization"] == "Bearer second" and h2["authorization"] == "Bearer third"
    assert h1["user-agent"] == "mnn-rollout-operator/0.1.0" and h1["accept"] == "application/json"
    assert method2 == "PATCH" and h2["content-type"] == APPLY_PATCH and json.loads(body2)["data"] == {}
    assert path2 == f"{CM_PATH}/x?fieldManager=mnn-rollout&force=true"
    assert cfg.retries is None  # the caller's configuration is left alone


def test_list_sends_its_label_selector(scripted: Scripted, make_client: Callable[..., KubeClient]) -> None:
    scripted.default = (200, {}, {"kind": "PodList", "items": [{"metadata": {"name": "p"}}]})
    assert make_client(scripted.url).list("Pod", "ns", "app=x,tier!=db") == [{"metadata": {"name": "p"}}]
    assert scripted.seen[0][2] == "/api/v1/namespaces/ns/pods?labelSelector=app%3Dx%2Ctier%21%3Ddb"


def test_the_operator_flags_set_the_rate_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.kube_qps, args.kube_burst) == (20.0, 30)
    args = parser.parse_args(["--kube-qps", "5.5", "--kube-burst", "7"])
    assert (args.kube_qps, args.kube_burst) == (5.5, 7)
    monkeypatch.setenv("MNN_ROLLOUT_KUBE_QPS", "0")
    monkeypatch.setenv("MNN_ROLLOUT_KUBE_BURST", "1")
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.kube_qps, args.kube_burst) == (0.0, 1)


def test_kopf_logs_a_line_per_handled_event_only_when_verbose(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    assert not parser.parse_args([]).verbose and parser.parse_args(["--verbose"]).verbose
    monkeypatch.setenv("MNN_ROLLOUT_VERBOSE", "1")
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    assert parser.parse_args([]).verbose
    kopf_objects = logging.getLogger("kopf.objects")
    monkeypatch.setattr(kopf_objects, "level", kopf_objects.level)  # restored after the test
    caplog.set_level(logging.DEBUG)
    for verbose in (False, True):
        runner.kopf_log_level(verbose)
        kopf_objects.info("Handler 'x' succeeded.")
        kopf_objects.warning("Handler 'x' failed temporarily")
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kopf.objects"] == [
        ("WARNING", "Handler 'x' failed temporarily"),
        ("INFO", "Handler 'x' succeeded."), ("WARNING", "Handler 'x' failed temporarily")]


def test_the_client_keeps_a_connection_per_reconcile_thread(emu: EmulatorProcess, make_client: Callable[..., KubeClient],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """16 threads at once on one client: with fewer pooled connections than threads, urllib3
    drops connections after use ("Connection pool is full") and opens new ones under load."""
    def burst(client: KubeClient) -> int:
        barrier = threading.Barrier(16)

        def many() -> None:
            barrier.wait(10)
            for _ in range(10):
                client.list("ConfigMap", "default")

        threads = [threading.Thread(target=many) for _ in range(16)]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        return sum("Connection pool is full" in r.getMessage() for r in caplog.records)

    assert burst(make_client(emulator_cfg(emu), qps=0, connections=4)) > 0  # the check sees a pool too small
    assert burst(make_client(emulator_cfg(emu), qps=0)) == 0  # the default: one per reconcile thread
