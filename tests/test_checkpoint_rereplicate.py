"""A daemon whose replica holder is lost replicates its newest checkpoint again at once,
onto the next live daemon in the ring (issue 50, part 2): losing one more node then
still keeps a full copy, without waiting for a replacement or the next save.

Real daemons on 127.0.0.1 with CURVE keys, real torch ranks saving with
DaemonStorageWriter (tests/programs/dcp_daemon_replicas.py), one per daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import curve_args, free_ports, peer_args, run_spread
from test_checkpoint_replicas import (
    PROGRAM,
    lose_node,
    rank_env,
    records,
    replicated_on,
    stats,
)

from conftest import DaemonProcess, poll_until

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

StartDaemon = Callable[..., DaemonProcess]


def sealed_ring(start_daemon: StartDaemon, keys: Path, count: int
                ) -> tuple[list[str], list[list[str]], list[DaemonProcess]]:
    """`count` daemons with CURVE keys, listed in ring order (sorted by endpoint)."""
    endpoints = sorted(f"tcp://127.0.0.1:{port}" for port in free_ports(count))
    flags = [peer_args(i, endpoints, *curve) for i, curve in enumerate(curve_args(keys,
                                                                                 endpoints))]
    return endpoints, flags, [start_daemon(*flag) for flag in flags]


def await_ring_replicas(daemons: list[DaemonProcess], endpoints: list[str], job: str) -> None:
    """Wait until each daemon's newest checkpoint is confirmed on its successor alone
    (`endpoints`: the daemons' peer endpoints, in ring order)."""
    for daemon, successor in zip(daemons, endpoints[1:] + endpoints[:1], strict=True):
        poll_until(lambda d=daemon, s=successor: replicated_on(d, job) == [s], 30,  # type: ignore[misc]
                   f"{daemon.endpoint}'s parts confirmed on {successor} alone")


@pytest.mark.timeout(400)
def test_a_lost_replica_holder_is_replaced_by_the_next_live_daemon_at_once(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    endpoints, flags, daemons = sealed_ring(start_daemon, tmp_path / "keys", 3)
    first, second, third = daemons
    job = "rereplicated"
    saved = records(run_spread(daemons, [1, 1, 1], PROGRAM, [job, "save", "3"],
                               timeout_s=150, job="torch-rereplicated", env=rank_env()))
    await_ring_replicas(daemons, endpoints, job)

    # The second daemon's successor is lost, and no replacement comes: its parts go
    # to the next live daemon in the ring, the first, and the lost one is forgotten.
    lose_node(third)
    poll_until(lambda: replicated_on(second, job) == [endpoints[0]], 60,
               f"the second daemon's parts confirmed on the first: {stats(second)}")
    assert (f"its replica on peer {endpoints[2]} was lost; replicating it on "
            f"{endpoints[0]}") in second.log()
    # The first daemon's replica holder (the second) is alive: nothing moved.
    assert replicated_on(first, job) == [endpoints[1]]
    held = {(r["origin"], r["rank"], r["complete"], r["step"])
            for r in stats(first)["checkpoint_replicas"][job]}
    assert {(endpoints[1], 1, True, 3), (endpoints[2], 2, True, 3)} <= held, held

    # Then the second node is lost too: its ranks' parts survive on the first alone,
    # which has nowhere left to copy its own to (said once).
    lose_node(second)
    poll_until(lambda: "no other live peer can take them" in first.log(), 60,
               "the first daemon to say its replicas have nowhere to go")
    assert first.log().count("no other live peer can take them") == 1
    replacement = start_daemon(*flags[1])
    loaded = records(run_spread([first, replacement], [1, 1], PROGRAM, [job, "load", "0"],
                                timeout_s=150, job="torch-rereplicated-2", env=rank_env()))
    for rank in (0, 1):
        assert loaded[rank]["step"] == 3, loaded[rank]
        assert loaded[rank]["digests"] == saved[rank]["digests"], f"rank {rank} differs"
    assert "opened from the peers' parts and replicas" in replacement.log()
    first.assert_alive()
