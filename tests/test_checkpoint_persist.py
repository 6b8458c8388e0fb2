"""Daemon checkpoints persisted as plain DCP directories (issue 50, part 3): every N-th
step lands in `DIR/<step>/`, and a process that cannot import gradsync loads it with
plain `dcp.load` + `FileSystemReader`, bitwise equal to the state that was saved.

Real daemon, real torch ranks (tests/programs/dcp_daemon_persist.py); the plain
loader is tests/programs/dcp_plain_load.py under `python -S`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from cluster import free_ports

from conftest import PROGRAMS, DaemonProcess, assert_all_exited_0, collect, spawn_ranks

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

STEPS = 4


def train(daemon: DaemonProcess, job: str, directory: Path, *options: str) -> list[dict]:
    """Two ranks of the persisting training program; their last JSON records."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]),
           "OMP_NUM_THREADS": "1"}
    ranks = spawn_ranks(daemon.endpoint, "dcp_daemon_persist.py", 2,
                        [job, str(directory), str(STEPS), *options], job=f"torch-{job}", env=env)
    results = collect(ranks, 150)
    assert_all_exited_0(results)
    return [result.records()[-1] for result in results]


def plain_load(directory: Path, *options: str) -> dict:
    """The checkpoint in `directory`, loaded by plain DCP without gradsync (see the program)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("GRADSYNC", "PYTHON"))}
    env.update(TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-S", str(PROGRAMS / "dcp_plain_load.py"),
         sysconfig.get_paths()["purelib"], str(directory), *options],
        cwd=directory.parent, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    record: dict = json.loads(done.stdout.splitlines()[-1])
    assert record["gradsync_modules"] == [], record["gradsync_modules"]
    return record


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_every_second_step_persists_and_loads_with_plain_dcp_bitwise(
    daemon: DaemonProcess, tmp_path: Path, layout: str
) -> None:
    options = ["--fsdp"] if layout == "fsdp" else []
    records = train(daemon, f"persist-{layout}", tmp_path / "persisted", *options)
    for record in records:
        assert record["waited"] and record["daemon_equal"], record
        assert record["errors"] == [] and record["warnings"] == [], record
    coordinator = next(r for r in records if r["rank"] == 0)
    assert coordinator["persisted"] == [2, 4]
    assert sorted(p.name for p in (tmp_path / "persisted").iterdir()) == ["2", "4"]
    newest = tmp_path / "persisted" / "4"
    assert sorted(p.name for p in newest.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # no helper or temporary file is left
    loaded = plain_load(newest, *options)["state"]
    assert sorted(loaded) == sorted(coordinator["state"])
    differing = [k for k in loaded if loaded[k] != coordinator["state"][k]]
    assert differing == [], f"persisted step 4 differs from the trained state: {differing}"
    if layout == "ddp":
        assert records[0]["state"] == records[1]["state"]


@pytest.mark.timeout(300)
def test_an_unwritable_directory_warns_and_training_goes_on(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # mkdir under a file fails, even for root
    records = train(daemon, "persist-fails", blocker / "persisted")
    for record in records:
        assert record["waited"] and record["daemon_equal"], record
        assert record["persisted"] == [], record
        assert record["errors"], record
        for message in record["errors"] + record["warnings"]:
            assert str(blocker / "persisted") in message, message
        assert all(w.startswith("CheckpointPersistWarning: could not persist checkpoint step")
                   for w in record["warnings"]), record["warnings"]
        assert {e.split(" of job")[0] for e in record["errors"]} == {
            "could not persist checkpoint step 2", "could not persist checkpoint step 4"}
