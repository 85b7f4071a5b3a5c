"""hash(salt, key) -> bucket -> version. Pure: no I/O, no clock, no process-local state.

The routing contract, the same in every pod, across restarts and machines:

- 10,000 buckets; ``bucket = int.from_bytes(sha256(salt + "\\0" + key)[:8], "big") % 10000``
  (never Python's ``hash()``, which changes per process). No key: a uniformly random bucket.
- A table gives every bucket to a version. A new table is evolved from the previous one
  (``evolve``), and between the two:

  1. exact weights: each version owns ``weight x 100`` buckets;
  2. monotone: a bucket changes version only from a version whose weight fell to one whose
     weight rose; a version whose weight is unchanged keeps exactly its buckets, with any number
     of versions;
  3. fresh users per version: a version whose weight rises takes its new buckets from those the
     falling versions give up in ITS OWN pseudo-random order (seeded by the salt and its name),
     so successive canaries draw independent sets of users from stable (overlap about w1 x w2),
     and a canary that rises keeps what it had and takes more in the same order;
  4. identical everywhere: the table is a function of the previous table and the new weights, and
     a table can be carried in the runtime config (``encode``/``decode``), which the operator does,
     so that every pod serves the one it published.

  With no previous table, every bucket starts as the stable version's.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import random
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

BUCKETS = 10_000
PER_PERCENT = BUCKETS // 100
# The longest ``buckets`` text decoded: one byte per bucket that zlib could not compress at all,
# in base64, with room to spare (an encoded table is a few KB).
MAX_BUCKETS_TEXT = 16_384


def bucket_of(salt: str, key: str) -> int:
    """The bucket of a user key: stable across processes, machines and Python versions."""
    digest = hashlib.sha256(f"{salt}\0{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % BUCKETS


@functools.lru_cache(maxsize=256)
def draw_order(salt: str, version: str) -> tuple[int, ...]:
    """Every bucket, in the order ``version`` takes them: by sha256(salt, version, bucket)."""
    def rank(bucket: int) -> bytes:
        return hashlib.sha256(f"{salt}\0{version}\0{bucket}".encode()).digest()[:8]

    return tuple(sorted(range(BUCKETS), key=rank))


def evolve(owners: Sequence[str] | None, weights: Mapping[str, int], stable: str, salt: str) -> tuple[str, ...]:
    """The next table: ``owners`` (one version per bucket; None: all ``stable``'s) moved to
    ``weights`` (percentages summing to 100) by the rules in this module's docstring."""
    if sum(weights.values()) != 100 or any(w < 0 for w in weights.values()):
        raise ValueError(f"weights {dict(weights)} must be 0-100 and sum to 100")
    new = list(owners) if owners is not None else [stable] * BUCKETS
    if len(new) != BUCKETS:
        raise ValueError(f"a routing table has {BUCKETS} buckets, not {len(new)}")
    have = Counter(new)
    excess = {v: n - weights.get(v, 0) * PER_PERCENT for v, n in have.items()
              if n > weights.get(v, 0) * PER_PERCENT}
    growers = sorted((v for v, w in weights.items() if w * PER_PERCENT > have.get(v, 0)))
    for version in growers:
        need = weights[version] * PER_PERCENT - have.get(version, 0)
        for bucket in draw_order(salt, version):
            if need == 0:
                break
            owner = new[bucket]
            if excess.get(owner, 0) > 0:
                new[bucket] = version
                excess[owner] -= 1
                need -= 1
    return tuple(new)


def encode(owners: Sequence[str]) -> dict[str, object]:
    """A table as it goes into the runtime config: the versions, and one byte per bucket (the
    index of its version), zlib-compressed and base64-encoded (a few KB)."""
    return dict(_encoded(tuple(owners)))


@functools.lru_cache(maxsize=256)
def _encoded(owners: tuple[str, ...]) -> tuple[tuple[str, object], ...]:
    names = sorted(set(owners))
    if len(names) > 255:
        raise ValueError("a routing table holds at most 255 versions")
    index = {n: i for i, n in enumerate(names)}
    raw = bytes(index[v] for v in owners)
    return (("versions", names), ("buckets", base64.b64encode(zlib.compress(raw, 6)).decode()))


def decode(table: Mapping[str, object]) -> tuple[str, ...]:
    """The inverse of ``encode``; ValueError naming what is wrong."""
    names = table.get("versions")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("routing.table.versions: must be a list of version names")
    text = str(table.get("buckets", ""))
    if len(text) > MAX_BUCKETS_TEXT:  # before decoding: a ConfigMap value may hold a MiB
        raise ValueError(f"routing.table.buckets: {len(text)} characters, at most {MAX_BUCKETS_TEXT}")
    try:
        # Bounded: a few KB of zlib can inflate to GBs; no table is over one byte per bucket.
        inflater = zlib.decompressobj()
        raw = inflater.decompress(base64.b64decode(text, validate=True), BUCKETS + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"routing.table.buckets: not zlib-compressed base64 ({exc})") from None
    if len(raw) > BUCKETS:
        raise ValueError(f"routing.table.buckets: more than {BUCKETS} buckets")
    if not inflater.eof or inflater.unused_data:
        raise ValueError("routing.table.buckets: not zlib-compressed base64 (the stream is "
                         + ("cut short)" if not inflater.eof else "followed by other data)"))
    if len(raw) != BUCKETS:
        raise ValueError(f"routing.table.buckets: {len(raw)} buckets, must be {BUCKETS}")
    if max(raw) >= len(names):
        raise ValueError(f"routing.table.buckets: version index {max(raw)} but only {len(names)} versions")
    return tuple(names[i] for i in raw)


# What a pod's /status says for its table_digest (and shadow) while its workers route (or shadow) differently:
# it matches no table, so the operator does not count the pod as serving one.
WORKERS_DIFFER = "workers-differ"


def table_digest(table: Mapping[str, object]) -> str:
    """A short digest of an encoded table (``encode``'s versions and buckets, as published): pods
    report the one they route by, and the operator compares it with the one it published."""
    canonical = json.dumps({"versions": table.get("versions"), "buckets": table.get("buckets")},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RoutingTable:
    """An immutable routing decision table; swap the whole object to change weights."""

    salt: str
    owners: tuple[str, ...]  # the version of each bucket
    weights: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def build(cls, salt: str, weights: Mapping[str, int], stable: str,
              previous: RoutingTable | Sequence[str] | None = None) -> RoutingTable:
        """The table for ``weights``, evolved from ``previous`` (a table, its owners, or None)."""
        before = previous.owners if isinstance(previous, RoutingTable) else previous
        return cls(salt=salt, owners=evolve(before, weights, stable, salt), weights=dict(weights))

    @classmethod
    def published(cls, salt: str, weights: Mapping[str, int], table: Mapping[str, object]) -> RoutingTable:
        """A table carried in the config; ValueError unless it gives every version its weight."""
        owners = decode(table)
        counts = Counter(owners)
        for version in sorted(set(counts) | {v for v, w in weights.items() if w}):
            if counts.get(version, 0) != weights.get(version, 0) * PER_PERCENT:
                raise ValueError(f"routing.table: {version} owns {counts.get(version, 0)} buckets but its weight"
                                 f" is {weights.get(version, 0)} ({weights.get(version, 0) * PER_PERCENT} buckets)")
        return cls(salt=salt, owners=owners, weights=dict(weights))

    def version_for_bucket(self, bucket: int) -> str:
        return self.owners[bucket]

    def route(self, key: str | None, rng: random.Random | None = None) -> str:
        """The version serving ``key``; without a key, a weighted random one."""
        if key is None:
            bucket = (rng or random).randrange(BUCKETS)
        else:
            bucket = bucket_of(self.salt, key)
        return self.owners[bucket]

    def without(self, unavailable: set[str], fallback: str) -> RoutingTable:
        """The same table with the buckets of unavailable versions served by ``fallback``."""
        if not unavailable & set(self.owners):
            return self
        owners = tuple(fallback if v in unavailable else v for v in self.owners)
        return RoutingTable(salt=self.salt, owners=owners, weights=self.weights)

    def encode(self) -> dict[str, object]:
        return encode(self.owners)
