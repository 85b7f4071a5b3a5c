"""The terminal view of a local rollout: redrawn in place on a TTY, plain periodic lines otherwise.

Per step a progress bar, the weights, per-version request rate, error rate and p99 (client side,
over the last few seconds), the last analysis verdict per metric with value and threshold, each
``compare: stable`` metric's estimate and always-valid interval, the phase and the events; and a
summary at the end.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, TextIO

from mnn_rollout.local.outcomes import Conversions
from mnn_rollout.local.traffic import Traffic, VersionStats
from rollout_operator.comparisons import interval_text
from rollout_operator.status import Phase
from rollout_operator.verdicts import FAIL, INCONCLUSIVE, PASS, Analysis, MetricResult

from .ports import LocalRollout, Tick

BAR = 28
OUTCOMES = {Phase.SUCCEEDED: "promoted", Phase.ROLLED_BACK: "rolled back", Phase.FAILED: "failed"}


def outcome(rollout: LocalRollout) -> str:
    return OUTCOMES.get(rollout.status.phase, "timed out" if rollout.timed_out else "unfinished")


def _bar(fraction: float, width: int = BAR) -> str:
    full = int(round(max(0.0, min(1.0, fraction)) * width))
    return "#" * full + "." * (width - full)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def _weights(weights: dict[str, int]) -> str:
    return " ".join(f"{k}:{v}" for k, v in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0])))


def _value(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _interval(m: MetricResult) -> str:
    """`` [lower, upper]`` of a compare: stable result, else nothing."""
    if m.interval is None:
        return ""
    return " [" + ", ".join("n/a" if x is None else f"{x:+.4g}" for x in m.interval) + "]"


def sequential_lines(sequential: dict[str, Any] | None) -> list[str]:
    """Each compare: stable metric over the whole rollout so far: the means, the difference and
    its always-valid interval, the decision."""
    def mean(side: dict[str, Any]) -> str:
        return "n/a" if side.get("mean") is None else f"{side['mean']:.4g} (n {side.get('n', 0):,.0f})"

    return [f"  {name}: {e.get('decision')}, canary {mean(e.get('canary') or {})} vs stable "
            f"{mean(e.get('stable') or {})}: difference {interval_text(e)} at {e.get('confidence', 0):.4g}, "
            f"margin {e.get('margin', 0):g}" for name, e in (sequential or {}).items()]


def analysis_lines(analysis: Analysis | None, index: int, failures: int, limit: int, t0: float) -> list[str]:
    if analysis is None:
        return ["analysis: none yet"]
    head = f"analysis #{index} at {analysis.at - t0:5.1f} s: {analysis.verdict.upper()}"
    if analysis.canary_requests is not None:
        head += f", {analysis.canary_requests:g} {'shadow runs' if analysis.shadow else 'canary requests'}"
    if analysis.verdict == FAIL:
        head += f" ({failures} in a row; rolled back at {limit})"
    lines = [head + (f" - {analysis.message}" if analysis.message else "")]
    for m in analysis.metrics:
        lines.append(f"  {m.name:<22} {_value(m.value):>9}{_interval(m)}   {m.threshold:<28} {m.verdict}")
    return lines


class View:
    """Call ``update`` on every tick (LocalRollout.run's ``on_tick``); ``close`` at the end."""

    def __init__(self, rollout: LocalRollout, traffic: Traffic | None, title: str, out: TextIO | None = None,
                 tty: bool | None = None, window: float = 2.0, redraw_every: float = 0.25,
                 plain_every: float = 2.0) -> None:
        self.rollout, self.traffic, self.title = rollout, traffic, title
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.window, self.redraw_every, self.plain_every = window, redraw_every, plain_every
        self.t0 = rollout.started_at
        self._drawn = 0  # lines of the last frame (TTY)
        self._last_draw = 0.0
        self._events_shown = 0
        self._analyses_shown = 0

    # -- pieces ------------------------------------------------------------------------------------

    def _elapsed(self, at: float | None = None) -> float:
        return (at if at is not None else time.time()) - self.t0

    def step_lines(self) -> list[str]:
        r, st, now = self.rollout, self.rollout.status, time.time()
        promoted = st.phase in (Phase.PROMOTING, Phase.SUCCEEDED)
        lines = []
        for i, step in enumerate(r.spec.strategy.steps):
            pause, current = step.pause_seconds, st.current_step == i and not promoted
            started = st.canary_weight > 0 or bool(st.shadow_percent)
            waited = now - (st.step_started_at or now)
            if promoted or (st.current_step is not None and i < st.current_step):
                fraction, note = 1.0, "passed"
            elif current and st.phase in OUTCOMES:
                waited = (st.rolled_back_at or now) - (st.step_started_at or now)
                fraction, note = waited / (pause or waited or 1), f"{st.phase.value} after {waited:.1f} s"
            elif current and started and pause is None:
                fraction, note = 0.0, "waiting for a manual promote"
            elif current and started:
                fraction, note = waited / pause if pause else 1.0, f"{min(waited, pause or 0):4.1f}/{pause:g} s"
                if waited >= (pause or 0):
                    note += ", waiting for a passing analysis"
            elif current:
                fraction, note = 0.0, f"waiting for {st.canary_version} to load"
            else:
                fraction, note = 0.0, ""
            size = f"shadow {step.shadow:>3}%" if step.shadow else f"{step.weight:>3}%"
            lines.append(f"  step {i + 1}  {size}  [{_bar(fraction)}] {note}")
        delay = r.spec.strategy.scale_down_delay_seconds
        if st.phase == Phase.SUCCEEDED:
            fraction, note = 1.0, f"{st.stable_version} serves everyone"
        elif st.phase == Phase.PROMOTING:
            fraction = (now - (st.promoted_at or now)) / delay if delay else 1.0
            note = f"{st.stable_version} is stable; {st.previous_stable} retires after {delay:g} s"
        else:
            fraction, note = 0.0, ""
        lines.append(f"  promote 100%  [{_bar(fraction)}] {note}")
        return lines

    def traffic_lines(self, stats: dict[str, VersionStats], label: str) -> list[str]:
        lines = [f"traffic ({label})   {'req/s':>8} {'errors':>7} {'err rate':>9} {'p99 ms':>8}"]
        for version, s in stats.items():
            lines.append(f"  {version:<16} {s.rate:>8.1f} {s.errors:>7} {s.error_rate:>9.2%} {_ms(s.p99):>8}")
        if not stats:
            lines.append("  (no requests yet)")
        return lines

    def frame(self) -> list[str]:
        r, st = self.rollout, self.rollout.status
        lines = [f"{self.title}   {self._elapsed():6.1f} s",
                 f"phase {st.phase.value}: {st.message}",
                 f"weights {_weights(st.weights)}", "", *self.step_lines(), ""]
        if self.traffic is not None:
            lines += self.traffic_lines(self.traffic.window(self.window), f"last {self.window:g} s") + [""]
        analysis = r.analyses[-1] if r.analyses else None
        lines += analysis_lines(analysis, len(r.analyses), st.failures, r.spec.strategy.analysis.failure_limit,
                                self.t0)
        if st.sequential:
            lines += ["", "compared with stable (every look so far, always-valid)", *sequential_lines(st.sequential)]
        lines += ["", "events"]
        lines += [f"  [{self._elapsed(at):5.1f} s] {e.reason}: {e.message}" for at, e in r.events[-8:]]
        return lines

    # -- output ------------------------------------------------------------------------------------

    def update(self, rollout: LocalRollout | None = None, tick: Tick | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if force or now - self._last_draw >= self.redraw_every:
                self._redraw(self.frame())
                self._last_draw = now
            return
        r = self.rollout
        for at, e in r.events[self._events_shown:]:
            self.out.write(f"[{self._elapsed(at):5.1f} s] {e.type} {e.reason}: {e.message}\n")
        self._events_shown = len(r.events)
        for i, a in enumerate(r.analyses[self._analyses_shown:], start=self._analyses_shown + 1):
            metrics = ", ".join(f"{m.name} {_value(m.value)}{_interval(m)} ({m.threshold}) {m.verdict}"
                                for m in a.metrics)
            detail = "; ".join(x for x in (metrics, a.message) if x)
            self.out.write(f"[{self._elapsed(a.at):5.1f} s] analysis #{i} {a.verdict}: {detail}\n")
        self._analyses_shown = len(r.analyses)
        if force or now - self._last_draw >= self.plain_every:
            self._last_draw = now
            st = r.status
            parts = [f"[{self._elapsed():5.1f} s] {st.phase.value} step {st.step_text or '-'} "
                     f"weights {_weights(st.weights)}"]
            if self.traffic is not None:
                for v, s in self.traffic.window(self.window).items():
                    parts.append(f"{v} {s.rate:.0f} req/s err {s.error_rate:.1%} p99 {_ms(s.p99)} ms")
            self.out.write(" | ".join(parts) + "\n")
        self.out.flush()

    def _redraw(self, lines: list[str]) -> None:
        width = max(20, shutil.get_terminal_size().columns - 1)  # a wrapped line would break the cursor-up
        text = "".join(f"{line[:width]}\x1b[K\n" for line in lines)
        up = f"\x1b[{self._drawn}F" if self._drawn else ""
        self.out.write(up + text + "\x1b[J")
        self.out.flush()
        self._drawn = len(lines)

    def close(self) -> None:
        """The final frame (TTY), or the final status line unless one was printed just now."""
        self.update(force=self.tty or time.monotonic() - self._last_draw > 0.5)


def summary(rollout: LocalRollout, traffic: Traffic | None, expected: str, seconds: float,
            served: dict[str, VersionStats] | None = None, applied: bool | None = None,
            users: Conversions | None = None) -> str:
    """The end-of-run report; ``served``: traffic just after the end (what the runtime serves now)."""
    st = rollout.status
    result = outcome(rollout)
    steps = len(rollout.spec.strategy.steps)
    passed = steps if st.phase in (Phase.PROMOTING, Phase.SUCCEEDED) else (st.current_step or 0)
    verdicts = [a.verdict for a in rollout.analyses]
    served_note = {None: "", True: " (served by the runtime)", False: " (NOT yet served by the runtime)"}[applied]
    lines = [
        "== summary ==",
        f"outcome: {result}",
        f"expected: {expected} ({'ok' if result == expected else 'NOT MET'})",
        f"time taken: {seconds:.1f} s",
        f"steps passed: {passed}/{steps}",
        f"stable: {st.stable_version}",
        f"final weights: {_weights(st.weights)}{served_note}",
        f"analyses: {len(verdicts)} ({', '.join(f'{verdicts.count(v)} {v}' for v in (PASS, INCONCLUSIVE, FAIL))})",
    ]
    if traffic is not None:
        total = traffic.summary()
        lines.append(f"requests: {sum(s.requests for s in total.values())} from {traffic.users} users")
        for version, s in total.items():
            lines.append(f"  {version:<16} {s.requests:>7} requests {s.errors:>6} errors ({s.error_rate:.2%}) "
                         f"p99 {_ms(s.p99)} ms")
        canary = rollout.spec.canary or ""
        lines.append(f"requests served by the canary {canary}: {total[canary].requests if canary in total else 0}")
        moves = sorted(traffic.moves.items())
        lines.append("users moved: " + (", ".join(f"{a}->{b} {n}" for (a, b), n in moves) if moves else "none"))
    if users is not None:
        drawn = ", ".join(f"{v} {users.rate(v):.1%} of {users.totals[v][0]}" for v in sorted(users.totals)
                          if users.rate(v) is not None)
        lines.append(f"users converted: {drawn or 'no answers'} (feedback: {users.counted} counted, "
                     f"{users.failed} failed)")
    if st.sequential:
        lines.append("compared with stable:")
        lines += sequential_lines(st.sequential)
    if served:
        n = sum(s.requests for s in served.values()) or 1
        lines.append("served after the end: " + ", ".join(f"{v} {s.requests / n:.0%}" for v, s in served.items()))
    aborted = [e for _, e in rollout.events if e.reason == "RolloutAborted"]
    if aborted:
        lines.append(f"rollback reason: {aborted[-1].message}")
    if rollout.timed_out:
        lines.append(f"the rollout did not finish within {rollout.time_limit:g} s (phase {st.phase.value})")
    return "\n".join(lines)
