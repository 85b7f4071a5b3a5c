"""Outcomes per version: feedback on answered requests (a conversion, a correct answer), counted
for the version that answered them.

Every infer response carries an ``id``: the request's own, or one the runtime makes,
``<16 hex>.<version>``. Version names are DNS labels (no dot), so a made id names its version and
feedback on it is counted for that version by any worker of any pod. A request's own id cannot:
the worker that answered it remembers which version did (``FeedbackBook``: bounded, with a TTL),
so feedback on it counts only when it reaches that same worker; otherwise it is counted as
unmatched, not as an error. Applications that send feedback should let the runtime make the id.

``POST /v2/models/{model}/feedback`` takes ``{"id": ..., "value": <number>}`` or a list of them;
values are from 0 to ``MAX_VALUE`` (the sums are read as counters by PromQL ``increase()`` and by the
direct provider, so they must never go down: shift a metric that can be negative).
"""

from __future__ import annotations

import itertools
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import orjson

from .errors import BadRequest

SEPARATOR = "."
MAX_ITEMS = 1000  # per feedback request
MAX_ID_LENGTH = 256
# Largest value taken: the pods' sums of squares must stay finite (1e200 twice made them +Inf for
# good, stalling every ``kind: mean`` comparison); 1e15 squared summed a billion times is 1e39.
MAX_VALUE = 1e15
UNKNOWN, EXPIRED = "unknown", "expired"  # why a feedback item was not counted


class _Ids:
    """16 hex digits per response: a random prefix per process (drawn again in a forked worker)
    and a counter; not a getrandom call per request, which profiling showed on the hot path."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self.prefix = secrets.token_hex(4)
        self.counter = itertools.count(int.from_bytes(secrets.token_bytes(3), "big"))

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter) & 0xFFFFFFFF:08x}"


_IDS = _Ids()


def new_id(version: str) -> str:
    """An id for a response of ``version`` that names it."""
    return f"{_IDS.next()}{SEPARATOR}{version}"


def version_in(request_id: str) -> str | None:
    """The version a made id names (None for any other id)."""
    head, sep, version = request_id.rpartition(SEPARATOR)
    if not sep or len(head) != 16 or not version:
        return None
    try:
        int(head, 16)
    except ValueError:
        return None
    return version


class FeedbackBook:
    """Which version answered each recent request that came with an id of its own: at most
    ``max_entries``, each for ``ttl`` seconds (the oldest go first)."""

    def __init__(self, max_entries: int = 100_000, ttl: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl, self.clock = max_entries, ttl, clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, request_id: str, version: str) -> None:
        with self._lock:
            self._entries.pop(request_id, None)
            self._entries[request_id] = (version, self.clock() + self.ttl)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def version(self, request_id: str) -> tuple[str | None, str | None]:
        """(the version, None), or (None, why not: ``unknown`` or ``expired``)."""
        made = version_in(request_id)
        if made is not None:
            return made, None
        with self._lock:
            found = self._entries.get(request_id)
            if found is None:
                return None, UNKNOWN
            if found[1] < self.clock():
                del self._entries[request_id]
                return None, EXPIRED
            return found[0], None


def parse_feedback(body: bytes) -> list[tuple[str, float]]:
    """``{"id", "value"}`` or a list of them -> [(id, value)]; BadRequest names the bad field."""
    try:
        doc: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"feedback body is not JSON: {exc}") from None
    items = doc if isinstance(doc, list) else [doc]
    if not items or len(items) > MAX_ITEMS:
        raise BadRequest(f"feedback: {len(items)} items; valid: 1 to {MAX_ITEMS} per request")
    out = []
    for i, item in enumerate(items):
        where = f"[{i}]" if isinstance(doc, list) else ""
        if not isinstance(item, dict):
            raise BadRequest(f"feedback{where}: {item!r} is not an object with id and value")
        rid, value = item.get("id"), item.get("value")
        if not isinstance(rid, str) or not rid or len(rid) > MAX_ID_LENGTH:
            raise BadRequest(f"feedback{where}.id: {rid!r} is not a response id (a string of 1-{MAX_ID_LENGTH})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or not 0 <= value <= MAX_VALUE:
            raise BadRequest(f"feedback{where}.value: {value!r} is not a number from 0 to {MAX_VALUE:g}")
        out.append((rid, float(value)))
    return out
