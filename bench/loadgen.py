"""Load for the benchmarks: the project's traffic generator and external closed-loop drivers.

``run_load``: the closed loop of the project's one traffic generator
(``mnn_rollout.local.traffic.Traffic``, raw asyncio streams over keep-alive connections): cheaper
per request than any Python HTTP client library, but still Python: with 2 server workers on 2
cores it, not the server, became the limit (bench/RESULTS.md).
``run_wrk`` (wrk, C), ``run_h2load`` (h2load, C) and ``run_grpc`` (a grpc.aio client in its own
process) run the same closed loop for bench/throughput.py and report a :class:`Measured` with the
errors counted. Loopback targets only.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from mnn_rollout.local.net import require_loopback
from mnn_rollout.local.traffic import Traffic


@dataclass
class LoadResult:
    concurrency: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)  # status -> requests (0: no answer)

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.seconds

    def pct(self, q: float) -> float:
        return float(np.percentile(self.latencies, q) * 1000) if self.latencies else float("nan")


def run_load(url: str, bodies: list[bytes], concurrency: int, duration: float, keys: list[str] | None = None,
             max_requests: int = 2_000_000, headers: dict[str, str] | None = None) -> LoadResult:
    """Closed loop: ``concurrency`` connections each POST the next request to ``url`` when the last
    returns (``bodies`` in turn, X-User-Id rotated over ``keys``, ``headers`` on every request)."""
    traffic = Traffic(url, bodies=bodies, keys=keys or [], headers=headers, rate=None, connections=concurrency,
                      max_seconds=duration, max_requests=max_requests, retry_pause=0).run()
    return LoadResult(concurrency, traffic.elapsed, [s.latency for s in traffic.samples()],
                      dict(traffic.statuses()))


# -- the same closed loop with cheaper generators: wrk for HTTP, a gRPC client process ----------

WRK = "wrk"
_TIME_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


@dataclass
class Measured:
    """One closed-loop run, whichever generator made it. Latencies in milliseconds."""

    tool: str
    concurrency: int
    seconds: float
    requests: int
    rps: float
    p50: float
    p99: float
    errors: int = 0  # non-2xx responses, socket errors, failed RPCs
    detail: str = ""  # what the errors were
    client_cpu: float = float("nan")  # the generator's CPU seconds per second of the run (1.0 = a core)

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.requests > 0


def measured(res: LoadResult) -> Measured:
    """A ``run_load`` result as a :class:`Measured`."""
    bad = {s: n for s, n in res.statuses.items() if not 200 <= s < 300}
    return Measured("python", res.concurrency, res.seconds, len(res.latencies), res.rps, res.pct(50), res.pct(99),
                    sum(bad.values()), ", ".join(f"HTTP {s}: {n}" for s, n in sorted(bad.items())))


def _lua_string(b: bytes) -> str:
    return '"' + "".join(chr(c) if 32 <= c < 127 and c not in (34, 92) else f"\\{c}" for c in b) + '"'


def wrk_script(url: str, body_files: list[Path], headers: dict[str, str], keys: list[str] | None) -> str:
    """A wrk Lua script: POST, requests pre-formatted in ``init`` (body i mod bodies, X-User-Id i mod
    keys), then handed out in turn."""
    u = urlparse(url)
    n = max(len(body_files), len(keys or [])) if keys else len(body_files)
    head = "".join(f"  h[{_lua_string(k.encode())}] = {_lua_string(v.encode())}\n" for k, v in headers.items())
    files = ", ".join(_lua_string(str(p).encode()) for p in body_files)
    key_list = ", ".join(_lua_string(k.encode()) for k in keys or [])
    return f"""
local files = {{{files}}}
local keys = {{{key_list}}}
local reqs, next_i, count = {{}}, 0, {n}
function init(args)
  local bodies = {{}}
  for i, f in ipairs(files) do
    local fh = assert(io.open(f, "rb")); bodies[i] = fh:read("*a"); fh:close()
  end
  for i = 0, count - 1 do
    local h = {{}}
    h["Host"] = "{u.hostname}:{u.port}"
{head}    if #keys > 0 then h["X-User-Id"] = keys[(i % #keys) + 1] end
    reqs[i] = wrk.format("POST", {_lua_string(u.path.encode())}, h, bodies[(i % #bodies) + 1])
  end
end
function request()
  local r = reqs[next_i]
  next_i = (next_i + 1) % count
  return r
end
"""


def parse_wrk(text: str, concurrency: int) -> Measured:
    def ms(value: str) -> float:
        m = re.fullmatch(r"([\d.]+)([a-z]+)", value)
        assert m, value
        return float(m.group(1)) * _TIME_UNITS[m.group(2)]

    pct = {int(m.group(1)): ms(m.group(2)) for m in re.finditer(r"^\s+(\d+)%\s+([\d.]+[a-z]+)\s*$", text, re.M)}
    done = re.search(r"^\s*(\d+) requests in ([\d.]+[a-z]+)", text, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M)
    if not (done and rps and 99 in pct):
        raise RuntimeError(f"cannot parse wrk's output:\n{text}")
    errors, detail = 0, []
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    if non2xx:
        errors += int(non2xx.group(1))
        detail.append(f"non-2xx: {non2xx.group(1)}")
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if sock:
        counts = dict(zip(("connect", "read", "write", "timeout"), map(int, sock.groups())))
        errors += sum(counts.values())
        detail += [f"socket {k}: {v}" for k, v in counts.items() if v]
    return Measured("wrk", concurrency, ms(done.group(2)) / 1000, int(done.group(1)), float(rps.group(1)),
                    pct.get(50, float("nan")), pct[99], errors, ", ".join(detail))


def run_wrk(url: str, bodies: list[bytes], concurrency: int, seconds: float, headers: dict[str, str] | None = None,
            keys: list[str] | None = None, timeout: float = 5.0) -> Measured:
    """Closed loop with wrk (one thread, ``concurrency`` keep-alive connections, whole seconds),
    POSTing ``bodies`` in turn with ``headers`` (Content-Type defaults to JSON) and X-User-Id
    rotated over ``keys``."""
    require_loopback(urlparse(url).hostname or "")
    duration = max(1, round(seconds))
    with tempfile.TemporaryDirectory(prefix="wrk-") as tmp:
        files = []
        for i, body in enumerate(bodies):
            files.append(Path(tmp) / f"body{i}")
            files[-1].write_bytes(body)
        script = Path(tmp) / "post.lua"
        script.write_text(wrk_script(url, files, {"Content-Type": "application/json", **(headers or {})}, keys))
        before = _children_cpu()
        out = subprocess.run([WRK, "-t1", f"-c{concurrency}", f"-d{duration}s", f"--timeout={timeout:g}s",
                              "--latency", "-s", str(script), url],
                             capture_output=True, text=True, timeout=duration + timeout + 30)
    if out.returncode != 0:
        raise RuntimeError(f"wrk exited with {out.returncode}:\n{out.stdout}\n{out.stderr}")
    res = parse_wrk(out.stdout, concurrency)
    res.client_cpu = (_children_cpu() - before) / res.seconds
    return res


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


# gRPC: a closed loop of `concurrency` callers, each on its own channel (its own connection, so
# that the supervisor deals them out over the workers), requests pre-serialized.

GRPC_INFER = "/inference.GRPCInferenceService/ModelInfer"


def grpc_requests(model: str, tensors: list[bytes], shape: list[int], name: str = "features",
                  datatype: str = "FP32") -> list[bytes]:
    """Serialized ModelInferRequests carrying each tensor as ``raw_input_contents`` (as tritonclient does)."""
    from mnn_runtime.grpc_v2 import grpc_predict_v2_pb2 as pb

    return [pb.ModelInferRequest(model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(
        name=name, datatype=datatype, shape=shape)], raw_input_contents=[t]).SerializeToString() for t in tensors]


async def _grpc_run(target: str, requests: list[bytes], concurrency: int, duration: float,
                    keys: list[str] | None) -> Measured:
    import grpc

    from mnn_runtime.grpc_v2 import grpc_predict_v2_pb2 as pb

    latencies: list[float] = []
    codes: dict[str, int] = {}
    sample: list[bytes] = []
    metadata = [(("x-user-id", k),) for k in keys] if keys else [()]
    # One channel (one connection) per caller: fewer channels cost the client the same per request
    # (measured: 1, 2, 8 or 32 channels at c=32) but may land every connection on one worker.
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(concurrency)]
    for ch in channels:
        await asyncio.wait_for(ch.channel_ready(), 10)
    stop_at = time.perf_counter() + duration

    async def caller(i: int, ch: grpc.aio.Channel) -> None:
        call = ch.unary_unary(GRPC_INFER)  # bytes in, bytes out
        n = i
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            try:
                reply = await call(requests[n % len(requests)], metadata=metadata[n % len(metadata)], timeout=10)
                if not sample:
                    sample.append(reply)
                latencies.append(time.perf_counter() - started)
            except grpc.aio.AioRpcError as exc:
                codes[exc.code().name] = codes.get(exc.code().name, 0) + 1
                latencies.append(time.perf_counter() - started)
            n += concurrency

    started, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(caller(i, ch) for i, ch in enumerate(channels)))
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    for ch in channels:
        await ch.close()
    if sample and not pb.ModelInferResponse.FromString(sample[0]).raw_output_contents:
        codes["OK without outputs"] = 1
    arr = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return Measured("grpc.aio", concurrency, seconds, len(latencies), len(latencies) / seconds,
                    float(np.percentile(arr, 50)), float(np.percentile(arr, 99)), sum(codes.values()),
                    ", ".join(f"{k}: {v}" for k, v in sorted(codes.items())), cpu / seconds)


def run_grpc(target: str, requests: list[bytes], concurrency: int, seconds: float,
             keys: list[str] | None = None) -> Measured:
    """The gRPC closed loop in a fresh interpreter (another process, like wrk), bounded in time."""
    require_loopback(target.rsplit(":", 1)[0])
    with tempfile.TemporaryDirectory(prefix="grpcload-") as tmp:
        req_file = Path(tmp) / "requests.json"
        req_file.write_text(json.dumps({"requests": [r.hex() for r in requests], "keys": keys or []}))
        out = subprocess.run([sys.executable, __file__, "grpc", target, str(req_file), str(concurrency), str(seconds)],
                             capture_output=True, text=True, timeout=seconds + 60)
    if out.returncode != 0:
        raise RuntimeError(f"the gRPC load generator exited with {out.returncode}:\n{out.stderr}")
    return Measured(**json.loads(out.stdout.strip().splitlines()[-1]))


H2LOAD = shutil.which("h2load")  # Debian's nghttp2-client: HTTP/2 load in C, as wrk is for HTTP/1.1


def run_h2load(target: str, message: bytes, concurrency: int, seconds: float,
               metadata: dict[str, str] | None = None) -> Measured:
    """Closed loop of unary ModelInfer calls with h2load (one connection per caller, one call in
    flight on each). h2load sees HTTP statuses, not gRPC's: the caller checks the server's own
    count of successes. It reports no percentiles: p50 holds its mean and p99 is NaN."""
    require_loopback(target.rsplit(":", 1)[0])
    assert H2LOAD is not None, "h2load is not installed (apt-get install nghttp2-client)"
    duration = max(1, round(seconds))
    with tempfile.TemporaryDirectory(prefix="h2load-") as tmp:
        body = Path(tmp) / "message"
        body.write_bytes(b"\x00" + len(message).to_bytes(4, "big") + message)  # gRPC length-prefixed
        headers = {"content-type": "application/grpc", "te": "trailers", **(metadata or {})}
        before = _children_cpu()
        out = subprocess.run([H2LOAD, "-D", str(duration), "-c", str(concurrency), "-m", "1", "-t", "1",
                              *[a for k, v in headers.items() for a in ("-H", f"{k}: {v}")],
                              "-d", str(body), f"http://{target}{GRPC_INFER}"],
                             capture_output=True, text=True, timeout=duration + 60)
    if out.returncode != 0:
        raise RuntimeError(f"h2load exited with {out.returncode}:\n{out.stdout}\n{out.stderr}")
    done = re.search(r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored",
                     out.stdout)
    rate = re.search(r"finished in ([\d.]+)s, ([\d.]+) req/s", out.stdout)
    mean = re.search(r"time for request:\s+\S+\s+\S+\s+([\d.]+)(us|ms|s)", out.stdout)
    if not (done and rate and mean):
        raise RuntimeError(f"cannot read h2load's output:\n{out.stdout}")
    failed = int(done[4]) + int(done[5])
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[mean[2]]
    res = Measured("h2load", concurrency, float(rate[1]), int(done[3]), float(rate[2]), float(mean[1]) * scale,
                   float("nan"), failed, f"{failed} HTTP/2 failures" if failed else "")
    res.client_cpu = (_children_cpu() - before) / res.seconds
    return res


def _grpc_main(argv: list[str]) -> None:
    target, req_file, concurrency, seconds = argv
    spec = json.loads(Path(req_file).read_text())
    res = asyncio.run(_grpc_run(target, [bytes.fromhex(r) for r in spec["requests"]], int(concurrency),
                                float(seconds), spec["keys"] or None))
    print(json.dumps(res.__dict__))


if __name__ == "__main__":
    if sys.argv[1:2] == ["grpc"]:
        _grpc_main(sys.argv[2:])
    else:
        sys.exit("usage: loadgen.py grpc TARGET REQUESTS.json CONCURRENCY SECONDS")
