"""The runtime config: which versions to serve and how to split traffic between them.

The same shape is written by the operator into the ``<name>-routing`` ConfigMap, so the operator
imports these models to render it. Every validation error names the field, the value and what
would be valid.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import unicodedata
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlparse

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from .routing import RoutingTable

# libyaml's safe loader and dumper where PyYAML has them (several times faster; the same documents)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]+$")
SUBFIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*: ")  # "metrics.0.query: ..."
# The data key of the routing ConfigMap that holds the runtime config YAML.
CONFIG_KEY = "runtime.yaml"
# How a runtime process drains on SIGTERM (the operator's terminationGracePeriodSeconds covers
# both): kept-alive connections get this long to close after their next answer (uvicorn's own
# keep-alive timeout, so an idle one is closed no sooner than usual) ...
DRAIN_CONNECTIONS_SECONDS = 5
# ... then requests still in flight this long.
DRAIN_IN_FLIGHT_SECONDS = 10
# Model files from outside the pod (https://, s3://) are downloaded by the runtime into a cache
# directory and checked against the version's sha256. The runtime reads where and how from its
# environment (the operator renders these from spec.modelSource).
REMOTE_SCHEMES = ("https", "http", "s3")  # http only to a loopback address: see uri_problem
MAX_URI_LENGTH = 2048
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MODEL_CACHE_ENV = "MNN_ROLLOUT_MODEL_CACHE"  # the cache directory (default: <tmp>/DEFAULT_MODEL_CACHE)
DEFAULT_MODEL_CACHE = "mnn-rollout-models"
# "true": the cache is this runtime's own (a pod's emptyDir), so after each config it applies the
# runtime removes the files no version of it names. Off by default: a directory shared by several
# runtimes on one machine must keep the others' files.
MODEL_CACHE_PRUNE_ENV = "MNN_ROLLOUT_MODEL_CACHE_PRUNE"
DOWNLOAD_TIMEOUT_ENV = "MNN_ROLLOUT_DOWNLOAD_TIMEOUT_SECONDS"  # longest one download may take
DOWNLOAD_MAX_BYTES_ENV = "MNN_ROLLOUT_DOWNLOAD_MAX_BYTES"  # largest file accepted
# The token POST /v2/models/M/feedback requires, when `serve` has no --feedback-token-file: the
# operator has the kubelet set it from spec.runtime.feedback's Secret.
FEEDBACK_TOKEN_ENV = "MNN_ROLLOUT_FEEDBACK_TOKEN"
ADMIN_TOKEN_ENV = "MNN_ROLLOUT_ADMIN_TOKEN"  # the same for the admin endpoints (--admin-token-file)
DOWNLOAD_TIMEOUT_SECONDS = 600
# Top-level directories a compile cache may not be in: the operator mounts an emptyDir on cacheDir.
SYSTEM_DIRS = frozenset({"usr", "etc", "proc", "sys", "dev", "bin", "sbin", "lib", "lib64", "boot"})
DOWNLOAD_MAX_BYTES = 4 * 1024**3


def is_loopback_host(host: str | None) -> bool:
    """Whether ``host`` is this machine: plain http:// is accepted only there (a test server, a
    sidecar in the pod), since anywhere else it would be readable and changeable on the way."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uri_problem(value: str) -> str | None:
    """What is wrong with a version's ``uri``, naming the value and what is valid; None if nothing."""
    valid = "valid: a path, file://, https://HOST/PATH or s3://BUCKET/KEY"
    if not value.strip():
        return f"uri is empty; {valid}"
    if len(value) > MAX_URI_LENGTH:
        return f"uri is {len(value)} characters long; valid: at most {MAX_URI_LENGTH}"
    parsed = urlparse(value)
    scheme = parsed.scheme
    if scheme in ("", "file"):
        return None
    if scheme not in REMOTE_SCHEMES or not value.startswith(f"{scheme}://"):
        return f"uri {value!r} has unsupported scheme {value.split(':', 1)[0]!r}; {valid}"
    if scheme == "s3":
        bucket, _, key = value[len("s3://"):].partition("/")
        if not S3_BUCKET.match(bucket) or ".." in bucket or not key or key.endswith("/"):
            return (f"uri {value!r} is not s3://BUCKET/KEY (a bucket name of 3-63 lowercase letters, digits, "
                    "'.' and '-', then the key of one object)")
        return None
    try:
        host, _ = parsed.hostname, parsed.port  # a port that is not a number raises
    except ValueError:
        host = None
    if not host:
        return f"uri {value!r} names no host (or a bad port); valid: https://HOST[:PORT]/PATH"
    if parsed.username is not None or parsed.password is not None:
        return (f"uri {value!r} carries a user or password, which would show in the ConfigMap, the status "
                "and the logs; valid: https://HOST/PATH (S3 credentials come from a Secret: spec.modelSource)")
    if scheme == "http" and not is_loopback_host(host):
        return (f"uri {value!r} is plain http to {host!r}; valid: https://, or http:// to a loopback address "
                "(127.0.0.1, ::1, localhost: a test server or a sidecar in the pod)")
    return None


class ConfigError(ValueError):
    """A config that cannot be served; the message names every bad field and value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchingSpec(_Strict):
    """Dynamic batching of one version: concurrent requests go through one ``forward``.

    Field names follow Triton's ``dynamic_batching``; the camelCase spellings (as in the
    ModelDeployment spec) are accepted too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    max_batch_size: int = Field(
        default=32, ge=2, le=1024, alias="maxBatchSize",
        description="Most rows (summed over the requests) one forward takes.",
    )
    max_queue_delay_microseconds: int = Field(
        default=0, ge=0, le=1_000_000, alias="maxQueueDelayMicroseconds",
        description="How long the first request of a batch waits for others; 0: only requests "
        "that arrived together (while the previous forward ran) are batched.",
    )


class EngineSpec(_Strict):
    """How MNN runs one version: the settings of its runtime manager and where its compile cache
    lives. The defaults are what every version ran with before there were settings: CPU, one
    thread. The camelCase spelling (``cacheDir``, as in the ModelDeployment spec) is accepted too.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    backend: Literal["CPU", "OpenCL", "Vulkan", "CUDA", "Metal", "Auto"] = Field(
        default="CPU", description="MNN backend; one the node lacks falls back to CPU (the version still serves).",
    )
    precision: Literal["normal", "high", "low", "lowBF16"] = Field(
        default="normal", description="MNN precision mode (low: fp16 where the hardware has it).",
    )
    memory: Literal["normal", "high", "low"] = Field(
        default="normal", description="MNN memory mode (low: quantized weights stay int8, slower).",
    )
    power: Literal["normal", "high", "low"] = Field(default="normal", description="MNN power mode.")
    threads: int = Field(
        default=1, ge=1, le=32, strict=True,  # true, 2.0 and "4" are refused, not read as 1, 2 and 4
        description="CPU threads of one forward (MNN caps them at 32).",
    )
    cache_dir: str | None = Field(
        default=None, alias="cacheDir",
        description="Directory of the compile cache (GPU kernels and tuning): "
        "<cacheDir>/<version>-<sha256 prefix>-<backend>.cache, read before load, written after warm-up.",
    )

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir_is_absolute(cls, value: str | None) -> str | None:
        if value is None:
            return value
        control = next((c for c in value if unicodedata.category(c) == "Cc"), None)
        if control is not None:
            raise ValueError(f"cacheDir {value!r} contains the control character {control!r}; valid: a directory "
                             "name without control characters, e.g. /var/cache/mnn")
        parts = [part for part in value.split("/") if part not in ("", ".")]
        if not value.startswith("/") or not parts or ".." in parts:
            raise ValueError(f"cacheDir {value!r} is not an absolute directory; valid: e.g. /var/cache/mnn "
                             "(not /, no '..')")
        if parts[0] in SYSTEM_DIRS:
            raise ValueError(f"cacheDir {value!r} is under /{parts[0]}, a system directory (an emptyDir mounted "
                             "there would hide the container's own files); valid: e.g. /var/cache/mnn")
        return value


class VersionSpec(_Strict):
    """One model version: a name and where its ``.mnn`` file is."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(description="Version name, a DNS-1123 label such as v1 or v2-int8.")
    uri: str = Field(description="A path or file:// URI of the .mnn file (relative to the config file), or "
                                 "an https:// or s3://BUCKET/KEY URI of one the runtime downloads (sha256 required).")
    sha256: str | None = Field(default=None, description="Expected sha256 of the file, lowercase hex.")
    batching: BatchingSpec | None = Field(
        default=None, description="Dynamic batching for this version; absent: every request runs alone."
    )
    engine: EngineSpec | None = Field(
        default=None, description="How MNN runs this version; absent: CPU with one thread.",
    )
    warmup_shapes: dict[str, list[int]] | None = Field(
        default=None, alias="warmupShapes",
        description="Input name -> the shape to warm the model up with at load, for models that leave "
        "dimensions other than the batch open (an image model's height and width).",
    )

    @field_validator("warmup_shapes")
    @classmethod
    def _shapes_are_positive(cls, value: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
        for name, shape in (value or {}).items():
            if not shape or any(d < 1 for d in shape):
                raise ValueError(f"warmup shape of input {name!r} is {shape}; valid: a list of sizes >= 1")
        return value

    @field_validator("name")
    @classmethod
    def _name_is_label(cls, value: str) -> str:
        if len(value) > 63 or not DNS1123_LABEL.match(value):
            raise ValueError(
                f"version name {value!r} is not a DNS-1123 label "
                "(lowercase letters, digits and '-', starting and ending with a letter or digit, at most 63)"
            )
        return value

    @field_validator("uri")
    @classmethod
    def _uri_is_supported(cls, value: str) -> str:
        problem = uri_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("sha256")
    @classmethod
    def _sha_is_hex(cls, value: str | None) -> str | None:
        if value is not None and not SHA256_HEX.match(value):
            raise ValueError(f"sha256 {value!r} is not 64 lowercase hex digits")
        return value

    @model_validator(mode="after")
    def _remote_file_names_its_digest(self) -> VersionSpec:
        if self.remote and self.sha256 is None:
            raise ValueError(f"sha256: required for the remote uri {self.uri!r} (the runtime checks the download "
                             "against it); valid: the file's sha256, 64 lowercase hex digits")
        return self

    @property
    def remote(self) -> bool:
        """Whether the file comes from outside the pod (https://, s3://): the runtime downloads it."""
        return urlparse(self.uri).scheme in REMOTE_SCHEMES

    def path(self, base: Path | None = None) -> Path:
        """The local file this version loads from; relative paths resolve against ``base``."""
        parsed = urlparse(self.uri)
        raw = unquote(parsed.path) if parsed.scheme == "file" else self.uri
        path = Path(raw)
        if not path.is_absolute() and base is not None:
            path = base / path
        return path


class RoutingSpec(_Strict):
    """Where the user key comes from and how it is hashed."""

    header: str = Field(default="X-User-Id", description="Request header that carries the user key.")
    parameter: str = Field(
        default="user_id", description="OIP request parameter used as the key when the header is absent."
    )
    salt: str | None = Field(default=None, description="Hash salt; defaults to the model name.")
    table: dict[str, Any] | None = Field(
        default=None,
        description="The bucket table the operator publishes ({versions, buckets}: see contract.routing.encode); "
                    "without it the runtime evolves its own from the weights.",
    )

    @field_validator("header")
    @classmethod
    def _header_is_token(cls, value: str) -> str:
        if not HEADER_NAME.match(value):
            raise ValueError(f"header {value!r} is not a valid HTTP header name (letters, digits, '-')")
        return value


class ServerSpec(_Strict):
    """Limits of the HTTP front end."""

    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Largest accepted request body; larger gets 413."
    )
    max_batch: int = Field(default=1024, ge=1, description="Largest accepted size of a dynamic batch dim.")
    idle_unload_seconds: float | None = Field(
        default=None, ge=1,
        description="Unload a version with weight 0 (not the stable one) after this long without a request; "
        "it loads again on its next pinned request or before it gains weight. Absent: never.",
    )


class ShadowSpec(_Strict):
    """Shadow traffic: a share of the requests stable answers is also run on another version in
    the same process, off the request's path; users get stable's answer, the other one is compared
    with it and dropped."""

    version: str = Field(description="The version run in stable's shadow: a listed version other than stable, "
                                     "normally at weight 0 (it serves no user).")
    percent: int = Field(ge=1, le=100, description="Percent of stable's routed requests (not pinned ones) also run "
                                                   "on it, 1-100, drawn at random per request.")


class RuntimeConfig(_Strict):
    """Everything one runtime serves: a model, its versions and the traffic split."""

    model: str = Field(description="Model name used in the OIP URLs and metric labels.")
    versions: list[VersionSpec] = Field(min_length=1, description="Every version to load.")
    weights: dict[str, int] = Field(
        default_factory=dict,
        description="Percent of keyed traffic per version, 0-100, summing to 100. Empty: stable gets 100.",
    )
    stable: str | None = Field(
        default=None, description="The version that owns the top buckets; defaults to the first listed."
    )
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    server: ServerSpec = Field(default_factory=ServerSpec)
    shadow: ShadowSpec | None = Field(
        default=None, description="Run a share of stable's requests on another version too, to compare; absent: none.",
    )

    @field_validator("model")
    @classmethod
    def _model_is_name(cls, value: str) -> str:
        if not value or len(value) > 253 or not re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", value):
            raise ValueError(f"model name {value!r} must be letters, digits, '_', '.', '-' (1-253 chars)")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> RuntimeConfig:
        check_versions(self.versions, self.weights, {"stable": self.stable})
        if self.routing.table is not None:
            RoutingTable.published(self.salt, self.effective_weights(), self.routing.table)  # ValueError: refused
        if self.shadow is not None:
            names = [v.name for v in self.versions]
            others = [n for n in names if n != self.stable_version]
            if self.shadow.version not in names:
                raise ValueError(f"shadow.version: {self.shadow.version!r} is not a listed version; valid: {others}")
            if self.shadow.version == self.stable_version:
                raise ValueError(f"shadow.version: {self.shadow.version!r} is the stable version, which it would be "
                                 f"compared with; valid: another listed version {others}")
        return self

    @property
    def stable_version(self) -> str:
        return self.stable or self.versions[0].name

    @property
    def shadow_version(self) -> str | None:
        """The version run in stable's shadow; it stays loaded (it is never unloaded while idle)."""
        return self.shadow.version if self.shadow is not None else None

    @property
    def salt(self) -> str:
        return self.routing.salt if self.routing.salt is not None else self.model

    def effective_weights(self) -> dict[str, int]:
        """Weight of every listed version; versions absent from ``weights`` get 0."""
        if not self.weights:
            return {v.name: (100 if v.name == self.stable_version else 0) for v in self.versions}
        return {v.name: self.weights.get(v.name, 0) for v in self.versions}

    def version_set_digest(self) -> str:
        """Hash of the version list alone: it changes when versions change, not when weights do."""
        text = "\n".join(f"{v.name}\t{v.uri}\t{v.sha256 or ''}" for v in self.versions)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_versions(versions: list[VersionSpec], weights: dict[str, int], named: dict[str, str | None]) -> None:
    """Cross-field rules shared by the runtime config and the ModelDeployment spec: unique
    version names; ``named`` fields (stable, canary) and weights name listed versions; weights
    are 0-100 and sum to 100."""
    names = [v.name for v in versions]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"versions: duplicate version names {duplicates}; each name must be unique")
    for field, value in named.items():
        if value is not None and value not in names:
            raise ValueError(f"{field}: {value!r} is not a listed version; valid: {names}")
    for name, weight in weights.items():
        if name not in names:
            raise ValueError(f"weights.{name}: {name!r} is not a listed version; valid: {names}")
        if not 0 <= weight <= 100:
            raise ValueError(f"weights.{name}: {weight} is outside 0-100")
    if weights and sum(weights.values()) != 100:
        raise ValueError(f"weights: {dict(weights)} sum to {sum(weights.values())}; must sum to 100")


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line per problem: ``field.path: message (got value)``; ``prefix`` is put before each
    path (the operator uses ``spec.``). Cross-field messages already start with their field."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(prefix + msg)
            continue
        value = err.get("input")
        sub = SUBFIELD.match(msg)
        if sub:  # a cross-field message naming a field below ``loc``: one path
            lines.append(f"{prefix}{loc}.{msg}")
            continue
        shown = "" if isinstance(value, dict) or f"{value!r}" in msg else f" (got {value!r})"
        lines.append(f"{prefix}{loc}: {msg}{shown}")
    return "; ".join(lines)


def parse_config(data: Any) -> RuntimeConfig:
    """Validate a decoded YAML/JSON document; raise ConfigError with a readable message."""
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping, got {type(data).__name__}")
    try:
        return RuntimeConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def parse_config_text(text: str) -> RuntimeConfig:
    try:
        data = yaml.load(text, Loader=YAML_LOADER)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config: not valid YAML: {exc}") from None
    return parse_config(data)


def load_config_file(path: str | Path) -> RuntimeConfig:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"config file {str(path)!r}: {exc.strerror}") from None
    return parse_config_text(text)


def dump_config(config: RuntimeConfig) -> str:
    """YAML text of a config, as the operator writes it into the ConfigMap."""
    return yaml.dump(config.model_dump(mode="json", exclude_none=True), Dumper=YAML_DUMPER, sort_keys=False)
