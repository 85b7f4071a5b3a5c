"""The MNN runtime manager each version runs on, from its engine settings (``versions[].engine``).

What MNN 3.6.1 does (read in its source, measured here) and what this module does about it:

- Backend names: its Python binding takes "CPU", "OPENCL", "VULKAN", "METAL", "CUDA", "AUTO" (upper
  case; "OpenCL" raises SystemError "backend not support"). A backend missing from the build or the
  node is no error: MNN prints "Can't Find type=N backend, use 0 instead" and runs on CPU. That
  line, read from fd 1 in a child process (``_probe``: asking in this one has side effects), tells
  a fallback; a creation or a load that raises falls back to CPU too, so a version always serves.
  For GPU backends MNN reads ``numThread`` as the GPU mode, fixed when the backend is first
  created: they get MNN's default (4, MNN_GPU_TUNING_WIDE); ``threads`` applies on CPU fallback.
- Modes take effect only as integers: ``"memory": "low"`` is silently ignored (measured: a 13 MB
  int8 model held 58 MB at "low" and at 0, 26 MB at 2).
- On CPU every runtime manager of a process shares MNN's one CPU runtime and one thread pool, so a
  manager per version costs nothing (16 more: +0 MB, +0 threads) and gives each version its own
  compile cache file (a manager holds one). The pool is started by the first manager asking for
  more than one thread and sized then: later ones get at most that many threads, so the largest
  count is asked for first (``reserve_threads``).
- A process forked after the pool started hangs in its first threaded forward (the pool's threads
  do not exist in the child). A process that will fork (``serve --workers N``) therefore creates
  only one-thread CPU managers (``fork_parent``): a version with threads > 1 or a GPU backend loads
  there on a one-thread CPU stand-in, and each worker loads it again on its own engine after the
  fork (``EngineInfo.per_process``). Its weights are then not shared between workers: a clone
  cannot move to another runtime manager (MNN's ``clone`` copies the original's thread count).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mnn_rollout.contract.config import EngineSpec

log = logging.getLogger(__name__)

DEFAULT = EngineSpec()
_MNN_NAME = {"CPU": "CPU", "OpenCL": "OPENCL", "Vulkan": "VULKAN", "CUDA": "CUDA", "Metal": "METAL", "Auto": "AUTO"}
_AUTO_ORDER = ("CUDA", "OpenCL", "Metal", "Vulkan")  # MNN's AUTO priority, among the backends named here
_MODE = {"normal": 0, "high": 1, "low": 2}
_PRECISION = {"normal": 0, "high": 1, "low": 2, "lowBF16": 3}
GPU_MODE = 4  # MNN_GPU_TUNING_WIDE: MNN's default numThread, read as the GPU mode by GPU backends
_MISSING = re.compile(r"Can't Find type=\d+ backend")

_lock = threading.RLock()
# Held while fd 1 is redirected (``native_output``): fd 1 is the process's, so two redirects at once
# (two versions loading on two threads) would take each other's messages and leave fd 1 on a
# deleted file. Taken after ``_lock`` (``_create`` runs under it), never before it.
_native_lock = threading.RLock()
_fork_parent = False
# One native model load at a time in the whole pod: a load peaks at ~3.2x the model's size inside
# MNN, and with workers a burst of pinned requests for an unloaded version loaded it in every worker
# and the supervisor at once. ``_load_lock`` orders this process's threads; ``_pod_lock_fd`` (a file
# made by the supervisor before it forks, inherited by every worker) is locked with lockf, whose
# locks belong to each process, around the load in every process. Taken before any other lock here.
# The file holds when the load under way began (``_BEGAN``, 0: none, or just taken or let go), so
# that loads one process runs back to back are told apart (``load_holder``).
_load_lock = threading.Lock()
_pod_lock_fd: int | None = None
_pool_threads = 1  # the size of MNN's thread pool in this process (1: not started)
_pool_owner: list[Any] = []  # the manager that started it
_available: dict[str, bool] = {}  # backend -> whether MNN has it here (the node does not change)


@dataclass(frozen=True)
class EngineInfo:
    """What a loaded version runs on, beside what its spec asked for."""

    requested: EngineSpec
    backend: str  # the backend MNN runs it on
    threads: int | None  # CPU threads of one forward (None on a GPU backend)
    reason: str | None = None  # why that differs from the request
    per_process: bool = False  # loaded on a fork-safe stand-in: each worker loads it again after the fork
    cache_file: str | None = None

    @property
    def fallback(self) -> bool:
        """A named backend it does not run on (Auto may pick any backend, CPU included)."""
        return self.requested.backend not in ("CPU", "Auto") and self.backend != self.requested.backend

    def as_parameters(self) -> dict[str, Any]:
        """The requested and the actual settings, as the metadata and status endpoints show them."""
        asked = self.requested
        out: dict[str, Any] = {
            "requested_backend": asked.backend, "backend": self.backend, "fallback": self.fallback,
            "requested_threads": asked.threads, "threads": self.threads,
            "precision": asked.precision, "memory": asked.memory, "power": asked.power,
        }
        if asked.cache_dir is not None:
            out["cache_dir"] = asked.cache_dir
            out["cache_file"] = self.cache_file
        if self.reason:
            out["reason"] = self.reason
        return out


def default_info() -> EngineInfo:
    return EngineInfo(DEFAULT, "CPU", 1)


def fork_parent(on: bool) -> None:
    """``on``: this process will fork workers, so it must start no MNN thread pool and no GPU
    context (versions that need them get a one-thread CPU stand-in); off in a worker after the fork."""
    global _fork_parent, _pod_lock_fd
    with _lock:
        _fork_parent = on
        if on and _pod_lock_fd is None:  # before the fork: the workers share it
            fd, path = tempfile.mkstemp(prefix="mnn-rollout-load-")
            os.unlink(path)  # the open file is enough, and nothing is left behind
            _mark_began(fd, 0.0)
            _pod_lock_fd = fd


@contextlib.contextmanager
def one_load_at_a_time() -> Iterator[None]:
    """Held around MNN's part of a model load: no other load runs meanwhile in this process or,
    with workers, in any process of the pod."""
    with _load_lock:
        fd = _pod_lock_fd
        if fd is None:
            yield
            return
        fcntl.lockf(fd, fcntl.LOCK_EX)
        try:
            _mark_began(fd, time.monotonic())
            yield
        finally:
            _mark_began(fd, 0.0)
            fcntl.lockf(fd, fcntl.LOCK_UN)


def _mark_began(fd: int, began: float) -> None:
    """Write when the load under way began (0: none) into the lock file, for ``load_holder``. With
    pwrite: the shared offset, lockf's, stays 0. Its 8 bytes are written when the file is made, so
    this overwrites them in place; should it fail all the same, the load goes on (a file left empty
    or at 0 reads as a load just taken: never judged overdue)."""
    try:
        os.pwrite(fd, _BEGAN.pack(began), 0)
    except OSError as exc:
        log.warning("the pod's load lock file could not be written: %s", exc)


_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux): type, whence, start, len, pid
_BEGAN = struct.Struct("d")  # time.monotonic() (CLOCK_MONOTONIC: the same clock in every process)


def load_holder() -> tuple[int, float | None] | None:
    """The pid of the process of the pod inside a model load (holding the pod's load lock) and
    when that load began (None in the moment it is taken or let go), or None (none is, or this
    process is not part of a pod with workers). MNN's load holds the GIL throughout: that process's
    event loop says nothing meanwhile, without being stuck."""
    fd = _pod_lock_fd
    if fd is None:
        return None
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
        began = os.pread(fd, _BEGAN.size, 0)
    except OSError:
        return None
    kind, _, _, _, pid = _FLOCK.unpack(got)
    if kind == fcntl.F_UNLCK or pid <= 0:
        if not _load_lock.locked():
            return None
        pid = os.getpid()  # a thread of this one (its own lock is no conflict)
    since = _BEGAN.unpack(began)[0] if len(began) == _BEGAN.size else 0.0
    return pid, since or None


def fork_safe(spec: EngineSpec) -> bool:
    return spec.backend == "CPU" and spec.threads == 1


def reserve_threads(threads: int) -> int:
    """Start MNN's thread pool for ``threads`` unless a pool runs already (it cannot grow, so call
    this with the largest count first); returns the threads a manager can have now."""
    global _pool_threads
    with _lock:
        if _fork_parent:
            return 1
        if threads > 1 and _pool_threads == 1:
            manager, _ = _create({"backend": "CPU", "numThread": threads})
            _pool_owner.append(manager)
            _pool_threads = threads
        return min(threads, _pool_threads)


# A private copy of a compile cache lives from the start of a load to the end of its warm-up; one
# older than this was left by a process killed meanwhile (removing a live one early would cost at
# most that load's cache write: ``close`` logs it).
STALE_CACHE_COPY_SECONDS = 3600.0


def remove_stale(folder: Path, pattern: str, seconds: float) -> None:
    """Remove the files of ``folder`` matching ``pattern`` that were not written for ``seconds``:
    temporary files a killed writer left behind (a live writer's is younger, so writers working at
    once never remove each other's). Failures are ignored: the next writer tries again."""
    oldest = time.time() - seconds
    for path in folder.glob(pattern):
        try:
            if path.stat().st_mtime < oldest:
                path.unlink()
        except OSError:
            pass


class CompileCache:
    """A version's compile cache file (GPU kernels and tuning; CPU writes nothing), handed to MNN
    before the load and written after the warm-up. MNN writes a private copy that then replaces
    the file, so workers writing at once never mix their bytes; copies a killed process left
    behind are removed once stale (``STALE_CACHE_COPY_SECONDS``). A corrupt or unwritable cache
    costs only the cache: MNN resets one it cannot use, and a directory it cannot write to is
    only read."""

    COPY = "*.cache.????????.tmp"  # the private copies mkstemp names (8 random characters)

    def __init__(self, path: Path) -> None:
        self.path = path
        self._private: Path | None = None
        self._copied: tuple[int, int] | None = None  # (size, mtime_ns) of the private copy as made

    def open(self, manager: Any) -> None:
        """Before the load: give MNN the cache to read (a private copy of it when the directory can
        be written to)."""
        target = self.path
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            remove_stale(self.path.parent, self.COPY, STALE_CACHE_COPY_SECONDS)
            fd, name = tempfile.mkstemp(prefix=f"{self.path.name}.", suffix=".tmp", dir=self.path.parent)
            os.close(fd)
            private = Path(name)
            with contextlib.suppress(FileNotFoundError):
                shutil.copyfile(self.path, private)
            stat = private.stat()
            self._private, self._copied, target = private, (stat.st_size, stat.st_mtime_ns), private
        except OSError as exc:
            log.warning("compile cache %s: its directory cannot be written to (%s); reading it only", self.path, exc)
        with native_output() as printed:
            manager.set_cache(str(target))
        for line in printed:
            log.debug("compile cache %s: MNN: %s", self.path, line)

    def discard(self) -> None:
        if self._private is not None:
            with contextlib.suppress(OSError):
                self._private.unlink()
            self._private = None

    def close(self, manager: Any) -> None:
        """After the warm-up: let MNN write what it compiled, then put it in place."""
        private = self._private
        if private is None:
            return
        self._private = None
        try:
            with native_output() as printed:
                manager.update_cache()
            for line in printed:
                log.debug("compile cache %s: MNN: %s", self.path, line)
            stat = private.stat()
            if stat.st_size == 0 or (stat.st_size, stat.st_mtime_ns) == self._copied:
                private.unlink()  # nothing new
            else:
                os.replace(private, self.path)
        except OSError as exc:
            log.warning("compile cache %s could not be written: %s", self.path, exc)
            with contextlib.suppress(OSError):
                private.unlink()


class Runtime:
    """One MNN runtime manager (``manager``: what ``load_module_from_file`` takes), what it runs
    on, and the compile cache that goes with it."""

    def __init__(self, manager: Any, info: EngineInfo, cache: CompileCache | None = None) -> None:
        self.manager = manager
        self.info = info
        self.cache = cache

    def set_cache(self) -> None:
        """Before the load: hand MNN the compile cache to read (no-op without ``cacheDir``)."""
        if self.cache is not None:
            self.cache.open(self.manager)

    def update_cache(self) -> None:
        """After the warm-up: write the compile cache (no-op without ``cacheDir``)."""
        if self.cache is not None:
            self.cache.close(self.manager)

    def drop_cache(self) -> None:
        """After a failed load: write nothing."""
        if self.cache is not None:
            self.cache.discard()


def open_runtime(spec: EngineSpec | None, cache_stem: str, cpu_because: str | None = None) -> Runtime:
    """A runtime manager for ``spec``: on its backend when this node has it, else on CPU with the
    reason (``cpu_because`` forces CPU: the model failed to load on the backend). A process that
    will fork gets the one-thread CPU stand-in for a spec that is not fork-safe. ``cache_stem``
    names the compile cache file: ``<cacheDir>/<cache_stem>-<backend>.cache``."""
    spec = spec or DEFAULT
    with _lock:
        if _fork_parent and not fork_safe(spec):
            if spec.backend != "CPU":
                _resolve(spec.backend)  # asked once here, in a child process: the workers inherit the answer
            manager, _ = _create(_config("CPU", 1, spec))
            stand_in = (f"loaded on CPU with 1 thread in the supervisor (a process that forks must not start MNN's "
                        f"thread pool or a GPU); each worker loads it on {spec.backend} with {spec.threads} threads")
            return Runtime(manager, EngineInfo(spec, "CPU", 1, stand_in, per_process=True))
        reason = cpu_because
        if reason is None and spec.backend != "CPU":
            backend = _resolve(spec.backend)
            if backend is None:
                reason = f"this node has no {spec.backend} backend (MNN: \"Can't Find\" it)"
            elif backend != "CPU":
                try:
                    manager, _ = _create(_config(spec.backend, GPU_MODE, spec))
                except (SystemError, RuntimeError, ValueError, TypeError) as exc:
                    reason = f"MNN could not create a {spec.backend} runtime: {exc}"
                else:
                    cache = _cache(spec, cache_stem, backend)
                    info = EngineInfo(spec, backend, None, cache_file=str(cache.path) if cache else None)
                    return Runtime(manager, info, cache)
        threads = reserve_threads(spec.threads)
        manager, _ = _create(_config("CPU", threads, spec))
        notes = [] if reason is None else [f"{reason}; runs on CPU"]
        if threads < spec.threads:
            notes.append(f"{threads} threads, not {spec.threads}: MNN's thread pool in this process was started "
                         f"for {threads} by a version loaded earlier")
        cache = _cache(spec, cache_stem, "CPU")
        info = EngineInfo(spec, "CPU", threads, "; ".join(notes) or None, cache_file=str(cache.path) if cache else None)
        return Runtime(manager, info, cache)


def _cache(spec: EngineSpec, stem: str, backend: str) -> CompileCache | None:
    if spec.cache_dir is None:
        return None
    return CompileCache(Path(spec.cache_dir) / f"{stem}-{backend}.cache")


def _config(backend: str, threads: int, spec: EngineSpec) -> dict[str, Any]:
    return {"backend": _MNN_NAME[backend], "numThread": threads, "precision": _PRECISION[spec.precision],
            "memory": _MODE[spec.memory], "power": _MODE[spec.power]}


def _resolve(backend: str) -> str | None:
    """The backend MNN runs a request for ``backend`` on here: itself, for Auto the first GPU
    backend it has (else CPU); None when this node lacks it."""
    names = _AUTO_ORDER if backend == "Auto" else (backend,)
    unknown = [name for name in names if name not in _available]
    if unknown:
        _available.update(_probe(unknown))
    return next((name for name in names if _available[name]), "CPU" if backend == "Auto" else None)


def _probe(names: list[str]) -> dict[str, bool]:
    """Which of ``names`` MNN has here, asked in a child process (once: forked workers inherit the
    answer). Asking in this one would leave a trace either way: for a missing backend MNN sets up
    its CPU runtime with the GPU mode (4) as thread count, starting a thread pool of 4 that spins
    beside every forward; a present one keeps the GPU mode it was first created with."""
    try:
        done = subprocess.run([sys.executable, "-m", __name__, *names], capture_output=True, text=True, timeout=60)
        found = json.loads(done.stdout.strip().splitlines()[-1])
        return {name: found.get(name) is True for name in names}
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, AttributeError) as exc:
        log.warning("could not ask MNN which of %s it has (%s): taken as missing", names, exc)
        return {name: False for name in names}


def _create(config: dict[str, Any]) -> tuple[Any, bool]:
    """``nn.create_runtime_manager`` for one config, and whether MNN said its backend is missing."""
    import MNN.nn as nn

    with native_output() as printed:
        manager = nn.create_runtime_manager((config,))
    missing = any(_MISSING.search(line) for line in printed)
    for line in printed:
        log.debug("MNN: %s", line)
    return manager, missing


@contextlib.contextmanager
def native_output(echo: bool = False) -> Iterator[list[str]]:
    """The lines MNN's C++ code prints to fd 1 meanwhile (it reports missing backends and weight
    files only there), kept from the process's stdout unless ``echo``. One thread at a time: a
    second waits until the first has put fd 1 back (a load waits for another's native part)."""
    lines: list[str] = []
    with _native_lock, tempfile.TemporaryFile(mode="w+b") as sink:
        saved = os.dup(1)
        try:
            os.dup2(sink.fileno(), 1)
            yield lines
        finally:
            _flush_c_stdio()
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace")
            lines.extend(line for line in text.splitlines() if line.strip())
            if echo and text:
                os.write(1, text.encode())


def _flush_c_stdio() -> None:
    """Flush C's stdio buffers (what MNN printed may still sit there when fd 1 is not a terminal)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None).fflush(None)


if __name__ == "__main__":  # ``python -m mnn_runtime.engine OpenCL ...``: which backends MNN has (see _probe)
    answer = {}
    for backend in sys.argv[1:]:
        try:
            _, gone = _create(_config(backend, GPU_MODE, DEFAULT))
        except (SystemError, RuntimeError, ValueError, TypeError, KeyError):
            gone = True
        answer[backend] = not gone
    print(json.dumps(answer), flush=True)
