"""broadcast, reduce, all_gather, reduce_scatter, gather, scatter, all_to_all, barrier, groups.

Against a numpy reference on one node (1-4 ranks) and across 2-3 daemons with
uneven local counts, every root, sizes 0, 1, odd and large, sub-groups inside
one node and across nodes, two groups at once; mismatches and lost peers.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import run_spread, spawn_spread, start_cluster

from conftest import DaemonProcess, collect, poll_until, run_ranks

StartDaemon = Callable[..., DaemonProcess]


def assert_clean(results: list[object]) -> None:
    for result in results:
        summary = result.records()[-1]  # type: ignore[attr-defined]
        assert summary["failures"] == 0, result.stdout  # type: ignore[attr-defined]
        assert summary["checked"] > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_collectives_on_one_node(daemon: DaemonProcess, nranks: int) -> None:
    results = run_ranks(daemon.endpoint, "collectives_matrix.py", nranks, ["", "group"],
                        timeout_s=280)
    assert_clean(results)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ranks_per_daemon", "groups"),
    [((1, 1), ""), ((1, 2, 1), "group"), ((2, 1), "group"), ((1, 1, 2, 1), "group")],
    ids=["2d-1+1", "3d-1+2+1-groups", "2d-2+1-groups", "4d-1+1+2+1-groups"],
)
def test_collectives_across_daemons(
    start_daemon: StartDaemon, ranks_per_daemon: tuple[int, ...], groups: str
) -> None:
    daemons = start_cluster(start_daemon, len(ranks_per_daemon))
    results = run_spread(daemons, ranks_per_daemon, "collectives_matrix.py", ["", groups],
                         timeout_s=280)
    assert_clean(results)


def check_mismatch(results: list[object]) -> None:
    for result in results:
        record = result.records()[-1]  # type: ignore[attr-defined]
        assert record["root"] and "root=0" in record["root"] and "root=1" in record["root"]
        assert record["untouched"] is True
        assert record["size"] and "int64[4]" in record["size"] and "int64[5]" in record["size"]
        assert record["after"] == list(range(len(results)))


@pytest.mark.timeout(120)
def test_mismatched_roots_and_sizes_on_one_node(daemon: DaemonProcess) -> None:
    check_mismatch(run_ranks(daemon.endpoint, "collective_mismatch.py", 2))


@pytest.mark.timeout(120)
def test_mismatched_roots_and_sizes_across_daemons(start_daemon: StartDaemon) -> None:
    daemons = start_cluster(start_daemon, 2)
    check_mismatch(run_spread(daemons, (1, 1), "collective_mismatch.py"))


@pytest.mark.timeout(240)
def test_a_dead_peer_fails_every_collective(start_daemon: StartDaemon, short_tmp: str) -> None:
    """One job per collective, all running at once across two daemons: killing
    one daemon fails every job on the other, each naming the lost peer."""
    kinds = ["broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
             "all_to_all", "barrier"]
    daemons = start_cluster(start_daemon, 2, "--peer-timeout-s", "2")
    ranks = {}
    for kind in kinds:
        markers = Path(short_tmp) / f"markers-{kind}"
        markers.mkdir()
        ranks[kind] = spawn_spread(daemons, (1, 1), "multinode_hold.py",
                                   [str(512 * 1024), str(markers), kind], job=kind)
    for kind in kinds:
        markers = Path(short_tmp) / f"markers-{kind}"
        poll_until(lambda m=markers: len(list(m.iterdir())) == 2, 120, f"{kind} to run")
    struck = time.monotonic()
    daemons[1].process.send_signal(signal.SIGKILL)
    for kind in kinds:
        survivor = collect(ranks[kind][:1], timeout_s=60)[0]
        outcome = survivor.records()[-1]
        assert outcome["error"] == "PeerLostError", (kind, survivor.stdout, survivor.stderr)
        assert daemons[1].endpoint not in outcome["message"]  # names the peer, not its socket
        assert "tcp://127.0.0.1" in outcome["message"] and f"job '{kind}'" in outcome["message"]
        assert outcome["at"] - struck < 10, (kind, outcome)
    for kind in kinds:
        collect(ranks[kind][1:], timeout_s=30)
    daemons[0].assert_alive()


FSDP_EXAMPLE = "../../examples/fsdp_numpy.py"  # relative to tests/programs


@pytest.mark.timeout(120)
def test_fsdp_example_matches_unsharded_training_on_one_node(daemon: DaemonProcess) -> None:
    results = run_ranks(daemon.endpoint, FSDP_EXAMPLE, 3)
    assert "MATCH" in results[0].stdout and "MISMATCH" not in results[0].stdout


@pytest.mark.timeout(120)
def test_fsdp_example_matches_unsharded_training_across_daemons(
    start_daemon: StartDaemon,
) -> None:
    daemons = start_cluster(start_daemon, 2)
    results = run_spread(daemons, (2, 1), FSDP_EXAMPLE)
    assert "MATCH" in results[0].stdout and "MISMATCH" not in results[0].stdout
