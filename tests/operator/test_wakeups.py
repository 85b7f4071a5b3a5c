"""When an object is reconciled: on its own changes (not its status), its pods' and children's
changes, and on timers only while something is in flight."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

import pytest

from rollout_operator.reconcile import Outcome
from rollout_operator.spec import parse_spec
from rollout_operator.status import Phase, RolloutStatus, iso
from rollout_operator.wakeups import WakeUps, next_wake

SPEC = parse_spec({"versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}], "canary": "v2",
                   "strategy": {"steps": [{"weight": 10, "pause": "1m"}], "scaleDownDelaySeconds": 30,
                                "analysis": {"interval": "10s"}}})
T0 = 1_800_000_000.0
LOADED = [{"name": "v1", "ready": True, "pods": 2}, {"name": "v2", "ready": True, "pods": 2}]


@pytest.mark.parametrize("status, pods, wait", [
    (RolloutStatus(phase=Phase.READY, versions=LOADED), 2, None),  # idle: events only
    (RolloutStatus(phase=Phase.SUCCEEDED, versions=LOADED), 2, None),
    (RolloutStatus(phase=Phase.ROLLED_BACK, versions=LOADED), 2, None),
    (RolloutStatus(phase=Phase.PAUSED, versions=LOADED), 2, None),  # paused: the next event resumes it
    # ... but a paused canary that serves users is still checked: woken when its next check is due
    (RolloutStatus(phase=Phase.PAUSED, canary_version="v2", canary_weight=10, versions=LOADED,
                   analysis={"checkedAt": iso(T0 - 4)}), 2, 6.0),
    (RolloutStatus(phase=Phase.INITIALIZING), 0, None),  # no pods yet: their events wake it
    # a version loading inside running pods changes no object: poll
    (RolloutStatus(phase=Phase.READY, versions=[LOADED[0], {"name": "v2", "ready": False, "pods": 2}]), 2, 2.0),
    (RolloutStatus(phase=Phase.READY, versions=LOADED, pending_action="promote:1: loading"), 2, 2.0),
    # new weights not yet confirmed by every pod: poll until they are
    (RolloutStatus(phase=Phase.READY, versions=LOADED, conditions=[{"type": "WeightsServed", "status": "False"}]),
     2, 2.0),
    (RolloutStatus(phase=Phase.READY, versions=LOADED, conditions=[{"type": "WeightsServed", "status": "True"}]),
     2, None),
    # a child the API refused (an admission policy may be lifted): tried again every 10 s
    (RolloutStatus(phase=Phase.READY, versions=LOADED,
                   conditions=[{"type": "ChildRejected", "status": "True"}]), 2, 10.0),
    (RolloutStatus(phase=Phase.READY, versions=LOADED,
                   conditions=[{"type": "ChildRejected", "status": "False"}]), 2, None),
    # ... even with a check due (one whose record cannot be written is due at once, again and again)
    (RolloutStatus(phase=Phase.PROGRESSING, canary_version="v2", versions=LOADED,
                   conditions=[{"type": "ChildRejected", "status": "True"}]), 2, 10.0),
    # in flight: the resync, or the next analysis when that is sooner
    (RolloutStatus(phase=Phase.PROGRESSING, canary_version="v2", versions=LOADED), 2, 0.0),
    (RolloutStatus(phase=Phase.PROGRESSING, canary_version="v2", versions=LOADED,
                   analysis={"checkedAt": iso(T0 - 9.5)}), 2, 0.5),
    (RolloutStatus(phase=Phase.PROGRESSING, canary_version="v2", versions=LOADED,
                   analysis={"checkedAt": iso(T0 - 1)}), 2, 2.0),
    # promoting: the old stable retires at promotedAt + scaleDownDelaySeconds
    (RolloutStatus(phase=Phase.PROMOTING, promoted_at=T0 - 29.25, versions=LOADED), 2, 0.75),
])
def test_next_wake(status: RolloutStatus, pods: int, wait: float | None) -> None:
    got = next_wake(SPEC, status, pods, resync=2.0, now=T0)
    assert got == (None if wait is None else pytest.approx(wait, abs=0.01))


class FakeReconciler:
    """Counts reconciles; the object's status is whatever the test sets."""

    class Ports:
        def __init__(self) -> None:
            self.body: dict[str, Any] | None = {
                "metadata": {"namespace": "ns", "name": "md", "uid": "u", "generation": 1},
                "spec": {"versions": [{"name": "v1", "uri": "v1.mnn"}]}}

        def read(self, namespace: str, name: str) -> dict[str, Any] | None:
            return self.body

    def __init__(self) -> None:
        self.ports = self.Ports()
        self.status = RolloutStatus(phase=Phase.READY, versions=[LOADED[0]])
        self.count = 0
        self.done = threading.Event()

    def reconcile(self, body: dict[str, Any], fresh: bool = False) -> Outcome:
        self.count += 1
        self.done.set()
        return Outcome(self.status)


class Stop:
    """kopf's DaemonStopped, enough for WakeUps.run."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    def wait(self) -> Any:
        return self.event.wait()


def test_an_idle_object_is_reconciled_once_then_only_on_its_own_changes() -> None:
    async def main() -> None:
        rec = FakeReconciler()
        wakeups = WakeUps(rec, post=lambda body, events: None, resync_seconds=0.05)  # type: ignore[arg-type]
        stop = Stop()
        task = asyncio.ensure_future(wakeups.run("ns", "md", stop))
        body = rec.ports.body
        assert body is not None
        await asyncio.sleep(0.3)
        assert rec.count == 1  # reconciled at start, then six resync periods of nothing
        wakeups.on_modeldeployment(body)  # the first event seen: records the signature, wakes
        await asyncio.sleep(0.1)
        assert rec.count == 2
        wakeups.on_modeldeployment({**body, "status": {"phase": "Ready"}})  # its own status write
        await asyncio.sleep(0.2)
        assert rec.count == 2
        wakeups.on_modeldeployment({**body, "metadata": {**body["metadata"], "generation": 2}})  # a spec edit
        await asyncio.sleep(0.1)
        assert rec.count == 3
        pod = {"metadata": {"namespace": "ns", "name": "p"}, "status": {"phase": "Running"}}
        wakeups.on_pod(None, pod, owner="md")
        await asyncio.sleep(0.1)
        assert rec.count == 4
        wakeups.on_pod("MODIFIED", pod, owner="md")  # nothing the reconcile looks at changed
        await asyncio.sleep(0.2)
        assert rec.count == 4
        ready = {**pod, "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}
        wakeups.on_pod("MODIFIED", ready, owner="md")
        await asyncio.sleep(0.1)
        assert rec.count == 5
        # in flight: timers every resync period without any event
        rec.status = replace(rec.status, phase=Phase.PROMOTING)
        wakeups.on_pod("DELETED", ready, owner="md")
        await asyncio.sleep(0.5)
        assert rec.count >= 8
        stop.event.set()
        await asyncio.wait_for(task, 2)
        wakeups.close()

    asyncio.run(main())


def test_a_gone_object_ends_its_loop() -> None:
    async def main() -> None:
        rec = FakeReconciler()
        rec.ports.body = None
        wakeups = WakeUps(rec, post=lambda body, events: None)  # type: ignore[arg-type]
        await asyncio.wait_for(wakeups.run("ns", "md", Stop()), 2)
        assert rec.count == 0
        wakeups.close()

    asyncio.run(main())


def _pod(name: str, rv: int, owner: str = "scorer") -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}",
                                        "resourceVersion": str(rv), "labels": {"mnnrollout.io/modeldeployment": owner}}}


class _ListingKube:
    """A client whose list answers what the API holds, and lets a watch event land mid-list."""

    def __init__(self, items: list[dict[str, Any]], during: Any = None) -> None:
        self.items, self.during, self.lists = items, during, 0

    def list(self, kind: str, namespace: str | None, selector: str | None = None) -> list[dict[str, Any]]:
        self.lists += 1
        if self.during is not None:
            self.during()
        return [dict(i) for i in self.items if i["kind"] == kind]


def test_a_relist_drops_what_was_deleted_unwatched_and_keeps_what_a_watch_added_meanwhile() -> None:
    from rollout_operator.ports import WatchCache

    cache = WatchCache()
    cache.sync(_ListingKube([_pod("a", 1), _pod("b", 2), _pod("c", 3, owner="other")]), None)  # type: ignore[arg-type]
    assert {p["metadata"]["name"] for p in cache.pods("default", "scorer")} == {"a", "b"}
    # b and c were deleted while no watch ran; d is created and its ADDED event lands during the list
    kube = _ListingKube([_pod("a", 4)], during=lambda: cache.put_pod(_pod("d", 9)))
    gone = cache.relist(kube, "Pod", None)  # type: ignore[arg-type]
    assert gone == {("default", "scorer"), ("default", "other")}
    assert {p["metadata"]["name"] for p in cache.pods("default", "scorer")} == {"a", "d"}
    assert cache.pods("default", "other") == []
    assert cache.pods("default", "scorer")[0]["metadata"]["resourceVersion"] == "4"  # the listed state
    # a burst of listing events asks for one list: the kind was just listed
    assert not cache.needs_relist("Pod") and cache.needs_relist("Pod", grace=0.0)
    # an older version from the list never replaces a newer one a watch delivered
    cache.put_pod(_pod("a", 10))
    cache.relist(_ListingKube([_pod("a", 5), _pod("d", 9)]), "Pod", None)  # type: ignore[arg-type]
    assert {p["metadata"]["name"]: p["metadata"]["resourceVersion"]
            for p in cache.pods("default", "scorer")} == {"a": "10", "d": "9"}


def test_a_daemon_paused_mid_reconcile_returns_only_after_it_so_a_resumed_one_never_overlaps() -> None:
    """Found in review: on a peering pause the loop returned at once while its reconcile went on
    in its thread, and the daemon kopf starts again on resuming reconciled the object beside it."""
    import time

    import kopf

    running, peak, lock = [0], [0], threading.Lock()

    def slow_once(namespace: str, name: str) -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.4)  # children, then status
        with lock:
            running[0] -= 1

    async def main() -> None:
        wakeups = WakeUps(FakeReconciler(), post=lambda *_: None, workers=4)  # type: ignore[arg-type]
        wakeups._once = slow_once  # type: ignore[method-assign]
        first = Stop()
        task = asyncio.create_task(wakeups.run("ns", "md", first))
        await asyncio.sleep(0.1)
        assert running[0] == 1  # the reconcile is running
        first.reason = kopf.DaemonStoppingReason.OPERATOR_PAUSING  # type: ignore[attr-defined]
        first.event.set()
        await asyncio.wait_for(task, 5)
        assert running[0] == 0 and not wakeups.exiting  # returned after it, and a pause is no exit
        again = Stop()
        resumed = asyncio.create_task(wakeups.run("ns", "md", again))
        await asyncio.sleep(0.2)
        again.event.set()
        await asyncio.wait_for(resumed, 5)
        wakeups.pool.shutdown(wait=True)
        assert peak[0] == 1

    asyncio.run(main())
