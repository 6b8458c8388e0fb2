"""The same job across daemons in separate network namespaces joined by a veth pair;
and, with one host's data stream slowed (tc), a rank that leaves while its last
slices are still on the wire.

Each daemon runs in its own namespace and reaches the other only through the
veth link, over addresses this test assigns inside the namespaces it creates
(and removes afterwards).  Needs root and iproute2; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cluster import curve_args, run_spread, spawn_spread

from conftest import DaemonProcess, collect, poll_until

StartDaemon = Callable[..., DaemonProcess]
SUBNET = "10.213.47"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[tuple[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    names = (f"gsa{tag}", f"gsb{tag}")
    veth = (f"gsva{tag}", f"gsvb{tag}")
    try:
        for name in names:
            _ip("netns", "add", name)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for index, (name, link) in enumerate(zip(names, veth, strict=True), start=1):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{SUBNET}.{index}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        pytest.skip(f"cannot create network namespaces here: {exc}")
    yield names
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@pytest.mark.timeout(240)
def test_job_across_network_namespaces(
    start_daemon: StartDaemon, two_hosts: tuple[str, str]
) -> None:
    endpoints = [f"tcp://{SUBNET}.{i}:29400" for i in (1, 2)]
    peers = ",".join(endpoints)
    daemons = [
        start_daemon("--listen", endpoints[i], "--peers", peers, "--insecure",
                     prefix=["ip", "netns", "exec", two_hosts[i]])
        for i in range(2)
    ]
    # Clients reach their daemon through its Unix socket (a file, not the network);
    # the daemons reach each other only over the veth pair.
    results = run_spread(daemons, (2, 1), "multinode_allreduce.py", ["ring,tree,rhd,auto"],
                         job="netns")
    for result in results:
        summary = result.records()[-1]
        assert summary["failures"] == 0, result.stdout
    for daemon in daemons:
        assert "formed across 2 daemons" in daemon.log()


def _tc(host: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", host, "tc", *args], check=True,
                   capture_output=True, timeout=30)


@pytest.mark.timeout(120)
def test_a_rank_leaving_fails_no_one_while_its_last_slices_are_in_flight(
    start_daemon: StartDaemon, two_hosts: tuple[str, str]
) -> None:
    """Host A sends everything but its ZeroMQ link at 200 kbit/s, so its data
    stream to B lags.  A's rank finishes its allreduce (its last slice is with
    A's kernel, still on the way to B) and leaves at once: B must read that slice
    before it hears that A's rank left, and finish, instead of failing the
    collective for a rank that already did its part."""
    if shutil.which("tc") is None:
        pytest.skip("needs tc (iproute2) to slow one stream")
    port = 29400
    endpoints = [f"tcp://{SUBNET}.{i}:{port}" for i in (1, 2)]
    veth = f"gsva{os.getpid() % 100000}"
    host_a = two_hosts[0]
    try:
        _tc(host_a, "qdisc", "add", "dev", veth, "root", "handle", "1:", "htb", "default", "20")
        _tc(host_a, "class", "add", "dev", veth, "parent", "1:", "classid", "1:10", "htb",
            "rate", "10gbit")
        _tc(host_a, "class", "add", "dev", veth, "parent", "1:", "classid", "1:20", "htb",
            "rate", "200kbit", "ceil", "200kbit")
        for direction in ("dport", "sport"):  # the ZeroMQ link, either way: full speed
            _tc(host_a, "filter", "add", "dev", veth, "parent", "1:0", "protocol", "ip",
                "prio", "1", "u32", "match", "ip", direction, str(port), "0xffff",
                "flowid", "1:10")
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"cannot shape the veth link here: {exc}")
    peers = ",".join(endpoints)
    daemons = [
        start_daemon("--listen", endpoints[i], "--peers", peers, "--insecure",
                     prefix=["ip", "netns", "exec", two_hosts[i]])
        for i in range(2)
    ]
    for attempt in range(3):
        results = run_spread(daemons, (1, 1), "multinode_finish.py",
                             [str(4 * 1024), "1", "ring"], job=f"leaving-{attempt}")
        for result in results:
            assert result.records() == [{"rounds": 1, "wrong": 0}], result.stdout
    for daemon in daemons:
        daemon.assert_alive()


@pytest.mark.fault
@pytest.mark.timeout(180)
@pytest.mark.parametrize("security", ["curve", "insecure"])
def test_a_cut_link_with_data_in_flight_fails_both_sides_within_the_peer_timeout(
    start_daemon: StartDaemon, two_hosts: tuple[str, str], short_tmp: str, security: str
) -> None:
    """A 64 MiB allreduce loop across the veth pair; the link goes down mid-collective
    (`ip link set VETH down`), with megabytes queued to send: the ranks on both sides get
    PeerLostError soon after the peer timeout (2 s), not CollectiveTimeoutError at
    their deadline (90 s here)."""
    peer_timeout_s = 2.0
    endpoints = [f"tcp://{SUBNET}.{i}:29400" for i in (1, 2)]
    peers = ",".join(endpoints)
    keys = Path(short_tmp) / "keys"
    flags = curve_args(keys, endpoints)
    daemons = [
        start_daemon("--listen", endpoints[i], "--peers", peers,
                     "--peer-timeout-s", str(peer_timeout_s),
                     *(flags[i] if security == "curve" else ["--insecure"]),
                     prefix=["ip", "netns", "exec", two_hosts[i]])
        for i in range(2)
    ]
    markers = Path(short_tmp) / "markers"
    markers.mkdir()
    ranks = spawn_spread(daemons, (1, 1), "multinode_hold.py",
                         [str(16 * 1024 * 1024), str(markers)], job="cut",
                         env={"GRADSYNC_TIMEOUT_S": "90"})
    veth = f"gsva{os.getpid() % 100000}"
    try:
        poll_until(lambda: len(list(markers.iterdir())) == 2, 90, "both ranks reducing")
        _ip("-n", two_hosts[0], "link", "set", veth, "down")
        cut = time.monotonic()
        results = collect(ranks, timeout_s=60)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
        _ip("-n", two_hosts[0], "link", "set", veth, "up")
    for result in results:
        outcome = result.records()[-1]
        assert outcome["error"] == "PeerLostError", result.stdout + result.stderr
        assert outcome["at"] - cut < peer_timeout_s + 20, outcome
    for daemon in daemons:
        daemon.assert_alive()
