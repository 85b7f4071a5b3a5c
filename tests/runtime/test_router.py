"""The routing contract: stable hash, 10,000 buckets, tables evolved by exact, monotone, fresh
draws for any number of versions, identical wherever they are computed or published."""

from __future__ import annotations

import base64
import hashlib
import math
import random
import subprocess
import sys
import zlib
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mnn_rollout.contract.routing import BUCKETS, PER_PERCENT, RoutingTable, bucket_of, decode, encode, evolve

KEYS = [f"user-{i}" for i in range(100_000)]


def two_way(canary_weight: int, salt: str = "scorer", canary: str = "v2") -> RoutingTable:
    return RoutingTable.build(salt, {"v1": 100 - canary_weight, canary: canary_weight}, stable="v1")


def test_the_bucket_is_the_documented_sha256_formula() -> None:
    digest = hashlib.sha256(b"scorer\0alice").digest()
    assert bucket_of("scorer", "alice") == int.from_bytes(digest[:8], "big") % 10_000


def test_without_history_every_bucket_starts_as_stable_and_the_canary_draws_its_share() -> None:
    table = two_way(30)
    assert Counter(table.owners) == {"v1": 7000, "v2": 3000}
    # a draw, not a range: the canary's buckets are spread over the whole space
    canary = [b for b, v in enumerate(table.owners) if v == "v2"]
    assert min(canary) < 100 and max(canary) > BUCKETS - 100
    assert abs(sum(canary) / len(canary) - BUCKETS / 2) < 300


def weights_sequences(min_versions: int = 2, max_versions: int = 6) -> st.SearchStrategy[list[dict[str, int]]]:
    """Random sequences of weight maps over 2-6 versions, each summing to 100."""
    def split(n: int) -> st.SearchStrategy[dict[str, int]]:
        return st.lists(st.integers(min_value=0, max_value=100), min_size=n - 1, max_size=n - 1).map(
            lambda cuts: _weights(n, sorted(cuts)))

    return st.integers(min_value=min_versions, max_value=max_versions).flatmap(
        lambda n: st.lists(split(n), min_size=1, max_size=6))


def _weights(n: int, cuts: list[int]) -> dict[str, int]:
    bounds = [0, *cuts, 100]
    return {f"v{i + 1}": bounds[i + 1] - bounds[i] for i in range(n)}


@settings(max_examples=60, deadline=None)
@given(sequence=weights_sequences(), salt=st.text(min_size=1, max_size=8))
def test_every_change_is_exact_and_monotone_for_two_to_six_versions(sequence: list[dict[str, int]],
                                                                     salt: str) -> None:
    owners = None
    previous: dict[str, int] = {"v1": 100}
    for weights in sequence:
        new = evolve(owners, weights, "v1", salt)
        assert Counter(new) == {v: w * PER_PERCENT for v, w in weights.items() if w}  # 1. exact
        before = owners or ("v1",) * BUCKETS
        for old_v, new_v in zip(before, new):
            if old_v != new_v:  # 2. only from a version whose weight fell to one whose weight rose
                assert weights.get(old_v, 0) < previous.get(old_v, 0), (old_v, new_v)
                assert weights.get(new_v, 0) > previous.get(new_v, 0), (old_v, new_v)
        owners, previous = new, weights


def test_a_version_whose_weight_is_unchanged_keeps_its_users_while_others_move() -> None:
    """The case the old layout broke: v3 at 10% while v2 goes 10 -> 20 (1,959 of 20,000 users of v3 moved)."""
    first = RoutingTable.build("scorer", {"v1": 80, "v2": 10, "v3": 10}, "v1")
    second = RoutingTable.build("scorer", {"v1": 70, "v2": 20, "v3": 10}, "v1", previous=first)
    keys = KEYS[:20_000]
    moved = Counter((first.route(k), second.route(k)) for k in keys if first.route(k) != second.route(k))
    assert set(moved) == {("v1", "v2")}, moved
    assert all(second.route(k) == "v3" for k in keys if first.route(k) == "v3")


def test_successive_canaries_draw_independent_users() -> None:
    """Canary a at 20%, rolled back; canary b at 20%: about 4% of users see both (w1 x w2), not 20%."""
    a = RoutingTable.build("scorer", {"v1": 80, "a": 20}, "v1")
    back = RoutingTable.build("scorer", {"v1": 100, "a": 0}, "v1", previous=a)
    assert set(back.owners) == {"v1"}  # a rollback returns every bucket to stable
    b = RoutingTable.build("scorer", {"v1": 80, "b": 20}, "v1", previous=back)
    both = sum(1 for x, y in zip(a.owners, b.owners) if x == "a" and y == "b") / BUCKETS
    assert abs(both - 0.04) < 0.01, both


def test_a_rising_canary_keeps_its_users_and_takes_more_in_the_same_order() -> None:
    t10 = two_way(10)
    t30 = RoutingTable.build("scorer", {"v1": 70, "v2": 30}, "v1", previous=t10)
    t60 = RoutingTable.build("scorer", {"v1": 40, "v2": 60}, "v1", previous=t30)
    sets = [{b for b, v in enumerate(t.owners) if v == "v2"} for t in (t10, t30, t60)]
    assert sets[0] < sets[1] < sets[2]
    assert t60.owners == two_way(60).owners  # from stable, the path does not matter with one canary


def test_promotion_gives_the_whole_table_to_the_canary() -> None:
    promoted = RoutingTable.build("scorer", {"v1": 0, "v2": 100}, "v1", previous=two_way(50))
    assert set(promoted.owners) == {"v2"}


@settings(max_examples=20, deadline=None)
@given(canary=st.integers(min_value=0, max_value=100), salt=st.text(min_size=1, max_size=20))
def test_the_observed_split_over_100k_keys_is_within_five_standard_errors(canary: int, salt: str) -> None:
    """The share of 100k hashed keys is binomial around the weight: within five standard errors."""
    table = two_way(canary, salt)
    share = sum(table.route(k) == "v2" for k in KEYS) / len(KEYS) * 100
    p = canary / 100
    assert abs(share - canary) <= 5 * 100 * math.sqrt(p * (1 - p) / len(KEYS))


def test_without_a_key_routing_is_weighted_random() -> None:
    table = two_way(25)
    rng = random.Random(1)
    share = sum(table.route(None, rng) == "v2" for _ in range(40_000)) / 40_000
    assert abs(share - 0.25) < 0.01


def test_unavailable_versions_are_served_by_the_fallback_in_their_own_buckets() -> None:
    table = two_way(30).without({"v2"}, fallback="v1")
    assert set(table.owners) == {"v1"}
    assert table.route("anyone") == "v1"


def test_a_table_round_trips_through_its_encoding_and_a_bad_one_is_refused_naming_the_field() -> None:
    table = RoutingTable.build("scorer", {"v1": 50, "v2": 30, "v3": 20}, "v1")
    encoded = table.encode()
    assert len(str(encoded["buckets"])) < 6000  # small enough for a ConfigMap many times over
    assert decode(encoded) == table.owners
    assert RoutingTable.published("scorer", {"v1": 50, "v2": 30, "v3": 20}, encoded).owners == table.owners
    with pytest.raises(ValueError, match=r"routing.table: v1 owns 5000 buckets but its weight is 40 \(4000"):
        RoutingTable.published("scorer", {"v1": 40, "v2": 40, "v3": 20}, encoded)
    with pytest.raises(ValueError, match="routing.table.buckets: not zlib-compressed base64"):
        decode({"versions": ["v1"], "buckets": "@@@"})
    with pytest.raises(ValueError, match="routing.table.buckets: 3 buckets"):
        decode(encode(("v1",) * 3))


def test_a_table_that_inflates_past_its_buckets_or_carries_more_is_refused_without_inflating_it() -> None:
    def buckets(raw: bytes) -> dict[str, object]:
        return {"versions": ["v1"], "buckets": base64.b64encode(raw).decode()}

    bomb = zlib.compress(bytes(10_000_000), 9)  # 13 KB of base64 that would inflate to 10 MB
    with pytest.raises(ValueError, match="routing.table.buckets: more than 10000 buckets"):
        decode(buckets(bomb))
    with pytest.raises(ValueError, match="routing.table.buckets: 20000 characters, at most 16384"):
        decode({"versions": ["v1"], "buckets": "A" * 20_000})
    whole = zlib.compress(bytes(BUCKETS))
    with pytest.raises(ValueError, match="routing.table.buckets: .* followed by other data"):
        decode(buckets(whole + b"left over"))
    with pytest.raises(ValueError, match="routing.table.buckets: .* cut short"):
        decode(buckets(whole[:-4]))
    assert decode(buckets(whole)) == ("v1",) * BUCKETS


def test_the_same_key_maps_to_the_same_version_in_two_separate_processes() -> None:
    script = (
        "from mnn_rollout.contract.routing import RoutingTable\n"
        "t = RoutingTable.build('scorer', {'v1': 70, 'v2': 30}, 'v1')\n"
        "print(''.join('1' if t.route(f'user-{i}') == 'v1' else '2' for i in range(5000)))\n"
    )
    outs = set()
    for seed in ("0", "12345"):  # different hash randomisation in each process
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        outs.add(subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                                check=True).stdout)
    local = "".join("1" if two_way(30).route(f"user-{i}") == "v1" else "2" for i in range(5000))
    assert outs == {local + "\n"}
