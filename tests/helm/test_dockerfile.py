"""The Dockerfile, checked without a container engine: parsed instruction by instruction (a small
parser below; no new dependency), and every command the image, the chart and the operator run is a
real `mnn-rollout` subcommand whose flags its parser accepts."""

from __future__ import annotations

import argparse
import fnmatch
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helm.chart import NON_DEFAULT, ROOT, render

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
MNN_ROLLOUT = Path(sys.executable).with_name("mnn-rollout")
COMPILERS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|cc|libc6-dev|python3-dev)\b")
EXAMPLE_PREFIX = "file:///opt/mnn-rollout/examples/"


@dataclass
class Instruction:
    cmd: str
    args: str
    line: int

    def json_or_shell(self) -> list[str]:
        text = self.args.strip()
        return list(json.loads(text)) if text.startswith("[") else ["/bin/sh", "-c", text]


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def of(self, cmd: str) -> list[Instruction]:
        return [i for i in self.instructions if i.cmd == cmd]


def parse_dockerfile(text: str) -> list[Stage]:
    """Instructions with line continuations joined, comments and parser directives dropped."""
    logical: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):  # comment lines inside a continuation are skipped
            continue
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        logical.append((start, buf + stripped))
        buf = ""
    assert not buf, "the Dockerfile ends inside a line continuation"
    stages: list[Stage] = []
    for number, line in logical:
        cmd, _, args = line.partition(" ")
        cmd = cmd.upper()
        if cmd == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.IGNORECASE)
            assert m, f"line {number}: FROM {args}"
            stages.append(Stage(m.group(1), m.group(2)))
        else:
            assert stages, f"line {number}: {cmd} before FROM"
            stages[-1].instructions.append(Instruction(cmd, args.strip(), number))
    return stages


def copy_parts(instr: Instruction) -> tuple[dict[str, str], list[str], str]:
    words = instr.json_or_shell() if instr.args.startswith("[") else shlex.split(instr.args)
    flags = {}
    while words and words[0].startswith("--"):
        key, _, value = words.pop(0)[2:].partition("=")
        flags[key] = value
    return flags, words[:-1], words[-1]


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule, simplified: the last matching pattern wins; a match on a parent directory
    excludes everything below it."""
    parts = Path(path).parts
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        for i in range(1, len(parts) + 1):
            candidate = "/".join(parts[:i])
            if fnmatch.fnmatch(candidate, pat) or (pat.startswith("**/") and fnmatch.fnmatch(candidate, pat[3:])) \
                    or (pat.startswith("**/") and fnmatch.fnmatch(parts[i - 1], pat[3:])):
                excluded = not negate
                break
    return excluded


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())


def test_multi_stage_with_pinned_bases(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    names = set()
    for stage in stages:
        if stage.base in names:  # FROM an earlier stage
            pass
        else:
            image, _, tag = stage.base.partition(":")
            assert "@sha256:" in stage.base or re.fullmatch(r"\d+\.\d+\.\d+[-.\w]*", tag), \
                f"base image {stage.base} is not pinned to a full version"
            assert "latest" not in tag
            assert "$" not in stage.base, "bases must be literal (pinned) image references"
        if stage.name:
            names.add(stage.name)
    # the builder and the final stage use the same base, so the copied venv's interpreter matches
    assert stages[0].base == stages[-1].base


def test_final_stage_has_no_compilers_and_runs_as_numeric_non_root(stages: list[Stage]) -> None:
    from rollout_operator.children import RUNTIME_UID

    final = stages[-1]
    for instr in final.of("RUN"):
        assert not COMPILERS.search(instr.args), f"line {instr.line}: the final stage installs a compiler"
    builder_runs = " ".join(i.args for s in stages[:-1] for i in s.of("RUN"))
    assert "build-essential" in builder_runs  # compilers live in the builder only
    users = final.of("USER")
    assert users, "the final stage sets no USER (it would run as root)"
    user = users[-1].args
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user} is not numeric"
    uid = int(user.split(":")[0])
    assert uid != 0 and uid == RUNTIME_UID
    # only the venv and the example models are copied from the other stages
    copied = [copy_parts(i) for i in final.of("COPY")]
    assert all(flags.get("from") for flags, _, _ in copied)
    sources = [s for _, srcs, _ in copied for s in srcs]
    assert "/opt/venv" in sources
    assert not [s for s in sources if s.startswith(("/usr", "/src", "/root"))]


def test_entrypoint_is_mnn_rollout_and_env_suits_a_read_only_root(stages: list[Stage]) -> None:
    final = stages[-1]
    (entry,) = final.of("ENTRYPOINT")
    assert json.loads(entry.args) == ["mnn-rollout"]
    env = " ".join(i.args for i in final.of("ENV"))
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "HOME=/tmp" in env and "PATH=/opt/venv/bin:$PATH" in env
    builder_runs = " ".join(i.args for s in stages[:-1] for i in s.of("RUN"))
    assert "compileall" in builder_runs  # bytecode is written at build time, never at run time


def test_every_copy_source_exists_or_comes_from_a_named_stage(stages: list[Stage]) -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    names = [s.name for s in stages if s.name]
    for index, stage in enumerate(stages):
        for instr in stage.of("COPY") + stage.of("ADD"):
            flags, sources, _ = copy_parts(instr)
            if "from" in flags:
                assert flags["from"] in names[:index + 1] and flags["from"] != stage.name, \
                    f"line {instr.line}: --from={flags['from']} is not an earlier stage"
                continue
            for src in sources:
                assert (ROOT / src).exists(), f"line {instr.line}: {src} does not exist"
                assert not dockerignored(src.rstrip("/"), patterns), f"line {instr.line}: {src} is in .dockerignore"


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = [p.strip() for p in DOCKERIGNORE.read_text().splitlines() if p.strip() and not p.startswith("#")]
    for path in (".venv", ".git", "tests", "testbed", "bench", "runtime/mnn_runtime/__pycache__", ".pytest_cache",
                 ".mypy_cache", "mnn_rollout.egg-info"):
        assert dockerignored(path, patterns), path
    for path in ("pyproject.toml", "README.md", "common/mnn_rollout/cli.py", "operator/rollout_operator/main.py"):
        assert not dockerignored(path, patterns), path


def test_example_models_are_built_in_the_builder_and_baked_where_the_examples_point(stages: list[Stage]) -> None:
    from mnn_runtime.examples import EXAMPLES

    runs = [(s, i) for s in stages[:-1] for i in s.of("RUN")]
    build = [i for _, i in runs if "mnn-rollout examples" in i.args]
    assert build, "no stage runs `mnn-rollout examples`"
    target = re.search(r"mnn-rollout examples (\S+)", build[0].args).group(1)  # type: ignore[union-attr]
    assert '.[dev]' in build[0].args  # onnx comes with the `dev` extra
    copied = [copy_parts(i) for i in stages[-1].of("COPY")]
    model_copy = next((srcs, dst) for flags, srcs, dst in copied if any(s.startswith(target) for s in srcs))
    srcs, dst = model_copy
    assert sorted(srcs) == sorted([f"{target}/*.mnn", f"{target}/SHA256SUMS"])  # only the models + sums
    assert dst.rstrip("/") == target == EXAMPLE_PREFIX[len("file://"):].rstrip("/")
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        for uri in re.findall(r"file://\S+", example.read_text()):
            name = uri[len(EXAMPLE_PREFIX):]
            assert uri.startswith(EXAMPLE_PREFIX) and name.endswith(".mnn"), (example.name, uri)
            assert name[:-4] in {e.name for e in EXAMPLES}, f"{example.name}: {uri} is not built"


def _parser(command: str) -> argparse.ArgumentParser:
    from mnn_rollout.cli import build_parser

    return build_parser(command)


@pytest.mark.parametrize("sub", ["operator", "serve", "examples"])
def test_the_image_commands_are_real_subcommands(sub: str) -> None:
    assert MNN_ROLLOUT.exists(), f"{MNN_ROLLOUT}: install the project into this venv"
    out = subprocess.run([str(MNN_ROLLOUT), sub, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"usage: mnn-rollout {sub}" in out.stdout


@pytest.mark.parametrize("values", [{}, NON_DEFAULT, {"webhook": {"enabled": False}, "replicas": 1,
                                                       "peering": {"enabled": False}}])
def test_every_flag_the_chart_passes_is_accepted_by_the_operator(values: dict[str, Any]) -> None:
    from rollout_operator.runner import add_arguments

    container = render(values).operator_container
    assert container["command"] == ["mnn-rollout"]
    args = container["args"]
    assert args[0] == "operator"
    parser = argparse.ArgumentParser(prog="mnn-rollout operator", exit_on_error=False)
    add_arguments(parser)
    parsed, unknown = parser.parse_known_args(args[1:])
    assert unknown == [], f"flags the operator does not know: {unknown}"
    full = _parser(args[0]).parse_args(args)  # and through the real console script's parser
    assert full.command == "operator"
    assert parsed.metrics_port == container["ports"][0]["containerPort"]
    assert parsed.namespace == values.get("watchNamespaces", [])
    if parsed.webhook_port:
        assert parsed.webhook_token_file.startswith("/etc/mnn-rollout/webhook/")


def test_the_operator_listens_on_loopback_unless_told_and_the_chart_tells_it_to_listen_on_the_pod_ip(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_operator.runner import add_arguments

    for name in ("MNN_ROLLOUT_METRICS_HOST", "MNN_ROLLOUT_WEBHOOK_HOST"):
        monkeypatch.delenv(name, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    assert (defaults.metrics_host, defaults.webhook_host) == ("127.0.0.1", "127.0.0.1")  # like serve's --host
    chart = parser.parse_args(render({}).operator_container["args"][1:])  # Prometheus and Alertmanager reach it
    assert (chart.metrics_host, chart.webhook_host) == ("0.0.0.0", "0.0.0.0")


def test_the_runtime_pods_command_is_accepted_by_serve() -> None:
    from rollout_operator import children
    from rollout_operator.spec import parse_spec

    manifest = yaml.safe_load((ROOT / "examples/scorer.yaml").read_text())
    spec = parse_spec(manifest["spec"])
    config = children.runtime_config(spec, "scorer", {"v1": 100, "v2": 0}, "v1", ["v1", "v2"])
    container = children.render_deployment(children.Target("scorer", "default"), spec, config)[
        "spec"]["template"]["spec"]["containers"][0]
    stages = parse_dockerfile(DOCKERFILE.read_text())
    assert container["command"] == json.loads(stages[-1].of("ENTRYPOINT")[0].args)
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    parsed = _parser(args[0]).parse_args(args)
    assert parsed.command == "serve" and parsed.configmap == "default/scorer-routing"
