"""``mnn-rollout operator``: wire the reconciler, metrics and kopf together and run."""

from __future__ import annotations

import argparse
import logging
import os
import random
from pathlib import Path
from typing import Any

from .spec import DEFAULT_IMAGE

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser, command: str = "operator") -> None:
    env = os.environ.get
    p.add_argument("--namespace", action="append", default=[],
                   help="namespace to watch (repeatable); default: all namespaces")
    p.add_argument("--peering", default=env("MNN_ROLLOUT_PEERING", "mnn-rollout"),
                   help="kopf peering name shared by the replicas (default mnn-rollout)")
    p.add_argument("--standalone", action="store_true", help="no peering: act even if other replicas run")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; the highest acts (default: random, so exactly one replica acts)")
    p.add_argument("--peering-lifetime", type=int, default=int(env("MNN_ROLLOUT_PEERING_LIFETIME", "15")),
                   help="seconds a replica's peering keep-alive is valid: how long a standby waits after the "
                        "active replica dies without notice (default 15)")
    p.add_argument("--metrics-host", default=env("MNN_ROLLOUT_METRICS_HOST", "127.0.0.1"),
                   help="address of the operator's /metrics (default 127.0.0.1; the chart passes 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, default=int(env("MNN_ROLLOUT_METRICS_PORT", "8090")),
                   help="port of the operator's /metrics (0 disables)")
    p.add_argument("--liveness", default=env("MNN_ROLLOUT_LIVENESS", ""),
                   help="kopf liveness endpoint, e.g. http://0.0.0.0:8091/healthz")
    p.add_argument("--webhook-host", default=env("MNN_ROLLOUT_WEBHOOK_HOST", "127.0.0.1"),
                   help="address of the Alertmanager webhook (default 127.0.0.1; the chart passes 0.0.0.0)")
    p.add_argument("--webhook-port", type=int, default=int(env("MNN_ROLLOUT_WEBHOOK_PORT", "8092")),
                   help="port of the Alertmanager webhook POST /alerts (0 disables)")
    p.add_argument("--webhook-token-file", default=env("MNN_ROLLOUT_WEBHOOK_TOKEN_FILE", ""),
                   help="file holding the webhook's bearer token (a mounted Secret); required for the webhook")
    p.add_argument("--runtime-image", default=env("MNN_ROLLOUT_RUNTIME_IMAGE", DEFAULT_IMAGE),
                   help="image of the runtime pods when a ModelDeployment names none "
                        f"(default {DEFAULT_IMAGE}; the Helm chart passes its own image)")
    p.add_argument("--resync-seconds", type=float, default=float(env("MNN_ROLLOUT_RESYNC_SECONDS", "2")),
                   help="how often a ModelDeployment is observed while a rollout is in flight or a version is "
                        "loading; idle objects are reconciled on their own and their pods' events only (default 2)")
    p.add_argument("--reconcile-workers", type=int, default=int(env("MNN_ROLLOUT_RECONCILE_WORKERS", "16")),
                   help="threads that run reconciles, shared by every ModelDeployment (default 16)")
    p.add_argument("--kube-qps", type=float, default=float(env("MNN_ROLLOUT_KUBE_QPS", "20")),
                   help="client-side rate limit of the operator's own Kubernetes API requests, per second "
                        "sustained (children, status, pods, the webhook; not kopf's watches); 0 disables "
                        "(default 20)")
    p.add_argument("--kube-burst", type=int, default=int(env("MNN_ROLLOUT_KUBE_BURST", "30")),
                   help="requests allowed at once above --kube-qps (default 30)")
    p.add_argument("--verbose", action="store_true", default=env("MNN_ROLLOUT_VERBOSE", "") not in ("", "0", "false"),
                   help="also log kopf's line per handled watch event (default: its warnings and errors only)")


def kopf_log_level(verbose: bool) -> None:
    """kopf logs "Handler '...' succeeded." at INFO for every watch event it hands on: with
    hundreds of ModelDeployments and their pods, most of the operator's log. Unless ``verbose``,
    only its warnings and errors."""
    logging.getLogger("kopf.objects").setLevel(logging.INFO if verbose else logging.WARNING)


def run(args: argparse.Namespace, memo_extra: dict[str, Any] | None = None) -> int:
    import kopf

    from .main import post_events  # (importing main registers the kopf handlers)
    from .alerts import AlertWebhook
    from .analyzer import Analyzer
    from .kube import KubeClient
    from .metrics import OperatorMetrics
    from .ports import ClusterPorts
    from .providers.factory import ProviderFactory
    from .reconcile import Reconciler
    from .wakeups import WakeUps

    kopf_log_level(args.verbose)
    metrics = OperatorMetrics()
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_host)
    # one client, one rate limit, for every thread: a connection each for the reconcile threads,
    # the relists and the alert webhook
    kube = KubeClient(qps=args.kube_qps, burst=args.kube_burst, connections=args.reconcile_workers + 4)
    reconciler = Reconciler(ClusterPorts(kube), metrics, analyzer=Analyzer(ProviderFactory(kube.secret_value)),
                            runtime_image=args.runtime_image)
    if args.webhook_port:
        if not args.webhook_token_file:
            log.error("--webhook-port is set but --webhook-token-file is not: the webhook stays off")
        else:
            token_path = Path(args.webhook_token_file)
            webhook = AlertWebhook(kube, args.webhook_host, args.webhook_port,
                                   lambda: token_path.read_text().strip() if token_path.is_file() else "",
                                   args.namespace or None)
            webhook.start()
            log.info("Alertmanager webhook on %s:%s/alerts", args.webhook_host, webhook.port)
    wakeups = WakeUps(reconciler, post_events, workers=args.reconcile_workers, resync_seconds=args.resync_seconds,
                      namespaces=args.namespace or None)
    memo = kopf.Memo(wakeups=wakeups, peering_lifetime=args.peering_lifetime, namespaces=args.namespace or None,
                     **(memo_extra or {}))
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    kwargs: dict[str, Any] = {"memo": memo, "standalone": args.standalone, "priority": priority,
                              "liveness_endpoint": args.liveness or None}
    if not args.standalone:
        kwargs["peering_name"] = args.peering
    if args.namespace:
        kwargs["namespaces"] = args.namespace
    else:
        kwargs["clusterwide"] = True
    log.info("operator starting (priority %s, peering %s)", priority,
             "off" if args.standalone else args.peering)
    if not args.standalone:
        from .peering import watch_peering

        watch_peering(kube, args.peering, args.namespace or None)
    kopf.run(**kwargs)
    return 0
