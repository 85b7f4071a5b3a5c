"""Inference, metadata and health logic shared by every front end (REST now, gRPC later).

Front ends translate their protocol into these calls and render ``InferenceError`` as their own
error shape; nothing here knows about HTTP beyond the header names of the routing contract.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from . import __version__
from . import binary as binary_ext
from .batching import Batcher, Grouper, batching_off_reason, timed_forward
from .codec import check_against_spec, decode_tensor, encode_output, to_array
from mnn_rollout.contract.config import BatchingSpec
from mnn_rollout.contract.routing import WORKERS_DIFFER
from .errors import BadRequest, InferenceError, ModelNotFound, VersionNotReady
from .feedback import MAX_ID_LENGTH, FeedbackBook, new_id, parse_feedback, version_in
from .metrics import UNROUTED, RuntimeMetrics, outcome_of
from .model import LoadedModel
from .registry import FAILED, OFFLOADED, PENDING, Registry, Snapshot, VersionState, model_metadata
from .shadow import Shadow, setting as shadow_setting

log = logging.getLogger(__name__)

PIN_HEADER = "x-model-version"
VERSION_HEADER = "X-Model-Version"


@dataclass(frozen=True)
class InferResult:
    status: int
    body: bytes
    version: str | None
    json_length: int | None = None  # set when the body carries binary outputs after its JSON
    # For a request handed over parsed (gRPC), instead of a body on success: the response id and
    # each output asked for as (name, datatype, shape, little-endian bytes).
    id: str = ""
    tensors: list[tuple[str, str, list[int], bytes]] | None = None


class DataPlane:
    """The OIP v2 operations over the registry's current snapshot."""

    def __init__(self, registry: Registry, metrics: RuntimeMetrics) -> None:
        self.registry = registry
        self.metrics = metrics
        # (event loop, version) -> (the model and spec it was made for, its batcher or None when
        # the model cannot be batched)
        self._batchers: dict[tuple[int, str], tuple[LoadedModel, BatchingSpec, Batcher | None]] = {}
        self._groupers: dict[asyncio.AbstractEventLoop, Grouper] = {}  # each loop's (batching.Grouper)
        self.feedback_book = FeedbackBook()  # the versions that answered requests with ids of their own
        self.shadow = Shadow(registry, metrics.shadow)  # stable's requests run again on the shadow version
        # serve --workers: what every worker routes by (workers_channel.PodRouting.read), for /status
        self.pod_routing: Callable[[], dict[str, Any] | None] | None = None
        registry.on_offload.append(self._let_go)

    def _let_go(self, names: list[str]) -> None:
        """Drop the batchers of versions just unloaded: each holds its model, whose memory would
        otherwise never be freed (called on the thread that unloads: the idle checker's, or a
        worker's loop)."""
        for key in [k for k in list(self._batchers) if k[1] in names]:
            self._batchers.pop(key, None)

    # -- health and metadata -------------------------------------------------------------------

    def live(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.registry.snapshot.ready

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "mnn-rollout", "version": __version__, "extensions": ["model_version_routing"]}

    def _snapshot_for(self, model: str) -> Snapshot:
        snap = self.registry.snapshot
        if model != snap.config.model:
            raise ModelNotFound(f"model {model!r} does not exist; valid: [{snap.config.model!r}]")
        return snap

    def model_ready(self, model: str, version: str | None = None) -> bool:
        snap = self._snapshot_for(model)
        if version is None:
            return snap.ready
        state = snap.versions.get(version)
        if state is None:
            snap.version(version)  # raises VersionNotFound with the valid names
        return bool(state and (state.ready or state.on_demand))  # unloaded while idle: loads for a request

    def model_metadata(self, model: str, version: str | None = None) -> dict[str, Any]:
        snap = self._snapshot_for(model)
        name = version or snap.config.stable_version
        state = snap.versions.get(name)
        if state is None or not state.on_demand:
            state = snap.version(name)  # raises unless loaded
        assert state.model is not None or state.metadata is not None
        meta = model_metadata(state.model) if state.model is not None else state.metadata
        assert meta is not None
        return {
            "name": model,
            "versions": [name for name, v in snap.versions.items() if v.ready or v.on_demand],
            "platform": "mnn",
            "inputs": meta["inputs"],
            "outputs": meta["outputs"],
            "parameters": {
                "version": state.spec.name,
                "stable_version": snap.config.stable_version,
                "weights": snap.weights,
                "sha256": meta["sha256"],
                "engine": meta["engine"],  # asked for and actual: backend, threads
            },
        }

    def loaded_model(self, model: str, version: str) -> LoadedModel:
        """The loaded model of ``version``: 404 when unknown, 503 when not loaded."""
        state = self._snapshot_for(model).version(version)
        assert state.model is not None
        return state.model

    def model_status(self, model: str) -> dict[str, Any]:
        """Every listed version's state, reason and weight, and the routing table's digest (an
        mnn-rollout extension of OIP, read by the operator to report per-version readiness and the
        routing served across pods, and what it shadows). With workers, the table, weights and
        shadow are the whole pod's (``_pod_wide``)."""
        snap = self._snapshot_for(model)
        status: dict[str, Any] = {
            "name": model,
            "ready": snap.ready,
            "stable_version": snap.config.stable_version,
            "weights": snap.weights,
            "table_digest": snap.table_digest,  # which table of these weights (another can have the same)
            "shadow": shadow_setting(snap.config),  # {"version", "percent"} run in stable's shadow, or None
            "versions_digest": snap.config.version_set_digest(),
            "versions": {
                name: {"ready": v.ready, "state": v.state, "reason": v.reason, "uri": v.spec.uri,
                       "sha256": v.model.sha256 if v.model else v.sha256, "batching": _batching_status(v),
                       "engine": v.model.engine.as_parameters() if v.model else None}
                for name, v in snap.versions.items()
            },
        }
        if self.pod_routing is not None:
            pod = self.pod_routing()
            status.update(_pod_wide(pod, snap))
            status["versions"] = _pod_versions(pod, status["versions"], os.getpid())
        return status

    # -- inference -----------------------------------------------------------------------------

    async def infer(
        self, model: str, url_version: str | None, body: bytes, headers: Mapping[str, str],
        parsed: tuple[dict[str, Any], bytes] | None = None, at_once: bool = False,
    ) -> InferResult:
        """Route, check, run and encode one request; every outcome is counted for its version.
        ``parsed``: the request object and its binary part, already apart (gRPC, which has no JSON
        to parse): ``body`` is then unused and the outputs come back raw (``InferResult.tensors``).
        ``at_once``: its forward is not grouped with the others of this turn (batching.Grouper).
        ``headers``: lower-case names, values decoded as latin-1 (a char per byte, as ASGI and HPACK give them)."""
        started = time.perf_counter()
        label = UNROUTED
        flight = None
        status = 500
        try:
            snap = self._snapshot_for(model)
            if parsed is None:
                json_part, binary = binary_ext.split_body(body, headers.get(binary_ext.HEADER))
                request, parse_error = _parse(json_part)
            else:
                (request, binary), parse_error = parsed, None
            version = self._choose(snap, url_version, headers, request)
            if version is not None:
                label = version
                flight = self.metrics.in_flight_of(label)
                flight.inc()
            if parse_error is not None:
                raise parse_error
            assert version is not None and request is not None
            state = await self._loaded(snap, version)
            arrays, wanted = self._inputs(state, request, snap.config.server.max_batch, binary)
            assert state.model is not None
            batcher = self._batcher(state) if state.spec.batching is not None else None
            forward_seconds: float | None = None  # stable's, the shadow's baseline (unbatched only)
            if batcher is None:
                # On the loop itself: forward holds the GIL, so a thread hop would only add its cost.
                grouper = self._grouper()
                if at_once or grouper.now():
                    outputs, forward_seconds = timed_forward(state.model, arrays)
                else:  # after the others read in this turn (see batching.Grouper)
                    outputs, forward_seconds = await grouper.later(state.model, arrays)
            else:
                outputs = await batcher.infer(arrays)
            given = request.get("id")
            made = version_in(given) if isinstance(given, str) else ""
            if not given or made not in (None, version):
                # Every response carries an id; a made one names its version (see feedback.py), so
                # one that names another version is not echoed: feedback on it would count there.
                request["id"] = new_id(version)
            elif made is None and len(given) <= MAX_ID_LENGTH:  # longer: feedback can never name it
                self.feedback_book.remember(given, version)
            if parsed is None:
                payload, json_length = _response(model, version, request, state, outputs, wanted)
                result = InferResult(200, payload, version, json_length)
            else:
                result = InferResult(200, b"", version, None, request["id"], _raw_outputs(state, outputs, wanted))
            if snap.config.shadow is not None:  # queued for its own thread; never waited for
                self.shadow.offer(snap, version, bool(url_version or headers.get(PIN_HEADER)), state.model, arrays,
                                  outputs, forward_seconds)
            status = 200
            return result
        except InferenceError as exc:
            status = exc.status_code
            return InferResult(status, _error_body(exc.message), None if label == UNROUTED else label)
        except asyncio.CancelledError:  # its client went away (a gRPC reset, a deadline) while it waited
            status = 0  # no answer: not counted as any outcome (it is no server error of its version)
            raise
        except Exception as exc:  # a bug must cost one request, never the worker
            log.exception("inference failed unexpectedly")
            return InferResult(500, _error_body(f"internal error: {type(exc).__name__}: {exc}"), None)
        finally:
            if flight is not None:
                flight.dec()
            if status:
                self.metrics.observe(label, outcome_of(status), time.perf_counter() - started)

    def feedback(self, model: str, body: bytes) -> dict[str, int]:
        """Count each feedback item for the version that answered the request it names; items
        whose request is unknown here or too old are counted as unmatched, not refused."""
        snap = self._snapshot_for(model)
        items = parse_feedback(body)
        matched = []
        for request_id, value in items:
            version, why = self.feedback_book.version(request_id)
            if version is None or version not in snap.versions:
                self.metrics.feedback_unmatched.labels(self.metrics.model, why or "unknown").inc()
                continue
            matched.append((version, value))
        self.metrics.count_feedback(matched)  # under one lock, however many items
        return {"counted": len(matched), "unmatched": len(items) - len(matched)}

    async def _loaded(self, snap: Snapshot, version: str) -> VersionState:
        """The version's state, once loaded: an offloaded one is loaded again first (this request
        waits for it; others asking meanwhile wait for the same load)."""
        state = snap.versions.get(version)
        if state is None or state.state != OFFLOADED:
            return snap.version(version)
        # shielded: this request giving up (cancelled) must not cancel the load the others wait for
        reloaded = await asyncio.shield(asyncio.wrap_future(self.registry.reload(version)))
        if reloaded is None or reloaded.model is None:
            raise VersionNotReady(f"version {version!r} is not ready: "
                                  f"{reloaded.reason if reloaded else 'no longer listed'}")
        return reloaded

    def _grouper(self) -> Grouper:
        loop = asyncio.get_running_loop()
        grouper = self._groupers.get(loop)
        if grouper is None:
            for gone in [k for k in list(self._groupers) if k.is_closed()]:  # loops that served and ended (tests)
                self._groupers.pop(gone, None)
            grouper = self._groupers[loop] = Grouper(loop)
        return grouper

    def _batcher(self, state: VersionState) -> Batcher | None:
        """This loop's batcher for a version with batching configured; None when the model
        cannot be batched (the reason is in ``model_status``)."""
        loop = asyncio.get_running_loop()
        key = (id(loop), state.spec.name)
        spec = state.spec.batching
        assert spec is not None and state.model is not None
        cached = self._batchers.get(key)
        if cached is not None and cached[0] is state.model and cached[1] == spec:
            return cached[2]
        live = self.registry.snapshot.versions
        for stale in [k for k, v in list(self._batchers.items())
                      if k[1] not in live or live[k[1]].model is not v[0]]:
            self._batchers.pop(stale, None)  # a removed or replaced model is not kept alive by its batcher
        batcher = None
        reason = batching_off_reason(state.model)
        if reason is not None:
            log.warning("version %s: batching is configured but off: %s", state.spec.name, reason)
        else:
            histogram = self.metrics.batch_rows.labels(self.metrics.model, state.spec.name)
            batcher = Batcher(state.model, spec, loop, histogram.observe)
        self._batchers[key] = (state.model, spec, batcher)
        return batcher

    def _choose(
        self,
        snap: Snapshot,
        url_version: str | None,
        headers: Mapping[str, str],
        request: dict[str, Any] | None,
    ) -> str | None:
        """The pinned version, else the hash-routed one; None when the body is unreadable and
        nothing else identifies the user."""
        pinned = url_version or headers.get(PIN_HEADER)
        if pinned:
            state = snap.versions.get(pinned)
            if state is None or state.state != OFFLOADED:  # an offloaded one loads for it
                snap.version(pinned)
            return pinned
        routing = snap.config.routing
        key = headers.get(routing.header.lower())
        if key is not None and not key.isascii():
            key = _header_text(routing.header, key)
        if not key or key.isspace():  # an empty header is no key: not one bucket for all who send it
            key = None
            if request is not None:
                key = _parameter_key(request, routing.parameter)
        if key is None and request is None:
            return None
        return snap.table.route(key)

    @staticmethod
    def _inputs(
        state: VersionState, request: dict[str, Any], max_batch: int, binary: bytes = b""
    ) -> tuple[list[np.ndarray], list[str] | None]:
        model = state.model
        assert model is not None
        raw = request.get("inputs")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("inputs: required, a non-empty list of tensors")
        sizes = binary_ext.binary_sizes(raw, binary)
        offset = 0
        given: dict[str, np.ndarray] = {}
        specs = {s.name: s for s in model.inputs}
        for i, obj in enumerate(raw):
            where = f"inputs[{i}]"
            size = sizes[i]
            name, datatype, shape, data = decode_tensor(obj, where, binary=size is not None)
            spec = specs.get(name)
            if spec is None:
                raise BadRequest(f"{where}.name: {name!r} is not an input of version {state.spec.name!r}; "
                                 f"valid: {sorted(specs)}")
            if name in given:
                raise BadRequest(f"{where}.name: input {name!r} is given twice")
            if size is not None:
                arr = binary_ext.binary_array(binary[offset:offset + size], datatype, shape, where)
                offset += size
            else:
                arr = to_array(data, datatype, shape, where)
            given[name] = check_against_spec(arr, datatype, spec, max_batch, where)
        missing = [n for n in specs if n not in given]
        if missing:
            raise BadRequest(f"inputs: missing {missing} required by version {state.spec.name!r}")
        batches = {given[s.name].shape[0] for s in model.inputs if s.shape and s.shape[0] == -1}
        if len(batches) > 1:
            raise BadRequest(f"inputs: batch sizes differ between inputs: {sorted(batches)}")
        return [given[s.name] for s in model.inputs], _wanted_outputs(request, state)


def _header_text(name: str, value: str) -> str:
    """A header's value as the UTF-8 text it carries: front ends hand header values over decoded
    as latin-1 (one char per byte, as ASGI and HPACK give them), the body's keys are JSON text, and
    the same user must hash the same either way."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        shown = value.encode("latin-1", "replace")
        raise BadRequest(f"header {name}: {shown[:64]!r}{'...' if len(shown) > 64 else ''} is not UTF-8; "
                         "a user key must be UTF-8 text") from None


def _parameter_key(request: dict[str, Any], name: str) -> str | None:
    """The user key in the body's ``parameters``: a string or an integer; None when absent, null
    or empty; anything else is refused, not routed at random unnoticed."""
    params = request.get("parameters")
    value = params.get(name) if isinstance(params, dict) else None
    if value is None:
        return None
    if isinstance(value, str):
        return value if value and not value.isspace() else None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    shown = repr(value)
    raise BadRequest(f"parameters.{name}: {shown[:64]}{'...' if len(shown) > 64 else ''} is not a user key; "
                     "valid: a string or an integer")


def _pod_wide(pod: dict[str, Any] | None, snap: Snapshot) -> dict[str, Any]:
    """What /status says of a pod's routing, from a worker (``pod``: as the supervisor wrote it,
    ``workers_channel.PodRouting``): this worker's table when every worker routes by it, else
    ``WORKERS_DIFFER`` (matching no table: the operator does not count the pod as serving the new
    one) with a lagging worker's weights; this worker's shadow when every worker shadows the same
    (a shadow change leaves the table as it is), else ``WORKERS_DIFFER`` too (and while their tables
    differ: not known); and ``lagging_workers``, the pids of those not routing by the newest config yet."""
    lagging = [pid for pid in (pod or {}).get("lagging") or [] if isinstance(pid, int)]
    if pod is not None and pod.get("table_digest") == snap.table_digest:
        own = shadow_setting(snap.config)
        return {"lagging_workers": lagging, "shadow": own if pod.get("shadow") == own else WORKERS_DIFFER}
    weights = (pod or {}).get("weights")
    return {"table_digest": WORKERS_DIFFER, "weights": weights if isinstance(weights, dict) else snap.weights,
            "shadow": WORKERS_DIFFER, "lagging_workers": lagging}


def _pod_versions(pod: dict[str, Any] | None, versions: dict[str, dict[str, Any]], me: int) -> dict[str, Any]:
    """/status's ``versions`` for a pod of workers, answered by worker ``me``: a version some other
    serving worker cannot serve yet (``pod["serves"]``: what each said it can serve) is pending, not
    ready, with a reason naming those workers (that worker routes its share to the fallback; the
    operator must not give it weight yet), unless this worker failed to load it (its own reason
    stands). With nothing said (``pod`` unread or too large), no version counts as served by all."""
    said = (pod or {}).get("serves")
    others = ({int(pid): {n for n in names if isinstance(n, str)} if isinstance(names, list) else set()
               for pid, names in said.items()
               if isinstance(pid, str) and pid.isdigit() and int(pid) != me} if isinstance(said, dict) else None)
    out = {}
    for name, version in versions.items():
        if others is None:
            reason: str | None = "the pod's workers have not said yet which versions they serve"
        else:
            behind = sorted(pid for pid, names in others.items() if name not in names)
            reason = (f"worker pid{'s' if len(behind) > 1 else ''} {', '.join(map(str, behind))} "
                      f"{'have' if len(behind) > 1 else 'has'} not loaded it yet") if behind else None
        if reason is not None and version["state"] != FAILED:
            version = {**version, "state": PENDING, "ready": False, "reason": reason}
        out[name] = version
    return out


def _batching_status(state: VersionState) -> dict[str, Any] | None:
    spec = state.spec.batching
    if spec is None:
        return None
    reason = batching_off_reason(state.model) if state.model is not None else None
    return {**spec.model_dump(), "active": reason is None, "reason": reason}


def _parse(body: bytes) -> tuple[dict[str, Any] | None, BadRequest | None]:
    try:
        request = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return None, BadRequest(f"body: not valid JSON: {exc}")
    if not isinstance(request, dict):
        return None, BadRequest("body: expected a JSON object with 'inputs'")
    return request, None


def _wanted_outputs(request: dict[str, Any], state: VersionState) -> list[str] | None:
    raw = request.get("outputs")
    if raw is None:
        return None
    assert state.model is not None
    valid = [s.name for s in state.model.outputs]
    if not isinstance(raw, list):
        raise BadRequest("outputs: expected a list of {\"name\": ...}")
    names = []
    for i, obj in enumerate(raw):
        name = obj.get("name") if isinstance(obj, dict) else None
        if name not in valid:
            raise BadRequest(f"outputs[{i}].name: {name!r} is not an output; valid: {valid}")
        names.append(name)
    return names


def _response(
    model: str,
    version: str,
    request: dict[str, Any],
    state: VersionState,
    outputs: list[np.ndarray],
    wanted: list[str] | None,
) -> tuple[bytes, int | None]:
    """The response body, and the JSON part's length when binary outputs follow it."""
    assert state.model is not None
    every, named = binary_ext.wants_binary(request)
    tensors, raw = [], []
    for spec, arr in zip(state.model.outputs, outputs):
        if wanted is not None and spec.name not in wanted:
            continue
        tensor = encode_output(spec.name, arr)
        if every or spec.name in named:
            data = _wire_bytes(tensor.pop("data"))
            tensor["parameters"] = {"binary_data_size": len(data)}
            raw.append(data)
        tensors.append(tensor)
    body: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": tensors}
    if isinstance(request.get("id"), str):
        body["id"] = request["id"]
    head = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    if not raw:
        return head, None
    return head + b"".join(raw), len(head)


_NATIVE_IS_WIRE = sys.byteorder == "little"


def _wire_bytes(arr: np.ndarray) -> bytes:
    """An output's values as raw little-endian bytes in C order (the binary extension's and gRPC's
    form). tobytes writes C order whatever the array's layout; a native little-endian array (every
    output on a little-endian host) goes as it is: one numpy call, not three."""
    if _NATIVE_IS_WIRE and arr.dtype.isnative:
        return arr.tobytes()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def _raw_outputs(state: VersionState, outputs: list[np.ndarray], wanted: list[str] | None,
                 ) -> list[tuple[str, str, list[int], bytes]]:
    """Each output asked for as (name, datatype, shape, raw bytes), for a caller that encodes them itself."""
    assert state.model is not None
    out = []
    for spec, arr in zip(state.model.outputs, outputs):
        if wanted is None or spec.name in wanted:
            tensor = encode_output(spec.name, arr)
            out.append((spec.name, tensor["datatype"], tensor["shape"], _wire_bytes(tensor["data"])))
    return out


def _error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})
