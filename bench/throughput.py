"""Requests/s and p99 of mnn-rollout against MLServer, a plain FastAPI + pydantic app and raw MNN.

All in one run, the example scorer (v1), batch 1, closed loops at concurrency 1, 8 and 32 from a
load generator in another process on the same 2 cores:

- raw MNN: the in-process forward loop (the limit);
- mnn-rollout (`serve --grpc-port`): JSON and binary-extension bodies (wrk) and gRPC (a grpc.aio
  client process, one channel per caller), 1 and N workers;
- MLServer 1.7.1 with a minimal MNN runtime (bench/peers.py creates its virtualenv on first use),
  parallel_workers 0 (in-process) and N; JSON (wrk);
- the plain FastAPI + pydantic app, 1 and N uvicorn workers; JSON (wrk);
- the HTTP floor: do-nothing responders (one fixed answer per request; bench/baselines/floor_server.py),
  in Python on uvloop + httptools (what mnn-rollout's REST path is built on) and in C (epoll; skipped
  without ``cc``), 1 and N processes; what any server costs per request here before doing any work.

HTTP rows use wrk (one thread, c connections, X-User-Id rotated over 1,000 keys); every row's
non-2xx responses, socket errors and failed RPCs are counted, and a row with any is flagged. The
server's CPU (its whole process tree) and the generator's are printed beside each row. Then the
issue's targets at c=32, as ratios.

    .venv/bin/python bench/throughput.py [--seconds 3] [--workers N] [--rounds 3]

``--rounds R`` (default 3) measures c=32 R times per server and keeps the round with the median
requests/s (rounds of a few seconds differed by up to ~25%). mnn-rollout's servers (1 and N workers)
run side by side, and each of its c=32 rounds goes over every worker count and protocol in turn, so
the figures the targets compare (REST against gRPC, 1 against N workers) are measured within a minute
of each other. Each REST JSON round is followed by a one-second raw forward loop, and REST per core is
the median over the rounds of each round's figure against the loop run right after it. ``--seconds`` is rounded to whole
seconds for wrk. mnn-rollout rows also show the requests each worker process served (read from
its multiprocess metric files). Then (unless ``--no-open-loop``) latency at fixed rates (25, 50
and 75% of mnn-rollout's JSON maximum at c=32 with N workers; ``bench/openloop.py``): mnn-rollout
REST and gRPC with N workers, MLServer (parallel_workers=0, its best) REST at the same rates.

``--batching`` turns on dynamic batching for every version mnn-rollout serves (the runtime config's
``batching: {}``: Triton's defaults, at most 32 rows and no queue delay, so only requests already
waiting when a forward starts run in it). It is off by default, as it is for a user's versions: the
rows without it are the ones the issue's targets were set against.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from loadgen import H2LOAD, Measured, grpc_requests, run_grpc, run_h2load, run_wrk  # noqa: E402
from openloop import HEADER as OPEN_HEADER, OpenLoop, format_row, grpc_open_loop, http_open_loop  # noqa: E402
from peers import (cpu_by_process, machine_busy_seconds, requests_total, start_fastapi, start_floor,  # noqa: E402
                   start_mlserver, stop)
from runtime_overhead import raw_loop  # noqa: E402

from mnn_rollout.local.net import free_port  # noqa: E402
from mnn_rollout.local.process import LocalRuntime  # noqa: E402
from mnn_runtime.examples import FEATURES, build_examples  # noqa: E402
from mnn_runtime.model import LoadedModel  # noqa: E402

CONCURRENCY = (1, 8, 32)
KEYS = [f"user-{i}" for i in range(1000)]
INFER = "/v2/models/scorer/infer"
# By worker count, per c=32 round of mnn-rollout REST JSON: (its requests per server core-second, the
# raw forward loop's calls per core-second measured right after it)
RAW_BESIDE: dict[str, list[tuple[float, float]]] = {}
OTHER_LOAD = 0.25  # cores used by other processes during a run above which the run is called noisy


@dataclass
class Row:
    server: str  # "mnn-rollout", "MLServer", ...
    protocol: str  # "JSON", "binary", "gRPC", "in process"
    workers: str  # "1", "2", "pw=0", ...
    res: Measured
    server_cpu: float  # server CPU seconds per second of the run (its whole process tree)
    other_cpu: float = float("nan")  # the rest of the machine's busy CPU meanwhile (other processes)
    busiest_cpu: float = float("nan")  # of the server's processes, the busiest one's cores
    per_worker: tuple[int, ...] = ()  # mnn-rollout: successes each worker process served, most first

    @property
    def config(self) -> str:
        if self.workers.startswith("pw="):
            return f"parallel_workers={self.workers[3:]}"
        return f"{self.workers} worker{'s' if self.workers != '1' else ''}"

    @property
    def cpu_us_per_request(self) -> float:
        """Server CPU per request in µs (nan for the in-process row, which has no server)."""
        if not self.res.rps or self.protocol == "in process":
            return float("nan")
        return self.server_cpu / self.res.rps * 1e6

    @property
    def name(self) -> str:
        if self.protocol == "in process":
            return f"{self.server}, in process"
        return f"{self.server} {self.protocol}, {self.config}"


def json_bodies(n: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    return [json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES],
                                    "data": rng.random(FEATURES).round(6).tolist()}]}).encode() for _ in range(n)]


def binary_bodies(n: int = 64) -> tuple[list[bytes], int]:
    rng = np.random.default_rng(1)
    head = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, FEATURES],
                                   "parameters": {"binary_data_size": FEATURES * 4}}],
                       "parameters": {"binary_data_output": True}}).encode()
    return [head + rng.random(FEATURES, dtype=np.float32).tobytes() for _ in range(n)], len(head)


def grpc_bodies(n: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    return grpc_requests("scorer", [rng.random(FEATURES, dtype=np.float32).tobytes() for _ in range(n)], [1, FEATURES])


def own_cpu() -> float:
    """CPU seconds of this process and its finished children (wrk, the gRPC client process)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def worker_successes(metrics_root: Path | None) -> dict[int, float]:
    """Successful inferences per worker pid so far, from the multiprocess metric files that
    ``serve --workers`` writes under ``metrics_root`` (its TMPDIR)."""
    from prometheus_client.mmap_dict import MmapedDict

    out: dict[int, float] = {}
    for path in (metrics_root.glob("mnn-rollout-metrics-*/counter_*.db") if metrics_root else ()):
        pid = int(path.stem.rsplit("_", 1)[1])
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path)):
            _, sample, labels, *_ = json.loads(key)
            if sample == "mnn_inference_requests_total" and labels.get("outcome") == "success":
                out[pid] = out.get(pid, 0.0) + value
    return out


def measure(pid: int, load: Callable[[int], Measured], c: int, metrics_root: Path | None = None,
            ) -> tuple[Measured, float, float, float, tuple[int, ...]]:
    """One run of ``load`` at concurrency ``c``: (result, server cores, cores used by other processes,
    the busiest server process's cores, successes per worker)."""
    served0 = worker_successes(metrics_root)
    t0, procs0, busy0, own0 = time.perf_counter(), cpu_by_process(pid), machine_busy_seconds(), own_cpu()
    res = load(c)
    wall, procs = time.perf_counter() - t0, cpu_by_process(pid)
    served = worker_successes(metrics_root)
    shares = tuple(sorted((int(n - served0.get(p, 0.0)) for p, n in served.items()
                           if n > served0.get(p, 0.0)), reverse=True))
    used = {p: procs[p] - procs0.get(p, 0.0) for p in procs}
    server = sum(used.values())
    # own: this process and the generator (its start-up included)
    other = (machine_busy_seconds() - busy0 - server - (own_cpu() - own0)) / wall
    flag = f"  ERRORS: {res.detail}" if not res.ok else ""
    busy_note = f"  (other processes used {other:.2f} cores)" if other > OTHER_LOAD else ""
    per_worker = f"  per worker {'/'.join(map(str, shares))}" if len(shares) > 1 else ""
    print(f"    c={c:<3} {res.rps:>9.0f} req/s  p99 {res.p99:7.2f} ms  "
          f"{server / res.requests * 1e6 if res.requests else 0:6.1f} µs CPU/req{per_worker}{flag}{busy_note}",
          flush=True)
    return res, server / res.seconds, other, max(used.values(), default=0.0) / res.seconds, shares


def median_run(runs: list[tuple[Measured, float, float, float, tuple[int, ...]]],
               ) -> tuple[Measured, float, float, float, tuple[int, ...]]:
    """The run with the median requests/s."""
    return sorted(runs, key=lambda r: r[0].rps)[len(runs) // 2]


def sweep(pid: int, load: Callable[[int], Measured], rounds: int, metrics_root: Path | None = None,
          ) -> list[tuple[Measured, float, float, float, tuple[int, ...]]]:
    """Each concurrency once, except c=32 (where the targets are judged): ``rounds`` times, keeping
    the round with the median req/s. Returns ``measure``'s tuple per concurrency."""
    load(8)  # warm-up (connections, lazy imports, packed weights), not counted
    return [median_run([measure(pid, load, c, metrics_root) for _ in range(rounds if c == max(CONCURRENCY) else 1)])
            for c in CONCURRENCY]


def start_ours(root: Path, workers: int, grpc_port: int) -> tuple[LocalRuntime, Path]:
    """``serve --workers N --grpc-port P``, with a TMPDIR of its own (where its metric files go)."""
    metrics_root = Path(tempfile.mkdtemp(prefix=f"ours-{workers}-", dir=root))
    srv = LocalRuntime(root / "runtime.yaml", root / f"ours-{workers}.log",
                       extra_args=["--workers", str(workers), "--grpc-port", str(grpc_port)], stop_timeout=40,
                       log_in_errors=True)
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(metrics_root)  # read by the child at its start only
    try:
        srv.start()
    finally:
        if saved is None:
            del os.environ["TMPDIR"]
        else:
            os.environ["TMPDIR"] = saved
    return srv, metrics_root


def ours_loads(srv: LocalRuntime, grpc_port: int, args: argparse.Namespace) -> dict[str, Callable[[int], Measured]]:
    url = srv.url + INFER
    jb, (bb, head_len), gb = json_bodies(), binary_bodies(), grpc_bodies()
    loads: dict[str, Callable[[int], Measured]] = {
        "JSON": lambda c: run_wrk(url, jb, c, args.seconds, keys=KEYS),
        "binary": lambda c: run_wrk(url, bb, c, args.seconds, keys=KEYS,
                                    headers={"Inference-Header-Content-Length": str(head_len)}),
        "gRPC": lambda c: run_grpc(f"127.0.0.1:{grpc_port}", gb, c, args.seconds, keys=KEYS),
    }
    if H2LOAD is not None:  # the same calls from a generator in C: the Python client takes 0.6 cores
        loads["gRPC/h2load"] = lambda c: checked_h2load(srv.url, f"127.0.0.1:{grpc_port}", gb[0], c, args.seconds)
    return loads


def bench_ours(root: Path, counts: list[int], args: argparse.Namespace, rows: list[Row]) -> None:
    """mnn-rollout with each worker count, all started at once. c=1 and c=8 run once per (workers,
    protocol). The targets' figures (c=32) come from ``args.rounds`` rounds that each go over every
    (workers, protocol) in turn, REST JSON followed by the raw forward loop (kept in RAW_BESIDE); each
    keeps its median. Measured one after the other instead, figures the targets compare were minutes apart,
    and this host's speed drifts by tens of percent within minutes (the raw loop more than a served
    request: 37,000 to 59,000 calls/s within ten minutes of one run)."""
    servers: dict[int, tuple[LocalRuntime, Path, dict[str, Callable[[int], Measured]]]] = {}
    mine: list[Row] = []
    model = LoadedModel.load(root / "v1.mnn")  # the raw loop's, loaded once: its loops time calls only
    try:
        for w in counts:
            grpc_port = free_port()
            srv, metrics_root = start_ours(root, w, grpc_port)
            servers[w] = (srv, metrics_root, ours_loads(srv, grpc_port, args))
        if max(counts) > 1:
            time.sleep(1.0)  # the first worker answers ready while the others may still start
        top = max(CONCURRENCY)
        for w, (srv, metrics_root, loads) in servers.items():
            assert srv.proc is not None
            for protocol, load in loads.items():
                print(f"  {Row('mnn-rollout', protocol, str(w), Measured('', 0, 0, 0, 0, 0, 0), 0).name}", flush=True)
                load(8)  # warm-up (connections, lazy imports, packed weights), not counted
                for c in CONCURRENCY:
                    if c != top:
                        mine.append(Row("mnn-rollout", protocol, str(w), *measure(srv.proc.pid, load, c, metrics_root)))
        judged: dict[tuple[int, str], list[tuple[Measured, float, float, float, tuple[int, ...]]]] = {}
        for r in range(args.rounds):
            print(f"  round {r + 1} of {args.rounds} at c={top}, every worker count and protocol", flush=True)
            for w, (srv, metrics_root, loads) in servers.items():
                assert srv.proc is not None
                for protocol, load in loads.items():
                    print(f"   {Row('mnn-rollout', protocol, str(w), Measured('', 0, 0, 0, 0, 0, 0), 0).name}")
                    run = measure(srv.proc.pid, load, top, metrics_root)
                    judged.setdefault((w, protocol), []).append(run)
                    if protocol == "JSON":  # REST per core is judged against the raw loop run right after
                        raw = raw_loop(model, 1.0)[3]
                        if run[0].ok:  # a round with errors is not judged
                            RAW_BESIDE.setdefault(str(w), []).append((run[0].rps / max(run[1], 1e-9), raw))
                        print(f"    raw MNN forward loop right after: {raw:.0f} calls per core-second", flush=True)
        for (w, protocol), runs in judged.items():
            mine.append(Row("mnn-rollout", protocol, str(w), *median_run(runs)))
        for w, (srv, _, _) in servers.items():
            if not srv.alive():
                raise RuntimeError(f"mnn-rollout serve ({w} workers) exited during the run:\n{srv.log()}")
    finally:
        for srv, _, _ in servers.values():
            try:
                srv.stop()
            except Exception as exc:  # noqa: BLE001 - the other server is still stopped
                print(f"    could not stop {srv.url}: {exc}", flush=True)
        order = {p: i for i, p in enumerate(("JSON", "binary", "gRPC", "gRPC/h2load"))}
        rows.extend(sorted(mine, key=lambda r: (int(r.workers), order.get(r.protocol, 9), r.res.concurrency)))


def checked_h2load(url: str, target: str, message: bytes, c: int, seconds: float) -> Measured:
    """h2load, with every call it counted as done checked against the server's successes (gRPC
    errors travel in trailers, which h2load does not read)."""
    before = requests_total(url, "success")
    res = run_h2load(target, message, c, seconds, {"x-user-id": "u1"})
    missing = res.requests - int(requests_total(url, "success") - before)
    if missing > 0:
        res.errors += missing
        res.detail = (res.detail + "; " if res.detail else "") + f"{missing} calls not counted as successes by the server"
    return res


def bench_peer(name: str, label: str, start: Callable[[], tuple[subprocess.Popen[bytes], str]],
               args: argparse.Namespace, rows: list[Row]) -> None:
    print(f"  {Row(name, 'JSON', label, Measured('', 0, 0, 0, 0, 0, 0), 0).name}", flush=True)
    proc, url = start()
    try:
        jb = json_bodies()
        for res, cpu, other, busiest, _ in sweep(proc.pid, lambda c: run_wrk(url + INFER, jb, c, args.seconds,
                                                                             keys=KEYS), args.rounds):
            rows.append(Row(name, "JSON", label, res, cpu, other, busiest))
        if proc.poll() is not None:
            raise RuntimeError(f"{name} ({label}) exited during the run with {proc.returncode}")
    finally:
        stop(proc)


def find(rows: list[Row], server: str, protocol: str, workers: str, c: int = 32) -> Row | None:
    for r in rows:
        if (r.server, r.protocol, r.workers, r.res.concurrency) == (server, protocol, workers, c):
            return r
    return None


def verdict(ratio: float, target: float, *rows: Row | None) -> str:
    if any(r is None or not r.res.ok for r in rows):
        return "not judged: a row has errors"
    return "met" if ratio >= target else "MISSED"


def p99_verdict(ours: Row, other: Row) -> str:
    met = "no higher: met" if ours.res.p99 <= other.res.p99 else "higher: MISSED"
    return f"p99 {ours.res.p99:.1f} ms vs {other.res.p99:.1f} ms ({met})"


def report(rows: list[Row], n: int, failures: list[str]) -> None:
    def cores(v: float) -> str:
        return f"{v:8.2f}" if v == v else f"{'':>8}"

    print(f"\n{'server':<42} {'conc':>4} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'srv CPU':>8} {'busiest':>8} "
          f"{'gen CPU':>8} {'other':>8} {'µs/req':>7}  errors; per worker")
    for r in rows:
        errors = "-" if r.res.ok else f"FLAGGED {r.res.errors} ({r.res.detail})"
        shares = f"; {'/'.join(map(str, r.per_worker))}" if len(r.per_worker) > 1 else ""
        print(f"{r.name:<42} {r.res.concurrency:>4} {r.res.rps:>9.0f} {r.res.p50:>8.2f} {r.res.p99:>8.2f} "
              f"{cores(r.server_cpu)} {cores(r.busiest_cpu)} {cores(r.res.client_cpu)} {cores(r.other_cpu)} "
              f"{r.cpu_us_per_request:>7.0f}  {errors}{shares}")
    print("\n(cores used during the run: srv CPU by the server's process tree, busiest by its busiest process, "
          "gen CPU by the load generator, other by everything else; gRPC/h2load: p50 is h2load's mean, "
          "it reports no p99)")
    noisy = [r for r in rows if r.other_cpu > OTHER_LOAD]
    if noisy:
        print(f"WARNING: other processes used > {OTHER_LOAD} cores during {len(noisy)} row(s) "
              f"(max {max(r.other_cpu for r in noisy):.2f}): the machine was not quiet; rerun for figures to quote")

    print(f"\ntargets at concurrency 32 (N = {n}):")
    ours_json = [x for w in ("1", str(n)) if (x := find(rows, "mnn-rollout", "JSON", w))]
    mls = [x for w in ("pw=0", f"pw={n}") if (x := find(rows, "MLServer", "JSON", w))]
    if ours_json and mls:
        best, theirs = max(ours_json, key=lambda r: r.res.rps), max(mls, key=lambda r: r.res.rps)
        ratio = best.res.rps / theirs.res.rps
        print(f"  mnn-rollout JSON best ({best.config}) / MLServer best ({theirs.config}): {ratio:.2f}x "
              f"(target >= 4x: {verdict(ratio, 4, best, theirs)}); {p99_verdict(best, theirs)}")
        for each in ours_json:
            print(f"    {each.name} / MLServer best: {each.res.rps / theirs.res.rps:.2f}x; {p99_verdict(each, theirs)}")
    for w in ("1", str(n)) if n > 1 else ("1",):
        mine, plain = find(rows, "mnn-rollout", "JSON", w), find(rows, "plain FastAPI + pydantic", "JSON", w)
        if mine and plain:
            ratio = mine.res.rps / plain.res.rps
            print(f"  mnn-rollout JSON / plain FastAPI, {w} worker{'s' if w != '1' else ''} each: {ratio:.2f}x "
                  f"(target >= 2x: {verdict(ratio, 2, mine, plain)}); {p99_verdict(mine, plain)}")
    if n > 1:
        for protocol in ("JSON", "binary", "gRPC", "gRPC/h2load"):
            one, many = find(rows, "mnn-rollout", protocol, "1"), find(rows, "mnn-rollout", protocol, str(n))
            if one and many:
                ratio = many.res.rps / one.res.rps
                used = many.server_cpu + many.res.client_cpu
                note = (f"; server + generator used {used:.2f} of {os.cpu_count()} cores"
                        if used > 0.9 * (os.cpu_count() or 2) else "")
                if many.busiest_cpu > 0.8 * many.server_cpu:
                    note += f"; one worker did {many.busiest_cpu / many.server_cpu:.0%} of the server's work"
                print(f"  mnn-rollout {protocol}, {n} workers / 1 worker: {ratio:.2f}x "
                      f"(target >= 1.7x: {verdict(ratio, 1.7, one, many)}){note}")
    for w in sorted({"1", str(n)}, key=int):
        rest, grpc_ = find(rows, "mnn-rollout", "JSON", w), find(rows, "mnn-rollout", "gRPC/h2load", w)
        if rest and grpc_:
            ratio = grpc_.res.rps / rest.res.rps
            cost = (grpc_.server_cpu / grpc_.res.rps) / (rest.server_cpu / rest.res.rps)
            print(f"  mnn-rollout gRPC (h2load) / REST JSON (wrk), {w} worker{'s' if w != '1' else ''}: {ratio:.2f}x "
                  f"(target >= 1x: {verdict(ratio, 1.0, rest, grpc_)}); server CPU per call {cost:.2f}x REST's")
    if n > 1:
        ones = [find(rows, "mnn-rollout", p, "1") for p in ("JSON", "gRPC/h2load")]
        manys = [find(rows, "mnn-rollout", p, str(n)) for p in ("JSON", "gRPC/h2load")]
        if all(ones) and all(manys):
            rest_gain = manys[0].res.rps / ones[0].res.rps  # type: ignore[union-attr]
            grpc_gain = manys[1].res.rps / ones[1].res.rps  # type: ignore[union-attr]
            print(f"  mnn-rollout gRPC gain from 1 to {n} workers {grpc_gain:.2f}x, REST's {rest_gain:.2f}x "
                  f"(target gRPC >= REST: {verdict(grpc_gain / rest_gain, 1.0, *ones, *manys)}); "
                  f"gRPC per worker {'/'.join(map(str, manys[1].per_worker)) or '?'}")  # type: ignore[union-attr]
    for w in sorted({"1", str(n)}, key=int):
        rest, pairs = find(rows, "mnn-rollout", "JSON", w), RAW_BESIDE.get(w, [])
        if rest is None or not rest.server_cpu:
            continue
        if pairs:  # each round against the raw loop run right after it; the median round
            ratios = sorted(per_core / raw for per_core, raw in pairs)
            ratio = ratios[len(ratios) // 2]
            how = (f"median of {len(ratios)} rounds, each against the raw forward loop run right after it "
                   f"(rounds {ratios[0]:.1%}-{ratios[-1]:.1%}; raw loop "
                   f"{min(r for _, r in pairs):.0f}-{max(r for _, r in pairs):.0f} calls per core-second)")
        else:
            raw_rate = raw_calls_per_core(rows)
            if raw_rate is None:
                continue
            ratio = rest.res.rps / rest.server_cpu / raw_rate
            how = f"against the run's first raw forward loop, {raw_rate:.0f} calls per core-second"
        print(f"  mnn-rollout REST JSON per server core ({w} worker{'s' if w != '1' else ''}): {ratio:.1%} of the "
              f"raw forward loop's calls per core-second (target >= 10%: {verdict(ratio, 0.10, rest)}); {how}")
    floor_breakdown(rows, n)
    flagged = [r for r in rows if not r.res.ok]
    if flagged:
        print(f"\n{len(flagged)} row(s) had errors: " + "; ".join(f"{r.name} c={r.res.concurrency}: {r.res.detail}"
                                                            for r in flagged))
    for failure in failures:
        print(f"\nFAILED, no rows: {failure}")


def raw_calls_per_core(rows: list[Row]) -> float | None:
    """The raw forward loop's calls per CPU-second: the median of the loops run beside the c=32
    rounds (see bench_ours), else the run's first loop."""
    beside = sorted(raw for pairs in RAW_BESIDE.values() for _, raw in pairs)
    if beside:
        return beside[len(beside) // 2]
    raw = find(rows, "raw MNN forward loop", "in process", "1", 1)
    return raw.res.rps / max(raw.server_cpu, 1e-9) if raw is not None else None


def floor_breakdown(rows: list[Row], n: int) -> None:
    """Where a REST JSON request's server CPU goes at c=32: the floor (what a do-nothing responder
    costs here), the forward (the raw loop's cost per call), and the rest (mnn-rollout's own work)."""
    raw_rate = raw_calls_per_core(rows)
    if raw_rate is None:
        return
    forward = 1e6 / raw_rate
    for w in sorted({"1", str(n)}, key=int):
        rest = find(rows, "mnn-rollout", "JSON", w)
        floors = [(kind, f) for kind in ("C", "Python") if (f := find(rows, f"HTTP floor, {kind}", "JSON", w))]
        if rest is None or not floors:
            continue
        cost = rest.cpu_us_per_request
        parts = "; ".join(f"a do-nothing responder in {kind} {f.cpu_us_per_request:.0f} µs "
                          f"({f.res.rps:.0f} req/s)" for kind, f in floors)
        python_floor = dict(floors).get("Python")
        budget = ""
        if python_floor is not None:
            base = python_floor.cpu_us_per_request
            budget = (f"; above the Python floor: {cost - base:.0f} µs (the forward at the raw loop's speed "
                      f"{forward:.0f} µs); 10% of the raw loop allows {10 * forward:.0f} µs in all, "
                      f"{10 * forward - base:.0f} µs above that floor")
        print(f"  where a REST JSON request's {cost:.0f} µs go ({w} worker{'s' if w != '1' else ''}): "
              f"{parts}{budget}")


def batch_every_version(config: Path) -> None:
    """Dynamic batching on, with the runtime's defaults, for every version in ``config``."""
    spec = yaml.safe_load(config.read_text())
    for version in spec["versions"]:
        version["batching"] = {}
    config.write_text(yaml.safe_dump(spec))
    print("  mnn-rollout: every version batches (max_batch_size 32, max_queue_delay_microseconds 0)", flush=True)


def open_loop(root: Path, model: Path, n: int, rows: list[Row], seconds: float, given_max: float | None) -> None:
    """Latency at 25, 50 and 75% of mnn-rollout's JSON maximum (c=32, N workers; or ``given_max``):
    mnn-rollout REST and gRPC (interleaved at each rate), then MLServer (parallel_workers=0) REST."""
    base = find(rows, "mnn-rollout", "JSON", str(n))
    top = given_max or (base.res.rps if base is not None and base.res.ok else None)
    if top is None:
        print("\nopen loop: skipped (no mnn-rollout JSON row at c=32; --open-max gives one)")
        return
    rates = [round(top * share) for share in (0.25, 0.5, 0.75)]
    jb, message = json_bodies(), grpc_bodies()[0]
    results: list[tuple[str, OpenLoop]] = []
    print(f"\nopen loop at {rates} req/s (25/50/75% of {top:.0f}), {seconds:g} s each:", flush=True)
    grpc_port = free_port()
    srv, _ = start_ours(root, n, grpc_port)
    try:
        time.sleep(1.0)
        http_open_loop(srv.url + INFER, jb, rates[0], 1.0, KEYS)  # warm-up, not counted
        grpc_open_loop(f"127.0.0.1:{grpc_port}", message, rates[0], 1.0, {"x-user-id": "u1"})
        for rate in rates:
            for name, run in ((f"mnn-rollout REST JSON, {n} workers", lambda: http_open_loop(
                    srv.url + INFER, jb, rate, seconds, KEYS)),
                              (f"mnn-rollout gRPC, {n} workers", lambda: grpc_open_loop(
                                  f"127.0.0.1:{grpc_port}", message, rate, seconds, {"x-user-id": "u1"}))):
                results.append((name, run()))
                print("  " + format_row(name, results[-1][1]), flush=True)
    finally:
        srv.stop()
    try:
        proc, url = start_mlserver(model, 0, root / "mlserver-open.log")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"  MLServer: FAILED to start: {exc}")
        proc = None
    if proc is not None:
        try:
            http_open_loop(url + INFER, jb, rates[0], 1.0, KEYS)
            for rate in rates:
                results.append(("MLServer REST JSON, parallel_workers=0", http_open_loop(url + INFER, jb, rate, seconds,
                                                                                          KEYS)))
                print("  " + format_row(results[-1][0], results[-1][1]), flush=True)
        finally:
            stop(proc)
    print("\n" + OPEN_HEADER)
    for name, res in sorted(results, key=lambda item: (item[0], item[1].rate)):
        print(format_row(name, res))
    print("(latency from each request's due time: free of coordinated omission; 'late': the generator's worst "
          "delay; failed: errors, or no answer within 5 s of the end)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds at c=32 (median kept)")
    parser.add_argument("--only", default="raw,ours,mlserver,fastapi,floor",
                        help="comma-separated subset (development)")
    parser.add_argument("--open-seconds", type=float, default=5.0, help="seconds per open-loop rate")
    parser.add_argument("--no-open-loop", action="store_true", help="closed loops only")
    parser.add_argument("--open-max", type=float, default=None,
                        help="the maximum the open-loop rates are shares of (default: this run's JSON c=32 row)")
    parser.add_argument("--batching", action="store_true",
                        help="mnn-rollout's versions batch (max 32 rows, no queue delay)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    n = args.workers
    counts = sorted({1, n})
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_examples(root)
        model = root / "v1.mnn"
        if args.batching:
            batch_every_version(root / "runtime.yaml")
        if "raw" in only:
            busy = machine_busy_seconds()
            rps, p50, p99, per_cpu_second = raw_loop(model, args.seconds)
            cpu, busy = rps / per_cpu_second, (machine_busy_seconds() - busy) / args.seconds
            rows.append(Row("raw MNN forward loop", "in process", "1",
                            Measured("none", 1, args.seconds, int(rps * args.seconds), rps, p50, p99), cpu, busy - cpu))
            print(f"  raw MNN forward loop: {rps:.0f} calls/s", flush=True)
        failures: list[str] = []
        if "ours" in only:
            try:
                bench_ours(root, counts, args, rows)
            except (RuntimeError, subprocess.SubprocessError) as exc:
                failures.append(f"ours: {exc}")
                print(f"    FAILED: {exc}", flush=True)
        for w in counts:
            pw = 0 if w == 1 else w
            runs: list[tuple[str, Callable[[], None]]] = [
                ("mlserver", partial(bench_peer, "MLServer", f"pw={pw}",
                                     partial(start_mlserver, model, pw, root / f"mlserver-{pw}.log"), args, rows)),
                ("fastapi", partial(bench_peer, "plain FastAPI + pydantic", str(w),
                                    partial(start_fastapi, model, w, root / f"fastapi-{w}.log"), args, rows)),
                ("floor", partial(bench_peer, "HTTP floor, Python", str(w),
                                  partial(start_floor, "python", w, root / f"floor-python-{w}.log"), args, rows)),
            ]
            if shutil.which("cc"):
                runs.append(("floor", partial(bench_peer, "HTTP floor, C", str(w),
                                              partial(start_floor, "c", w, root / f"floor-c-{w}.log"), args, rows)))
            elif "floor" in only and w == counts[0]:
                print("  HTTP floor, C: skipped (no cc to build bench/baselines/floor.c)", flush=True)
            for key, run in runs:
                if key in only:
                    try:
                        run()
                    except (RuntimeError, subprocess.SubprocessError) as exc:  # a server that died or never started
                        failures.append(f"{key}, {w} worker(s): {exc}")
                        print(f"    FAILED: {exc}", flush=True)
        report(rows, n, failures)
        if not args.no_open_loop:
            open_loop(root, model, n, rows, args.open_seconds, args.open_max)
    print(f"\nwhole run: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
