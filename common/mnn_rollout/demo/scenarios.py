"""``mnn-rollout demo``: a canary rollout with no cluster.

The operator's reconcile loop (``rollout_operator.reconcile.Reconciler``, through the local ports
of ``ports.py``) drives a real runtime process (real MNN, real HTTP, on loopback) through a canary
rollout while a traffic generator plays many users. Scenarios:

- ``promote`` (default): canary ``v2``, a healthy retrain: promoted step by step.
- ``breaking``: canary ``v2-breaking`` expects 80 features, v1-shaped requests fail: rolled back
  on the error rate.
- ``slow``: canary ``v2-slow``, a latency regression: rolled back on latency.
- ``worse-quality``: canary ``v2``, fast and error-free, but the simulated users convert less often
  after its answers (they send feedback with the response ids): rolled back by the sequential
  test of the conversion rate against stable's (``compare: stable``).
- ``shadow-breaking``: canary ``v2-breaking`` starts with a shadow step (weight 0, half of stable's
  requests also run on it): caught there and rolled back having served no user.

Exit code 0 only when the outcome is the expected one.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mnn_rollout.local.outcomes import Conversions
from mnn_rollout.local.process import LocalRuntime
from mnn_rollout.local.traffic import Traffic
from mnn_runtime.examples import build_examples

from .ports import LocalRollout
from .view import View, outcome, summary


@dataclass(frozen=True)
class Scenario:
    name: str
    canary: str
    expect: str  # the outcome local_view.outcome() must report
    story: str
    shadow: int | None = None  # a first step in stable's shadow at this percent (weight 0)
    metrics: tuple[dict[str, Any], ...] = ()  # besides the common ones
    conversions: Mapping[str, float] = field(default_factory=dict)  # users' conversion rate per version
    serves_canary: bool = True  # False: the expected outcome includes no request served by the canary


# The business metric of worse-quality: the conversion rate (feedback 1 or 0 per answer) against
# stable's, rolled back once the canary is worse by more than 5 points with 95% confidence at any
# look. Users convert 30% of the time after v1's answers and 15% after v2's. Simulated with the
# operator's test (2,000 runs, looks every 2 s at 10% of 300 req/s, seed 7): v2 is called worse at
# the 3rd look at the median and by the 8th in 99% of runs (13th at most); a canary converting as
# v1 does was called worse in 1 run of 2,000 and not worse in 98.9% within 40 looks.
CONVERSION = {"name": "conversion", "compare": "stable", "kind": "rate", "margin": 0.05, "confidence": 0.95}
SCENARIOS = {
    "promote": Scenario("promote", "v2", "promoted", "v2 is a healthy retrain (int8 weights): it should be promoted"),
    "breaking": Scenario("breaking", "v2-breaking", "rolled back",
                         "v2-breaking expects 80 features, clients send 64: errors, so it should be rolled back"),
    "slow": Scenario("slow", "v2-slow", "rolled back",
                     "v2-slow is ~250x the compute of v1: a latency regression, so it should be rolled back"),
    "worse-quality": Scenario("worse-quality", "v2", "rolled back",
                              "v2 is fast and error-free, but users convert 15% of the time after its answers "
                              "against 30% after v1's: the conversion rate should roll it back",
                              metrics=(CONVERSION,), conversions={"v1": 0.30, "v2": 0.15}),
    "shadow-breaking": Scenario("shadow-breaking", "v2-breaking", "rolled back",
                                "v2-breaking runs first in the shadow of half of v1's requests: its errors there "
                                "should roll it back before any user is served by it", shadow=50,
                                metrics=({"name": "shadow-error-rate", "max": 0.05},), serves_canary=False),
}
STEP_WEIGHTS = (10, 30, 60)
ERROR_RATE_MAX = 0.05
# Latency thresholds, measured on the 2-core development machine while other test suites shared
# the cores: 40 two-second intervals per canary at 10% of ~290 req/s, from the runtime's histograms
# as the direct provider reads them. p99 over ~60 canary requests is the platform's tail, not the
# model's: healthy v2 reached 35.5 ms while v2-slow went as low as 9.6 ms, and their p99 / stable
# p99 ratios overlapped too (v2 0.26-2.17, v2-slow 1.06-8.70). The median separates cleanly:
# canary p50 / stable p50 was 0.74-1.22 for v2 and 5.5-13.3 for v2-slow, so a p50 ratio of 3
# catches the regression (margins 2.5x and 1.8x); contention slows both versions and cancels out
# of the ratio. p99 keeps an absolute ceiling, as a production spec would (v2 max 35.5 ms: 2.8x).
LATENCY_P50_RATIO = 3.0
LATENCY_P99_MAX = 0.1


def demo_spec(scenario: Scenario, sums: dict[str, str], step_seconds: float = 5.0) -> dict[str, Any]:
    """The ModelDeployment spec of a scenario: the same analysis for every scenario."""
    interval = 1 if step_seconds < 4 else 2
    shadow = [{"shadow": scenario.shadow, "pause": f"{step_seconds:g}s"}] if scenario.shadow else []
    return {
        "model": "scorer",
        "versions": [{"name": v, "uri": f"{v}.mnn", "sha256": sums[v]} for v in ("v1", scenario.canary)],
        "stable": "v1",
        "canary": scenario.canary,
        "strategy": {
            "steps": shadow + [{"weight": w, "pause": f"{step_seconds:g}s"} for w in STEP_WEIGHTS],
            "analysis": {
                "interval": f"{interval}s",
                "minRequests": 20,
                "failureLimit": 2,
                "provider": {"type": "direct"},
                "metrics": [
                    {"name": "error-rate", "max": ERROR_RATE_MAX},
                    {"name": "latency-p50", "maxLatencyRatio": LATENCY_P50_RATIO},
                    {"name": "latency-p99", "max": LATENCY_P99_MAX},
                    *scenario.metrics,
                ],
            },
            "scaleDownDelaySeconds": max(1.0, min(2.0, step_seconds)),
        },
        "progressDeadlineSeconds": 60,
        "runtime": {"replicas": 1, "workers": 1},
    }


def run_demo(scenario: str = "promote", step_seconds: float = 5.0, workdir: str | None = None,
             rate: float = 300.0, users: int = 2000, time_limit: float = 100.0, out: TextIO | None = None,
             tty: bool | None = None) -> int:
    out = out or sys.stdout
    chosen = SCENARIOS[scenario]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mnn-rollout-demo-") as tmp:
        root = Path(workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        out.write(f"scenario {chosen.name}: {chosen.story}\nbuilding the example models in {root} ...\n")
        out.flush()
        sums = build_examples(root)
        rollout = LocalRollout(demo_spec(chosen, sums, step_seconds), root / "demo-runtime.yaml", name="scorer",
                               time_limit=time_limit)
        rollout.prepare()  # the first decision (nothing loaded yet) and the config it describes
        runtime = LocalRuntime(rollout.config_path, root / "runtime.log", feedback_token=secrets.token_urlsafe(24))
        traffic: Traffic | None = None
        users_act: Conversions | None = None
        applied, served = None, {}
        try:
            runtime.start()
            if chosen.conversions:
                users_act = Conversions(runtime.url, "scorer", chosen.conversions,
                                        runtime.feedback_token or "").start()
            traffic = Traffic(runtime.url, "scorer", users=users, rate=rate, connections=4,
                              max_seconds=time_limit + 30,
                              on_answer=users_act.answered if users_act else None).start()
            title = (f"mnn-rollout demo {chosen.name}: canary {chosen.canary} vs stable v1, {users} users, "
                     f"~{rate:g} req/s")
            out.write(f"{title}\nruntime on {runtime.url}, following {rollout.config_path}\n")
            view = View(rollout, traffic, title, out=out, tty=tty)
            rollout.run(runtime.url, on_tick=view.update)
            view.close()
            if rollout.done:
                applied = rollout.wait_applied(timeout=5)
                time.sleep(1.0)  # traffic after the end shows what the runtime serves now
                served = traffic.window(1.0)
        except RuntimeError as exc:  # the runtime did not start
            out.write(f"error: {exc}\n")
            return 1
        except KeyboardInterrupt:
            out.write("\ninterrupted\n")
            return 130
        finally:
            if traffic is not None:
                traffic.stop()
            if users_act is not None:
                users_act.stop()
            code = runtime.stop()
        result = outcome(rollout)
        out.write("\n" + summary(rollout, traffic, chosen.expect, time.monotonic() - started, served, applied,
                                 users_act) + "\n")
        out.write(f"runtime stopped (exit {code}); its log: {root / 'runtime.log'}"
                  f"{'' if workdir else ' (removed with the temp dir)'}\n")
        out.flush()
        untouched = chosen.serves_canary or traffic is None or chosen.canary not in traffic.totals
        return 0 if result == chosen.expect and applied and code == 0 and untouched else 1


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return value


def add_arguments(p: argparse.ArgumentParser, command: str = "demo") -> None:
    p.add_argument("--scenario", choices=list(SCENARIOS), default="promote",
                   help="promote: healthy v2 is promoted (default); breaking: v2-breaking fails requests and is "
                        "rolled back; slow: v2-slow is a latency regression and is rolled back; worse-quality: "
                        "users convert less often with v2, rolled back by the conversion rate; shadow-breaking: "
                        "v2-breaking is caught in a shadow step, having served no user")
    p.add_argument("--step-seconds", type=_positive, default=5.0, help="pause of each step (default 5)")
    p.add_argument("--rate", type=_positive, default=300.0, help="requests/s of all users together (default 300)")
    p.add_argument("--users", type=lambda t: int(_positive(t)), default=2000, help="distinct user ids (default 2000)")
    p.add_argument("--time-limit", type=_positive, default=100.0,
                   help="give up on the rollout after this many seconds (default 100)")
    p.add_argument("--workdir", default=None, help="where to build models and write the runtime config "
                                                   "(default: a temp dir)")


def run_from_args(args: argparse.Namespace) -> int:
    return run_demo(scenario=args.scenario, step_seconds=args.step_seconds, workdir=args.workdir, rate=args.rate,
                    users=args.users, time_limit=args.time_limit)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(run_demo(sys.argv[1] if len(sys.argv) > 1 else "promote"))
