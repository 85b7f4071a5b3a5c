"""A rollout with no cluster: the operator's own ``Reconciler`` drives one local runtime process.

``LocalPorts`` implements the Reconciler's ports (``rollout_operator.ports.Ports``) on this
machine: the ModelDeployment lives in memory, the routing ConfigMap's runtime config is written to
the file the runtime follows (``mnn-rollout serve --config``), the other children are kept in
memory, and the one "pod" is the runtime process, observed through ``GET /v2/models/{m}/status``.
``LocalRollout`` calls ``Reconciler.reconcile`` on a short tick, exactly as the operator does on
its events and timers: every phase change, weight and verdict comes from the operator's code.
"""

from __future__ import annotations

import copy
import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from mnn_rollout.contract.config import CONFIG_KEY, parse_config_text
from mnn_rollout.local.net import write_atomic
from rollout_operator import children
from rollout_operator.analyzer import Analyzer
from rollout_operator.observe import Observation, PodView, scrape
from rollout_operator.ports import DELETED
from rollout_operator.providers.factory import ProviderFactory
from rollout_operator.reconcile import Reconciler
from rollout_operator.rollout import Event
from rollout_operator.spec import parse_spec
from rollout_operator.status import Phase, RolloutStatus
from rollout_operator.verdicts import Analysis

DONE = (Phase.SUCCEEDED, Phase.ROLLED_BACK, Phase.FAILED)
NAMESPACE = "local"


class LocalPorts:
    """The Reconciler's ports on this machine: one in-memory ModelDeployment, a config file, and
    the runtime process at ``url`` (None until it has started: no pods yet)."""

    def __init__(self, body: dict[str, Any], config_path: Path) -> None:
        self.body = body
        self.config_path = config_path
        self.config_text = ""
        self.children: dict[str, dict[str, Any]] = {}  # Kind/name -> the last object written
        self.url: str | None = None
        self._versions = itertools.count(2)

    def read(self, namespace: str, name: str) -> dict[str, Any] | None:
        meta = self.body["metadata"]
        if (namespace, name) != (meta["namespace"], meta["name"]):
            return None
        return copy.deepcopy(self.body)

    def write_children(self, objs: Iterable[dict[str, Any]]) -> dict[str, str]:
        """Like the cluster's: created, updated or unchanged by the children's spec-hash. The
        routing ConfigMap's runtime config goes to the file the runtime follows."""
        written = {}
        for obj in objs:
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            old = self.children.get(key)
            if old is not None and children.spec_hash(old) == children.spec_hash(obj):
                written[key] = "unchanged"
                continue
            written[key] = "created" if old is None else "updated"
            self.children[key] = copy.deepcopy(obj)
            if obj["kind"] == "ConfigMap":
                text = obj["data"][CONFIG_KEY]
                if text != self.config_text:
                    write_atomic(self.config_path, text)
                    self.config_text = text
        return written

    def delete_children(self, stubs: Iterable[dict[str, Any]], owner_uid: str) -> dict[str, str]:
        """Forget the children named that were written (all of them are this object's)."""
        deleted = {}
        for obj in stubs:
            key = f"{obj['kind']}/{obj['metadata']['name']}"
            if self.children.pop(key, None) is not None:
                deleted[key] = DELETED
        return deleted

    def runtime_replicas(self, target: children.Target) -> int | None:
        return 1  # the one runtime process

    def store_status(self, body: dict[str, Any], status: dict[str, Any]) -> str | None:
        if body["metadata"].get("resourceVersion") != self.body["metadata"]["resourceVersion"]:
            raise RuntimeError("status decided from an old version of the object")  # never with one loop
        self.body["status"] = copy.deepcopy(status)
        self.body["metadata"]["resourceVersion"] = version = str(next(self._versions))
        return version

    def published_table(self, target: children.Target) -> tuple[str, ...] | None:
        return children.published_owners(self.children.get(f"ConfigMap/{target.routing}"))

    def observe_pods(self, target: children.Target, port: int, model: str) -> Observation:
        if self.url is None:
            return Observation([])
        u = urlparse(self.url)
        obs = scrape([PodView("local", u.hostname, int(u.port or 80), ready=True)], model)
        # The pod's Ready condition would be the runtime's /v2/health/ready: the same flag as /status.
        return Observation([replace(p, ready=bool((p.status or {}).get("ready"))) for p in obs.pods])


@dataclass(frozen=True)
class Tick:
    at: float
    status: RolloutStatus
    analysis: Analysis | None
    events: tuple[Event, ...]


class LocalRollout:
    """Reconcile one in-memory ModelDeployment against one local runtime until the rollout ends
    (or ``time_limit`` seconds pass)."""

    def __init__(self, spec: dict[str, Any], config_path: Path, name: str = "local", tick: float = 0.2,
                 time_limit: float = 110.0, clock: Callable[[], float] = time.time) -> None:
        self.spec = parse_spec(spec)  # refuses a bad spec before anything starts
        self.name, self.model = name, self.spec.model_name(name)
        self.config_path, self.tick, self.time_limit, self.clock = config_path, tick, time_limit, clock
        body = {"apiVersion": f"{children.GROUP}/v1alpha1", "kind": "ModelDeployment",
                "metadata": {"name": name, "namespace": NAMESPACE, "uid": f"local-{name}-{os.getpid()}",
                             "generation": 1, "resourceVersion": "1"},
                "spec": copy.deepcopy(spec)}
        self.ports = LocalPorts(body, config_path)
        self.reconciler = Reconciler(self.ports, analyzer=Analyzer(ProviderFactory()), clock=clock)
        self.status = RolloutStatus()
        self.events: list[tuple[float, Event]] = []
        self.history: list[tuple[float, RolloutStatus]] = []  # every status that differed from the last
        self.analyses: list[Analysis] = []
        self.started_at = clock()
        self.timed_out = False

    @property
    def done(self) -> bool:
        return self.status.phase in DONE

    @property
    def url(self) -> str | None:
        return self.ports.url

    @property
    def config_text(self) -> str:
        return self.ports.config_text

    def prepare(self) -> None:
        """Before the runtime starts: the first reconcile (no pods yet) writes the config."""
        self.step()

    def step(self) -> Tick:
        """One reconcile: observe, analyse when due, decide, write the config, then the status."""
        now = self.clock()
        outcome = self.reconciler.reconcile(self.ports.body)
        assert outcome is not None  # the in-memory object never goes away
        self.status = outcome.status
        if outcome.analysis is not None:
            self.analyses.append(outcome.analysis)
        self.events.extend((now, e) for e in outcome.events)
        if not self.history or self.history[-1][1].to_dict() != self.status.to_dict():
            self.history.append((now, self.status))
        return Tick(now, outcome.status, outcome.analysis, tuple(outcome.events))

    def run(self, url: str, on_tick: Callable[[LocalRollout, Tick], None] | None = None) -> RolloutStatus:
        """Loop until Succeeded, RolledBack or Failed, or until ``time_limit`` seconds have passed."""
        self.ports.url = url
        deadline = time.monotonic() + self.time_limit
        while not self.done:
            if time.monotonic() >= deadline:
                self.timed_out = True
                break
            started = time.monotonic()
            tick = self.step()
            if on_tick is not None:
                on_tick(self, tick)
            time.sleep(max(0.0, self.tick - (time.monotonic() - started)))
        return self.status

    def wait_applied(self, timeout: float = 5.0) -> bool:
        """Wait until the runtime serves the weights of the last config written (bounded)."""
        want = parse_config_text(self.config_text).effective_weights()
        deadline = time.monotonic() + timeout
        target = children.Target(self.name, NAMESPACE)
        while time.monotonic() < deadline:
            pods = self.ports.observe_pods(target, self.spec.runtime.port, self.model).pods
            if pods and (pods[0].status or {}).get("weights") == want:
                return True
            time.sleep(0.1)
        return False
