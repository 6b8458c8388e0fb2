"""Checkpoints in daemon memory (issue 50, part 1): torch DCP saves into segments the
daemon owns, commits only complete ones, and training resumes from them bitwise.

Real daemons, real torch ranks (tests/programs/dcp_daemon_train.py); the truth
is the same training never interrupted.
"""

from __future__ import annotations

import pytest
from cluster import free_ports

from conftest import DaemonProcess, assert_all_exited_0, collect, poll_until, spawn_ranks
from gradsync.client import Client
from gradsync.client.checkpoints import DaemonCheckpoints, checkpoint_client
from gradsync.protocol.errors import CheckpointError

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

from gradsync.client.torch.checkpoint import DaemonStorageReader

STEPS = 6


def train(daemon: DaemonProcess, job: str, *options: str,
          expect_exit: bool = True) -> list[dict[str, object]]:
    """Two ranks of the training program; their last JSON records (when all exit 0)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]),
           "OMP_NUM_THREADS": "1"}
    ranks = spawn_ranks(daemon.endpoint, "dcp_daemon_train.py", 2, [job, str(STEPS), *options],
                        job=f"torch-{job}", env=env)
    results = collect(ranks, 150, grace_after_failure_s=60)
    if not expect_exit:
        assert any(r.returncode != 0 for r in results), "the rank meant to die did not"
        return []
    assert_all_exited_0(results)
    return [result.records()[-1] for result in results]


@pytest.fixture(scope="module")
def truth(module_daemon: DaemonProcess) -> dict[str, object]:
    """The same training never interrupted (once for the module: it is deterministic)."""
    records = train(module_daemon, "truth")
    assert records[0]["params"] == records[1]["params"]
    return records[0]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("failure", ["--die-mid-step", "--die-in-save"])
def test_a_rank_killed_resumes_from_the_newest_complete_checkpoint_bitwise(
    daemon: DaemonProcess, truth: dict[str, object], failure: str
) -> None:
    job = failure.strip("-")
    train(daemon, job, failure, "3", expect_exit=False)
    # Step 2 is complete; step 3 never committed (rank 1 died before or inside its save).
    held = daemon_stats(daemon)["checkpoints"][job]  # type: ignore[index]
    complete = [c["step"] for c in held if c["complete"]]
    assert complete == [2, 1], held  # the newest two complete ones, newest first
    resumed = train(daemon, job, "--resume")
    for record in resumed:
        assert record["resumed_from"] == 2, record
        assert record["params"] == truth["params"], "resumed training differs from the truth"
        assert [c["step"] for c in record["checkpoints"]] == [5, 4]  # type: ignore[union-attr]


@pytest.mark.timeout(300)
def test_async_save_resumes_bitwise(daemon: DaemonProcess, truth: dict[str, object]) -> None:
    train(daemon, "async", "--async", "--die-mid-step", "4", expect_exit=False)
    resumed = train(daemon, "async", "--resume", "--async")
    # Step 3's save was still in flight when rank 1 died in step 4: it may have
    # committed or not; either way the newest complete one loads and ends bitwise.
    for record in resumed:
        assert record["resumed_from"] in (2, 3), record
        assert record["params"] == truth["params"]


@pytest.mark.timeout(300)
def test_a_checkpoint_over_the_budget_is_an_error_and_training_goes_on(
    start_daemon: object
) -> None:
    daemon: DaemonProcess = start_daemon("--max-shm-bytes", "48MiB")  # type: ignore[operator]
    records = train(daemon, "budget", "--blob-mib", "64", "--blob-step", "2")
    for record in records:
        errors = record["errors"]
        assert len(errors) == 1, errors  # type: ignore[arg-type]
        assert "max_shm_bytes" in errors[0] and "checkpoint step 2" in errors[0], errors  # type: ignore[index]
        # Training went on: the later steps were saved, the failed one never became complete.
        assert [c["step"] for c in record["checkpoints"]] == [5, 4]  # type: ignore[union-attr]


@pytest.mark.timeout(120)
def test_checkpoints_belong_to_their_job(daemon: DaemonProcess) -> None:
    with checkpoint_client("owner", 0, daemon.endpoint) as owner:
        store = DaemonCheckpoints(owner)
        part = store.put(7, "data", 100)
        part[:5] = b"hello"
        part.close()
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            store.open()  # not committed yet
        with pytest.raises(CheckpointError, match=r"parts \[\(1, 'data'\)\]"):
            store.commit(7, [(0, "data"), (1, "data")])
        store.commit(7, [(0, "data")])
        opened = store.open()
        assert opened.step == 7 and opened.parts[(0, "data")][:5] == b"hello"
        with pytest.raises(CheckpointError, match="already complete"):
            store.put(7, "data", 100)
        with Client(daemon.endpoint, "intruder", 0, 1, 0, 1) as intruder:
            for kind, fields in [("ckpt_open", {}), ("ckpt_list", {}),
                                 ("ckpt_put", {"step": 8, "item": "x", "nbytes": 8}),
                                 ("ckpt_commit", {"step": 7, "parts": [[0, "data"]]})]:
                with pytest.raises(CheckpointError, match="job 'intruder' may not use the "
                                   "checkpoints of job 'owner'"):
                    intruder.call(kind, job="owner", **fields)
            with pytest.raises(CheckpointError, match="may not use the checkpoints of job"):
                DaemonStorageReader(job="owner", client=intruder).read_metadata()
    # A later session of the job (a restarted trainer) reads it: it outlived the first.
    poll_until(lambda: not daemon_stats(daemon)["jobs"].get(  # type: ignore[attr-defined]
        "checkpoint:owner#0", {}).get("active"), 10, "the first session to end")
    with checkpoint_client("owner", 1, daemon.endpoint) as again:
        assert [c["step"] for c in DaemonCheckpoints(again).list()] == [7]
        stats = daemon_stats(daemon)
        entry = stats["checkpoints"]["owner"][0]  # type: ignore[index]
        assert entry["step"] == 7 and entry["complete"] and entry["bytes"] >= 100
        from gradsync.client.cli.stats import render_table

        assert "checkpoint of job 'owner' step 7 (complete): 4.0 KiB" in render_table(stats)


def daemon_stats(daemon: DaemonProcess) -> dict[str, object]:
    from gradsync.client.cli.stats import fetch_snapshot

    return fetch_snapshot(daemon.endpoint + ".stats", 5.0)  # type: ignore[no-any-return]


@pytest.mark.timeout(240)
def test_fsdp2_sharded_model_and_optimizer_state_round_trip(daemon: DaemonProcess) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]),
           "OMP_NUM_THREADS": "1"}
    results = collect(spawn_ranks(daemon.endpoint, "dcp_daemon_fsdp.py", 2, ["fsdp"],
                                  job="torch-fsdp", env=env), 150)
    assert_all_exited_0(results)
    for record in (result.records()[-1] for result in results):
        assert record["sharded"], "FSDP2 did not shard the parameters"
        assert any(str(k).startswith("optim.state.") for k in record["keys"]), record  # type: ignore[union-attr]
        assert record["differed_before"] and record["equal_after"], record
