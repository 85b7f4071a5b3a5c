"""Review of idle unloading (``server.idle_unload_seconds``): the clock a version is judged idle by."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mnn_rollout.contract.config import RuntimeConfig, parse_config_text
from mnn_runtime.idle import IdleUnloader
from mnn_runtime.metrics import RuntimeMetrics
from mnn_runtime.registry import Registry


def config(examples_dir: Path, v2: int = 0, stable: str = "v1", shadow: bool = False) -> RuntimeConfig:
    other = "v2" if stable == "v1" else "v1"
    return parse_config_text(yaml.safe_dump({
        "model": "scorer", "stable": stable, "weights": {stable: 100 - v2, other: v2},
        "versions": [{"name": v, "uri": str(examples_dir / f"{v}.mnn")} for v in ("v1", "v2")],
        "server": {"idle_unload_seconds": 10},
        **({"shadow": {"version": "v2", "percent": 50}} if shadow else {})}))


@pytest.mark.parametrize("held", ["weight", "shadow", "stable"])
def test_the_idle_clock_starts_when_a_version_can_first_be_unloaded(examples_dir: Path, held: str) -> None:
    """v2 takes no request for a minute while it carries weight (a canary at 10% on a quiet pod),
    is the shadow version, or is stable; then it drops to weight 0, plain. It was unloaded at the
    next check (0.8 s later in a real runtime, 1 or 2 workers), with the reason "no request for 10 s
    at weight 0" in its status: it had been at weight 0 for under a second."""
    before = {"weight": config(examples_dir, v2=10), "shadow": config(examples_dir, shadow=True),
              "stable": config(examples_dir, stable="v2")}[held]
    registry = Registry(before, examples_dir, RuntimeMetrics("scorer"))
    now = [0.0]
    unloaded: list[str] = []
    unloader = IdleUnloader(registry, lambda names, reason: unloaded.extend(names), clock=lambda: now[0])
    assert "v2" not in unloader.tick()
    now[0] = 60.0
    assert "v2" not in unloader.tick()  # held: never unloaded however long unused (v1, stable's other, may be)
    registry.apply(config(examples_dir))  # v2 at weight 0, not shadow, not stable
    now[0] = 61.0
    assert unloader.tick() == [] and "v2" not in unloaded  # at weight 0 for 1 s of the 10
    now[0] = 69.0
    assert unloader.tick() == []
    now[0] = 70.5
    assert unloader.tick() == ["v2"]  # 10 s at weight 0, unused
