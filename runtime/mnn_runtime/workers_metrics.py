"""Metrics of ``serve --workers``: prometheus-client's multiprocess mode.

Every worker writes its samples to files in one directory and /metrics sums them, so a scrape
shows the whole pod. A dead worker's counters stay in the sum (the pod's totals never go
backwards); its live gauges are dropped. Its other files are merged into one archive per kind
(``counter_archive.db``, ``gauge_sum_archive.db``, ...), so the directory, and the time a scrape
takes, stay bounded however many workers were replaced (one per added version, per reload of an
idle version, per crash). A merge and a scrape never overlap: a scrape holds a shared lock on the
directory, a merge the exclusive one, so no scrape sees a count twice or not at all.

A feedback item adds to three series in two files of its worker (its trial to ``counter_<pid>.db``,
its value and square to ``gauge_sum_<pid>.db``), which a scrape in another worker reads one after
the other: a scrape between the writes counted the success without its trial (more successes than
trials) or the trial without its value. A worker writes a request's items holding a shared lock
on ``FEEDBACK_LOCK`` and a scrape reads holding the exclusive one, so a scrape sees each item whole.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

_pid = os.getpid()
PREFIX = "mnn-rollout-metrics-"
LOCK = ".merge.lock"
FEEDBACK_LOCK = ".feedback.lock"  # shared: a worker writing a feedback item; exclusive: a scrape reading
OWNER = ".owner"  # locked (flock) by the server that made the directory, for as long as it or a worker lives
ARCHIVE = "archive"


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def _process_id() -> int:
    """This process's pid, as os.getpid gives it, without a system call: prometheus-client asks at
    every increment and observation (~4 times a request) to notice a fork."""
    return _pid


def enable_multiprocess_metrics() -> Path:
    """Switch prometheus-client to multiprocess values; call before any metric is created. The
    directory is this pod's for as long as one of its processes lives (``OWNER``), and those left
    by servers that died without removing theirs (SIGKILL, an OOM kill) are removed first."""
    from prometheus_client import values

    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    owner = os.open(path / (OWNER + ".new"), os.O_CREAT | os.O_WRONLY, 0o600)  # kept open: the workers inherit it
    fcntl.flock(owner, fcntl.LOCK_EX)
    os.rename(path / (OWNER + ".new"), path / OWNER)  # seen by another server's sweep only once locked
    remove_abandoned(path.parent)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    values.ValueClass = values.MultiProcessValue(process_identifier=_process_id)
    return path


def remove_abandoned(parent: Path) -> None:
    """Remove the metrics directories under ``parent`` whose owners are all gone (no process holds
    the lock on their ``OWNER`` file: the lock dies with the last process holding it open). In a
    pod, /tmp is an emptyDir that outlives the container: a container restarted again and again (an
    OOM kill) left a directory of ~1 MB files per worker each time. One without the file (being
    made, or made by an older server) is left alone."""
    for directory in parent.glob(PREFIX + "*"):
        try:
            fd = os.open(directory / OWNER, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its server lives
        finally:
            os.close(fd)  # (a lock taken is let go with it)
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def _locked(directory: Path | str, operation: int, name: str = LOCK) -> Iterator[None]:
    """``flock`` on the file ``name`` of ``directory`` through a descriptor of this call's own (no
    Python file object: a feedback request takes it once)."""
    fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, operation)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


class _Read:
    """Metric families read once (under the lock), as a collector."""

    def __init__(self, families: list[Any]) -> None:
        self.families = families

    def collect(self) -> list[Any]:
        return self.families


def collect(directory: Path | str) -> CollectorRegistry:
    """Every worker's samples summed (dead workers' archives included), read now: a registry to
    give ``generate_latest`` or to ``collect()``."""
    from prometheus_client import CollectorRegistry, multiprocess

    with _locked(directory, fcntl.LOCK_SH), _locked(directory, fcntl.LOCK_EX, FEEDBACK_LOCK):
        families = list(multiprocess.MultiProcessCollector(None, path=str(directory)).collect())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Read(families))  # type: ignore[arg-type]
    return registry


def feedback_writes(directory: Path | str) -> contextlib.AbstractContextManager[None]:
    """``with`` it: the shared lock on ``FEEDBACK_LOCK`` a worker holds while it writes a request's
    feedback items (``collect`` reads holding the exclusive one). The file is opened at each call, so
    each lock is its caller's own: one taken through a descriptor inherited across a fork would be
    the parent's too, and one's unlock the other's."""
    return _locked(directory, fcntl.LOCK_SH, FEEDBACK_LOCK)


def mark_dead(pid: int, metrics_dir: Path | None) -> None:
    """Drop the live gauges of a worker that exited and merge its other samples into the archives
    (its counters stay in the sum)."""
    if metrics_dir is None:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(metrics_dir))
    with _locked(metrics_dir, fcntl.LOCK_EX):
        archive(pid, metrics_dir)


def _merged(mode: str, old: tuple[float, float] | None, new: tuple[float, float]) -> tuple[float, float]:
    """An archived (value, timestamp) and a dead process's, as the collector would combine them."""
    if old is None:
        return new
    if mode == "max":
        return max(old, new)
    if mode == "min":
        return min(old, new)
    if mode == "mostrecent":
        return new if new[1] >= old[1] else old
    return old[0] + new[0], max(old[1], new[1])  # counters, histograms, summaries, gauges summed


def archive(pid: int, directory: Path) -> None:
    """Merge process ``pid``'s files into the archives and remove them. Gauges kept per process
    (``all``) stay as they are: their series are labelled by pid."""
    from prometheus_client.mmap_dict import MmapedDict

    suffix = f"_{pid}.db"
    for path in sorted(directory.glob(f"*{suffix}")):
        kind = path.name[:-len(suffix)]  # counter, histogram, summary, gauge_<mode>
        mode = kind.split("_", 1)[1] if kind.startswith("gauge_") else "sum"
        if mode not in ("sum", "max", "min", "mostrecent"):
            continue
        target = MmapedDict(str(directory / f"{kind}_{ARCHIVE}.db"))
        try:
            kept = {key: (value, stamp) for key, value, stamp in target.read_all_values()}
            for key, value, stamp, _ in MmapedDict.read_all_values_from_file(str(path)):
                target.write_value(key, *_merged(mode, kept.get(key), (value, stamp)))
        finally:
            target.close()
        path.unlink()
