"""``mnn-rollout``: one console script, one subcommand per job, each imported only when it runs.

The parser is built for the one subcommand on the command line: ``mnn-rollout serve`` (every
runtime pod) imports the runtime and never kopf, the Kubernetes client or the operator;
``mnn-rollout operator`` imports the operator and never MNN. The top-level ``--help`` lists every
subcommand from the table below without importing either side.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Command:
    help: str
    arguments: str  # "module:function", called as function(parser, command) to add the arguments
    run: str  # "module:function", called as function(args) -> exit code


def _resolve(target: str) -> Callable[..., Any]:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]


CTL_COMMANDS = {
    "status": "show a rollout as a tree; --watch follows it",
    "promote": "move the canary to its next step (--full: straight to 100%%)",
    "abort": "roll the canary back to stable now",
    "retry": "restart a rolled-back canary from its first step",
    "pause": "freeze the rollout at its current weights (spec.paused)",
    "resume": "continue a paused rollout",
    "list": "list ModelDeployments and their rollout state",
}
COMMANDS: dict[str, Command] = {
    "serve": Command("serve every version in a runtime config over OIP v2 REST (and gRPC)",
                     f"{__name__}:_serve_arguments", f"{__name__}:_cmd_serve"),
    "operator": Command("run the Kubernetes operator (kopf) for ModelDeployments",
                        "rollout_operator.runner:add_arguments", "rollout_operator.runner:run"),
    "convert": Command("convert an ONNX model to MNN (safely, no telemetry)",
                       f"{__name__}:_convert_arguments", f"{__name__}:_cmd_convert"),
    "examples": Command("build the example scorer models and a runtime config",
                        f"{__name__}:_examples_arguments", f"{__name__}:_cmd_examples"),
    "profile": Command("time each operator of an MNN model against a plain forward (MNN session callbacks)",
                       f"{__name__}:_profile_arguments", f"{__name__}:_cmd_profile"),
    "demo": Command("a canary rollout with no cluster: the operator's reconcile loop drives a local runtime "
                    "while many users send traffic",
                    "mnn_rollout.demo.scenarios:add_arguments", "mnn_rollout.demo.scenarios:run_from_args"),
    **{name: Command(text, "rollout_operator.ctl:add_arguments", "rollout_operator.ctl:run")
       for name, text in CTL_COMMANDS.items()},
}


# -- the runtime's subcommands -----------------------------------------------------------------


def _serve_arguments(p: argparse.ArgumentParser, command: str) -> None:
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
    p.add_argument("--admin-token-file", metavar="PATH", default=None,
                   help="enable the admin endpoints (GET /v2/models/M/versions/V/profile) for requests with "
                        "'Authorization: Bearer TOKEN', TOKEN read from this file at start (default: "
                        "$MNN_ROLLOUT_ADMIN_TOKEN if set, else disabled)")
    p.add_argument("--feedback-token-file", metavar="PATH", default=None,
                   help="enable POST /v2/models/M/feedback for requests with 'Authorization: Bearer TOKEN', "
                        "TOKEN read from this file at start (default: $MNN_ROLLOUT_FEEDBACK_TOKEN if set, "
                        "else disabled)")


def _token(path: str | None, flag: str, env: str) -> str | None:
    """The token in the file a ``--*-token-file`` flag names, else in the environment variable
    ``env`` (surrounding whitespace removed; None: neither given); raises ValueError naming the flag
    or the variable when it cannot be used."""
    if path is None:
        return _checked_token(os.environ.get(env), env)
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path!r}: cannot be read: {exc}") from None
    return _checked_token(token, f"{flag} {path!r}")


def _checked_token(token: str | None, where: str) -> str | None:
    """``token`` (None: none given); raises ValueError naming ``where`` when it cannot be a bearer token."""
    if token is None:
        return None
    token = token.strip()
    if not token or not (token.isascii() and token.isprintable()) or " " in token:
        raise ValueError(f"{where}: must hold one token of printable ASCII without spaces")
    return token


def _cmd_serve(args: argparse.Namespace) -> int:
    from mnn_rollout.contract.config import ADMIN_TOKEN_ENV, FEEDBACK_TOKEN_ENV, ConfigError
    from mnn_runtime.server import (build_runtime, build_runtime_from_configmap, raise_open_files_limit, serve,
                                    serve_workers)
    from mnn_runtime.workers_cpus import usable_cpus

    if bool(args.config) == bool(args.configmap):
        print("error: give exactly one of --config FILE or --configmap NAMESPACE/NAME", file=sys.stderr)
        return 2
    try:
        token = _token(args.admin_token_file, "--admin-token-file", ADMIN_TOKEN_ENV)
        feedback_token = _token(args.feedback_token_file, "--feedback-token-file", FEEDBACK_TOKEN_ENV)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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

    raise_open_files_limit()  # a descriptor per connection: take what the hard limit allows

    def build():  # type: ignore[no-untyped-def]
        if args.config:
            return build_runtime(Path(args.config), admin_token=token, feedback_token=feedback_token)
        return build_runtime_from_configmap(args.configmap, admin_token=token, feedback_token=feedback_token)

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


def _convert_arguments(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("src", help="ONNX model file")
    p.add_argument("dst", help="MNN model file to write")
    p.add_argument("--weight-bits", type=int, default=None, help="store weights quantized to N bits (8)")


def _cmd_convert(args: argparse.Namespace) -> int:
    from mnn_runtime.convert import ConversionError, convert

    try:
        out = convert(args.src, args.dst, weight_bits=args.weight_bits)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _examples_arguments(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("dir", help="directory to write the models into")
    p.add_argument("--size", choices=["small", "large"], default="small",
                   help="'large' also builds a >=50 MB version for memory benchmarks")


def _cmd_examples(args: argparse.Namespace) -> int:
    from mnn_runtime.examples import build_examples

    sums = build_examples(args.dir, size=args.size)
    for name, sha in sums.items():
        print(f"{sha}  {Path(args.dir) / (name + '.mnn')}")
    print(f"wrote {Path(args.dir) / 'runtime.yaml'}")
    return 0


def _profile_arguments(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("file", metavar="FILE", help="the .mnn model file")
    p.add_argument("--runs", default="10", help="runs to average over (default 10)")
    p.add_argument("--shape", action="append", default=[], metavar="NAME=D,D,...",
                   help="an input's shape (repeat per input); needed for inputs with open dimensions "
                        "other than the batch; default: the declared shape at batch 1")
    p.add_argument("--json", action="store_true",
                   help='print {"total_ms", "forward_ms", "ops": [{"name", "type", "ms", "share", "mflops"}]}')


def _cmd_profile(args: argparse.Namespace) -> int:
    import json

    from mnn_runtime.profile import ProfileError, native_stdout_to_stderr, parse_shape, profile_model

    try:
        runs = int(args.runs)
    except ValueError:
        runs = 0
    try:
        if runs < 1:
            raise ProfileError(f"--runs {args.runs!r}: must be a whole number of at least 1")
        shapes: dict[str, tuple[int, ...]] = {}
        for text in args.shape:
            name, shape = parse_shape(text)
            if name in shapes:
                raise ProfileError(f"--shape {text!r}: input {name!r} is given twice")
            shapes[name] = shape
        path = Path(args.file)
        if not path.is_file():
            raise ProfileError(f"FILE {args.file!r}: {'is not a file' if path.exists() else 'no such file'}")
        with native_stdout_to_stderr():  # MNN prints to stdout; keep it for the result
            profile = profile_model(path, runs, shapes)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(profile.as_dict()) if args.json else profile.table(path.name))
    return 0


# -- the parser ----------------------------------------------------------------------------------


def build_parser(command: str | None = None, prog: str = "mnn-rollout",
                 commands: dict[str, Command] | None = None) -> argparse.ArgumentParser:
    """The parser with the arguments of ``command`` only (its module is imported); every other
    subcommand is listed with its help."""
    table = COMMANDS if commands is None else commands
    parser = argparse.ArgumentParser(prog=prog, description="Roll out new versions of MNN models safely.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in table.items():
        p = sub.add_parser(name, help=cmd.help)
        if name == command:
            _resolve(cmd.arguments)(p, name)
            p.set_defaults(run=cmd.run)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand: the first argument that is not an option (there are no top-level options)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None, prog: str = "mnn-rollout", commands: dict[str, Command] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    table = COMMANDS if commands is None else commands
    command = _command_of(argv)
    args = build_parser(command if command in table else None, prog, table).parse_args(argv)
    return int(_resolve(args.run)(args))


def plugin_main(argv: list[str] | None = None) -> int:
    """``kubectl mnn-rollout ...`` (the console script kubectl-mnn_rollout): the control commands,
    with ``-n NAMESPACE`` before the command too, as kubectl takes it."""
    from rollout_operator.ctl import namespace_after_command

    table = {name: cmd for name, cmd in COMMANDS.items() if name in CTL_COMMANDS}
    return main(namespace_after_command(sys.argv[1:] if argv is None else argv), prog="kubectl mnn-rollout",
                commands=table)


if __name__ == "__main__":
    sys.exit(main())
