"""Allreduce across several daemons on 127.0.0.1: every algorithm against numpy."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cluster import free_ports, peer_args, run_spread

from conftest import DaemonProcess
from gradsync.client.ping import query

StartDaemon = Callable[..., DaemonProcess]


def start_cluster(start_daemon: StartDaemon, count: int, *extra: str) -> list[DaemonProcess]:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
    return [start_daemon(*peer_args(i, endpoints, "--insecure", *extra)) for i in range(count)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("ranks_per_daemon", "extra"),
    [
        ((1, 1), ()),
        # Small slices: every transfer of the larger counts is cut into many,
        # the last one short (sent by copy, below the zero-copy threshold).
        ((1, 2, 1), ("--pipeline-slice-bytes", "100KiB")),
        ((2, 1, 1, 2), ()),
        ((1, 1, 1, 1, 1), ()),
    ],
    ids=["2d-1+1", "3d-1+2+1-small-slices", "4d-2+1+1+2", "5d-1x5"],
)
def test_every_algorithm_matches_numpy(
    start_daemon: StartDaemon, ranks_per_daemon: tuple[int, ...], extra: tuple[str, ...]
) -> None:
    daemons = start_cluster(start_daemon, len(ranks_per_daemon), *extra)
    results = run_spread(daemons, ranks_per_daemon, "multinode_allreduce.py", timeout_s=280)
    for result in results:
        summary = result.records()[-1]
        assert summary["failures"] == 0, result.stdout
        assert summary["checked"] > 300
    for daemon in daemons:
        daemon.assert_alive()
        # --insecure links: the slices went over the plain-TCP data streams.
        counters = query(daemon.endpoint, 5.0)["counters"]
        assert counters["links_stream_sent"] > 0 and counters["links_stream_received"] > 0
        assert counters["links_stream_failed"] == counters["links_stream_refused"] == 0
        # Slices of the running step were read straight into place.
        assert counters["slices_placed"] > 0
        assert counters["links_malformed"] == 0
