"""The control commands (rollout_operator/ctl.py) where no cluster answers: their errors, their
output and their arguments."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_operator.ctl import namespace_after_command

PLUGIN = str(Path(sys.executable).parent / "kubectl-mnn_rollout")


def plugin(tmp_path: Path, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``kubectl mnn-rollout ARGS`` outside a cluster, with an empty home and this KUBECONFIG."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(HOME=str(tmp_path), KUBECONFIG=str(kubeconfig))
    return subprocess.run([PLUGIN, *args], env=env, capture_output=True, text=True, timeout=60)


def test_with_no_kubernetes_configuration_the_plugin_says_so_in_one_line_and_exits_1(tmp_path: Path) -> None:
    for kubeconfig in (tmp_path / "missing", tmp_path):  # no file; a directory
        result = plugin(tmp_path, kubeconfig, "status", "foo")
        assert result.returncode == 1, result
        assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr  # before the fix: a traceback
        assert result.stderr.startswith("error: no Kubernetes configuration (KUBECONFIG or ~/.kube/config): ")


def test_an_unreachable_api_server_is_one_error_line_without_the_clients_retry_logs(tmp_path: Path) -> None:
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
contexts: [{{name: c, context: {{cluster: c, user: u}}}}]
users: [{{name: u, user: {{token: t}}}}]
current-context: c
""")
    result = plugin(tmp_path, kubeconfig, "status", "foo")
    assert result.returncode == 1, result
    assert "retrying" not in result.stderr and result.stderr.count("\n") == 1, result.stderr  # before: 4 INFO lines
    assert result.stderr.startswith("error: ") and "Connection refused" in result.stderr


@pytest.mark.parametrize(("argv", "expected"), [
    (["-n", "x", "status", "foo"], ["status", "-n", "x", "foo"]),
    (["--namespace", "x", "promote", "foo", "--full"], ["promote", "--namespace", "x", "foo", "--full"]),
    (["-nx", "abort", "foo"], ["abort", "-nx", "foo"]),
    (["--namespace=x", "list"], ["list", "--namespace=x"]),
    (["status", "foo", "-n", "x"], ["status", "foo", "-n", "x"]),  # already after it
    (["-h"], ["-h"]),  # another option first: the parser's to judge
    (["-n", "x", "-h", "status"], ["-n", "x", "-h", "status"]),
    (["-n", "x"], ["-n", "x"]),  # no subcommand
    (["-n"], ["-n"]),
])
def test_namespace_options_before_the_subcommand_are_moved_after_it(argv: list[str], expected: list[str]) -> None:
    assert namespace_after_command(argv) == expected
