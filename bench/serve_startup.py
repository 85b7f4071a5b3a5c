"""Start time and memory of one serving process: this checkout against an earlier revision.

Each round launches ``mnn-rollout serve --config FILE --workers 1`` (the runtime pod's process, one
worker so the figure is one interpreter) from each tree, times launch -> first 200 on
``/v2/health/ready``, and reads the process's RSS and PSS once ready. Rounds alternate between the
trees so both see the same machine load; medians and the after/before ratio are printed.

    .venv/bin/python bench/serve_startup.py --before 9692ef1 --rounds 7

``--before REV`` is extracted with ``git archive`` into a temp dir and run from its own sources
(PYTHONPATH), with the module path that revision used for its CLI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "common"))
sys.path.insert(0, str(ROOT / "runtime"))

from mnn_rollout.local.net import free_port  # noqa: E402
from mnn_runtime.examples import build_examples  # noqa: E402


def memory_kb(pid: int) -> tuple[int, int]:
    rss = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:")))
    pss = int(next(line.split()[1] for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
                   if line.startswith("Pss:")))
    return rss, pss


def launch(cmd: list[str], env: dict[str, str], port: int, timeout: float = 60.0) -> tuple[float, int, int]:
    started = time.perf_counter()
    proc = subprocess.Popen([*cmd, "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {timeout} s")
            time.sleep(0.005)
        seconds = time.perf_counter() - started
        rss, pss = memory_kb(proc.pid)
        return seconds, rss, pss
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def tree_of(rev: str, into: Path) -> Path:
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def command_for(tree: Path, config: Path) -> tuple[list[str], dict[str, str]]:
    """The serve command and environment that run ``tree``'s own sources."""
    folders = [tree / d for d in ("common", "runtime", "operator") if (tree / d).is_dir()]
    module = "mnn_rollout.cli" if (tree / "common" / "mnn_rollout" / "cli.py").exists() else "mnn_runtime.cli"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(f) for f in folders), PYTHONDONTWRITEBYTECODE="1")
    return ([sys.executable, "-m", module, "serve", "--config", str(config), "--workers", "1",
             "--log-level", "warning"], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=None, help="git revision to compare against (default: none)")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="serve-startup-") as tmp:
        root = Path(tmp)
        build_examples(root / "models")
        config = root / "runtime.yaml"
        config.write_text(yaml.safe_dump({"model": "scorer", "versions": [
            {"name": "v1", "uri": str(root / "models" / "v1.mnn")}]}))
        trees = {"after (this checkout)": ROOT}
        if args.before:
            trees = {f"before ({args.before})": tree_of(args.before, root / "before"), **trees}
        results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in trees}
        for name, tree in trees.items():  # one unmeasured launch each: warm the page cache
            launch(*command_for(tree, config), free_port())
        for _ in range(args.rounds):
            for name, tree in trees.items():
                results[name].append(launch(*command_for(tree, config), free_port()))
        print(f"serve --workers 1, one 8 MB version; median of {args.rounds} alternating rounds")
        print(f"{'tree':<28} {'start -> ready s':>17} {'RSS MB':>8} {'PSS MB':>8}")
        medians = {}
        for name, rows in results.items():
            s = statistics.median(r[0] for r in rows)
            rss = statistics.median(r[1] for r in rows) / 1024
            pss = statistics.median(r[2] for r in rows) / 1024
            medians[name] = (s, rss, pss)
            print(f"{name:<28} {s:>17.3f} {rss:>8.1f} {pss:>8.1f}")
        if len(medians) == 2:
            (b, a) = medians.values()
            print(f"after / before: start {a[0] / b[0]:.2f}x, RSS {a[1] / b[1]:.2f}x, PSS {a[2] / b[2]:.2f}x")


if __name__ == "__main__":
    main()
