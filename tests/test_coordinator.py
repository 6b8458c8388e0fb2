"""Membership that scales (issue 48, part 2), with real daemons: a job's
coordinator (daemon/core/coordinating.py) that holds none of its ranks forms
it, and once it is gone the survivors' next job forms at the next one; at rest
a daemon heartbeats its ring neighbours only (daemon/core/watching.py)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import curve_args, free_ports, peer_args, run_spread, spawn_spread

from conftest import DaemonProcess, collect, poll_until, spawn_rank
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.daemon.core.membership import coordinator_of, coordinators_of

pytestmark = pytest.mark.timeout(180)
StartDaemon = Callable[..., DaemonProcess]


def _peer_states(daemon: DaemonProcess) -> dict[str, str]:
    peers = fetch_snapshot(daemon.endpoint + ".stats", 5.0)["peers"]
    return {name: entry["state"] for name, entry in peers.items()}


def _job_named(endpoints: list[str], coordinator: str, prefix: str) -> str:
    return next(name for name in (f"{prefix}-{i}" for i in range(1000))
                if coordinator_of(name, endpoints) == coordinator)


def test_a_daemon_without_ranks_coordinates_and_its_loss_moves_the_next_job(
    start_daemon: StartDaemon,
) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    daemons = [start_daemon(*peer_args(i, endpoints, "--insecure")) for i in range(3)]
    for daemon in daemons:
        poll_until(lambda d=daemon: set(_peer_states(d).values()) == {"up"}, 30,  # type: ignore[misc]
                   f"every link of {daemon.endpoint} up")
    pair, third = daemons[:2], daemons[2]

    # Ranks on the first two daemons; the job's name makes the third coordinate it.
    job = _job_named(endpoints, endpoints[2], "elsewhere")
    results = run_spread(pair, (1, 1), "multinode_allreduce.py", ["ring,star", "float32", "sum"],
                         job=job)
    assert [r.records()[-1]["failures"] for r in results] == [0, 0]
    entries = [fetch_snapshot(d.endpoint + ".stats", 5.0)["jobs"][job] for d in pair]
    assert [e["coordinator"] for e in entries] == [endpoints[2]] * 2, entries
    assert job not in fetch_snapshot(third.endpoint + ".stats", 5.0)["jobs"]  # no rank there

    # The third daemon goes: a job it would coordinate forms at the next one.
    third.process.kill()
    third.process.wait()
    for daemon in pair:
        poll_until(lambda d=daemon: _peer_states(d)[endpoints[2]] == "lost", 30,  # type: ignore[misc]
                   f"{daemon.endpoint} to see the third daemon lost")
    moved = _job_named(endpoints, endpoints[2], "moved")
    results = run_spread(pair, (1, 1), "multinode_allreduce.py", ["ring", "float32", "sum"],
                         job=moved)
    assert [r.records()[-1]["failures"] for r in results] == [0, 0]
    entries = [fetch_snapshot(d.endpoint + ".stats", 5.0)["jobs"][moved] for d in pair]
    assert [e["coordinator"] for e in entries] == [coordinator_of(moved, endpoints[:2])] * 2
    for daemon in pair:
        daemon.assert_alive()


def _counter(daemon: DaemonProcess, name: str) -> int:
    return int(fetch_snapshot(daemon.endpoint + ".stats", 5.0)["counters"][name])


def _links(daemon: DaemonProcess) -> dict[str, tuple[str, bool]]:
    """Each peer's link state, and whether it is heartbeated now."""
    peers = fetch_snapshot(daemon.endpoint + ".stats", 5.0)["peers"]
    return {name: (entry["state"], entry["watched"]) for name, entry in peers.items()}


def _neighbours_up(daemon: DaemonProcess, me: str, ring: list[str]) -> bool:
    """The links of the daemon (`me` among peers) to its two ring neighbours are up
    (`--watch-neighbours 1`)."""
    at = ring.index(me)
    states = _peer_states(daemon)
    return all(states[ring[(at + step) % len(ring)]] == "up" for step in (-1, 1))


def _ring_of(start_daemon: StartDaemon, count: int,
             *flags: str) -> tuple[list[str], dict[str, DaemonProcess]]:
    """`count` daemons heartbeating one ring neighbour on either side, once each
    one's links to its neighbours are up: the ring (sorted endpoints) and the
    daemons by endpoint."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
    daemons = [start_daemon(*peer_args(i, endpoints, "--insecure", "--watch-neighbours", "1",
                                       *flags)) for i in range(count)]
    by_endpoint = dict(zip(endpoints, daemons, strict=True))
    ring = sorted(endpoints)
    for endpoint, daemon in by_endpoint.items():
        poll_until(lambda d=daemon, e=endpoint: _neighbours_up(d, e, ring),  # type: ignore[misc]
                   30, f"the links of {endpoint} to its ring neighbours up")
    return ring, by_endpoint


def test_at_rest_a_daemon_links_and_heartbeats_its_ring_neighbours_alone(
    start_daemon: StartDaemon,
) -> None:
    """Four daemons, one ring neighbour on either side (`--watch-neighbours 1`): at
    rest the daemon opposite on the ring is not even connected; a job spanning
    both opens the link and heartbeats it while the job lasts; stopped at rest,
    it is suspected by its neighbours and by no one else."""
    ring, by_endpoint = _ring_of(start_daemon, 4)
    daemons = list(by_endpoint.values())
    me, opposite = by_endpoint[ring[0]], by_endpoint[ring[2]]

    at_rest = {ring[1]: ("up", True), ring[2]: ("idle", False), ring[3]: ("up", True)}
    poll_until(lambda: _links(me) == at_rest, 30, "the ring neighbours alone linked and watched")
    assert _links(opposite)[ring[0]] == ("idle", False)

    ranks = spawn_spread([me, opposite], (1, 1), "multinode_hold.py", ["1024"], job="across")
    try:
        poll_until(lambda: _links(me)[ring[2]] == ("up", True), 30,
                   "the link the job uses to open, and its peer to be watched")
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    poll_until(lambda: _links(me)[ring[2]] == ("up", False), 30,
               "the job's peer no longer watched")

    before = {d.endpoint: _counter(d, "links_peer_suspected") for d in daemons}
    opposite.process.send_signal(signal.SIGSTOP)
    try:
        poll_until(lambda: all(_counter(by_endpoint[n], "links_peer_suspected")
                               > before[by_endpoint[n].endpoint] for n in (ring[1], ring[3])),
                   30, "the stopped daemon's neighbours to suspect it")
    finally:
        opposite.process.send_signal(signal.SIGCONT)
    assert _counter(me, "links_peer_suspected") == before[me.endpoint]
    for daemon in daemons:
        daemon.assert_alive()


@pytest.mark.fault
def test_a_member_lost_where_no_one_here_watches_it_fails_every_member_at_once(
    start_daemon: StartDaemon, tmp_path: Path,
) -> None:
    """A job on four daemons, each watching one job neighbour on either side: the
    daemon opposite the first is stopped mid-training.  The first does not watch
    it, yet its rank fails within seconds, naming it, on its neighbours' word
    (passed on by the coordinator), not at the collective's deadline."""
    ring, by_endpoint = _ring_of(start_daemon, 4)
    daemons = list(by_endpoint.values())
    victim = by_endpoint[ring[2]]
    job = next(name for name in (f"four-{i}" for i in range(1000))
               if coordinator_of(name, ring) != ring[2])
    ranks = spawn_spread([by_endpoint[e] for e in ring], (1, 1, 1, 1), "multinode_hold.py",
                         ["65536", str(tmp_path)], job=job)
    try:
        poll_until(lambda: len(list(tmp_path.glob("started-*"))) == 4, 60,
                   "every rank's first allreduce")
        before = _counter(by_endpoint[ring[0]], "links_peer_suspected")
        stopped = time.monotonic()
        victim.process.send_signal(signal.SIGSTOP)
        try:
            results = collect([ranks[0], ranks[1], ranks[3]], timeout_s=60)
        finally:
            victim.process.send_signal(signal.SIGCONT)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
    first = results[0].records()[-1]
    assert first["error"] in ("PeerLostError", "RankLostError"), first
    assert ring[2] in first["message"], first
    assert first["at"] - stopped < 15, first  # the declaration takes about 2 s
    assert _counter(by_endpoint[ring[0]], "links_peer_suspected") == before
    for daemon in daemons:
        daemon.assert_alive()


@pytest.mark.fault
def test_a_coordinator_lost_before_its_job_forms_is_named_by_its_standby(
    start_daemon: StartDaemon,
) -> None:
    """Ranks 0 and 2 of a world of 3 have joined, on the standby and on the
    coordinator; rank 1 has not.  The coordinator is killed: the standby knew that
    rank 2 was announced there, so rank 0 fails now, naming the lost daemon and
    the rank, not at its deadline (300 s)."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    daemons = [start_daemon(*peer_args(i, endpoints, "--insecure")) for i in range(3)]
    by_endpoint = dict(zip(endpoints, daemons, strict=True))
    for daemon in daemons:
        poll_until(lambda d=daemon: set(_peer_states(d).values()) == {"up"}, 30,  # type: ignore[misc]
                   f"every link of {daemon.endpoint} up")
    job, (coordinator, standby) = next(
        (name, coordinators_of(name, endpoints)) for name in (f"early-{i}" for i in range(1000))
        if coordinators_of(name, endpoints)[0] != endpoints[0])
    ranks = [spawn_rank("multinode_hold.py", ["1024"], by_endpoint[where].endpoint, rank, 3, 0, 1,
                        job) for rank, where in ((0, standby), (2, coordinator))]
    try:
        for rank, where in ((0, standby), (2, coordinator)):
            poll_until(lambda r=rank, w=where: str(r) in fetch_snapshot(  # type: ignore[misc]
                by_endpoint[w].endpoint + ".stats", 5.0)["jobs"].get(job, {}).get("members", {}),
                30, f"rank {rank} to join")
        killed = time.monotonic()
        by_endpoint[coordinator].process.kill()
        by_endpoint[coordinator].process.wait()
        (result,) = collect(ranks[:1], timeout_s=60)
    finally:
        for rank_process in ranks:
            if rank_process.poll() is None:
                rank_process.kill()
                rank_process.wait()
    outcome = result.records()[-1]
    assert outcome["error"] == "PeerLostError", result.stdout + result.stderr
    assert coordinator in outcome["message"] and "ranks [2]" in outcome["message"], outcome
    assert outcome["at"] - killed < 30, outcome
    by_endpoint[standby].assert_alive()


@pytest.mark.fault
def test_links_open_on_first_use_and_a_dead_coordinator_never_linked_is_given_up_on(
    start_daemon: StartDaemon,
) -> None:
    """Five daemons, one ring neighbour on either side: two that are not neighbours
    run a job over a link neither opened at start, and it closes once quiet
    after the job (`--link-idle-s`).  Then a daemon no member ever
    linked to is killed, and a job it would coordinate is started: the members
    open a link to it, give up on it when no handshake comes
    (`open_deadline_s`, 4 s by default), and the job forms at the next
    coordinator."""
    ring, by_endpoint = _ring_of(start_daemon, 5, "--link-idle-s", "1")
    endpoints = list(by_endpoint)
    first, second, third = (by_endpoint[ring[i]] for i in (0, 1, 2))
    assert _peer_states(first)[ring[2]] == "idle" and _peer_states(third)[ring[0]] == "idle"

    # Not neighbours: the job's first messages open the links.
    apart = next(name for name in (f"apart-{i}" for i in range(1000))
                 if coordinators_of(name, endpoints) == (ring[0], ring[2]))
    results = run_spread([first, third], (1, 1), "multinode_allreduce.py",
                         ["ring,star", "float32", "sum"], job=apart)
    assert [r.records()[-1]["failures"] for r in results] == [0, 0]
    assert f"opening the link to {ring[2]} (first use)" in first.log()
    assert f"opening the link to {ring[0]} (first use)" in third.log()
    # The job over, nothing keeps those links: quiet for `--link-idle-s`, they close.
    poll_until(lambda: _peer_states(first)[ring[2]] == _peer_states(third)[ring[0]] == "idle",
               30, "the links the ended job used to close")

    # ring[3] is a neighbour of neither ring[0] nor ring[1]: they have no link to it.
    dead = by_endpoint[ring[3]]
    assert _peer_states(first)[ring[3]] == _peer_states(second)[ring[3]] == "idle"
    dead.process.kill()
    dead.process.wait()
    job = next(name for name in (f"orphan-{i}" for i in range(1000))
               if coordinators_of(name, endpoints)[0] == ring[3]
               and coordinators_of(name, endpoints)[1] in (ring[0], ring[1]))
    started = time.monotonic()
    results = run_spread([first, second], (1, 1), "multinode_allreduce.py",
                         ["ring", "float32", "sum"], job=job)
    assert [r.records()[-1]["failures"] for r in results] == [0, 0]
    assert time.monotonic() - started < 60
    for daemon in (first, second):
        # The job may form (at the standby) before the later of the two members' own
        # 4 s runs out: each gives the dead daemon up within it of opening its link.
        poll_until(lambda d=daemon: _peer_states(d)[ring[3]] == "lost", 30,  # type: ignore[misc]
                   f"{daemon.endpoint} to give {ring[3]} up")
        assert f"peer {ring[3]} lost: no answer within 4s of opening the link" in daemon.log()
    for daemon in (first, second, third):
        daemon.assert_alive()


def test_ten_daemons_on_the_shipped_defaults_link_their_neighbours_and_open_the_rest_on_use(
    start_daemon: StartDaemon, short_tmp: str,
) -> None:
    """Past 2N+1 daemons (ten: N = log2 10 rounded up, 4) the shipped defaults
    connect each daemon at start to its 8 ring neighbours only, over CURVE.  A
    job of all ten, a rank each, runs ring, tree and halving-doubling
    allreduces, matching numpy, over those links and the ones opened on first
    use (the coordinator's formation to every member, partners beyond the
    neighbours)."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(10)]
    keys = curve_args(Path(short_tmp) / "keys", endpoints)
    daemons = [start_daemon(*peer_args(i, endpoints, *keys[i])) for i in range(10)]
    for endpoint, daemon in zip(endpoints, daemons, strict=True):
        poll_until(lambda d=daemon: sorted(_peer_states(d).values())  # type: ignore[misc]
                   == ["idle"] + ["up"] * 8, 60,
                   f"{endpoint} to link its 8 ring neighbours and no one else")
    results = run_spread(daemons, (1,) * 10, "multinode_allreduce.py",
                         ["ring,tree,rhd", "float32", "sum"], job="ten", timeout_s=180)
    assert [r.records()[-1]["failures"] for r in results] == [0] * 10
    assert any("(first use)" in daemon.log() for daemon in daemons)
    for daemon in daemons:
        daemon.assert_alive()
