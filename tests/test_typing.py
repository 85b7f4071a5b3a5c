"""The product code stays mypy clean: type hints everywhere, checked by mypy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_runtime_and_operator_are_mypy_clean() -> None:
    result = subprocess.run([sys.executable, "-m", "mypy", "runtime/mnn_runtime", "operator/rollout_operator"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
