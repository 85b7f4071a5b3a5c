"""``Observation``: a version counts as ready only where a pod serves exactly the file the spec names."""

from __future__ import annotations

from typing import Any

from mnn_rollout.contract.config import VersionSpec
from mnn_rollout.contract.routing import RoutingTable, table_digest
from rollout_operator.observe import Observation, PodView

SHA_A, SHA_B = "a" * 64, "b" * 64


def pod(name: str, **versions: dict[str, Any]) -> PodView:
    return PodView(name, "127.0.0.9", 8080, True, {"ready": True, "versions": versions})


def loaded(uri: str, sha: str = SHA_A, reason: str | None = None) -> dict[str, Any]:
    return {"ready": True, "state": "ready" if reason is None else "failed", "uri": uri, "sha256": sha,
            "reason": reason}


def test_every_pod_serving_the_named_file_is_ready() -> None:
    obs = Observation([pod("a", v2=loaded("v2.mnn")), pod("b", v2=loaded("v2.mnn"))])
    view = obs.version(VersionSpec(name="v2", uri="v2.mnn", sha256=SHA_A))
    assert view.ready and (view.ready_pods, view.pods, view.reason) == (2, 2, None)
    assert obs.version(VersionSpec(name="v2", uri="v2.mnn")).ready  # no sha256 in the spec: the uri decides


def test_a_pod_still_serving_the_old_uri_or_digest_keeps_the_version_unready_and_says_why() -> None:
    obs = Observation([pod("a", v2=loaded("v2-new.mnn", SHA_B)), pod("b", v2=loaded("v2.mnn", SHA_A))])
    view = obs.version(VersionSpec(name="v2", uri="v2-new.mnn", sha256=SHA_B))
    assert not view.ready and view.ready_pods == 1
    assert view.reason == "b: serves v2.mnn, not v2-new.mnn yet"
    same_uri = Observation([pod("a", v2=loaded("v2.mnn", SHA_A))]).version(
        VersionSpec(name="v2", uri="v2.mnn", sha256=SHA_B))
    assert not same_uri.ready and "with sha256 aaaaaaaaaaaa..., not bbbbbbbbbbbb..." in (same_uri.reason or "")


def test_a_failed_reload_that_still_serves_the_old_file_is_not_ready_and_gives_the_runtimes_reason() -> None:
    reason = "new file v2-new.mnn not loaded, still serving v2.mnn: sha256 mismatch"
    obs = Observation([pod("a", v2=loaded("v2.mnn", SHA_A, reason=reason))])
    view = obs.version(VersionSpec(name="v2", uri="v2-new.mnn", sha256=SHA_B))
    assert not view.ready and view.reason == f"a: {reason}"


def test_a_version_unloaded_while_idle_counts_as_ready_only_for_the_file_the_spec_names() -> None:
    idle = {"ready": False, "state": "offloaded", "uri": "v2.mnn", "sha256": SHA_A,
            "reason": "no request for 60 s at weight 0: unloaded; loads again on its next request"}
    obs = Observation([pod("a", v2=loaded("v2.mnn")), pod("b", v2=idle)])
    view = obs.version(VersionSpec(name="v2", uri="v2.mnn", sha256=SHA_A))
    assert view.ready and (view.ready_pods, view.offloaded_pods, view.reason) == (2, 1, None)
    assert view.as_status()["offloadedPods"] == 1
    other = obs.version(VersionSpec(name="v2", uri="v2.mnn", sha256=SHA_B))  # another file: must load first
    assert not other.ready and other.offloaded_pods == 0


def test_weights_are_served_when_every_ready_pod_reports_them() -> None:
    loaded = {"v1": {"ready": True}, "v2": {"ready": False, "state": "offloaded"}}  # unloaded while idle: serves

    def weighted(name: str, weights: dict[str, int] | None, ready: bool = True,
                 versions: dict[str, Any] = loaded) -> PodView:
        status: dict[str, Any] = {"ready": True, "versions": versions}
        if weights is not None:
            status["weights"] = weights
        return PodView(name, "127.0.0.9", 8080, ready, status)

    want = {"v1": 80, "v2": 20, "v3": 0}
    both = Observation([weighted("a", {"v1": 80, "v2": 20}), weighted("b", {"v1": 80, "v2": 20, "v3": 0})])
    assert both.serving(want) == (True, "")
    # the right weights, but v2 failed to load there: its buckets go to the pod's fallback
    failed = Observation([weighted("a", {"v1": 80, "v2": 20}, versions={"v1": {"ready": True}, "v2": {"ready": False}})])
    assert failed.serving(want) == (False, "a has not loaded v2 (its share goes to the fallback)")
    stale = Observation([weighted("a", {"v1": 80, "v2": 20}), weighted("b", {"v1": 100, "v2": 0}),
                         weighted("c", {"v1": 100}), weighted("d", {"v2": 100}, ready=False)])
    assert stale.serving(want) == (False, "b serves v1:100 (and 1 more pods)")
    assert Observation([weighted("a", None), PodView("b", None, 8080, True)]).serving(want) == (None, "")


def test_a_pod_routing_by_an_older_table_of_the_same_weights_does_not_serve_them() -> None:
    weights = {"v1": 50, "a": 25, "b": 25}
    first = RoutingTable.build("scorer", weights, "v1")
    between = RoutingTable.build("scorer", {"v1": 50, "a": 50, "b": 0}, "v1", first)
    published = RoutingTable.build("scorer", weights, "v1", between)  # the same weights, other buckets
    assert published.owners != first.owners

    def routing(name: str, table: RoutingTable | None) -> PodView:
        status: dict[str, Any] = {"ready": True, "weights": weights,
                                  "versions": {v: {"ready": True, "state": "ready"} for v in weights}}
        if table is not None:
            status["table_digest"] = table_digest(table.encode())
        return PodView(name, "127.0.0.9", 8080, True, status)

    encoded = published.encode()
    assert Observation([routing("a", published)]).serving(weights, encoded) == (True, "")
    stale = Observation([routing("a", published), routing("b", first)]).serving(weights, encoded)
    assert stale == (False, f"b routes by another table of these weights (digest {table_digest(first.encode())},"
                            f" not {table_digest(encoded)})")
    # an older runtime reports no digest: judged by its weights, as before
    assert Observation([routing("a", None)]).serving(weights, encoded) == (True, "")
    assert Observation([routing("b", first)]).serving(weights) == (True, "")  # no table to compare with
