"""After a node is lost, the survivors' checkpoints are replicated again onto the daemon
that replaces it (issue 50): a lost peer's confirmations are forgotten, so the
replacement at its address gets the survivor's newest checkpoint when it comes up,
before any rank asks for it.

Real daemons on 127.0.0.1 with CURVE keys, real torch ranks saving with
DaemonStorageWriter (tests/programs/dcp_daemon_replicas.py), one per daemon.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import run_spread
from test_checkpoint_replicas import PROGRAM, lose_node, rank_env, replicated_on, sealed_pair

from conftest import DaemonProcess, poll_until

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

StartDaemon = Callable[..., DaemonProcess]


@pytest.mark.timeout(300)
def test_a_survivors_checkpoint_is_replicated_onto_the_replacement_node(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    endpoints, flags, (first, second) = sealed_pair(start_daemon, tmp_path / "keys")
    job = "re-replicated"
    run_spread(
        [first, second],
        [1, 1],
        PROGRAM,
        [job, "save", "2"],
        timeout_s=150,
        job="torch-re-replicated",
        env=rank_env(),
    )
    poll_until(
        lambda: replicated_on(first, job) == [endpoints[1]],
        30,
        "the first daemon's parts confirmed on the second",
    )
    lose_node(second)
    poll_until(
        lambda: replicated_on(first, job) == [],
        30,
        "the first daemon to forget the confirmation of the lost peer",
    )
    replacement = start_daemon(*flags[1])
    poll_until(
        lambda: replicated_on(first, job) == [endpoints[1]],
        60,
        "the first daemon's parts confirmed on the replacement",
    )
    replacement.assert_alive()
