"""Control commands shared by ``mnn-rollout`` and the kubectl plugin: status, promote, abort,
retry, pause, resume, list. Actions are annotations the operator handles once; pause and resume
are ``spec.paused``, so ``kubectl`` alone can do the same."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from .children import OWNER_LABEL
from .comparisons import interval_text
from .kube import ApiError, KubeClient
from .reconcile import ACTION_ANNOTATION

DONE_PHASES = {"Succeeded": 0, "Ready": 0, "RolledBack": 1, "Failed": 1, "InvalidSpec": 1}


def _client() -> KubeClient:
    return KubeClient()


def _get(kube: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    md = kube.get("ModelDeployment", namespace, name)
    if md is None:
        raise SystemExit(f"error: modeldeployment {namespace}/{name} not found")
    return md


def act(kube: KubeClient, namespace: str, name: str, action: str, wait: float = 20.0,
        token: str | None = None) -> tuple[int, str]:
    """Request ``action`` and wait (at most ``wait`` seconds) for the operator's answer: applied,
    pending (it applies once it can) or ignored with the reason. Returns (exit code, outcome).
    ``token`` (``action:unique``, default ``action:time``) is how the answer names the request."""
    _get(kube, namespace, name)
    token = token or f"{action}:{time.time():.3f}"
    kube.patch("ModelDeployment", namespace, name, {"metadata": {"annotations": {ACTION_ANNOTATION: token}}})

    def answer(st: dict[str, Any]) -> tuple[int, str] | None:
        if st.get("lastAction") == token:
            result = str(st.get("actionResult") or "applied")
            return (1 if result.startswith("ignored") else 0), result
        if str(st.get("pendingAction") or "").startswith(token + ": "):
            return 0, "pending: " + str(st["pendingAction"]).split(": ", 1)[1]
        return None

    return _await_answer(kube, namespace, name, answer, wait)


def set_paused(kube: KubeClient, namespace: str, name: str, paused: bool, wait: float = 20.0) -> tuple[int, str]:
    """Set spec.paused and wait for the operator to observe that generation."""
    _get(kube, namespace, name)
    patched = kube.patch("ModelDeployment", namespace, name, {"spec": {"paused": paused}})
    generation = patched["metadata"].get("generation")

    def answer(st: dict[str, Any]) -> tuple[int, str] | None:
        if generation is not None and (st.get("observedGeneration") or 0) >= generation:
            return 0, f"applied (phase {st.get('phase', '?')})"
        return None

    return _await_answer(kube, namespace, name, answer, wait)


def _await_answer(kube: KubeClient, namespace: str, name: str,
                  answer: Callable[[dict[str, Any]], tuple[int, str] | None], wait: float) -> tuple[int, str]:
    """Poll the object's status until ``answer`` gives (exit code, outcome), at most ``wait`` s."""
    deadline = time.monotonic() + wait
    while True:
        found = answer(_get(kube, namespace, name).get("status") or {})
        if found is not None:
            return found
        if time.monotonic() >= deadline:
            return 2, f"requested; the operator has not answered within {wait:g} s"
        time.sleep(0.25)


def render(md: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> str:
    """A tree of the rollout: versions and weights, step, each analysis metric, conditions, pods."""
    meta, spec, st = md["metadata"], md.get("spec") or {}, md.get("status") or {}
    stale = "" if observed(md) else \
        f"  (spec generation {meta.get('generation')} not observed yet: the status is of an earlier spec)"
    lines = [f"{meta['namespace']}/{meta['name']}  phase {st.get('phase', '?')}  ready {st.get('readyText', '?')}"
             + stale]
    lines.append(f"├─ stable  {st.get('stableVersion', '?')}")
    if st.get("canaryVersion"):
        shadow = f"  shadow {st['shadowPercent']}% of stable's requests" if st.get("shadowPercent") else ""
        lines.append(f"├─ canary  {st['canaryVersion']}  weight {st.get('canaryWeight', 0)}%{shadow}  "
                     f"step {st.get('stepText') or '-'}")
    weights = st.get("weights") or {}
    lines.append("├─ weights " + ", ".join(f"{k}:{v}" for k, v in sorted(weights.items(), key=lambda kv: -kv[1])))
    for v in st.get("versions") or []:
        mark = "✔" if v.get("ready") else "✘"
        reason = f"  {v['reason']}" if v.get("reason") and not v.get("ready") else ""
        lines.append(f"│  {mark} {v['name']:<14} loaded on {v.get('readyPods', 0)}/{v.get('pods', 0)} pods{reason}")
    analysis = st.get("analysis") or {}
    if analysis:
        limit = ((spec.get("strategy") or {}).get("analysis") or {}).get("failureLimit", "?")
        lines.append(f"├─ analysis {analysis.get('verdict', '?')} at {analysis.get('checkedAt', '?')}  "
                     f"failures {analysis.get('failures', 0)}/{limit}"
                     + (f"  ({analysis['message']})" if analysis.get("message") else ""))
        for m in analysis.get("metrics") or []:
            value = "n/a" if m.get("value") is None else f"{m['value']:.4g}"
            lines.append(f"│  {m['verdict']:<12} {m['name']:<24} {value:>10}   {m.get('threshold', '')}")
    lines += _comparison_lines(st)
    for c in st.get("conditions") or []:
        lines.append(f"├─ {c['type']:<13} {c['status']:<6} {c.get('reason', '')}: {c.get('message', '')}")
    if pods is not None:
        lines.append(f"├─ pods ({len(pods)})")
        for pod in pods:
            pst = pod.get("status") or {}
            ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in pst.get("conditions") or [])
            restarts = sum(c.get("restartCount", 0) for c in pst.get("containerStatuses") or [])
            lines.append(f"│  {'✔' if ready else '✘'} {pod['metadata']['name']:<40} {pst.get('podIP') or '-':<16} "
                         f"{'Ready' if ready else 'NotReady'}  restarts {restarts}")
    lines.append(f"└─ {st.get('message', '')}")
    return "\n".join(lines)


def observed(md: dict[str, Any]) -> bool:
    """Whether the status describes the current spec: the operator observed its generation."""
    generation = md["metadata"].get("generation")
    seen = (md.get("status") or {}).get("observedGeneration")
    return generation is None or (seen is not None and seen >= generation)


def _comparison_lines(st: dict[str, Any]) -> list[str]:
    """compare: stable metrics (estimate, always-valid interval, decision) and an experiment."""
    def one(label: str, e: dict[str, Any]) -> str:
        c, s = e.get("canary") or {}, e.get("stable") or {}
        means = "" if c.get("mean") is None or s.get("mean") is None else \
            f"  {c['mean']:.4g} (n {c.get('n', 0):,.0f}) vs stable {s['mean']:.4g} (n {s.get('n', 0):,.0f})"
        return (f"│  {str(e.get('decision')):<12} {label:<24} {interval_text(e)} at "
                f"{float(e.get('confidence') or 0):.4g}{means}")

    lines = []
    if st.get("sequential"):
        lines.append("├─ compared with stable (always-valid, every look)")
        lines += [one(name, e) for name, e in st["sequential"].items()]
    exp = st.get("experiment") or {}
    if exp:
        weights = ", ".join(f"{k}:{v}" for k, v in sorted((exp.get("weights") or {}).items()))
        lines.append(f"├─ experiment {exp.get('state', '?')} on {exp.get('metric', '?')}  {weights}"
                     + (f"  winner {exp['winner']}" if exp.get("winner") else ""))
        lines += [one(f"{v} vs {exp.get('control', 'stable')}", e)
                  for v, e in sorted((exp.get("comparisons") or {}).items())]
        if exp.get("message"):
            lines.append(f"│  {exp['message']}")
    return lines


def status(kube: KubeClient, namespace: str, name: str, watch: bool, timeout: float | None,
           as_json: bool = False) -> int:
    """Print the rollout; with --watch redraw until it ends. Exit 1 if it ended RolledBack/Failed,
    2 on --timeout (like ``kubectl argo rollouts status``). A status of an earlier spec (the
    operator has not observed the current generation yet) is not an end."""
    deadline = time.monotonic() + timeout if timeout else None
    tty = sys.stdout.isatty()
    while True:
        md = _get(kube, namespace, name)
        pods = kube.list("Pod", namespace, f"{OWNER_LABEL}={name},app.kubernetes.io/component=runtime")
        text = json.dumps(md.get("status") or {}, indent=2) if as_json else render(md, pods)
        if watch and tty:
            sys.stdout.write("\x1b[H\x1b[2J" + text + "\n")
        else:
            print(text, flush=True)
        phase = (md.get("status") or {}).get("phase", "")
        rolling = bool((md.get("spec") or {}).get("canary")) and phase in ("Progressing", "Paused", "Promoting",
                                                                          "Initializing")
        if not watch and not timeout:
            return DONE_PHASES.get(phase, 0)
        if not rolling and phase in DONE_PHASES and observed(md):
            return DONE_PHASES[phase]
        if deadline is not None and time.monotonic() > deadline:
            print(f"timed out waiting for {namespace}/{name} (phase {phase})", file=sys.stderr)
            return 2
        time.sleep(1)


def list_all(kube: KubeClient, namespace: str | None) -> int:
    path = "/apis/mnnrollout.io/v1alpha1/" + (f"namespaces/{namespace}/" if namespace else "") + "modeldeployments"
    items = kube.request("GET", path).get("items", [])
    print(f"{'NAMESPACE':<14} {'NAME':<20} {'PHASE':<12} {'STABLE':<12} {'CANARY':<14} {'WEIGHT':>6} {'STEP':>5}")
    for md in items:
        st = md.get("status") or {}
        print(f"{md['metadata']['namespace']:<14} {md['metadata']['name']:<20} {st.get('phase', ''):<12} "
              f"{st.get('stableVersion', ''):<12} {st.get('canaryVersion', '') or '-':<14} "
              f"{st.get('canaryWeight', 0):>6} {st.get('stepText', '') or '-':>5}")
    return 0


def add_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """The arguments of one control command (its help lives in ``mnn_rollout.cli.CTL_COMMANDS``)."""
    p.set_defaults(ctl=command)
    if command == "list":
        p.add_argument("-n", "--namespace", default=None)
        p.add_argument("-A", "--all-namespaces", action="store_true")
        return
    p.add_argument("name", help="the ModelDeployment")
    p.add_argument("-n", "--namespace", default=None, help="namespace (default: the context's, else default)")
    if command != "status":
        p.add_argument("--wait", type=float, default=20.0,
                       help="seconds to wait for the operator's answer (applied, pending or ignored; default 20); "
                            "exit 1 when ignored, 2 when unanswered")
    if command == "status":
        p.add_argument("-w", "--watch", action="store_true", help="refresh until the rollout ends")
        p.add_argument("--timeout", type=float, default=None, help="seconds to wait; exit 2 when it passes")
        p.add_argument("-o", "--output", choices=["tree", "json"], default="tree")
    elif command == "promote":
        p.add_argument("--full", action="store_true", help="promote to 100%% now, skipping the remaining steps")


def current_namespace() -> str:
    try:
        from kubernetes import config

        _, context = config.list_kube_config_contexts()
        return str(context.get("context", {}).get("namespace") or "default")
    except Exception:
        return "default"


def namespace_after_command(argv: list[str]) -> list[str]:
    """``-n NS COMMAND ...`` as kubectl users type it, as ``COMMAND -n NS ...``: the namespace
    options given before the subcommand moved after it (every control command takes them)."""
    moved: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        if argv[i] in ("-n", "--namespace") and i + 1 < len(argv):
            moved += argv[i:i + 2]
            i += 2
        elif argv[i].startswith("--namespace=") or (argv[i].startswith("-n") and len(argv[i]) > 2):
            moved.append(argv[i])
            i += 1
        else:
            return argv  # another option first: left for the parser to judge
    if not moved or i >= len(argv):
        return argv
    return [argv[i], *moved, *argv[i + 1:]]


def run(args: argparse.Namespace) -> int:
    """One control command; exit 1 on an error (no Kubernetes configuration, the object not found,
    an API error), each told in one ``error:`` line."""
    from kubernetes.config import ConfigException

    # the client's retries are logged at INFO for the operator; a command's output is its answer
    logging.getLogger("rollout_operator").setLevel(logging.WARNING)
    namespace = getattr(args, "namespace", None) or current_namespace()
    try:
        kube = _client()
    except (ConfigException, OSError) as exc:
        print(f"error: no Kubernetes configuration (KUBECONFIG or ~/.kube/config): {exc}", file=sys.stderr)
        return 1
    try:
        if args.ctl == "list":
            return list_all(kube, None if args.all_namespaces else namespace)
        if args.ctl == "status":
            return status(kube, namespace, args.name, args.watch, args.timeout, args.output == "json")
        if args.ctl in ("pause", "resume"):
            code, outcome = set_paused(kube, namespace, args.name, args.ctl == "pause", args.wait)
        else:
            code, outcome = act(kube, namespace, args.name,
                                "promote-full" if args.ctl == "promote" and args.full else args.ctl, args.wait)
    except ApiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"modeldeployment.mnnrollout.io/{args.name} {args.ctl}{' --full' if getattr(args, 'full', False) else ''}: "
          f"{outcome}", file=sys.stdout if code == 0 else sys.stderr)
    return code
