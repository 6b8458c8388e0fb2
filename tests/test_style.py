"""House style: `ruff check .` and `mypy` (configured in pyproject.toml) pass.

Both run as subprocesses from the repository root, exactly as a developer
would run them; a tool that is not installed skips its test with the reason.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_tool(module: str, *args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[dev]')")
    try:
        return subprocess.run(
            [sys.executable, "-m", module, *args], cwd=REPO, stdin=subprocess.DEVNULL,
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{module} took longer than {timeout_s}s") from None


@pytest.mark.timeout(120)
def test_ruff_check_passes() -> None:
    result = run_tool("ruff", "check", ".", timeout_s=100)
    assert result.returncode == 0, f"ruff check . found problems:\n{result.stdout}{result.stderr}"


@pytest.mark.timeout(600)
def test_mypy_passes() -> None:
    result = run_tool("mypy", timeout_s=580)
    assert result.returncode == 0, f"mypy found problems:\n{result.stdout}{result.stderr}"
