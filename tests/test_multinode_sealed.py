"""Allreduce across daemons with CURVE keys: the slices take sealed data streams.

Every algorithm, a few dtypes and ops, sizes from 0 to 300,001 elements against
numpy (multinode_allreduce.py; test_multinode.py runs the whole matrix, whose
reductions do not depend on the streams), 2 and 3 daemons; the counters must
show the data went over sealed streams rather than ZeroMQ, read into place,
with nothing refused or failed, and the log names this CPU's cipher.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import curve_args, free_ports, peer_args, run_spread

from conftest import DaemonProcess
from gradsync.client.ping import query
from gradsync.daemon.peers.stream_crypto import CIPHER_TITLES, fast_cipher

StartDaemon = Callable[..., DaemonProcess]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks_per_daemon", [(1, 1), (1, 2, 1)], ids=["2d", "3d"])
def test_curve_daemons_match_numpy_over_sealed_streams(
    start_daemon: StartDaemon, short_tmp: str, ranks_per_daemon: tuple[int, ...]
) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(len(ranks_per_daemon))]
    flags = curve_args(Path(short_tmp) / "keys", endpoints)
    daemons = [start_daemon(*peer_args(i, endpoints, *flags[i])) for i in range(len(endpoints))]
    results = run_spread(daemons, ranks_per_daemon, "multinode_allreduce.py",
                         ["ring,tree,rhd,star,auto", "float32,bfloat16,int32", "sum,max,bxor"],
                         timeout_s=280)
    for result in results:
        summary = result.records()[-1]
        assert summary["failures"] == 0, result.stdout
        assert summary["checked"] >= 5 * 5 * 5  # algorithms x (dtype, op) pairs x counts
    for daemon in daemons:
        daemon.assert_alive()
        counters = query(daemon.endpoint, 5.0)["counters"]
        assert counters["links_stream_sent"] > 0
        assert counters["links_stream_encrypted_sent"] == counters["links_stream_sent"]
        assert counters["links_stream_encrypted_received"] == counters["links_stream_received"]
        assert counters["links_stream_received"] > 0
        assert counters["links_stream_auth_failed"] == counters["links_stream_failed"] == 0
        assert counters["links_stream_refused"] == counters["links_malformed"] == 0
        assert counters["slices_placed"] > 0
        assert f"), {CIPHER_TITLES[fast_cipher()]}" in daemon.log()
