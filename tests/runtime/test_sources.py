"""Remote model files (https://, s3://): downloaded once into the cache, checked against their
sha256, and a failed download fails that version only. Against a loopback HTTP server and a
local S3-compatible server (moto's server mode), never the outside network."""

from __future__ import annotations

import gzip
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from mnn_rollout.contract.config import VersionSpec
from mnn_rollout.local.net import wait_for, write_atomic
from mnn_runtime.sources import SourceError, SourceSettings, cache_path, local_file, prune, secure
from rollout_operator.observe import Observation, PodView
from tests.runtime_server import RuntimeServer
from tests.s3_server import moto_s3

BODY = {"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}
KEYS = [f"user-{i}" for i in range(40)]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ModelFiles(ThreadingHTTPServer):
    """Model files over plain HTTP on 127.0.0.1, counting the requests per path. ``stall`` paths
    answer nothing until the server closes; ``/moved/P`` redirects to ``/P``; ``/ftp/P`` redirects
    to ftp://; ``/nolength/P`` sends ``/P`` without a Content-Length; ``/gzip/P`` sends ``/P``
    gzip-encoded whatever the request accepts. ``encodings``: each request's Accept-Encoding."""

    daemon_threads = True

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = dict(files)
        self.requests: Counter[str] = Counter()
        self.encodings: list[str | None] = []
        self.stall: set[str] = set()
        self.closing = threading.Event()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def close(self) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: ModelFiles

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        files = self.server
        files.requests[self.path] += 1
        files.encodings.append(self.headers.get("Accept-Encoding"))
        if self.path in files.stall:
            files.closing.wait(30)
            return
        for prefix, target in (("/moved/", "/"), ("/ftp/", f"ftp://127.0.0.1:{files.server_address[1]}/")):
            if self.path.startswith(prefix):
                self.send_response(302)
                self.send_header("Location", target + self.path[len(prefix):])
                self.end_headers()
                return
        plain = self.path.removeprefix("/nolength").removeprefix("/gzip")
        body = files.files.get(plain)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        if self.path.startswith("/gzip/"):
            body = gzip.compress(body)
            self.send_header("Content-Encoding", "gzip")
            self.send_header("Content-Length", str(len(body)))
        if plain == self.path:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def files(examples_dir: Path) -> Iterator[ModelFiles]:
    names = ("v1.mnn", "v2.mnn", "v2-slow.mnn")
    server = ModelFiles({f"/{name}": (examples_dir / name).read_bytes() for name in names})
    yield server
    server.close()


def settings(tmp_path: Path, **bounds: Any) -> SourceSettings:
    return SourceSettings(tmp_path / "cache", **bounds)


# -- the download itself -------------------------------------------------------------------------


def test_a_remote_file_is_downloaded_checked_and_then_taken_from_the_cache(files: ModelFiles, tmp_path: Path) -> None:
    data = files.files["/v1.mnn"]
    spec = VersionSpec(name="v1", uri=files.url("/v1.mnn"), sha256=sha(data))
    where = settings(tmp_path)
    path = local_file(spec, None, settings=where)
    assert path == cache_path(spec, where) and path.name.startswith(sha(data)) and path.read_bytes() == data
    assert local_file(spec, None, settings=where) == path
    assert local_file(spec, None, download=False, settings=where) == path  # what a worker finds
    assert files.requests["/v1.mnn"] == 1
    assert sorted(where.cache_dir.iterdir()) == [path]  # no temporary file left behind


def test_a_wrong_digest_fails_naming_both_digests_and_keeps_nothing(files: ModelFiles, tmp_path: Path) -> None:
    expected = sha(files.files["/v1.mnn"])
    spec = VersionSpec(name="v2", uri=files.url("/v2.mnn"), sha256=expected)
    where = settings(tmp_path)
    with pytest.raises(SourceError) as info:
        local_file(spec, None, settings=where)
    assert info.value.reason == (f"{spec.uri}: the downloaded file has sha256 {sha(files.files['/v2.mnn'])}, "
                                 f"expected {expected}; not kept")
    assert list(where.cache_dir.iterdir()) == []


@pytest.mark.parametrize(
    ("path", "bounds", "reason"),
    [
        ("/missing.mnn", {}, "HTTP 404 Not Found"),
        ("/stalled.mnn", {"timeout": 1.0}, "timed out"),
        ("/v1.mnn", {"max_bytes": 1000}, "bytes, larger than the limit of 1000 bytes"),  # by its Content-Length
        ("/nolength/v1.mnn", {"max_bytes": 1000}, ": larger than the limit of 1000 bytes"),  # as the bytes come
        ("/ftp/v1.mnn", {}, "redirected to ftp://127.0.0.1"),
    ],
)
def test_http_errors_timeouts_oversize_files_and_insecure_redirects_fail_with_the_reason(
        files: ModelFiles, tmp_path: Path, path: str, bounds: dict[str, Any], reason: str) -> None:
    files.stall.add("/stalled.mnn")
    spec = VersionSpec(name="v1", uri=files.url(path), sha256=sha(files.files["/v1.mnn"]))
    where = settings(tmp_path, **bounds)
    started = time.monotonic()
    with pytest.raises(SourceError) as info:
        local_file(spec, None, settings=where)
    assert reason in info.value.reason and spec.uri in info.value.reason, info.value.reason
    assert time.monotonic() - started < 10
    assert [p.name for p in where.cache_dir.iterdir()] == []


def test_the_file_is_asked_for_unencoded_and_a_compressed_answer_is_refused_before_it_is_decoded(
        files: ModelFiles, tmp_path: Path) -> None:
    """A gzip answer is refused whatever its size: decoded, 20 KB on the wire grow to 20 MB in memory
    before a limit counting decoded bytes sees them."""
    files.files["/zeros.mnn"] = bytes(20_000_000)
    where = settings(tmp_path, max_bytes=1_000_000)
    data = files.files["/v1.mnn"]
    assert local_file(VersionSpec(name="v1", uri=files.url("/v1.mnn"), sha256=sha(data)), None, settings=where)
    for path in ("/gzip/zeros.mnn", "/gzip/v1.mnn"):
        spec = VersionSpec(name="v1", uri=files.url(path), sha256=sha(files.files[path.removeprefix("/gzip")]))
        with pytest.raises(SourceError) as info:
            local_file(spec, None, settings=where)
        assert info.value.reason == (f"{spec.uri}: answered with Content-Encoding 'gzip' although asked for the file "
                                     "as it is (Accept-Encoding: identity); valid: the file unencoded")
    assert files.encodings == ["identity"] * 3
    assert [p.name for p in where.cache_dir.iterdir()] == [cache_path(VersionSpec(
        name="v1", uri=files.url("/v1.mnn"), sha256=sha(data)), where).name]


def test_redirects_are_followed_to_https_or_loopback_http_only(files: ModelFiles, tmp_path: Path) -> None:
    data = files.files["/v1.mnn"]
    path = local_file(VersionSpec(name="v1", uri=files.url("/moved/v1.mnn"), sha256=sha(data)), None,
                      settings=settings(tmp_path))
    assert path.read_bytes() == data and files.requests["/moved/v1.mnn"] == files.requests["/v1.mnn"] == 1
    assert secure("https", "models.example.com") and secure("http", "127.0.0.1") and secure("http", "::1")
    assert not secure("http", "models.example.com") and not secure("http", "10.0.0.1") and not secure("ftp", "::1")


def test_a_damaged_cached_file_is_downloaded_again(files: ModelFiles, tmp_path: Path) -> None:
    data = files.files["/v1.mnn"]
    where = settings(tmp_path)
    where.cache_dir.mkdir()
    spec = VersionSpec(name="v1", uri=files.url("/v1.mnn"), sha256=sha(data))
    cache_path(spec, where).write_bytes(data[:1000])
    path = local_file(spec, None, settings=where)
    assert path.read_bytes() == data and files.requests["/v1.mnn"] == 1


def test_a_cached_file_that_cannot_be_read_fails_that_version_naming_it(files: ModelFiles, tmp_path: Path) -> None:
    """/proc/self/mem answers a read at offset 0 with EIO, for any user (root reads past a chmod)."""
    data = files.files["/v1.mnn"]
    where = settings(tmp_path)
    where.cache_dir.mkdir()
    spec = VersionSpec(name="v1", uri=files.url("/v1.mnn"), sha256=sha(data))
    cache_path(spec, where).symlink_to("/proc/self/mem")
    with pytest.raises(SourceError) as info:
        local_file(spec, None, settings=where)
    assert info.value.reason == f"{spec.uri}: the cached {str(cache_path(spec, where))!r} cannot be read: " \
                                "Input/output error"


def test_a_worker_never_downloads(files: ModelFiles, tmp_path: Path) -> None:
    spec = VersionSpec(name="v1", uri=files.url("/v1.mnn"), sha256=sha(files.files["/v1.mnn"]))
    with pytest.raises(SourceError, match="is not in the cache .*the supervisor process downloads it"):
        local_file(spec, None, download=False, settings=settings(tmp_path))
    assert files.requests["/v1.mnn"] == 0


def test_a_pruned_cache_keeps_the_files_named_and_only_removes_its_own_entries(files: ModelFiles,
                                                                              tmp_path: Path) -> None:
    specs = [VersionSpec(name=v, uri=files.url(f"/{v}.mnn"), sha256=sha(files.files[f"/{v}.mnn"]))
             for v in ("v1", "v2")]
    shared = settings(tmp_path)
    paths = [local_file(spec, None, settings=shared) for spec in specs]
    others = [shared.cache_dir / name for name in (".0123456789abcdef-x.part", "notes.txt", "a" * 64 + ".mnn")]
    for other in others:
        other.write_bytes(b"not ours")
    assert prune(specs[:1], shared) == []  # not the runtime's own cache: nothing is removed
    assert all(p.is_file() for p in [*paths, *others])
    own = SourceSettings(shared.cache_dir, prune=True)
    assert prune(specs[:1], own) == [paths[1]]
    assert paths[0].is_file() and not paths[1].exists() and all(p.is_file() for p in others)
    assert prune([], SourceSettings(tmp_path / "never-made", prune=True)) == []


def test_the_settings_come_from_the_environment_with_bounded_defaults(tmp_path: Path) -> None:
    defaults = SourceSettings.from_env({})
    assert defaults.cache_dir.name == "mnn-rollout-models" and defaults.timeout == 600
    assert defaults.max_bytes == 4 * 1024**3 and not defaults.prune
    assert SourceSettings.from_env({"MNN_ROLLOUT_MODEL_CACHE_PRUNE": "true"}).prune
    given = SourceSettings.from_env({"MNN_ROLLOUT_MODEL_CACHE": str(tmp_path),
                                     "MNN_ROLLOUT_DOWNLOAD_TIMEOUT_SECONDS": "30",
                                     "MNN_ROLLOUT_DOWNLOAD_MAX_BYTES": "-5"})
    assert (given.cache_dir, given.timeout, given.max_bytes) == (tmp_path, 30, 4 * 1024**3)  # a bad bound: the default


# -- a serving runtime ---------------------------------------------------------------------------


def write(path: Path, config: dict[str, Any]) -> None:
    write_atomic(path, yaml.safe_dump(config))


def served_by(url: str, keys: list[str] = KEYS) -> set[str]:
    with httpx.Client(base_url=url, timeout=10) as client:
        answers = [client.post("/v2/models/scorer/infer", json=BODY, headers={"X-User-Id": k}) for k in keys]
    assert {r.status_code for r in answers} == {200}, [r.text for r in answers if r.status_code != 200]
    return {r.headers["x-model-version"] for r in answers}


def status(url: str) -> dict[str, Any]:
    return dict(httpx.get(url + "/v2/models/scorer/status", timeout=5).json())


def test_versions_download_from_a_local_http_server_and_a_bad_download_fails_only_that_version(
        files: ModelFiles, tmp_path: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MNN_ROLLOUT_MODEL_CACHE", str(tmp_path / "cache"))
    v1, v2 = files.files["/v1.mnn"], files.files["/v2.mnn"]
    config = {"model": "scorer", "weights": {"v1": 80, "v2": 10, "v3": 10}, "versions": [
        {"name": "v1", "uri": files.url("/v1.mnn"), "sha256": sha(v1)},
        {"name": "v2", "uri": files.url("/v2.mnn"), "sha256": sha(v1)},  # the wrong digest
        {"name": "v3", "uri": files.url("/missing.mnn"), "sha256": sha(v2)}]}
    write(tmp_path / "runtime.yaml", config)
    server: RuntimeServer = start_server(tmp_path / "runtime.yaml", wait_ready=False)
    versions = status(server.url)["versions"]
    assert versions["v1"]["ready"] and versions["v1"]["uri"] == files.url("/v1.mnn")
    assert versions["v1"]["sha256"] == sha(v1)
    assert not versions["v2"]["ready"] and f"has sha256 {sha(v2)}, expected {sha(v1)}" in versions["v2"]["reason"]
    assert not versions["v3"]["ready"] and "HTTP 404" in versions["v3"]["reason"]
    assert served_by(server.url) == {"v1"}  # the failed versions' users go to stable
    # the operator reads the same status: the remote version counts as loaded where its uri and digest match
    pods = Observation([PodView("pod-a", "127.0.0.1", server.port, True, status(server.url))])
    assert pods.version(VersionSpec(name="v1", uri=files.url("/v1.mnn"), sha256=sha(v1))).ready
    assert "has sha256" in (pods.version(VersionSpec(name="v2", uri=files.url("/v2.mnn"), sha256=sha(v1))).reason or "")

    # the right digest: v2 downloads and serves; then a bad new file never replaces it
    config["versions"][1]["sha256"] = sha(v2)
    write(tmp_path / "runtime.yaml", config)
    wait_for(lambda: status(server.url)["versions"]["v2"]["ready"], 20, "v2 ready")
    config["versions"][1] = {"name": "v2", "uri": files.url("/gone/v2.mnn"), "sha256": "1" * 64}
    write(tmp_path / "runtime.yaml", config)
    wait_for(lambda: "still serving" in (status(server.url)["versions"]["v2"]["reason"] or ""), 20, "v2 kept")
    r = httpx.post(server.url + "/v2/models/scorer/versions/v2/infer", json=BODY, timeout=10)
    assert r.status_code == 200 and r.headers["x-model-version"] == "v2"
    assert status(server.url)["versions"]["v2"]["uri"] == files.url("/v2.mnn")


def test_a_cached_file_is_not_downloaded_again_on_a_reload_or_a_restart(
        files: ModelFiles, tmp_path: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MNN_ROLLOUT_MODEL_CACHE", str(tmp_path / "cache"))
    v1 = {"name": "v1", "uri": files.url("/v1.mnn"), "sha256": sha(files.files["/v1.mnn"])}
    v2 = {"name": "v2", "uri": files.url("/v2.mnn"), "sha256": sha(files.files["/v2.mnn"])}
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": [v1]})
    first: RuntimeServer = start_server(tmp_path / "runtime.yaml")
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": [v1, v2], "weights": {"v1": 50, "v2": 50}})
    wait_for(lambda: status(first.url)["versions"].get("v2", {}).get("ready"), 20, "v2 ready")
    assert served_by(first.url) == {"v1", "v2"}
    assert first.stop() == 0
    second: RuntimeServer = start_server(tmp_path / "runtime.yaml")
    assert served_by(second.url) == {"v1", "v2"}
    assert files.requests == Counter({"/v1.mnn": 1, "/v2.mnn": 1})
    assert "using the cached" in second.log()


def test_a_runtime_that_owns_its_cache_keeps_only_the_files_its_config_uses(
        files: ModelFiles, tmp_path: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a pod does (its cache is an emptyDir living through every rollout): a version removed
    from the config leaves the disk; a file still serving stays, even when a new one failed."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("MNN_ROLLOUT_MODEL_CACHE", str(cache))
    monkeypatch.setenv("MNN_ROLLOUT_MODEL_CACHE_PRUNE", "true")
    v1 = {"name": "v1", "uri": files.url("/v1.mnn"), "sha256": sha(files.files["/v1.mnn"])}
    v2 = {"name": "v2", "uri": files.url("/v2.mnn"), "sha256": sha(files.files["/v2.mnn"])}
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": [v1, v2], "weights": {"v1": 50, "v2": 50}})
    server: RuntimeServer = start_server(tmp_path / "runtime.yaml")
    names = {v["name"]: cache_path(VersionSpec(**v), SourceSettings(cache)).name for v in (v1, v2)}
    assert {p.name for p in cache.iterdir()} == set(names.values())
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": [v1]})
    wait_for(lambda: "v2" not in status(server.url)["versions"], 20, "v2 removed")
    wait_for(lambda: {p.name for p in cache.iterdir()} == {names["v1"]}, 10, "v2's file removed")
    # a new file for v1 that cannot be had: v1 keeps serving its file, and its file stays
    bad = {**v1, "uri": files.url("/gone/v1.mnn"), "sha256": "1" * 64}
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": [bad]})
    wait_for(lambda: "still serving" in (status(server.url)["versions"]["v1"]["reason"] or ""), 20, "v1 kept")
    assert served_by(server.url) == {"v1"} and {p.name for p in cache.iterdir()} == {names["v1"]}
    assert "model cache: removed " + names["v2"] in server.log()


def test_with_two_workers_the_supervisor_downloads_each_file_once(
        files: ModelFiles, tmp_path: Path, start_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MNN_ROLLOUT_MODEL_CACHE", str(tmp_path / "cache"))
    versions = [{"name": name, "uri": files.url(f"/{name}.mnn"), "sha256": sha(files.files[f"/{name}.mnn"])}
                for name in ("v1", "v2")]
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": versions, "weights": {"v1": 50, "v2": 50}})
    server: RuntimeServer = start_server(tmp_path / "runtime.yaml", extra_args=["--workers", "2"])
    assert served_by(server.url) == {"v1", "v2"}
    # a version added while serving: downloaded once by the supervisor, then the workers are replaced
    slow = {"name": "v3", "uri": files.url("/v2-slow.mnn"), "sha256": sha(files.files["/v2-slow.mnn"])}
    write(tmp_path / "runtime.yaml", {"model": "scorer", "versions": [*versions, slow],
                                      "weights": {"v1": 50, "v2": 0, "v3": 50}})
    wait_for(lambda: served_by(server.url) == {"v1", "v3"}, 30, "v3 served by every worker", interval=0.2)
    assert files.requests == Counter({"/v1.mnn": 1, "/v2.mnn": 1, "/v2-slow.mnn": 1})
    assert server.log().count("downloaded") == 3


# -- S3: moto's server mode on loopback ------------------------------------------------------------


@pytest.fixture(scope="module")
def s3(examples_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The local S3 server, with the example v2 in bucket ``models``."""
    with moto_s3(tmp_path_factory.mktemp("moto"), {"scorer/v2.mnn": (examples_dir / "v2.mnn").read_bytes()}) as env:
        yield env


def s3_config(tmp_path: Path, examples_dir: Path) -> Path:
    v2 = (examples_dir / "v2.mnn").read_bytes()
    write(tmp_path / "runtime.yaml", {"model": "scorer", "weights": {"v1": 50, "v2": 50}, "versions": [
        {"name": "v1", "uri": str(examples_dir / "v1.mnn")},
        {"name": "v2", "uri": "s3://models/scorer/v2.mnn", "sha256": sha(v2)},
        {"name": "v3", "uri": "s3://models/scorer/missing.mnn", "sha256": sha(v2)}]})
    return tmp_path / "runtime.yaml"


def test_an_s3_version_is_served_with_the_credentials_from_the_environment(
        s3: dict[str, str], examples_dir: Path, tmp_path: Path, start_server: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**s3, "MNN_ROLLOUT_MODEL_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    server: RuntimeServer = start_server(s3_config(tmp_path, examples_dir), extra_args=["--workers", "2"])
    assert served_by(server.url) == {"v1", "v2"}  # forked after an S3 download: both workers serve it
    versions = status(server.url)["versions"]
    assert versions["v2"]["uri"] == "s3://models/scorer/v2.mnn"
    assert not versions["v3"]["ready"] and "no such object" in versions["v3"]["reason"]
    assert [p.name[:64] for p in (tmp_path / "cache").iterdir()] == [sha((examples_dir / "v2.mnn").read_bytes())]


def test_wrong_s3_credentials_fail_that_version_only(
        s3: dict[str, str], examples_dir: Path, tmp_path: Path, start_server: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**s3, "AWS_SECRET_ACCESS_KEY": "not-the-secret",
                        "MNN_ROLLOUT_MODEL_CACHE": str(tmp_path / "cache")}.items():
        monkeypatch.setenv(name, value)
    server: RuntimeServer = start_server(s3_config(tmp_path, examples_dir), wait_ready=False)
    reason = status(server.url)["versions"]["v2"]["reason"]
    assert "s3://models/scorer/v2.mnn" in reason and "403" in reason and "SignatureDoesNotMatch" in reason, reason
    assert served_by(server.url) == {"v1"}
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []
