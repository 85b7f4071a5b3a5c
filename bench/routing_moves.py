"""Users moved per weight change, against the minimum possible, for the routing tables of
``mnn_rollout.contract.routing`` beside the layout they replaced (each non-stable version a range
of buckets packed from 0 in listed order, stable on top), measured in the same run.

For random sequences of weights over 2 to 6 versions (seeded), every change moves at least
``sum(max(0, new - old))`` percent of the users: those the versions that gained must get. A
table meets that minimum exactly when it is monotone. Also: how many users two successive
canaries share (each at 20%, the first rolled back): independent draws share about 4%.

    .venv/bin/python bench/routing_moves.py [--sequences 100] [--users 20000]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "common"))

from mnn_rollout.contract.routing import BUCKETS, PER_PERCENT, bucket_of, evolve  # noqa: E402


def packed(weights: Mapping[str, int], order: Sequence[str], stable: str) -> tuple[str, ...]:
    """The replaced layout: non-stable versions in ``order`` from bucket 0 up, stable on top."""
    owners: list[str] = []
    for name in order:
        if name != stable:
            owners += [name] * (weights.get(name, 0) * PER_PERCENT)
    return tuple(owners + [stable] * (BUCKETS - len(owners)))


def random_weights(rng: random.Random, names: list[str]) -> dict[str, int]:
    cuts = sorted(rng.randint(0, 100) for _ in range(len(names) - 1))
    bounds = [0, *cuts, 100]
    return {n: bounds[i + 1] - bounds[i] for i, n in enumerate(names)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sequences", type=int, default=100)
    p.add_argument("--steps", type=int, default=5, help="weight changes per sequence")
    p.add_argument("--users", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    rng = random.Random(args.seed)
    buckets = [bucket_of("scorer", f"user-{i}") for i in range(args.users)]
    rows = []
    for n in range(2, 7):
        names = [f"v{i + 1}" for i in range(n)]
        minimum = 0.0
        moved = {"new": 0, "old": 0}
        unchanged = {"new": 0, "old": 0}  # users of a version whose weight did not change, moved
        for _ in range(args.sequences):
            weights = {"v1": 100, **{v: 0 for v in names[1:]}}
            tables = {"new": ("v1",) * BUCKETS, "old": packed(weights, names, "v1")}
            for _ in range(args.steps):
                nxt = random_weights(rng, names)
                minimum += sum(max(0, nxt[v] - weights[v]) for v in names) / 100 * len(buckets)
                after = {"new": evolve(tables["new"], nxt, "v1", "scorer"), "old": packed(nxt, names, "v1")}
                for kind in ("new", "old"):
                    for b in buckets:
                        was = tables[kind][b]
                        if was != after[kind][b]:
                            moved[kind] += 1
                            unchanged[kind] += weights[was] == nxt[was]
                weights, tables = nxt, after
        rows.append((n, args.sequences * args.steps, minimum, moved, unchanged))
    print(f"users moved per weight change, {args.users:,} users, {args.sequences} random sequences of "
          f"{args.steps} changes per version count (seed {args.seed})")
    print(f"{'versions':>8} {'changes':>7} {'minimum':>8} {'new':>7} {'old':>7} {'new/min':>7} {'old/min':>7}"
          f"  users of unchanged versions moved (new / old)")
    for n, changes, minimum, moved, unchanged in rows:
        print(f"{n:>8} {changes:>7} {minimum / changes:>8.0f} {moved['new'] / changes:>7.0f} "
              f"{moved['old'] / changes:>7.0f} {moved['new'] / minimum:>7.3f} {moved['old'] / minimum:>7.3f}"
              f"  {unchanged['new']} / {unchanged['old']}")
    # Successive canaries: a at 20%, rolled back; b at 20%.
    a = evolve(None, {"v1": 80, "a": 20}, "v1", "scorer")
    back = evolve(a, {"v1": 100, "a": 0}, "v1", "scorer")
    b = evolve(back, {"v1": 80, "b": 20}, "v1", "scorer")
    both_new = sum(1 for x in buckets if a[x] == "a" and b[x] == "b") / len(buckets)
    old_a, old_b = packed({"v1": 80, "a": 20}, ["v1", "a"], "v1"), packed({"v1": 80, "b": 20}, ["v1", "b"], "v1")
    both_old = sum(1 for x in buckets if old_a[x] == "a" and old_b[x] == "b") / len(buckets)
    print(f"two successive canaries at 20%: users in both {both_new:.1%} (new; independent draws: 4.0%) "
          f"against {both_old:.1%} (old)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
