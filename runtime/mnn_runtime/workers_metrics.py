"""Metrics of ``serve --workers``: prometheus-client's multiprocess mode.

Every worker writes its samples to files in one directory and /metrics sums them, so a scrape
shows the whole pod. A dead worker's counters stay in the sum (the pod's totals never go
backwards); its live gauges are dropped.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


_pid = os.getpid()


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _process_id() -> int:
    """This process's pid, as os.getpid gives it, without a system call: prometheus-client asks at
    every increment and observation (~4 times a request) to notice a fork."""
    return _pid


def enable_multiprocess_metrics() -> Path:
    """Switch prometheus-client to multiprocess values; call before any metric is created."""
    from prometheus_client import values

    path = Path(tempfile.mkdtemp(prefix="mnn-rollout-metrics-"))
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    values.ValueClass = values.MultiProcessValue(process_identifier=_process_id)
    return path


def mark_dead(pid: int, metrics_dir: Path | None) -> None:
    """Drop the live gauges of a worker that exited (its counters stay in the sum)."""
    if metrics_dir is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(metrics_dir))
