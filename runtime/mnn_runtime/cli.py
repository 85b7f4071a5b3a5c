"""``mnn-rollout``: one console script, one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _cmd_serve(args: argparse.Namespace) -> int:
    from .config import ConfigError
    from .server import build_runtime, build_runtime_from_configmap, serve, serve_workers

    if bool(args.config) == bool(args.configmap):
        print("error: give exactly one of --config FILE or --configmap NAMESPACE/NAME", file=sys.stderr)
        return 2
    from .workers import usable_cpus

    if args.workers == "auto":
        workers = usable_cpus()
    else:
        try:
            workers = int(args.workers)
        except ValueError:
            workers = 0
        if workers < 1:
            print(f"error: --workers {args.workers!r}: must be a whole number of at least 1, or 'auto'",
                  file=sys.stderr)
            return 2

    def build():  # type: ignore[no-untyped-def]
        return build_runtime(Path(args.config)) if args.config else build_runtime_from_configmap(args.configmap)

    try:
        if workers > 1:
            return serve_workers(build, args.host, args.port, workers, log_level=args.log_level,
                                 grpc_port=args.grpc_port)
        runtime = build()
    except ConfigError as exc:
        print(f"error: {args.config or args.configmap}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    serve(runtime, args.host, args.port, log_level=args.log_level, grpc_port=args.grpc_port)
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from .convert import ConversionError, convert

    try:
        out = convert(args.src, args.dst, weight_bits=args.weight_bits)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _cmd_examples(args: argparse.Namespace) -> int:
    from .examples import build_examples

    sums = build_examples(args.dir, size=args.size)
    for name, sha in sums.items():
        print(f"{sha}  {Path(args.dir) / (name + '.mnn')}")
    print(f"wrote {Path(args.dir) / 'runtime.yaml'}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(scenario=args.scenario, step_seconds=args.step_seconds, workdir=args.workdir, rate=args.rate,
                    users=args.users, time_limit=args.time_limit)


def _cmd_operator(args: argparse.Namespace) -> int:
    from rollout_operator.runner import run

    return run(args)


def _cmd_ctl(args: argparse.Namespace) -> int:
    from rollout_operator.ctl import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mnn-rollout", description="Roll out new versions of MNN models safely."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="serve every version in a runtime config over OIP v2 REST")
    p.add_argument("--config", help="runtime config YAML file (followed for changes)")
    p.add_argument("--configmap", help="NAMESPACE/NAME of a ConfigMap holding runtime.yaml, followed "
                                       "through the Kubernetes API (in a pod)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind (default 8080)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve OIP v2 over gRPC on this port (same host; default: no gRPC)")
    p.add_argument("--workers", default="auto",
                   help="worker processes sharing one copy of the weights (forked after loading); default "
                        "'auto': the CPUs this process may use (its cgroup CPU limit, else its affinity)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("operator", help="run the Kubernetes operator (kopf) for ModelDeployments")
    from rollout_operator.runner import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_operator)

    p = sub.add_parser("convert", help="convert an ONNX model to MNN (safely, no telemetry)")
    p.add_argument("src", help="ONNX model file")
    p.add_argument("dst", help="MNN model file to write")
    p.add_argument("--weight-bits", type=int, default=None, help="store weights quantized to N bits (8)")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("examples", help="build the example scorer models and a runtime config")
    p.add_argument("dir", help="directory to write the models into")
    p.add_argument("--size", choices=["small", "large"], default="small",
                   help="'large' also builds a >=50 MB version for memory benchmarks")
    p.set_defaults(func=_cmd_examples)

    def _positive(text: str) -> float:
        value = float(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
        return value

    p = sub.add_parser("demo", help="a canary rollout with no cluster: the operator's state machine drives a "
                                     "local runtime while many users send traffic")
    p.add_argument("--scenario", choices=["promote", "breaking", "slow"], default="promote",
                   help="promote: healthy v2 is promoted (default); breaking: v2-breaking fails requests and is "
                        "rolled back; slow: v2-slow is a latency regression and is rolled back")
    p.add_argument("--step-seconds", type=_positive, default=5.0, help="pause of each step (default 5)")
    p.add_argument("--rate", type=_positive, default=300.0, help="requests/s of all users together (default 300)")
    p.add_argument("--users", type=lambda t: int(_positive(t)), default=2000, help="distinct user ids (default 2000)")
    p.add_argument("--time-limit", type=_positive, default=100.0,
                   help="give up on the rollout after this many seconds (default 100)")
    p.add_argument("--workdir", default=None, help="where to build models and write the runtime config "
                                                   "(default: a temp dir)")
    p.set_defaults(func=_cmd_demo)
    from rollout_operator.ctl import add_commands

    add_commands(sub)
    for name, p in sub.choices.items():
        if p.get_default("ctl"):
            p.set_defaults(func=_cmd_ctl)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
