"""Simulated users who act on what they were answered: each answered request converts with a
probability that depends on the version that served it, and its outcome (1 converted, 0 not) is
posted to the runtime's feedback endpoint with the response's ``id``, as an application would.

    users = Conversions(runtime.url, "scorer", {"v1": 0.30, "v2": 0.15}, runtime.feedback_token).start()
    Traffic(runtime.url, "scorer", on_answer=users.answered).start()
    ...
    users.stop()  # posts what is left

Outcomes are drawn independently per request (the independence the sequential test assumes), from
a seeded generator, and posted in batches from a thread of their own every ``flush_seconds``, so
the traffic generator's event loop never waits for them. Loopback targets only.
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Mapping
from urllib.parse import urlparse

import httpx

from .net import require_loopback

MAX_BATCH = 1000  # the runtime's limit of items per feedback request


def response_id(body: bytes) -> str | None:
    """The ``id`` of an OIP infer response body (every runtime response carries one)."""
    at = body.rfind(b'"id":"')
    if at < 0:
        return None
    start = at + 6
    end = body.find(b'"', start)
    return body[start:end].decode() if end > start else None


class Conversions:
    """Per version, the probability that a user converts after an answer (``default`` for a
    version not named); ``totals`` counts answers and conversions per version as drawn."""

    def __init__(self, url: str, model: str, rates: Mapping[str, float], token: str, default: float = 0.0,
                 seed: int = 11, flush_seconds: float = 0.2, timeout: float = 5.0) -> None:
        require_loopback(urlparse(url).hostname or "")
        self.endpoint = f"{url.rstrip('/')}/v2/models/{model}/feedback"
        self.headers = {"Authorization": f"Bearer {token}"}  # the runtime's feedback token
        self.rates, self.default = dict(rates), default
        self.flush_seconds, self.timeout = flush_seconds, timeout
        self.totals: dict[str, list[int]] = {}  # version -> [answers, conversions]
        self.posted = 0  # items the runtime accepted (counted or unmatched)
        self.counted = 0  # items the runtime counted for a version
        self.failed = 0  # items whose post failed
        self._rng = random.Random(seed)
        self._pending: list[dict[str, object]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def answered(self, version: str, body: bytes) -> None:
        """One successful answer of ``version``: draw the user's outcome and queue it."""
        rid = response_id(body)
        if rid is None:
            return
        with self._lock:
            converted = self._rng.random() < self.rates.get(version, self.default)
            total = self.totals.setdefault(version, [0, 0])
            total[0] += 1
            total[1] += converted
            self._pending.append({"id": rid, "value": 1 if converted else 0})

    def rate(self, version: str) -> float | None:
        """The conversion rate drawn so far for ``version``."""
        answers, conversions = self.totals.get(version, [0, 0])
        return conversions / answers if answers else None

    def start(self) -> Conversions:
        self._thread = threading.Thread(target=self._run, name="conversions", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 2)

    def _run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self._stop.wait(self.flush_seconds):
                self._flush(client)
            self._flush(client)

    def _flush(self, client: httpx.Client) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for start in range(0, len(pending), MAX_BATCH):
            batch = pending[start:start + MAX_BATCH]
            try:
                resp = client.post(self.endpoint, content=json.dumps(batch),
                                   headers={"Content-Type": "application/json", **self.headers})
                resp.raise_for_status()
                self.posted += len(batch)
                self.counted += int(resp.json().get("counted", 0))
            except (httpx.HTTPError, ValueError):
                self.failed += len(batch)
