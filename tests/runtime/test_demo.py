"""``mnn-rollout demo``: the operator's state machine drives a real local runtime through a canary
rollout while many users send traffic. Each scenario runs end to end with 1 s steps."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mnn_rollout.contract.config import load_config_file
from mnn_rollout.demo.ports import LocalRollout
from mnn_rollout.local.process import LocalRuntime
from mnn_rollout.local.traffic import Traffic
from rollout_operator.status import Phase

CLI = [sys.executable, "-m", "mnn_rollout.cli", "demo"]


def demo(tmp_path: Path, *args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "--step-seconds", "1", "--workdir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=timeout)


def field(out: str, name: str) -> str:
    found = re.search(rf"^{re.escape(name)}: (.*)$", out, re.MULTILINE)
    assert found, f"no {name!r} line in:\n{out}"
    return found.group(1)


def test_promote_is_the_default_and_ends_with_v2_serving_everyone(tmp_path: Path) -> None:
    r = demo(tmp_path)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert field(out, "outcome") == "promoted"
    assert field(out, "expected") == "promoted (ok)"
    assert field(out, "steps passed") == "3/3"
    assert field(out, "final weights") == "v2:100 (served by the runtime)"
    assert field(out, "served after the end") == "v2 100%"
    # the plain (non-TTY) view: events, per-step weights and verdicts as they happen
    for needed in ("RolloutStarted", "StepStarted: canary v2 ready: step 1/3 at 10%", "step 2/3: 30%",
                   "step 3/3: 60%", "RolloutPromoted", "RolloutSucceeded", "analysis #2 pass"):
        assert needed in out, needed
    assert "rollback reason" not in out
    # both versions took traffic from the 2,000 users, and none of it failed
    versions = dict(re.findall(r"^  (v1|v2) +(\d+) requests +0 errors", out, re.MULTILINE))
    assert set(versions) == {"v1", "v2"} and all(int(n) > 50 for n in versions.values()), out
    # raising the canary's weight only ever moves users from stable to the canary
    assert re.fullmatch(r"v1->v2 \d+", field(out, "users moved")), out
    assert (tmp_path / "runtime.log").exists() and (tmp_path / "v2.mnn").exists()


def test_breaking_is_rolled_back_on_the_error_rate(tmp_path: Path) -> None:
    r = demo(tmp_path, "--scenario", "breaking")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert field(out, "outcome") == "rolled back"
    assert field(out, "expected") == "rolled back (ok)"
    assert "error-rate = 1 breached error rate <= 0.05" in field(out, "rollback reason")
    assert field(out, "final weights") == "v1:100 v2-breaking:0 (served by the runtime)"
    assert field(out, "served after the end") == "v1 100%"
    assert re.search(r"^  v2-breaking +(\d+) requests +\1 errors \(100\.00%\)", out, re.MULTILINE), out
    assert "RolloutPromoted" not in out


def test_slow_is_rolled_back_on_latency(tmp_path: Path) -> None:
    r = demo(tmp_path, "--scenario", "slow")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert field(out, "outcome") == "rolled back"
    reason = field(out, "rollback reason")
    assert reason.startswith("canary v2-slow rolled back: latency-"), reason
    assert "error-rate" not in reason
    assert field(out, "served after the end") == "v1 100%"
    assert re.search(r"^  v2-slow +\d+ requests +0 errors", out, re.MULTILINE), out


def test_worse_quality_is_rolled_back_by_the_conversion_rate_with_its_interval(tmp_path: Path) -> None:
    r = demo(tmp_path, "--scenario", "worse-quality")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert field(out, "outcome") == "rolled back" and field(out, "expected") == "rolled back (ok)"
    reason = field(out, "rollback reason")
    found = re.fullmatch(r"canary v2 rolled back: conversion: worse: canary - stable = (-[\d.]+), 0\.95 always-valid "
                         r"interval \[(-[\d.]+), (-[\d.]+)\], higher is better: worse beyond the margin \(upper bound "
                         r"< -0\.05\)", reason)
    assert found, reason
    estimate, lower, upper = map(float, found.groups())
    assert lower < estimate < upper < -0.05 and lower < -0.15 < upper  # the users' 15% against 30%
    # fast and error-free: nothing but the business metric failed it
    assert re.search(r"^  v2 +\d+ requests +0 errors", out, re.MULTILINE), out
    assert "latency-" not in reason and "error-rate" not in reason
    # the users converted as simulated, and their feedback was counted per version
    rates = dict(re.findall(r"(v1|v2) ([\d.]+)% of \d+", field(out, "users converted")))
    assert abs(float(rates["v1"]) - 30) < 5 and abs(float(rates["v2"]) - 15) < 6, rates
    assert "0 failed)" in field(out, "users converted")
    # the view showed the estimate and interval as the rollout went, and the summary repeats them
    assert re.search(r"analysis #\d+ \w+: .*conversion -?[\d.]+ \[-?[\d.]+, [-+][\d.]+\]", out), out
    assert re.search(r"^  conversion: worse, canary [\d.]+ \(n [\d,]+\) vs stable [\d.]+ \(n [\d,]+\): "
                     r"difference -[\d.]+ \[-[\d.]+, -[\d.]+\] at 0\.95, margin 0\.05$", out, re.MULTILINE), out
    assert field(out, "served after the end") == "v1 100%"


def test_shadow_breaking_is_caught_in_its_shadow_step_having_served_no_user(tmp_path: Path) -> None:
    r = demo(tmp_path, "--scenario", "shadow-breaking")
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert field(out, "outcome") == "rolled back" and field(out, "steps passed") == "0/4"
    assert field(out, "rollback reason") == ("canary v2-breaking rolled back: shadow-error-rate = 1 breached shadow "
                                             "error rate <= 0.05 (in a shadow step: the canary served no user)")
    assert "StepStarted: canary v2-breaking ready: step 1/4: shadow of 50% of stable's requests, weight 0" in out
    assert field(out, "requests served by the canary v2-breaking") == "0"
    assert not re.search(r"^  v2-breaking +\d+ requests", out, re.MULTILINE), out
    assert re.search(r"^  v1 +\d+ requests +0 errors", out, re.MULTILINE), out
    assert field(out, "final weights") == "v1:100 v2-breaking:0 (served by the runtime)"
    assert "StepAdvanced" not in out


def test_an_unknown_scenario_is_refused() -> None:
    r = subprocess.run([*CLI, "--scenario", "sideways"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid choice: 'sideways'" in r.stderr


@pytest.mark.parametrize("bad", ["0", "-1", "x"])
def test_step_seconds_must_be_positive(bad: str) -> None:
    r = subprocess.run([*CLI, "--step-seconds", bad], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--step-seconds" in r.stderr


def test_local_rollout_drives_decide_and_the_config_file_in_process(model_dir: Path) -> None:
    spec = {
        "model": "scorer", "stable": "v1", "canary": "v2",
        "versions": [{"name": "v1", "uri": "v1.mnn"}, {"name": "v2", "uri": "v2.mnn"}],
        "strategy": {"steps": [{"weight": 50, "pause": "1s"}], "scaleDownDelaySeconds": 1,
                     "analysis": {"interval": "1s", "minRequests": 10,
                                  "metrics": [{"name": "error-rate", "max": 0.05}]}},
    }
    config = model_dir / "local.yaml"
    rollout = LocalRollout(spec, config, name="scorer", time_limit=40)
    rollout.prepare()
    assert load_config_file(config).effective_weights() == {"v1": 100, "v2": 0}
    runtime = LocalRuntime(config, model_dir / "runtime.log")
    runtime.start()
    traffic = Traffic(runtime.url, "scorer", users=500, rate=150, connections=2, max_seconds=60).start()
    try:
        final = rollout.run(runtime.url)
        assert rollout.wait_applied()
    finally:
        traffic.stop()
        assert runtime.stop() == 0
    assert final.phase == Phase.SUCCEEDED and not rollout.timed_out
    # the operator's own reconcile loop: its child and version events come along
    assert [e.reason for _, e in rollout.events] == ["RolloutStarted", "ChildrenCreated", "StepStarted",
                                                     "RolloutPromoted", "RolloutSucceeded", "VersionsChanged"]
    phases = [st.phase for _, st in rollout.history]
    assert phases.index(Phase.PROGRESSING) < phases.index(Phase.PROMOTING) < phases.index(Phase.SUCCEEDED)
    assert [st.weights for _, st in rollout.history if st.phase == Phase.PROGRESSING][-1] == {"v1": 50, "v2": 50}
    assert any(a.verdict == "pass" for a in rollout.analyses)
    served = load_config_file(config)  # the old stable is retired from the runtime config
    assert [v.name for v in served.versions] == ["v2"] and served.effective_weights() == {"v2": 100}
    assert set(traffic.moves) <= {("v1", "v2")} and traffic.totals["v2"][1] == 0


def test_the_terminal_view_draws_a_shadow_step_and_the_comparison_with_stable(tmp_path: Path) -> None:
    import io
    from dataclasses import replace

    from mnn_rollout.demo.scenarios import SCENARIOS, demo_spec
    from mnn_rollout.demo.view import View

    spec = demo_spec(SCENARIOS["shadow-breaking"], {v: "0" * 64 for v in ("v1", "v2-breaking")})
    spec["strategy"]["analysis"]["metrics"].append({"name": "conversion", "compare": "stable", "margin": 0.05})
    rollout = LocalRollout(spec, tmp_path / "view.yaml", name="scorer")
    entry = {"decision": "undecided", "estimate": -0.02, "lower": -0.09, "upper": 0.05, "confidence": 0.95,
             "margin": 0.05, "canary": {"n": 120.0, "mean": 0.28}, "stable": {"n": 1100.0, "mean": 0.3}}
    rollout.status = replace(rollout.status, phase=Phase.PROGRESSING, current_step=0, shadow_percent=50,
                             canary_version="v2-breaking", step_started_at=rollout.started_at,
                             sequential={"conversion": entry})
    out = io.StringIO()
    lines = View(rollout, None, "title", out=out, tty=True).frame()
    assert any(line.startswith("  step 1  shadow  50%  [") for line in lines), lines
    assert any(line.startswith("  step 2   10%  [") for line in lines), lines
    assert "  conversion: undecided, canary 0.28 (n 120) vs stable 0.3 (n 1,100): difference -0.02 [-0.09, +0.05] " \
           "at 0.95, margin 0.05" in lines
