"""Model files from outside the pod: ``https://`` and ``s3://BUCKET/KEY`` versions are downloaded
into a cache directory before they are loaded, and checked against the version's sha256.

- Streamed to a temporary file beside the cache entry while hashing, then renamed into place
  (``<sha256>-<hash of the URI>.mnn``) only when the digest matches: a failed, cut or wrong
  download never leaves a file a later load could take for good.
- A cached file with the right digest is used as it is (no request): a reload, a restart with the
  same cache directory, an offloaded version loaded again cost no download. The entry is keyed by
  the URI too, so a URI whose file does not have the digest given fails even when another
  version's file has that digest.
- Bounded: one download may take at most ``timeout`` seconds from the first byte asked to the last
  received, and at most ``max_bytes`` bytes (the Content-Length or the object size is checked
  first, the bytes received as they come). HTTPS asks for the file unencoded and refuses a
  compressed answer: a small one could grow past the limit in memory before it was counted.
- Every failure is a ``SourceError`` (a ``ModelLoadError``): the version fails with the reason,
  the others keep serving, a serving version keeps its file.
- Only the process that loads downloads: the workers of ``serve --workers N`` find the file in the
  cache (the supervisor put it there before forking them) and never fetch it themselves.
- Pruned when the cache is the runtime's own (``MNN_ROLLOUT_MODEL_CACHE_PRUNE=true``, set in the
  pods, whose cache is an emptyDir that lives through every rollout): after each config is
  applied, the cached files that no version of it names, nor any file still serving, are removed,
  so the pod's disk holds the live versions, not every version it ever served.

HTTPS goes through httpx (already a dependency). S3 through obstore (the Rust ``object_store``
crate of Apache Arrow behind a small Python API): any S3-compatible endpoint, the standard AWS
environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``, ``AWS_ENDPOINT_URL``) and the AWS credential chain (web identity, container
credentials) without code here. Each is imported only when a version needs it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from mnn_rollout.contract.config import (DEFAULT_MODEL_CACHE, DOWNLOAD_MAX_BYTES, DOWNLOAD_MAX_BYTES_ENV,
                                         DOWNLOAD_TIMEOUT_ENV, DOWNLOAD_TIMEOUT_SECONDS, MODEL_CACHE_ENV,
                                         MODEL_CACHE_PRUNE_ENV, VersionSpec, is_loopback_host)
from .engine import remove_stale
from .model import ModelLoadError, file_sha256

if TYPE_CHECKING:
    import httpx

log = logging.getLogger(__name__)

CHUNK = 1 << 20
CONNECT_SECONDS = 10.0  # to open a connection (and, for HTTPS, between two reads)


class SourceError(ModelLoadError):
    """A remote model file that could not be had; ``reason`` names the URI and why."""


@dataclass(frozen=True)
class SourceSettings:
    """Where downloads go and their bounds, from the environment (the operator sets it)."""

    cache_dir: Path  # one file per remote URI and digest (see cache_path)
    timeout: float = DOWNLOAD_TIMEOUT_SECONDS  # seconds one download may take, first byte asked to last
    max_bytes: int = DOWNLOAD_MAX_BYTES  # largest file accepted
    prune: bool = False  # the cache is this runtime's own: remove files no version names (see prune)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> SourceSettings:
        cache = env.get(MODEL_CACHE_ENV) or os.path.join(tempfile.gettempdir(), DEFAULT_MODEL_CACHE)
        return cls(Path(cache), _positive(env, DOWNLOAD_TIMEOUT_ENV, float, DOWNLOAD_TIMEOUT_SECONDS),
                   int(_positive(env, DOWNLOAD_MAX_BYTES_ENV, int, DOWNLOAD_MAX_BYTES)),
                   env.get(MODEL_CACHE_PRUNE_ENV, "").lower() in ("1", "true", "yes"))


def _positive(env: Mapping[str, str], name: str, kind: type[float] | type[int], default: float) -> float:
    text = env.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = 0
    if value <= 0:
        log.error("%s=%r is not a positive number; using %s", name, text, default)
        return default
    return value


def local_file(spec: VersionSpec, base_dir: Path | None, download: bool = True,
               settings: SourceSettings | None = None) -> Path:
    """The local file to load ``spec`` from: its path, or for a remote URI the cached copy,
    downloaded first when it is not cached (and ``download`` allows: False in a worker)."""
    if not spec.remote:
        return spec.path(base_dir)
    assert spec.sha256 is not None  # the contract requires it for a remote URI
    settings = settings or SourceSettings.from_env()
    target = cache_path(spec, settings)
    if target.is_file():
        try:
            cached = file_sha256(target)
        except OSError as exc:
            raise SourceError(f"{spec.uri}: the cached {str(target)!r} cannot be read: {exc.strerror or exc}") from None
        if cached == spec.sha256:
            log.info("%s: using the cached %s", spec.uri, target)
            return target
        log.warning("%s: the cached %s does not have sha256 %s; downloading it again", spec.uri, target, spec.sha256)
    if not download:
        raise SourceError(f"{spec.uri} is not in the cache {str(settings.cache_dir)!r}; the supervisor process "
                          "downloads it")
    try:
        settings.cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceError(f"{spec.uri}: cache directory {str(settings.cache_dir)!r} cannot be made: "
                          f"{exc.strerror}") from None
    started = time.monotonic()
    size = fetch(spec.uri, spec.sha256, target, settings)
    log.info("%s: downloaded %d bytes in %.2f s into %s", spec.uri, size, time.monotonic() - started, target)
    return target


def cache_path(spec: VersionSpec, settings: SourceSettings) -> Path:
    """Where the cache keeps the file of a remote ``spec``."""
    return settings.cache_dir / f"{spec.sha256}-{hashlib.sha256(spec.uri.encode()).hexdigest()[:16]}.mnn"


CACHE_ENTRY = re.compile(r"^[0-9a-f]{64}-[0-9a-f]{16}\.mnn$")  # cache_path's names; nothing else is touched


def prune(keep: Iterable[VersionSpec], settings: SourceSettings | None = None) -> list[Path]:
    """With ``settings.prune``: remove the cached files of versions not in ``keep``; returns them.
    Only complete entries (cache_path's names) are removed: never a download in progress, never
    a file of anyone else. Failures are logged, never raised (the next config tries again)."""
    settings = settings or SourceSettings.from_env()
    if not settings.prune:
        return []
    wanted = {cache_path(spec, settings).name for spec in keep if spec.remote}
    removed = []
    try:
        entries = list(settings.cache_dir.iterdir())
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("model cache %s not pruned: %s", settings.cache_dir, exc.strerror)
        return []
    for entry in entries:
        if entry.name in wanted or not CACHE_ENTRY.match(entry.name):
            continue
        try:
            entry.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            log.warning("cached model file %s not removed: %s", entry, exc.strerror)
            continue
        removed.append(entry)
    if removed:
        log.info("model cache: removed %s (no version names them)", ", ".join(p.name for p in removed))
    return removed


def fetch(uri: str, sha256: str, target: Path, settings: SourceSettings) -> int:
    """Download ``uri`` to ``target`` through a temporary file, keeping it only when its digest is
    ``sha256``; returns its size. Raises SourceError."""
    deadline = time.monotonic() + settings.timeout
    remove_stale(target.parent, ".*.part", settings.timeout + 60)  # left by a killed download (none runs longer)
    try:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{sha256[:16]}-", suffix=".part")
    except OSError as exc:
        raise SourceError(f"{uri}: cannot write into {str(target.parent)!r}: {exc.strerror}") from None
    digest, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in _chunks(uri, settings, deadline):
                size += len(chunk)
                if size > settings.max_bytes:
                    raise SourceError(f"{uri}: larger than the limit of {settings.max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise SourceError(f"{uri}: not downloaded within {settings.timeout:g} s ({size} bytes so far)")
                digest.update(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != sha256:
            raise SourceError(f"{uri}: the downloaded file has sha256 {actual}, expected {sha256}; not kept")
        os.replace(name, target)
        return size
    except OSError as exc:  # the disk: full, gone
        raise SourceError(f"{uri}: cannot write the download into {str(target.parent)!r}: {exc}") from None
    finally:
        if os.path.exists(name):
            os.unlink(name)


def _chunks(uri: str, settings: SourceSettings, deadline: float) -> Iterator[bytes]:
    scheme = urlparse(uri).scheme
    if scheme == "s3":
        return _s3_chunks(uri, settings, deadline)
    return _http_chunks(uri, settings, deadline)


def _http_chunks(uri: str, settings: SourceSettings, deadline: float) -> Iterator[bytes]:
    """GET ``uri``, following redirects to https:// only (or http:// to a loopback address)."""
    import httpx  # here: a runtime without remote versions never imports it

    def refuse_plain_http(request: httpx.Request) -> None:
        if not secure(request.url.scheme, request.url.host):
            raise SourceError(f"{uri}: redirected to {request.url}, which is not https://")

    timeout = httpx.Timeout(min(CONNECT_SECONDS, settings.timeout))
    try:
        with httpx.Client(timeout=timeout, follow_redirects=True,
                          event_hooks={"request": [refuse_plain_http]}) as client:
            # identity: the file as it is, so the limit counts the bytes received (httpx asks for gzip by
            # default and decodes it: a small answer could grow past the limit in memory before it is checked)
            with client.stream("GET", uri, headers={"Accept-Encoding": "identity"}) as response:
                if response.status_code != 200:
                    raise SourceError(f"{uri}: HTTP {response.status_code} {response.reason_phrase}")
                encoding = response.headers.get("content-encoding", "").strip().lower()
                if encoding not in ("", "identity"):
                    raise SourceError(f"{uri}: answered with Content-Encoding {encoding!r} although asked for the file "
                                      "as it is (Accept-Encoding: identity); valid: the file unencoded")
                length = response.headers.get("content-length", "")
                if length.isdigit() and int(length) > settings.max_bytes:
                    raise SourceError(f"{uri}: {length} bytes, larger than the limit of {settings.max_bytes} bytes")
                yield from response.iter_raw()  # as it arrives, never decoded: the deadline is checked per read
    except httpx.TimeoutException as exc:
        raise SourceError(f"{uri}: timed out ({type(exc).__name__}, no answer for "
                          f"{timeout.read:g} s)") from None
    except httpx.HTTPError as exc:
        raise SourceError(f"{uri}: {type(exc).__name__}: {exc}") from None
    if time.monotonic() > deadline:
        raise SourceError(f"{uri}: not downloaded within {settings.timeout:g} s")


def secure(scheme: str, host: str) -> bool:
    """Whether a download (or a redirect) may go to this URL: https://, or http:// to this machine."""
    return scheme == "https" or (scheme == "http" and is_loopback_host(host))


def _s3_chunks(uri: str, settings: SourceSettings, deadline: float) -> Iterator[bytes]:
    """GET the object, signed with the credentials of the environment."""
    import obstore
    from obstore.exceptions import BaseError
    from obstore.store import S3Store

    bucket, _, key = uri[len("s3://"):].partition("/")
    endpoint = next((os.environ[n] for n in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
                     if os.environ.get(n)), "")
    remaining = timedelta(seconds=max(0.001, deadline - time.monotonic()))
    try:
        store = S3Store(
            bucket,
            # the timeout covers the whole request, body included; an explicit endpoint in plain
            # http (an in-cluster MinIO) is the user's choice, as with KServe's s3-usehttps: 0
            client_options={"timeout": remaining, "connect_timeout": timedelta(seconds=CONNECT_SECONDS),
                            "allow_http": endpoint.startswith("http://")},
            retry_config={"max_retries": 2, "retry_timeout": remaining},
        )
        result = obstore.get(store, key)
        size = int(result.meta["size"])
        if size > settings.max_bytes:
            raise SourceError(f"{uri}: {size} bytes, larger than the limit of {settings.max_bytes} bytes")
        yield from result.stream(min_chunk_size=CHUNK)
    except SourceError:
        raise
    except FileNotFoundError:
        raise SourceError(f"{uri}: no such object (endpoint {endpoint or 'AWS S3'})") from None
    except (BaseError, OSError, ValueError) as exc:
        raise SourceError(f"{uri}: {_s3_reason(exc)} (endpoint {endpoint or 'AWS S3'})") from None


def _s3_reason(exc: Exception) -> str:
    """The status and S3 error code of an obstore error, not its whole debug dump."""
    text = str(exc)
    status = re.search(r"status code: (\d{3}[^:<]*)", text)
    code = re.search(r"<Code>([^<]+)</Code>", text)
    if status or code:
        parts = (status.group(1).strip() if status else "", f"({code.group(1)})" if code else "")
        return " ".join(p for p in parts if p)
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
