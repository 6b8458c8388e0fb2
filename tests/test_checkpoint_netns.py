"""Issue 50's lost-node scenario on two hosts: FSDP2, 2 nodes x 2 ranks, a checkpoint in
daemon memory every step; the whole node 1 is lost (its daemon SIGKILLed, its segments
and manifest removed, as a dead machine's memory goes) and a fresh daemon in its place
serves ranks that load their parts from node 0's replicas.  The resumed training must
end bitwise equal to an uninterrupted run with the same data order.

Each node is a network namespace of its own (benchmarks/topology.py: a veth pair,
addresses 10.213.50.x assigned inside the namespaces made here and deleted after),
with its daemon (CURVE keys: sealed links) and its two torch ranks inside it; the
daemons reach each other only over the veth link, the ranks meet at a c10d store on
node 0's address.  Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from cluster import curve_args, peer_args
from test_checkpoint_replicas import lose_node, records, replicated_on, stats

from benchmarks.topology import Topology, list_namespaces, namespaces, namespaces_unavailable
from conftest import (
    PROGRAMS,
    RANK_ZYGOTE,
    DaemonProcess,
    assert_all_exited_0,
    collect,
    poll_until,
)

pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")

pytestmark = [pytest.mark.fault]

StartDaemon = Callable[..., DaemonProcess]
PROGRAM = "dcp_daemon_fsdp_resume.py"
#: The c10d store's first port on node 0 (the namespace's ports are its own); one per run.
STORE_PORT = 29500


@pytest.fixture
def hosts() -> Iterator[Topology]:
    """Two namespaces joined by a veth pair; asked for before `start_daemon`, so the
    daemons inside have stopped when they are deleted."""
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        try:
            topo = stack.enter_context(namespaces(2))
        except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot create network namespaces here: {exc}")
        yield topo
    left = set(topo.namespaces) & set(list_namespaces())
    assert not left, f"namespaces left behind: {left}"


def spawn_on_hosts(topo: Topology, daemons: Sequence[DaemonProcess], args: Sequence[str],
                   job: str, store_port: int) -> list[subprocess.Popen[str]]:
    """Two ranks per node, numbered as torchrun numbers nodes, each inside its node's
    namespace (forked by the suite's zygote, which moves the child there)."""
    processes = []
    for node, daemon in enumerate(daemons):
        for local_rank in range(2):
            env = {**os.environ, "RANK": str(2 * node + local_rank), "WORLD_SIZE": "4",
                   "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "2",
                   "GRADSYNC_DAEMON": daemon.endpoint, "GRADSYNC_JOB": job,
                   "MASTER_ADDR": topo.hosts[0], "MASTER_PORT": str(store_port),
                   "OMP_NUM_THREADS": "1"}
            processes.append(RANK_ZYGOTE.popen([sys.executable, str(PROGRAMS / PROGRAM), *args],
                                               env=env, netns=topo.namespaces[node]))
    return processes


@pytest.mark.timeout(900)
def test_fsdp2_on_two_hosts_resumes_bitwise_on_a_fresh_node_from_the_replicas(
    hosts: Topology, start_daemon: StartDaemon, short_tmp: str
) -> None:
    endpoints = hosts.endpoints()[0]
    flags = [peer_args(i, endpoints, *curve)
             for i, curve in enumerate(curve_args(Path(short_tmp) / "keys", endpoints))]
    daemons = [start_daemon(*flags[i], prefix=hosts.prefix(i)) for i in range(2)]
    runs = iter(range(STORE_PORT, STORE_PORT + 3))

    def train(job: str, *options: str) -> dict[int, Any]:
        ranks = spawn_on_hosts(hosts, daemons, [job, "5", *options], f"torch-{job}",
                               next(runs))
        try:
            results = collect(ranks, timeout_s=240)
        finally:  # none outlives the test (pytest-timeout's signal stops a wait midway)
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
        assert_all_exited_0(results, "\n".join(
            f"--- daemon {d.endpoint} log:\n{d.log()[-3000:]}" for d in daemons))
        return records(results)

    truth = train("truth")
    train("fsdp", "--stop-after", "2")  # a checkpoint every step
    for daemon, successor in zip(daemons, reversed(endpoints), strict=True):
        poll_until(lambda d=daemon, s=successor: replicated_on(d, "fsdp") == [s], 60,  # type: ignore[misc]
                   f"step 2's parts of {daemon.endpoint} confirmed on {successor}")
        assert stats(daemon)["checkpoints"]["fsdp"][0]["step"] == 2
    lose_node(daemons[1])
    daemons[1] = start_daemon(*flags[1], prefix=hosts.prefix(1))
    resumed = train("fsdp", "--resume")
    for rank in range(4):
        assert resumed[rank]["resumed_from"] == 2, resumed[rank]
        assert resumed[rank]["digests"] == truth[rank]["digests"], (
            f"rank {rank}: resumed training differs from the uninterrupted one")
