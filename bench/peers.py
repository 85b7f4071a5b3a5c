"""Peer servers the benchmarks compare against, started on free loopback ports.

- MLServer 1.7.1 (in its own virtualenv, ``ROOT/.bench-venv/mlserver``, created on first use and
  kept; with ``uvloop==0.21.0`` pinned: with a newer uvloop its parallel workers crash at start)
  serving the ``.mnn`` file through the minimal custom runtime in
  ``bench/baselines/mlserver_mnn.py``, ``debug: false``.
- The plain FastAPI + pydantic app of ``bench/baselines/plain_fastapi.py`` under uvicorn.

Both answer ``POST /v2/models/scorer/infer`` like ``mnn-rollout serve``. Each ``start_*`` returns
``(Popen, base url)`` once the model answers ready; stop with :func:`stop`.

    .venv/bin/python bench/peers.py   # create the MLServer environment only
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from mnn_rollout.local.net import free_port
from mnn_rollout.local.process import cpu_seconds

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "bench" / "baselines"
MLSERVER_VENV = ROOT / ".bench-venv" / "mlserver"
MLSERVER_PACKAGES = ("mlserver==1.7.1", "uvloop==0.21.0", "MNN==3.6.1", "numpy")
MODEL_NAME = "scorer"


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (those alive now)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid] + [p for k in kids for p in tree(int(k))]


def pss_kb(pid: int) -> int:
    """Proportional set size of one process (shared pages split between their users), in kB."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_by_process(pid: int) -> dict[int, float]:
    """User + system CPU seconds used so far by ``pid`` and each of its live descendants."""
    out = {}
    for p in tree(pid):
        try:
            out[p] = cpu_seconds(p)
        except OSError:  # it exited meanwhile
            continue
    return out


def machine_busy_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: everything but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    guest = sum(fields[8:10]) if len(fields) > 9 else 0  # already counted in user and nice
    return (sum(fields) - idle - guest) / os.sysconf("SC_CLK_TCK")


def requests_total(url: str, outcome: str | None = None) -> float:
    """mnn-rollout's ``mnn_inference_requests_total`` over every version (of one outcome), read
    from its /metrics."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("mnn_inference_requests_total{") and (outcome is None or f'outcome="{outcome}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def mlserver_venv(quiet: bool = True) -> Path:
    """The MLServer virtualenv (created once; reused while its package pins are unchanged).
    Returns its ``mlserver`` executable."""
    stamp = MLSERVER_VENV / ".installed"
    exe = MLSERVER_VENV / "bin" / "mlserver"
    want = "\n".join(MLSERVER_PACKAGES) + "\n"
    if exe.exists() and stamp.exists() and stamp.read_text() == want:
        return exe
    base = getattr(sys, "_base_executable", sys.executable)  # not this venv's python: its base
    if not (MLSERVER_VENV / "bin" / "python").exists():
        subprocess.run([base, "-m", "venv", str(MLSERVER_VENV)], check=True)
    pip = [str(MLSERVER_VENV / "bin" / "python"), "-m", "pip", "install", *(["--quiet"] if quiet else [])]
    print(f"installing {' '.join(MLSERVER_PACKAGES)} into {MLSERVER_VENV} ...", file=sys.stderr, flush=True)
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, *MLSERVER_PACKAGES], check=True)
    stamp.write_text(want)
    return exe


def _wait_ready(proc: subprocess.Popen[bytes], url: str, what: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log}:\n{_tail(log)}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop(proc)
    raise RuntimeError(f"{what} was not ready within {timeout:g} s; see {log}:\n{_tail(log)}")


def _tail(log: Path, n: int = 30) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _popen(cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM the server's process group (its workers too), SIGKILL after ``timeout``."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # stragglers of the group (worker processes), whether or not the parent exited cleanly
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def start_mlserver(model_path: Path, parallel_workers: int, log: Path, name: str = MODEL_NAME,
                   versions: tuple[str, ...] = (), timeout: float = 120) -> tuple[subprocess.Popen[bytes], str]:
    """MLServer 1.7.1 serving ``model_path`` as model ``name`` (once per entry of ``versions``,
    as /v2/models/NAME/versions/V/infer, if any); HTTP, gRPC and metrics on free 127.0.0.1 ports,
    ``debug: false``. ``parallel_workers=0`` runs inference in the server process; N > 0 runs it
    in N worker processes, each loading every model."""
    exe = mlserver_venv()
    folder = Path(tempfile.mkdtemp(prefix="mlserver-", dir=log.parent))
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    settings = {
        "debug": False,
        "host": "127.0.0.1",
        "http_port": http_port,
        "grpc_port": grpc_port,
        "metrics_port": metrics_port,
        "parallel_workers": parallel_workers,
        "load_models_at_startup": True,
    }
    (folder / "settings.json").write_text(json.dumps(settings, indent=2))
    uri = str(Path(model_path).resolve())
    for version in versions or (None,):
        model_dir = folder / (f"{name}-{version}" if version else name)
        model_dir.mkdir()
        parameters = {"uri": uri, **({"version": version} if version else {})}
        model_settings = {"name": name, "implementation": "mlserver_mnn.MNNModel", "parameters": parameters}
        (model_dir / "model-settings.json").write_text(json.dumps(model_settings, indent=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLSERVER_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(PYTHONPATH=str(BASELINES), PYTHONUNBUFFERED="1")
    proc = _popen([str(exe), "start", str(folder)], env, log, cwd=folder)
    url = f"http://127.0.0.1:{http_port}"
    what = f"MLServer (parallel_workers={parallel_workers})"
    for version in versions or (None,):
        path = f"/v2/models/{name}/versions/{version}/ready" if version else f"/v2/models/{name}/ready"
        _wait_ready(proc, url + path, what, log, timeout)
    return proc, url


def start_fastapi(model_path: Path, workers: int, log: Path,
                  timeout: float = 60) -> tuple[subprocess.Popen[bytes], str]:
    """The plain FastAPI + pydantic baseline under uvicorn, one model copy per worker."""
    port = free_port()
    env = dict(os.environ, MODEL=str(model_path), PYTHONPATH=str(BASELINES), PYTHONUNBUFFERED="1")
    proc = _popen([sys.executable, "-m", "uvicorn", "plain_fastapi:app", "--host", "127.0.0.1", "--port", str(port),
                   "--workers", str(workers), "--log-level", "warning"], env, log)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url + "/docs", f"plain FastAPI ({workers} workers)", log, timeout)
    if workers > 1:
        time.sleep(1.0)  # the first worker answers while the others still import
    return proc, url


def start_floor(kind: str, workers: int, log: Path, timeout: float = 60) -> tuple[subprocess.Popen[bytes], str]:
    """A do-nothing HTTP responder (``kind`` "python": uvloop + httptools; "c": epoll in C), ``workers``
    processes on one port: the floor of any server's CPU per request (bench/baselines/floor_server.py)."""
    port = free_port()
    proc = _popen([sys.executable, str(BASELINES / "floor_server.py"), kind, str(port), str(workers)],
                  dict(os.environ), log)
    url = f"http://127.0.0.1:{port}"
    _wait_ready(proc, url + "/", f"HTTP floor ({kind}, {workers} workers)", log, timeout)
    if workers > 1:
        time.sleep(0.5)
    return proc, url


if __name__ == "__main__":
    print(mlserver_venv(quiet=False))
