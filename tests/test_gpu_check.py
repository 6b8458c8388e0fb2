"""benchmarks.gpu_check, the GPU check of issue 7, as far as a CPU machine goes.

On a GPU machine it is run through the device tool; here: without cupy it
refuses at once and clearly, and its `--host` mode runs the same plumbing
(private daemon, rank processes, killed ranks, reports) on host buffers.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: Run as its README says: a module of the benchmarks package, from the repository root.
COMMAND = [sys.executable, "-m", "benchmarks.gpu_check"]


@pytest.mark.timeout(60)
@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed")
def test_without_cupy_it_refuses_at_once(short_tmp: str) -> None:
    result = subprocess.run([*COMMAND, "--out", short_tmp], cwd=REPO,
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 2, result
    assert "needs cupy and an NVIDIA GPU" in result.stdout + result.stderr


@pytest.mark.timeout(240)
def test_host_mode_runs_every_phase_and_reports(short_tmp: str) -> None:
    out = Path(short_tmp) / "out"
    result = subprocess.run([*COMMAND, "--host", "--out", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    checks = json.loads((out / "gpu_check.json").read_text())["checks"]
    assert all(check["status"] == "pass" for check in checks), checks
    names = " | ".join(check["name"] for check in checks)
    for phase in ("all_reduce matrix, 4 ranks", "collectives", "DDP float32",
                  "rank killed after submit", "serves a new job",
                  "no shared-memory segment left"):
        assert phase in names, names
    assert "all_reduce matrix" in (out / "gpu_check.md").read_text()
