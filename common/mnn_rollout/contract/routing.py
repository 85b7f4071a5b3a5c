"""hash(salt, key) -> bucket -> version. Pure: no I/O, no clock, no process-local state.

The routing contract, the same in every pod, across restarts and machines:
- 10,000 buckets; ``bucket = int.from_bytes(sha256(salt + "\\0" + key)[:8], "big") % 10000``
  (never Python's ``hash()``, which changes per process).
- Non-stable versions own the lowest buckets, one range after another in the order they are
  listed in the config; the stable version owns the remaining top buckets. With one canary it owns
  ``[0, w_canary)``, so raising its weight only moves users from stable to the canary.
- No key: a uniformly random bucket, i.e. weighted random.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

BUCKETS = 10_000
PER_PERCENT = BUCKETS // 100


def bucket_of(salt: str, key: str) -> int:
    """The bucket of a user key: stable across processes, machines and Python versions."""
    digest = hashlib.sha256(f"{salt}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


@dataclass(frozen=True)
class BucketRange:
    version: str
    start: int
    stop: int  # exclusive


@dataclass(frozen=True)
class RoutingTable:
    """An immutable routing decision table; swap the whole object to change weights."""

    salt: str
    ranges: tuple[BucketRange, ...]
    weights: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def build(
        cls, salt: str, order: Sequence[str], weights: Mapping[str, int], stable: str
    ) -> RoutingTable:
        """Lay out bucket ranges: non-stable versions in ``order`` from 0 up, stable on top."""
        if sum(weights.values()) != 100:
            raise ValueError(f"weights {dict(weights)} must sum to 100")
        ranges: list[BucketRange] = []
        start = 0
        for name in order:
            if name == stable or weights.get(name, 0) == 0:
                continue
            stop = start + weights[name] * PER_PERCENT
            ranges.append(BucketRange(name, start, stop))
            start = stop
        if start < BUCKETS:
            ranges.append(BucketRange(stable, start, BUCKETS))
        return cls(salt=salt, ranges=tuple(ranges), weights=dict(weights))

    def version_for_bucket(self, bucket: int) -> str:
        for r in self.ranges:
            if bucket < r.stop:
                return r.version
        return self.ranges[-1].version

    def route(self, key: str | None, rng: random.Random | None = None) -> str:
        """The version serving ``key``; without a key, a weighted random one."""
        if key is None:
            bucket = (rng or random).randrange(BUCKETS)
        else:
            bucket = bucket_of(self.salt, key)
        return self.version_for_bucket(bucket)

    def without(self, unavailable: set[str], fallback: str) -> RoutingTable:
        """The same layout with the ranges of unavailable versions served by ``fallback``."""
        if not unavailable & {r.version for r in self.ranges}:
            return self
        ranges = tuple(
            BucketRange(fallback if r.version in unavailable else r.version, r.start, r.stop)
            for r in self.ranges
        )
        return RoutingTable(salt=self.salt, ranges=ranges, weights=self.weights)
