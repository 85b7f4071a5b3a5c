"""The ``mnn-rollout`` console script: help, convert, examples, serve errors and the demo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mnn_rollout.contract.config import load_config_file
from mnn_runtime.model import LoadedModel, file_sha256

CLI = [sys.executable, "-m", "mnn_rollout.cli"]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("sub", ["serve", "convert", "examples", "demo"])
def test_every_subcommand_has_help(sub: str) -> None:
    r = run(sub, "--help")
    assert r.returncode == 0 and "usage: mnn-rollout " + sub in r.stdout


def test_the_top_level_help_lists_the_subcommands() -> None:
    r = run("--help")
    assert r.returncode == 0
    for sub in ("serve", "convert", "examples", "demo"):
        assert sub in r.stdout


def test_convert_writes_a_loadable_model_and_int8_is_smaller(tmp_path: Path) -> None:
    import onnx

    from mnn_runtime.examples import EXAMPLES, scorer_onnx

    src = tmp_path / "v1.onnx"
    onnx.save(scorer_onnx(EXAMPLES[0]), src)
    assert run("convert", str(src), str(tmp_path / "fp32.mnn")).returncode == 0
    assert run("convert", str(src), str(tmp_path / "int8.mnn"), "--weight-bits", "8").returncode == 0
    assert LoadedModel.load(tmp_path / "fp32.mnn").inputs[0].shape == (-1, 64)
    assert (tmp_path / "int8.mnn").stat().st_size * 3 < (tmp_path / "fp32.mnn").stat().st_size


def test_convert_fails_clearly_on_a_non_model_and_keeps_the_old_output(tmp_path: Path, examples_dir: Path) -> None:
    src = tmp_path / "notes.onnx"
    src.write_text("not a model")
    dst = tmp_path / "v1.mnn"
    dst.write_bytes((examples_dir / "v1.mnn").read_bytes())
    before = file_sha256(dst)
    r = run("convert", str(src), str(dst))
    assert r.returncode == 1
    assert "notes.onnx" in r.stderr and "produced no model" in r.stderr
    assert file_sha256(dst) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.onnx", "v1.mnn"]


def test_convert_names_a_missing_source(tmp_path: Path) -> None:
    r = run("convert", str(tmp_path / "absent.onnx"), str(tmp_path / "x.mnn"))
    assert r.returncode == 1 and "absent.onnx' does not exist" in r.stderr


def test_examples_records_every_sha256_and_a_runtime_config(examples_dir: Path) -> None:
    sums = dict(line.split("  ")[::-1] for line in (examples_dir / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {"v1.mnn", "v2.mnn", "v2-breaking.mnn", "v2-slow.mnn"}
    for name, sha in sums.items():
        assert file_sha256(examples_dir / name) == sha
    config = load_config_file(examples_dir / "runtime.yaml")
    assert config.effective_weights() == {"v1": 90, "v2": 10}
    assert all(v.sha256 == sums[v.uri] for v in config.versions)


def test_serve_refuses_an_invalid_config_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "runtime.yaml"
    bad.write_text("model: scorer\nversions: [{name: v1, uri: v1.mnn}]\nweights: {v1: 120}\n")
    r = run("serve", "--config", str(bad), "--port", "0", timeout=60)
    assert r.returncode == 2
    assert "weights.v1: 120 is outside 0-100" in r.stderr
