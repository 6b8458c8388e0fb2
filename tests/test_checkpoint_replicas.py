"""Checkpoint replicas on peer daemons (issue 50, part 2): each daemon's parts go to the
next daemon over the sealed data streams after the commit; a node lost with its
daemon and its memory comes back as a fresh daemon whose ranks load their parts
from the peers, bitwise.

Real daemons on 127.0.0.1 with CURVE keys (sealed streams), real torch ranks saving
with DaemonStorageWriter (tests/programs/dcp_daemon_replicas.py), one per daemon.
FSDP2 on two hosts (network namespaces) resuming on a fresh node:
tests/test_checkpoint_netns.py.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from cluster import curve_args, free_ports, peer_args, run_spread, spawn_spread

from conftest import DaemonProcess, collect, poll_until
from gradsync.daemon.checkpoint_manifest import manifest_name
from gradsync.protocol.shm import SHM_DIR

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

StartDaemon = Callable[..., DaemonProcess]
PROGRAM = "dcp_daemon_replicas.py"


def sealed_pair(start_daemon: StartDaemon, keys: Path,
                *extra: Sequence[str]) -> tuple[list[str], list[list[str]], list[DaemonProcess]]:
    """Two daemons with CURVE keys; `extra[i]`: daemon i's own flags."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    flags = [peer_args(i, endpoints, *curve) for i, curve in enumerate(curve_args(keys,
                                                                                 endpoints))]
    daemons = [start_daemon(*flags[i], *(extra[i] if i < len(extra) else ()))
               for i in range(2)]
    return endpoints, flags, daemons


def stats(daemon: DaemonProcess) -> dict[str, Any]:
    from gradsync.client.cli.stats import fetch_snapshot

    return fetch_snapshot(daemon.endpoint + ".stats", 5.0)  # type: ignore[no-any-return]


def replicated_on(daemon: DaemonProcess, job: str) -> list[str]:
    """Where the daemon's newest checkpoint of `job` has replicas confirmed."""
    held = stats(daemon)["checkpoints"].get(job, [])
    return list(held[0].get("replicas", [])) if held else []


def rank_env() -> dict[str, str]:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_ports(1)[0]),
            "OMP_NUM_THREADS": "1"}


def records(results: Sequence[Any]) -> dict[int, dict[str, Any]]:
    return {int(r["rank"]): r for r in (result.records()[-1] for result in results)}


def lose_node(daemon: DaemonProcess) -> None:
    """SIGKILL the daemon and remove what its machine's memory held."""
    daemon.process.send_signal(signal.SIGKILL)
    daemon.process.wait(10)
    daemon.sweep_segments()
    manifest = os.path.join(SHM_DIR, manifest_name(daemon.socket_path))
    if os.path.exists(manifest):
        os.unlink(manifest)


@pytest.mark.timeout(300)
def test_a_replacement_node_loads_its_parts_from_the_peers_replicas_bitwise(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    endpoints, flags, (first, second) = sealed_pair(start_daemon, tmp_path / "keys")
    job = "replicated"
    saved = records(run_spread([first, second], [1, 1], PROGRAM, [job, "save", "3"],
                               timeout_s=150, job="torch-replicated", env=rank_env()))
    # Each daemon's parts reach the other (its successor in the ring of two).
    poll_until(lambda: replicated_on(first, job) == [endpoints[1]], 30,
               f"the first daemon's parts confirmed on the second: {stats(first)}")
    poll_until(lambda: replicated_on(second, job) == [endpoints[0]], 30,
               f"the second daemon's parts confirmed on the first: {stats(second)}")
    held = stats(second)["checkpoint_replicas"][job]
    assert {(r["origin"], r["rank"]) for r in held} >= {(endpoints[0], 0)}, held
    assert all(r["complete"] and r["step"] == 3 for r in held), held

    lose_node(second)
    replacement = start_daemon(*flags[1])
    loaded = records(run_spread([first, replacement], [1, 1], PROGRAM, [job, "load", "0"],
                                timeout_s=150, job="torch-replicated-2", env=rank_env()))
    for rank in (0, 1):
        assert loaded[rank]["step"] == 3, loaded[rank]
        assert loaded[rank]["digests"] == {
            key: digest for key, digest in saved[rank]["digests"].items()
        }, f"rank {rank} loaded other bytes than it saved"
    assert "opened from the peers' parts and replicas" in replacement.log()


@pytest.mark.timeout(300)
def test_a_replica_over_the_peers_budget_is_dropped_and_the_save_succeeds(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    endpoints, _, (first, second) = sealed_pair(
        start_daemon, tmp_path / "keys", (), ("--max-shm-bytes", "24MiB"))
    job = "budget"
    run_spread([first, second], [1, 1], PROGRAM, [job, "save", "1", "--blob-mib", "32"],
               timeout_s=150, job="torch-budget", env=rank_env())
    poll_until(lambda: "does not fit" in second.log(), 30,
               "the second daemon to drop the replica it has no room for")
    poll_until(lambda: "dropped the replica" in first.log(), 30,
               "the first daemon to hear that its replica was dropped")
    # The second daemon's own (small) part still reached the first.
    poll_until(lambda: replicated_on(second, job) == [endpoints[0]], 30,
               f"the second daemon's part confirmed on the first: {stats(second)}")
    assert replicated_on(first, job) == []
    assert stats(first)["checkpoints"][job][0]["complete"]
    assert not stats(second).get("checkpoint_replicas", {}).get(job)


@pytest.mark.timeout(300)
def test_a_sender_killed_mid_transfer_leaves_no_replica_segment(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    _, _, (first, second) = sealed_pair(start_daemon, tmp_path / "keys")
    job = "midway"
    ranks = spawn_spread([first, second], [1, 1], PROGRAM,
                         [job, "save", "1", "--blob-mib", "384"], job="torch-midway",
                         env=rank_env())

    def arriving() -> bool:
        held = stats(second)["checkpoint_replicas"].get(job, [])
        return any(not r["complete"] for r in held)

    try:
        poll_until(arriving, 150, "a replica from the first daemon to be arriving")
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(10)
    finally:
        collect(ranks, 60)
    poll_until(lambda: not stats(second)["checkpoint_replicas"].get(job), 30,
               "the half-received replica to be dropped")
    assert "dropping the replica" in second.log()
    # What the second daemon holds now is its own checkpoint alone: one segment, its
    # rank's one part (the metadata is the coordinator's), once its ranks are gone.
    def own_alone() -> bool:
        snapshot = stats(second)
        own = snapshot["checkpoints"].get(job, [])
        return [c["ranks"] for c in own] == [[1]] and snapshot["shm"]["segments"] == 1

    poll_until(own_alone, 30, f"no memory held but the own checkpoint: {stats(second)}")
    second.assert_alive()


@pytest.mark.timeout(400)
def test_on_three_nodes_each_daemons_parts_go_to_its_ring_successor(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    endpoints = sorted(f"tcp://127.0.0.1:{port}" for port in free_ports(3))
    flags = [peer_args(i, endpoints, *curve)
             for i, curve in enumerate(curve_args(tmp_path / "keys", endpoints))]
    daemons = [start_daemon(*flag) for flag in flags]
    job = "ring"
    saved = records(run_spread(daemons, [1, 1, 1], PROGRAM, [job, "save", "4"],
                               timeout_s=150, job="torch-ring", env=rank_env()))
    for index, daemon in enumerate(daemons):
        successor = endpoints[(index + 1) % 3]
        poll_until(lambda d=daemon, s=successor: replicated_on(d, job) == [s], 30,  # type: ignore[misc]
                   f"{daemon.endpoint}'s parts confirmed on {successor} alone")
    # The middle node is lost: its parts live on the third alone; the replacement
    # pulls them from there, and the other ranks' parts from their own daemons.
    lose_node(daemons[1])
    daemons[1] = start_daemon(*flags[1])
    loaded = records(run_spread(daemons, [1, 1, 1], PROGRAM, [job, "load", "0"],
                                timeout_s=150, job="torch-ring-2", env=rank_env()))
    for rank in range(3):
        assert loaded[rank]["step"] == 4
        assert loaded[rank]["digests"] == saved[rank]["digests"], f"rank {rank} differs"
