"""Follow the routing config and hand every valid change to the registry.

Outside a cluster the source is a file, polled a few times a second (a mounted ConfigMap updates
through a symlink swap, which polling sees too). An invalid new config is refused with a logged
reason and the current one is kept.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
from collections.abc import Callable
from pathlib import Path

from mnn_rollout.contract.config import CONFIG_KEY, ConfigError, RuntimeConfig, parse_config_text
from .kube import KubeAPI, KubeError

log = logging.getLogger(__name__)

Apply = Callable[[RuntimeConfig], object]
OnResult = Callable[[str, str | None], None]


class ConfigApplier:
    """Parse a config text, apply it when valid and new, report the result once per text."""

    def __init__(self, apply: Apply, on_result: OnResult | None = None) -> None:
        self._apply = apply
        self._on_result = on_result
        self._last_digest: str | None = None

    def offer(self, text: str, origin: str) -> bool:
        """Returns True when the text was new and applied."""
        digest = hashlib.sha256(text.encode()).hexdigest()
        if digest == self._last_digest:
            return False
        self._last_digest = digest
        try:
            config = parse_config_text(text)
        except ConfigError as exc:
            log.error("refused new config from %s, keeping the current one: %s", origin, exc)
            self._report("rejected", str(exc))
            return False
        self._apply(config)
        log.info("applied new config from %s (weights %s)", origin, config.effective_weights())
        self._report("applied", None)
        return True

    def _report(self, result: str, reason: str | None) -> None:
        if self._on_result is not None:
            self._on_result(result, reason)


class FileConfigSource:
    """Polls a config file; a daemon thread that stops with ``stop()``."""

    def __init__(self, path: Path, applier: ConfigApplier, interval: float = 0.2) -> None:
        self.path = path
        self.applier = applier
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stamp: tuple[int, int, int] | None = None

    def prime(self, text: str) -> None:
        """Record the text already applied at start so it is not applied twice."""
        self.applier._last_digest = hashlib.sha256(text.encode()).hexdigest()
        self._stamp = self._stat()

    def follow(self, applier: ConfigApplier) -> FileConfigSource:
        """Another follower of the same file, from where this one is, with its own applier."""
        other = FileConfigSource(self.path, applier, self.interval)
        other._stamp = self._stamp
        applier._last_digest = self.applier._last_digest
        return other

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def poll_once(self) -> bool:
        stamp = self._stat()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            text = self.path.read_text()
        except OSError as exc:
            log.error("cannot read config file %s: %s", self.path, exc)
            return False
        if not text.strip():  # a file edited in place, read between its truncation and its writing
            log.warning("config file %s is empty: keeping the current config until it has one", self.path)
            return False
        return self.applier.offer(text, str(self.path))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll_once()
            except Exception:  # the watcher must outlive any single bad update
                log.exception("config watcher failed on an update; still watching")

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="config-file-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def configmap_text(obj: dict[str, object], origin: str) -> str:
    data = obj.get("data") or {}
    if not isinstance(data, dict) or CONFIG_KEY not in data:
        raise ConfigError(f"{origin}: has no data key {CONFIG_KEY!r}")
    return str(data[CONFIG_KEY])


class ConfigMapSource:
    """Follows one ConfigMap through the Kubernetes API: a watch that resumes after disconnects.

    A mounted ConfigMap volume is refreshed by the kubelet only every minute or more; a watch
    delivers a change in milliseconds. On a broken stream it resumes from the last
    resourceVersion; when that is too old (410 Gone) it lists again.
    """

    def __init__(self, api: KubeAPI, namespace: str, name: str, applier: ConfigApplier,
                 watch_timeout: int = 60, retry_delay: float = 0.5, max_retry_delay: float = 5.0) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.applier = applier
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self._failures = 0  # in a row: each doubles the wait before the next try, up to max_retry_delay
        self.resource_version = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def origin(self) -> str:
        return f"configmap {self.namespace}/{self.name}"

    def fetch(self) -> str:
        """The current config text; records the resourceVersion to watch from."""
        obj = self.api.get_configmap(self.namespace, self.name)
        self.resource_version = str(obj.get("metadata", {}).get("resourceVersion", ""))
        return configmap_text(obj, self.origin)

    def prime(self, text: str) -> None:
        self.applier._last_digest = hashlib.sha256(text.encode()).hexdigest()

    def follow(self, applier: ConfigApplier) -> ConfigMapSource:
        """Another follower of the same ConfigMap, from where this one is, with its own applier."""
        other = ConfigMapSource(self.api, self.namespace, self.name, applier, self.watch_timeout, self.retry_delay,
                                self.max_retry_delay)
        other.resource_version = self.resource_version
        applier._last_digest = self.applier._last_digest
        return other

    def _relist(self) -> None:
        self.applier.offer(self.fetch(), self.origin)

    def _watch_once(self) -> None:
        for event in self.api.watch_configmap(self.namespace, self.name, self.resource_version, self.watch_timeout):
            obj = event.get("object", {})
            rv = obj.get("metadata", {}).get("resourceVersion")
            if rv:
                self.resource_version = str(rv)
            kind = event.get("type")
            if kind in ("ADDED", "MODIFIED"):
                try:
                    self.applier.offer(configmap_text(obj, self.origin), self.origin)
                except ConfigError as exc:
                    log.error("refused new config from %s, keeping the current one: %s", self.origin, exc)
            elif kind == "DELETED":
                log.error("%s was deleted; keeping the current config", self.origin)
            if self._stop.is_set():
                return

    def _backoff(self) -> None:
        """Wait before trying again: retry_delay doubled for each failure in a row, up to
        max_retry_delay, times a random 0.5-1 (every pod of every ModelDeployment watches its
        ConfigMap: after an API outage they must not all retry together, twice a second)."""
        self._failures += 1
        delay = min(self.retry_delay * 2 ** min(self._failures - 1, 16), self.max_retry_delay)
        self._stop.wait(delay * random.uniform(0.5, 1.0))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.resource_version:
                    self._relist()
                    self._failures = 0
                self._watch_once()
                self._failures = 0
            except KubeError as exc:
                if exc.code == 410:
                    log.info("%s: watch expired (410), listing again", self.origin)
                    self.resource_version = ""
                    continue
                log.warning("%s: %s; retrying", self.origin, exc)
                if exc.code == 404:
                    self.resource_version = ""
                self._backoff()
            except (OSError, ValueError) as exc:  # connection dropped, bad chunk: resume from the last version
                log.warning("%s: watch interrupted (%s); resuming", self.origin, exc)
                self._backoff()
            except Exception:
                log.exception("%s: watcher failed; resuming", self.origin)
                self._backoff()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="configmap-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
