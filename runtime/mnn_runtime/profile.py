"""Per-operator timing of one MNN model: ``mnn-rollout profile`` and the runtime's admin endpoint.

What is served is an ``MNN.nn`` Module, which has no per-operator hook; MNN's session API does:
``Interpreter.runSessionWithCallBackInfo`` calls back before and after every operator. A profile
therefore builds its own Interpreter and session from the model's file, which holds a second copy
of the weights while it runs (fine for an admin call, never on the serving path: the runtime
profiles in a child process, see ``Profiler``), and runs it on one MNN thread. Each run is a
plain ``runSession`` followed by one with callbacks, on the same inputs, so a slow moment of the
machine lands on both. An operator's time is measured from its ``before`` callback to its
``after`` callback, so it includes MNN wrapping that operator's tensors for Python: measured at
~1.8 µs per operator on these machines (an 8-op scorer whose forward takes 9 µs sums to 23 µs; a
23-op one of 3.5 ms sums to the forward within noise).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mnn_rollout.contract.config import ADMIN_TOKEN_ENV, FEEDBACK_TOKEN_ENV

from .errors import InferenceError

CONFIG = {"backend": "CPU", "numThread": 1}
SECRET_ENV = frozenset({ADMIN_TOKEN_ENV, FEEDBACK_TOKEN_ENV, "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                        "AWS_SESSION_TOKEN"})
MAX_RUNS = 1000  # the endpoint's bound: 1000 runs of v2-slow (two ~4 ms forwards each) took 8-15 s here
DEFAULT_TIMEOUT = 60  # the endpoint's wall-clock limit of one profile, seconds (its ?timeout=)
MAX_TIMEOUT = 600
NICE = 10  # how much less CPU priority the profiling child takes than its serving process
STOPPED = "the server is shutting down"  # why a profile is stopped by ``Profiler.stop``

log = logging.getLogger(__name__)


class ProfileError(Exception):
    """The model cannot be profiled as asked; the message names the file, input or shape."""


class ProfileBusy(InferenceError):
    status_code = 429


class ModelFileChanged(InferenceError):
    """The version's file on disk is no longer the one that was loaded: a profile would time
    another model."""

    status_code = 409


class ProfileTimeout(InferenceError):
    """The profile ran past its wall-clock limit; its process was killed."""

    status_code = 504


class ProfileStopped(InferenceError):
    """The server (or this worker) is shutting down: the profile's process was killed."""

    status_code = 503

    def __init__(self) -> None:
        super().__init__(f"{STOPPED}; the profile was stopped")


@dataclass(frozen=True)
class OpTiming:
    name: str
    type: str
    ms: float  # mean over the runs
    share: float  # of the total of every operator's time
    mflops: float  # MNN's own estimate (millions; its units vary by operator type)


@dataclass(frozen=True)
class Profile:
    ops: tuple[OpTiming, ...]
    total_ms: float  # the sum of the operators' mean times
    forward_ms: float  # the mean of the plain runSession calls, timed the same way
    runs: int
    shapes: dict[str, tuple[int, ...]]

    def as_dict(self) -> dict[str, Any]:
        return {"total_ms": self.total_ms, "forward_ms": self.forward_ms,
                "ops": [{"name": o.name, "type": o.type, "ms": o.ms, "share": o.share, "mflops": o.mflops}
                        for o in self.ops]}

    def to_dict(self) -> dict[str, Any]:
        """``as_dict`` with the runs and shapes: everything ``from_dict`` needs."""
        return {**self.as_dict(), "runs": self.runs, "shapes": {n: list(s) for n, s in self.shapes.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Profile:
        return cls(tuple(OpTiming(**op) for op in data["ops"]), data["total_ms"], data["forward_ms"], data["runs"],
                   {name: tuple(shape) for name, shape in data["shapes"].items()})

    def table(self, title: str) -> str:
        """The profile as text, one line per operator in the order they ran."""
        shapes = ", ".join(f"{name}={','.join(map(str, shape))}" for name, shape in self.shapes.items())
        width = max([len(o.name) for o in self.ops] + [2])
        kind = max([len(o.type) for o in self.ops] + [4])
        lines = [f"{title}: {len(self.ops)} ops, mean of {self.runs} runs, inputs {shapes}",
                 f"{'#':>3}  {'op':<{width}}  {'type':<{kind}}  {'ms':>9}  {'share':>6}"]
        lines += [f"{i:>3}  {o.name:<{width}}  {o.type:<{kind}}  {o.ms:>9.4f}  {o.share:>6.1%}"
                  for i, o in enumerate(self.ops, 1)]
        lines.append(f"total of ops {self.total_ms:.4f} ms; plain forward {self.forward_ms:.4f} ms "
                     f"(each op's time includes ~2 µs of callback overhead)")
        return "\n".join(lines)


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """``NAME=D,D,...`` -> (name, dims); every dimension a whole number of at least 1."""
    name, sep, dims = text.rpartition("=")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        shape = ()
    if not sep or not name or not shape or any(d < 1 for d in shape):
        raise ProfileError(f"--shape {text!r}: expected NAME=D,D,... with whole dimensions of at least 1, "
                           "e.g. features=1,64")
    return name, shape


def profile_model(path: Path, runs: int = 10, shapes: Mapping[str, Sequence[int]] | None = None) -> Profile:
    """Time every operator of the ``.mnn`` file at ``path`` over ``runs`` runs. ``shapes`` sets
    input shapes; an input left out runs at its declared shape with batch 1."""
    if runs < 1:
        raise ProfileError(f"runs: {runs} must be at least 1")
    it, session = _open(path)
    inputs = _fill_inputs(it, session, path, dict(shapes or {}))
    order: list[tuple[str, str, float]] = []
    timed: list[int] = []
    started = [0]

    def before(tensors: Any, op: Any) -> bool:
        started[0] = time.perf_counter_ns()
        return True

    def after(tensors: Any, op: Any) -> bool:
        timed.append(time.perf_counter_ns() - started[0])
        return True

    def named(tensors: Any, op: Any) -> bool:
        order.append((op.getName(), op.getType(), float(op.getFlops())))
        return True

    _run(it, session, path, inputs)  # the first runs allocate and pack: not timed
    it.runSessionWithCallBackInfo(session, before, named)
    forward_ns = np.zeros(runs)
    op_ns = np.zeros((runs, len(order)))
    for r in range(runs):
        t0 = time.perf_counter_ns()
        it.runSession(session)
        forward_ns[r] = time.perf_counter_ns() - t0
        timed.clear()
        it.runSessionWithCallBackInfo(session, before, after)
        if len(timed) != len(order):
            raise ProfileError(f"{str(path)!r}: ran {len(order)} operators, then {len(timed)}")
        op_ns[r] = timed
    means = op_ns.mean(axis=0) / 1e6
    total = float(means.sum())
    ops = tuple(OpTiming(name, kind, round(float(ms), 6), round(float(ms) / total, 6) if total else 0.0,
                         round(flops, 6)) for (name, kind, flops), ms in zip(order, means))
    return Profile(ops, round(total, 6), round(float(forward_ns.mean()) / 1e6, 6), runs, inputs)


def _open(path: Path) -> tuple[Any, Any]:
    try:
        with path.open("rb") as fh:
            fh.read(1)
    except OSError as exc:
        raise ProfileError(f"FILE {str(path)!r}: cannot be read: {exc.strerror or exc}") from None
    import MNN

    try:
        it = MNN.Interpreter(str(path))
    except Exception:  # MNN raises a bare Exception ("Invalid model file")
        raise ProfileError(f"FILE {str(path)!r}: not a valid MNN model") from None
    return it, it.createSession(dict(CONFIG))


def _fill_inputs(it: Any, session: Any, path: Path, shapes: dict[str, Sequence[int]]) -> dict[str, tuple[int, ...]]:
    """Resize every input to its given (else declared, batch 1) shape and fill it with the same
    pseudo-random data every time; returns the shapes used."""
    import MNN

    tensors = it.getSessionInputAll(session)
    unknown = sorted(set(shapes) - set(tensors))
    if unknown:
        raise ProfileError(f"--shape {unknown[0]}=...: {unknown[0]!r} is not an input of {str(path)!r}; "
                           f"inputs: {sorted(tensors)}")
    used: dict[str, tuple[int, ...]] = {}
    for name, tensor in tensors.items():
        declared = tuple(int(d) for d in tensor.getShape())
        given = shapes.get(name)
        if given is None:
            if any(d <= 0 for d in declared[1:]):
                raise ProfileError(f"input {name!r} of {str(path)!r} has open dimensions: shape "
                                   f"{list(declared)} (-1: open); give one with --shape "
                                   f"{name}={','.join('D' if d <= 0 else str(d) for d in declared)}")
            used[name] = (max(declared[0], 1), *declared[1:]) if declared else ()
            continue
        if len(given) != len(declared) or any(d > 0 and d != g for d, g in zip(declared[1:], given[1:])):
            raise ProfileError(f"--shape {name}={','.join(map(str, given))}: does not fit input {name!r} of shape "
                               f"{list(declared)} (-1: any size; the first dimension is the batch)")
        used[name] = tuple(int(d) for d in given)
    for name, tensor in tensors.items():
        it.resizeTensor(tensor, used[name])
    it.resizeSession(session)
    rng = np.random.default_rng(0)
    for name, tensor in tensors.items():
        dtype = tensor.getNumpyData().dtype
        data = (rng.uniform(0, 1, used[name]) if dtype.kind == "f" else rng.integers(0, 2, used[name])).astype(dtype)
        layout = tensor.getDimensionType()
        if layout == MNN.Tensor_DimensionType_Caffe_C4:
            layout = MNN.Tensor_DimensionType_Caffe
        tensor.copyFrom(MNN.Tensor(used[name], tensor.getDataType(), data, layout))
    return used


def _run(it: Any, session: Any, path: Path, shapes: Mapping[str, Sequence[int]]) -> None:
    code = it.runSession(session)
    if code != 0:
        raise ProfileError(f"{str(path)!r} cannot run on input shapes "
                           f"{ {n: list(s) for n, s in shapes.items()} } (MNN error code {code})")


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """MNN's C++ code prints to fd 1 (a banner at import, errors): send it to stderr so that
    ``--json`` output stays parseable."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def child_environment(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The profiling child's environment: the server's, less its secrets (the admin and feedback
    tokens, S3 credentials): it reads a local file and answers on a pipe, and needs none of them."""
    return {k: v for k, v in env.items() if k not in SECRET_ENV}


class Profiler:
    """The runtime's side: one profile at a time per process, each in a child process of its own
    (``python -m mnn_runtime.profile``). Not a thread: ``runSessionWithCallBackInfo`` holds the GIL
    from the first operator to the last, so a thread stalled the serving loop for whole operators
    (p99 of a v1 request 0.8 -> 115 ms while profiling a 426 ms forward). The child is killed when
    its wall-clock limit passes, when the caller stops waiting (the HTTP client went away) or at once
    when the server shuts down (``stop``: its request answers 503 instead of holding the drain)."""

    def __init__(self) -> None:
        self._busy = False  # these three touched only on the event loop
        self._child: asyncio.subprocess.Process | None = None  # the running profile's process
        self._stopped = False

    def stop(self) -> None:
        """The server is shutting down: kill the running profile's process now (its request answers
        503) and start no other."""
        self._stopped = True
        if self._child is not None and self._child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._child.kill()
            log.info("profiling process %d killed: %s", self._child.pid, STOPPED)

    async def run(self, path: Path, sha256: str, runs: int, shapes: Mapping[str, Sequence[int]],
                  timeout: float = DEFAULT_TIMEOUT) -> Profile:
        if self._stopped:
            raise ProfileStopped()
        if self._busy:
            raise ProfileBusy("a profile is already running in this process; try again when it is done")
        self._busy = True
        try:  # let go only once the child is gone
            return await self._in_child(path, sha256, runs, shapes, timeout)
        finally:
            self._busy = False

    async def _in_child(self, path: Path, sha256: str, runs: int, shapes: Mapping[str, Sequence[int]],
                        timeout: float) -> Profile:
        ask = json.dumps({"path": str(path), "sha256": sha256, "runs": runs, "timeout": timeout, "parent": os.getpid(),
                          "shapes": {name: list(shape) for name, shape in shapes.items()}}).encode()
        pipe = asyncio.subprocess.PIPE
        try:
            proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "mnn_runtime.profile", stdin=pipe,
                                                        stdout=pipe, stderr=pipe, env=child_environment())
        except OSError as exc:
            raise ProfileError(f"cannot start the profiling process: {exc}") from None
        log.info("profiling %s: %d runs in process %d, time limit %g s", path, runs, proc.pid, timeout)
        why = "the caller stopped waiting"  # cancelled: the HTTP client went away
        self._child = proc
        try:
            if self._stopped:  # while it was being started
                why = STOPPED
                raise ProfileStopped()
            out, err = await asyncio.wait_for(proc.communicate(ask), timeout)
        except asyncio.TimeoutError:
            why = f"past its time limit of {timeout:g} s"
            raise ProfileTimeout(f"the profile ran past its time limit of {timeout:g} s (timeout={timeout:g}) and was "
                                 f"stopped: ask for fewer runs or a longer timeout (at most {MAX_TIMEOUT})") from None
        finally:
            self._child = None
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
                log.info("profiling process %d killed: %s", proc.pid, why)
        if self._stopped and proc.returncode != 0:  # killed by ``stop`` (one done as it came answers)
            raise ProfileStopped()
        try:
            answer = json.loads(out)
        except ValueError:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
            raise ProfileError(f"the profiling process exited with {proc.returncode}: {tail[0]}") from None
        if "profile" not in answer:
            raise (ModelFileChanged if answer["error"] == "changed" else ProfileError)(answer["message"])
        return Profile.from_dict(answer["profile"])


def _profile_unchanged(path: Path, sha256: str, runs: int, shapes: Mapping[str, Sequence[int]]) -> Profile:
    from .model import file_sha256

    if not path.is_file() or file_sha256(path) != sha256:
        raise ModelFileChanged(f"the file {str(path)!r} changed on disk since this version was loaded; "
                               "it would profile another model")
    return profile_model(path, runs, shapes)


def _exit_when_orphaned(parent: int, deadline: float) -> None:
    """The child's own stop, in case its parent could not kill it (the parent died, say)."""
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.2)
    os._exit(3)


def _child() -> int:
    """One profile asked as JSON on stdin, answered as JSON on stdout; at a lower CPU priority than
    the serving process's (``NICE`` more), which keeps the cores it competes for."""
    with contextlib.suppress(OSError):  # a profile runs all the same at the priority it has
        os.nice(NICE)
    ask = json.loads(sys.stdin.buffer.read())
    deadline = time.monotonic() + float(ask["timeout"]) + 5
    threading.Thread(target=_exit_when_orphaned, args=(ask["parent"], deadline), daemon=True).start()
    answer: dict[str, Any]
    try:
        with native_stdout_to_stderr():  # MNN prints to fd 1; keep it for the answer
            profile = _profile_unchanged(Path(ask["path"]), ask["sha256"], ask["runs"], ask["shapes"])
        answer = {"profile": profile.to_dict()}
    except ModelFileChanged as exc:
        answer = {"error": "changed", "message": exc.message}
    except ProfileError as exc:
        answer = {"error": "profile", "message": str(exc)}
    sys.stdout.write(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(_child())
