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

from gradsync.client.torch.checkpoint_persist import CheckpointPersistWarning, Persister

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
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "async"])
def test_every_second_step_persists_and_loads_with_plain_dcp_bitwise(
    daemon: DaemonProcess, tmp_path: Path, layout: str
) -> None:
    options = {"ddp": [], "fsdp": ["--fsdp"], "async": ["--async"]}[layout]
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
    loaded = plain_load(newest, *[o for o in options if o == "--fsdp"])["state"]
    assert sorted(loaded) == sorted(coordinator["state"])
    differing = [k for k in loaded if loaded[k] != coordinator["state"][k]]
    assert differing == [], f"persisted step 4 differs from the trained state: {differing}"
    assert any(key.startswith("optim.state.") for key in loaded), sorted(loaded)
    assert loaded["step"].endswith(" 0400000000000000"), loaded["step"]  # int64 4
    if layout != "fsdp":
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


# -- the persister alone: no daemon, one process --------------------------------


def persist_in_process(directory: Path, state: dict, step: int, world: int = 1) -> Persister:
    """What DaemonStorageWriter does for rank 0 of `world`, with an anonymous mapping
    standing for the daemon segment."""
    import mmap

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from gradsync.client.torch.checkpoint import _copy_in, _payloads

    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    plans, metadata = planner.create_global_plan([planner.create_local_plan()])
    plan = planner.finish_plan(plans[0])
    payloads, size = _payloads(plan, planner)
    mapping = mmap.mmap(-1, max(size, 1))
    results = _copy_in(mapping, payloads, 0)
    persister = Persister(directory, 1, 0.5, "units")
    persister.prepare(step, world)
    held = [(p[0], r.storage_data) for p, r in zip(payloads, results, strict=True)]
    persister.write_rank(step, 0, held, mapping)
    persister.write_metadata(step, metadata, world)
    return persister


@pytest.mark.timeout(60)
def test_the_persisted_format_is_torchs_own(tmp_path: Path) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
             "empty": torch.zeros(0, 5), "half": torch.ones(7, dtype=torch.bfloat16),
             "extra": {"lr": 0.5, "name": "adam"}}
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / ".metadata").write_bytes(b"an older save of step 3")
    persister = persist_in_process(tmp_path, state, 3)
    assert persister.wait(30) and persister.errors == [] and persister.persisted == [3]
    target = {"w": torch.zeros(3, 4), "empty": torch.ones(0, 5),
              "half": torch.zeros(7, dtype=torch.bfloat16), "extra": {"lr": 0.0, "name": ""}}
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "3"), no_dist=True)
    assert all(torch.equal(target[k], state[k]) for k in ("w", "empty", "half"))
    assert target["extra"] == state["extra"]


@pytest.mark.timeout(60)
def test_a_rank_that_never_writes_is_a_warning_after_the_deadline(tmp_path: Path) -> None:
    import torch

    with pytest.warns(CheckpointPersistWarning) as caught:
        persister = persist_in_process(tmp_path, {"w": torch.ones(4)}, 6, world=2)
        assert persister.wait(30)
    step = tmp_path / "6"
    assert persister.errors == [str(w.message) for w in caught]
    assert persister.errors == [
        f"could not persist checkpoint step 6 of job 'units' to {step}: TimeoutError: rank 1's "
        "items were not written within 0.5 s (persist_timeout_s) (the checkpoint in daemon "
        "memory is unaffected)"]
    assert not (step / ".metadata").exists() and persister.persisted == []


@pytest.mark.timeout(60)
def test_a_stale_or_foreign_rank_record_is_refused(tmp_path: Path) -> None:
    import msgpack

    from gradsync.client.torch.checkpoint_persist import FORMAT, _decode_results

    other_step = msgpack.packb({"format": FORMAT, "step": 4, "rank": 1, "items": []})
    with pytest.raises(ValueError, match="the record is of step 4 rank 1"):
        _decode_results(other_step, 6, 1)
    with pytest.raises(ValueError, match="not a gradsync persisted-checkpoint record"):
        _decode_results(msgpack.packb([1, 2]), 6, 1)
    failed = msgpack.packb({"format": FORMAT, "step": 6, "rank": 1, "error": "disk full"})
    with pytest.raises(ValueError, match="rank 1 failed: disk full"):
        _decode_results(failed, 6, 1)
    escaping = msgpack.packb({"format": FORMAT, "step": 6, "rank": 1, "items": [
        ["w", [0], 0, "../__1_0.distcp", 0, 8, None]]})
    with pytest.raises(ValueError, match="rank 1's record has a malformed item for 'w'"):
        _decode_results(escaping, 6, 1)
