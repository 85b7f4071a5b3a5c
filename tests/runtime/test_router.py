"""The routing contract: stable hash, 10,000 buckets, canary in the lowest buckets."""

from __future__ import annotations

import math

import hashlib
import random
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from mnn_rollout.contract.routing import BUCKETS, RoutingTable, bucket_of

KEYS = [f"user-{i}" for i in range(100_000)]


def two_way(canary_weight: int, salt: str = "scorer") -> RoutingTable:
    return RoutingTable.build(salt, ["v1", "v2"], {"v1": 100 - canary_weight, "v2": canary_weight}, stable="v1")


def test_the_bucket_is_the_documented_sha256_formula() -> None:
    digest = hashlib.sha256(b"scorer\0alice").digest()
    assert bucket_of("scorer", "alice") == int.from_bytes(digest[:8], "big") % 10_000


def test_the_canary_owns_the_lowest_buckets_and_stable_the_rest() -> None:
    table = two_way(30)
    assert table.version_for_bucket(0) == "v2"
    assert table.version_for_bucket(2999) == "v2"
    assert table.version_for_bucket(3000) == "v1"
    assert table.version_for_bucket(BUCKETS - 1) == "v1"


def test_more_than_two_versions_take_ranges_in_listed_order_below_stable() -> None:
    table = RoutingTable.build("s", ["v1", "v2", "v3"], {"v1": 50, "v2": 20, "v3": 30}, stable="v1")
    assert [(r.version, r.start, r.stop) for r in table.ranges] == [
        ("v2", 0, 2000), ("v3", 2000, 5000), ("v1", 5000, 10_000)
    ]


@settings(max_examples=20, deadline=None)
@given(canary=st.integers(min_value=0, max_value=100), salt=st.text(min_size=1, max_size=20))
def test_the_observed_split_over_100k_keys_is_within_five_standard_errors(canary: int, salt: str) -> None:
    """The share of 100k hashed keys is binomial around the weight: within five standard errors
    (at most 0.8 points; a fixed half point failed about once in 30 runs of 20 salts)."""
    table = two_way(canary, salt)
    share = sum(table.route(k) == "v2" for k in KEYS) / len(KEYS) * 100
    p = canary / 100
    assert abs(share - canary) <= 5 * 100 * math.sqrt(p * (1 - p) / len(KEYS))


@settings(max_examples=50, deadline=None)
@given(a=st.integers(min_value=0, max_value=100), b=st.integers(min_value=0, max_value=100),
       keys=st.lists(st.text(max_size=30), min_size=1, max_size=300))
def test_raising_the_canary_weight_only_moves_keys_from_stable_to_canary(a: int, b: int, keys: list[str]) -> None:
    low, high = sorted((a, b))
    before, after = two_way(low), two_way(high)
    for key in keys:
        if before.route(key) == "v2":
            assert after.route(key) == "v2", key


def test_without_a_key_routing_is_weighted_random() -> None:
    table = two_way(25)
    rng = random.Random(1)
    share = sum(table.route(None, rng) == "v2" for _ in range(40_000)) / 40_000
    assert abs(share - 0.25) < 0.01


def test_unavailable_versions_are_served_by_the_fallback_in_their_own_buckets() -> None:
    table = two_way(30).without({"v2"}, fallback="v1")
    assert {r.version for r in table.ranges} == {"v1"}
    assert table.route("anyone") == "v1"


def test_the_same_key_maps_to_the_same_version_in_two_separate_processes() -> None:
    script = (
        "from mnn_rollout.contract.routing import RoutingTable\n"
        "t = RoutingTable.build('scorer', ['v1', 'v2'], {'v1': 70, 'v2': 30}, 'v1')\n"
        "print(''.join('1' if t.route(f'user-{i}') == 'v1' else '2' for i in range(5000)))\n"
    )
    outs = set()
    for seed in ("0", "12345"):  # different hash randomisation in each process
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        outs.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                check=True).stdout)
    local = "".join("1" if two_way(30).route(f"user-{i}") == "v1" else "2" for i in range(5000))
    assert outs == {local + "\n"}
