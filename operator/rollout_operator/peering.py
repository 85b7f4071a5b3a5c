"""A clear start: kopf waits silently, reconciling nothing, when its peering CRD or object is
missing. Say so, with the two fixes, instead."""

from __future__ import annotations

import logging
import threading

from .kube import ApiError, KubeClient

log = logging.getLogger(__name__)


def peering_problem(kube: KubeClient, name: str, namespaces: list[str] | None) -> str | None:
    """None when kopf's peering object ``name`` exists where kopf looks for it; else what is missing."""
    kind = "KopfPeering" if namespaces else "ClusterKopfPeering"
    crd = "kopfpeerings.kopf.dev" if namespaces else "clusterkopfpeerings.kopf.dev"
    try:
        if namespaces:
            missing = [ns for ns in namespaces
                       if name not in {p["metadata"]["name"] for p in kube.list("KopfPeering", ns)}]
            return f"{kind} {name!r} in namespace {', '.join(missing)}" if missing else None
        if name not in {p["metadata"]["name"] for p in kube.list("ClusterKopfPeering", None)}:
            return f"{kind} {name!r}"
        return None
    except ApiError as exc:
        if exc.status == 404:
            return f"the CRD {crd}"
        log.warning("could not check kopf peering %r: %s", name, exc)
        return None


def explain(name: str, what: str) -> str:
    return (f"kopf peering {name!r}: {what} is missing, so this operator waits and reconciles nothing. Fix: "
            "install the chart's peering CRDs and object (helm/mnn-rollout with peering.enabled=true, or kubectl "
            "apply kopf's KopfPeering/ClusterKopfPeering CRDs and a peering object of that name), or run one "
            "replica with --standalone")


def watch_peering(kube: KubeClient, name: str, namespaces: list[str] | None, every: float = 15.0) -> threading.Thread:
    """Check now (so the ERROR comes within seconds of start), then every ``every`` seconds while
    something is missing; log once more when it is found."""
    def run() -> None:
        said = False
        while True:
            problem = peering_problem(kube, name, namespaces)
            if problem is None:
                if said:
                    log.info("kopf peering %r found: the operator resumes", name)
                return
            log.error(explain(name, problem))
            said = True
            stop.wait(every)

    stop = threading.Event()
    thread = threading.Thread(target=run, name="peering-check", daemon=True)
    thread.start()
    return thread
