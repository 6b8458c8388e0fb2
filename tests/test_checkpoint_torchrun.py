"""Checkpoints in daemon memory under torchrun (issue 50): a rank SIGKILLed mid-step is
restarted by `torchrun --max-restarts` and the group resumes from the daemon's newest
complete checkpoint; then both ranks are SIGKILLed, and a new torchrun resumes again.
The run ends bitwise equal to one that was never interrupted.

Real daemon, real torchrun (its elastic agent restarts the workers), real torch DDP
ranks (tests/programs/dcp_daemon_train.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_checkpoints import STEPS, daemon_stats, train

from conftest import PROGRAMS, DaemonProcess

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

JOB = "torchrun"


def torchrun(daemon: DaemonProcess, out: Path, max_restarts: int,
             *options: str) -> subprocess.CompletedProcess[str]:
    """Two ranks of the training program under torchrun, on `daemon`."""
    out.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")},
           "GRADSYNC_DAEMON": daemon.endpoint, "GRADSYNC_JOB": f"torch-{JOB}",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
         str(PROGRAMS / "dcp_daemon_train.py"), JOB, str(STEPS), "--resume-if-any",
         "--out", str(out), *options],
        env=env, capture_output=True, text=True, timeout=300)


def complete_steps(daemon: DaemonProcess) -> list[int]:
    held: list[dict[str, Any]] = daemon_stats(daemon)["checkpoints"][JOB]  # type: ignore[index]
    return [c["step"] for c in held if c["complete"]]


@pytest.mark.fault
@pytest.mark.timeout(600)
def test_torchrun_restarts_a_killed_rank_then_both_and_training_ends_bitwise(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    truth = train(daemon, "truth")[0]
    # Attempt 0: rank 1 dies in step 2 (steps 0 and 1 are saved); torchrun restarts
    # both ranks, which resume from step 1; attempt 1: both die in step 4.
    first = torchrun(daemon, tmp_path / "first", 1, "--die-mid-step", "2",
                     "--all-die-mid-step", "4", "--all-die-attempt", "1")
    assert first.returncode != 0, "both ranks of the restarted group were meant to die"
    assert sorted(p.name for p in (tmp_path / "first").iterdir()) == [
        f"attempt-{attempt}-rank-{rank}.started" for attempt in (0, 1) for rank in (0, 1)
    ], f"two attempts, no rank finished:\n{first.stderr[-4000:]}"
    # The restarted group saved steps 2 and 3 after resuming from 1: the newest two.
    assert complete_steps(daemon) == [3, 2], daemon_stats(daemon)["checkpoints"]
    # A new torchrun (the node's trainers gone, the daemon not): it resumes from 3.
    second = torchrun(daemon, tmp_path / "second", 0)
    assert second.returncode == 0, f"{second.stdout[-3000:]}\n{second.stderr[-6000:]}"
    for rank in range(2):
        record = json.loads((tmp_path / "second" / f"rank-{rank}.json").read_text())
        assert record["resumed_from"] == 3, record
        assert record["params"] == truth["params"], (
            f"rank {rank}: resumed training differs from the uninterrupted one")
        assert [c["step"] for c in record["checkpoints"]] == [5, 4], record
    daemon.assert_alive()
