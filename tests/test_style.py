"""House style: `ruff check .` and `mypy` (configured in pyproject.toml) pass;
the core imports nothing above it, no event loop and no clock; no function
under daemon/ is longer than 60 lines.

The tools run as subprocesses from the repository root, exactly as a developer
would run them; a tool that is not installed skips its test with the reason.
"""

from __future__ import annotations

import ast
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


#: Layers the daemon's core must not import (DESIGN.md, "Rules of the layout"):
#: what it needs from them, it names as a Protocol of its own (core/interfaces.py).
ABOVE_THE_CORE = ("gradsync.daemon.run", "gradsync.daemon.io", "gradsync.daemon.peers")


def imported_from(source: str, packages: tuple[str, ...]) -> list[str]:
    """Every module `source` imports from `packages` (or below them), including
    imports under `if TYPE_CHECKING:` (a type the core borrows is still a tie)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [name for name in names
                  if any(name == top or name.startswith(top + ".") for top in packages)]
    return found


def imports_from_above(source: str) -> list[str]:
    """Every module `source` imports from the layers above the core."""
    return imported_from(source, ABOVE_THE_CORE)


def test_the_layering_check_sees_an_upward_import() -> None:
    source = ("from typing import TYPE_CHECKING\nimport gradsync.daemon.core.plans\n"
              "if TYPE_CHECKING:\n    from gradsync.daemon.run.executor import ScheduleRun\n"
              "import gradsync.daemon.peers.links\n")
    assert sorted(imports_from_above(source)) == ["gradsync.daemon.peers.links",
                                                  "gradsync.daemon.run.executor"]


def test_the_core_imports_nothing_above_it() -> None:
    offenders = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "daemon" / "core").glob("*.py"))
        if (found := imports_from_above(path.read_text()))
    }
    assert not offenders, f"daemon/core imports from run/, io/ or peers/: {offenders}"


#: What the core must not touch (DESIGN.md): an event loop, sockets, or a clock
#: of its own (time is an input: an injected clock).
NOT_IN_THE_CORE = ("asyncio", "socket", "selectors", "time", "datetime", "uvloop", "zmq")


def loop_socket_or_clock(source: str) -> list[str]:
    """Every import of `source` from NOT_IN_THE_CORE, including under TYPE_CHECKING."""
    return imported_from(source, NOT_IN_THE_CORE)


def test_the_loop_and_clock_check_sees_them() -> None:
    source = ("import asyncio\nfrom time import monotonic\nimport timeit\n"
              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import zmq.asyncio\n")
    assert sorted(loop_socket_or_clock(source)) == ["asyncio", "time", "zmq.asyncio"]


def test_the_core_has_no_event_loop_socket_or_clock() -> None:
    offenders = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "daemon" / "core").glob("*.py"))
        if (found := loop_socket_or_clock(path.read_text()))
    }
    assert not offenders, (
        f"daemon/core imports an event loop, sockets or a clock: {offenders}; settle an "
        "Outcome (core/outcome.py) and take time from an injected clock instead")


#: The longest a function under daemon/ may be, in lines (its def to its last line).
LONGEST_FUNCTION = 60


def long_functions(source: str, limit: int = LONGEST_FUNCTION) -> list[str]:
    """`name (lines)` of every function of `source` longer than `limit` lines."""
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None and node.end_lineno - node.lineno + 1 > limit
    ]


def test_the_length_check_sees_a_long_function() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    assert long_functions(f"def short():\n    pass\n\nasync def long():\n{body}") == [
        "long (61)"]


def test_no_function_under_the_daemon_is_longer_than_60_lines() -> None:
    offenders = {
        str(path.relative_to(REPO)): found
        for path in sorted((REPO / "daemon").rglob("*.py"))
        if (found := long_functions(path.read_text()))
    }
    assert not offenders, f"split these into named steps: {offenders}"
