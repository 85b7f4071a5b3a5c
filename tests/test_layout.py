"""One of each local-run helper: one ``free_port``, one ``wait_for``, one traffic generator, all in
``common/mnn_rollout/local/``; and the benchmarks import no test module (what they share with the
tests, the emulator, the kubelet stand-in, the test cluster and the Prometheus stack, is in
``testbed/``)."""

from __future__ import annotations

import ast
import functools
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / "common" / "mnn_rollout" / "local"
SKIP = {"build", "dist", "node_modules", "__pycache__"}
# a class named like a load generator: Traffic, Load, HotLoad, LoadGen, FailureClock, ...
GENERATOR_NAME = re.compile(r"(?i).*(traffic|load|loadgen|loadgenerator|clock)")
@functools.cache
def python_files() -> list[Path]:
    """The repository's own Python files: no virtualenv, no hidden or build directory."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if not (d.startswith(".") or d in SKIP or d.endswith(".egg-info")))
        found += [Path(folder) / f for f in sorted(files) if f.endswith(".py")]
    return found


@functools.cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def definitions(kinds: tuple[type[ast.AST], ...], name: str | re.Pattern[str]) -> list[tuple[str, int, str]]:
    """(file, line, name) of every definition of these kinds whose name is ``name`` (or matches it)."""
    found = []
    for path in python_files():
        for node in ast.walk(tree(path)):
            defined = getattr(node, "name", None)
            if isinstance(node, kinds) and isinstance(defined, str) and (
                    defined == name if isinstance(name, str) else name.fullmatch(defined)):
                found.append((str(path.relative_to(ROOT)), getattr(node, "lineno", 0), defined))
    return found


def imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(tree(path)):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_repository_files_are_found() -> None:
    files = python_files()
    assert LOCAL / "net.py" in files and ROOT / "bench" / "loadgen.py" in files
    assert not any(".venv" in p.parts for p in files)


@pytest.mark.parametrize("name", ["free_port", "wait_for"])
def test_one_definition_of_each_helper(name: str) -> None:
    found = definitions((ast.FunctionDef, ast.AsyncFunctionDef), name)
    assert [file for file, _, _ in found] == ["common/mnn_rollout/local/net.py"], found


def test_one_traffic_generator() -> None:
    classes = definitions((ast.ClassDef,), GENERATOR_NAME)
    assert [(file, name) for file, _, name in classes] == [("common/mnn_rollout/local/traffic.py", "Traffic")], classes
    # and no other module speaks HTTP over raw asyncio streams (the stand-in's Service proxy
    # opens them to forward TCP bytes, not to speak HTTP)
    proxy = ROOT / "testbed" / "k8s" / "kubelet_services.py"
    raw = [str(p.relative_to(ROOT)) for p in python_files() if p not in (LOCAL / "traffic.py", proxy)
           and any(isinstance(n, ast.Attribute) and n.attr == "open_connection" for n in ast.walk(tree(p)))]
    assert raw == []


@pytest.mark.parametrize("path", sorted((ROOT / "bench").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_bench_imports_no_test_module(path: Path) -> None:
    tests = sorted(m for m in imported_modules(path) if m == "tests" or m.startswith("tests."))
    assert tests == []


def test_the_test_bed_imports_no_test_module() -> None:
    found = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m == "tests" or m.startswith("tests."))
             for p in (ROOT / "testbed").rglob("*.py")}
    assert "testbed/k8s/emulator.py" in found and not any(found.values()), found
