"""Membership at scale, simulated (issue 48, part 2): what forming a job, detecting
a lost daemon and resting cost each daemon, for M = 4 to 1,024 daemons.

The daemons' cores run in this one process, unchanged: each daemon is a real
`ClusterJobs` (daemon/core/cluster.py) on a fake transport, and a lost daemon is
judged by a real `FailureDetector` (daemon/core/failure_detector.py) on an
injected clock.  Messages go through a simulated network (every hop `ALPHA_S`)
in a discrete-event loop; each daemon handles one message at a time, for as long
as its core really took on this CPU, so the simulated times include the cores'
own work.  Nothing is sent on a socket.

- **form**: every daemon holds one rank of a job of M ranks; all announce at t=0
  (to the job's coordinator, daemon/core/coordinating.py); the job is formed
  on a daemon once its core says so.
- **detect**: one daemon vanishes.  A watcher's detector (default settings)
  hears every other peer's heartbeats, suspects the silent one, asks its
  witnesses (they have not heard it either) and declares it; then every
  survivor's core is told the peer was lost and ends the job (the failure
  news: withdrawals to the coordinator, and its word to the members).
- **rest**: heartbeats and the DEALER's pings per second per daemon, from the
  links' schedule (daemon/peers/health.py): one of each per watched peer (its
  ring neighbours, daemon/core/watching.py) per interval, each answered.
- **links**: the connections a daemon holds (daemon/peers/links.py): to its
  ring neighbours from the start, and to each other daemon it sent to, opened
  on first use; ZeroMQ's own heartbeats run on each.

    python -m benchmarks.membership_scale            # the RESULTS.md table
    python -m benchmarks.membership_scale --sizes 4,64 --json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import heapq
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.daemon.config import DaemonConfig
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.failure_detector import (
    Ask,
    DetectorTimings,
    FailureDetector,
    Verdict,
)
from gradsync.daemon.core.matching import CollectiveCall, Job, Member
from gradsync.daemon.core.watching import ring_neighbours
from gradsync.daemon.peers.health import _DEALER_PING_IVL_S
from gradsync.protocol.errors import GradsyncError

#: One hop across the simulated network, in seconds (a LAN's latency).
ALPHA_S = 50e-6
JOB = "sim"


def endpoint_of(index: int) -> str:
    """A daemon's name in the simulation (no socket is ever opened)."""
    return f"tcp://10.{index // 65536}.{index // 256 % 256}.{index % 256}:29400"


class Network:
    """The simulated wire: messages in flight, each daemon's busy time, counts."""

    def __init__(self) -> None:
        self.now = 0.0
        self._in_flight: list[tuple[float, int, str, str, dict[str, Any]]] = []
        self._order = itertools.count()
        self._busy_until: dict[str, float] = collections.defaultdict(float)
        self._outbox: list[tuple[str, str, dict[str, Any]]] = []
        self.sent: collections.Counter[str] = collections.Counter()
        self.received: collections.Counter[str] = collections.Counter()
        #: Daemons gone: the links drop what is sent to them.
        self.down: set[str] = set()
        #: The peers each daemon holds a link to: opened at start or on first use.
        self.linked: dict[str, set[str]] = collections.defaultdict(set)

    def post(self, src: str, dst: str, header: dict[str, Any]) -> None:
        if dst != src:
            self.linked[src].add(dst)
        if dst != src and dst not in self.down:  # nor what a daemon sends itself
            self.sent[src] += 1
            self.received[dst] += 1
            self._outbox.append((src, dst, header))

    def run(self, daemon: str, at: float, work: Callable[[], None]) -> float:
        """Let `daemon` do `work` once it is free after `at`; what it sent leaves
        when it is done.  When it was done."""
        start = max(at, self._busy_until[daemon])
        self.now = start
        began = time.perf_counter()
        work()
        done = start + time.perf_counter() - began
        self._busy_until[daemon] = done
        for src, dst, header in self._outbox:
            heapq.heappush(self._in_flight, (done + ALPHA_S, next(self._order), src, dst, header))
        self._outbox.clear()
        return done

    def next_message(self) -> tuple[float, str, str, dict[str, Any]] | None:
        if not self._in_flight:
            return None
        at, _, src, dst, header = heapq.heappop(self._in_flight)
        return at, src, dst, header


class SimTransport:
    """One daemon's `PeerTransport` on the simulated network."""

    def __init__(self, endpoint: str, peers: Sequence[str], network: Network) -> None:
        self.endpoint = endpoint
        self._peers = peers
        self._network = network

    @property
    def peers(self) -> Sequence[str]:
        return self._peers

    def post(self, peer: str, header: dict[str, Any], payloads: Sequence[Any] = (),
             zero_copy: bool = False) -> Any:
        self._network.post(self.endpoint, peer, header)
        return None

    def link_costs(self) -> tuple[float, float] | None:
        return ALPHA_S, 1e-9

    def reachable(self, peer: str) -> bool:
        return peer not in self._network.down


class NoCollectives:
    """The failure path of daemons that run no collectives here: nothing to answer."""

    def fail(self, pending: CollectiveCall, error: GradsyncError) -> None:
        pass


@dataclasses.dataclass
class Phase:
    """What one phase cost: messages per daemon (the most of any daemon), in all,
    and the simulated time until its end."""

    sent_per_daemon: int
    received_per_daemon: int
    total: int
    time_s: float


@dataclasses.dataclass
class Row:
    daemons: int
    form: Phase
    declare_s: float
    witnesses_asked: int
    news: Phase
    rest_per_daemon_s: float
    #: Links a daemon opens at start (its ring neighbours), and after the job
    #: formed and ended: the most any daemon holds (the coordinator), and in all.
    links_at_start: int
    links_most: int
    links_total: int
    wall_s: float


class Cluster:
    """M daemons' cores on one simulated network."""

    def __init__(self, size: int) -> None:
        self.network = Network()
        self.endpoints = [endpoint_of(i) for i in range(size)]
        self.cores: dict[str, ClusterJobs] = {}
        self.jobs: dict[str, Job] = {}
        for rank, endpoint in enumerate(self.endpoints):
            jobs: dict[str, Job] = {}
            core = ClusterJobs(DaemonConfig(), jobs, lambda: self.network.now)
            core.connect(SimTransport(endpoint, self.endpoints, self.network), NoCollectives())
            self.network.linked[endpoint].update(
                ring_neighbours(endpoint, self.endpoints) or set(self.endpoints) - {endpoint})
            job = Job(JOB, size, 1, lambda: self.network.now)
            job.add_member(Member(rank, 0, 1000 + rank, rank))
            jobs[JOB] = job
            self.cores[endpoint], self.jobs[endpoint] = core, job

    def deliver(self, done: dict[str, float], settled: Callable[[Job], bool]) -> float:
        """Deliver until nothing is in flight; `done[d]`: when `settled` first held
        on daemon d.  When the last message was handled."""
        last = 0.0
        while (message := self.network.next_message()) is not None:
            at, src, dst, header = message
            core, job = self.cores[dst], self.jobs[dst]
            last = self.network.run(dst, at, lambda c=core, s=src, h=header:  # type: ignore[misc]
                                    c.on_message(s, h, ()))
            if dst not in done and settled(job):
                done[dst] = last
        return last

    def phase(self, since: tuple[collections.Counter[str], collections.Counter[str]],
              time_s: float) -> Phase:
        sent = self.network.sent - since[0]
        received = self.network.received - since[1]
        return Phase(max(sent.values(), default=0), max(received.values(), default=0),
                     sum(sent.values()), time_s)

    def counts(self) -> tuple[collections.Counter[str], collections.Counter[str]]:
        return collections.Counter(self.network.sent), collections.Counter(self.network.received)

    def form(self) -> Phase:
        before = self.counts()
        formed: dict[str, float] = {}
        for endpoint in self.endpoints:
            core, job = self.cores[endpoint], self.jobs[endpoint]
            self.network.run(endpoint, 0.0, lambda c=core, j=job: c.local_complete(j))  # type: ignore[misc]
        self.deliver(formed, lambda job: job.across.formation is not None)
        generations = {job.across.formation.generation if job.across.formation else None
                       for job in self.jobs.values()}
        if len(formed) != len(self.endpoints) or len(generations) != 1:
            raise RuntimeError(f"the job did not form alike on every daemon: {len(formed)} "
                               f"of {len(self.endpoints)} formed, generations {generations}")
        return self.phase(before, max(formed.values()))

    def lose(self, victim: str, declared_s: float) -> Phase:
        """Every survivor's core hears at `declared_s` that `victim` was lost."""
        self.network.down.add(victim)
        before = self.counts()
        broken: dict[str, float] = {}
        survivors = [e for e in self.endpoints if e != victim]
        for endpoint in survivors:
            core = self.cores[endpoint]
            self.network.run(endpoint, declared_s,
                             lambda c=core: c.peer_lost(victim, "simulated"))  # type: ignore[misc]
        last = self.deliver(broken, lambda job: job.broken is not None)
        for endpoint in survivors:
            if self.jobs[endpoint].broken is None:
                raise RuntimeError(f"{endpoint} did not end the job")
        return self.phase(before, max(last, declared_s) - declared_s)


def detect(size: int) -> tuple[float, int]:
    """One watcher's detector with default settings, `size - 1` peers heard every
    heartbeat interval, one of which falls silent at t=1 s: (seconds from the
    silence to the verdict, witnesses asked)."""
    now = [0.0]
    timings = DetectorTimings.for_timeout(DaemonConfig().peer_timeout_s)
    detector = FailureDetector(timings, lambda: now[0])
    peers = [endpoint_of(i) for i in range(1, size)]
    victim = peers[-1]
    for peer in peers:
        detector.watch(peer)
    silent_from, asked = 1.0, 0
    while now[0] < 60.0:
        now[0] += timings.ping_ivl_s
        for peer in peers:
            if peer != victim or now[0] < silent_from:
                detector.heard(peer)
        for action in detector.tick():
            if isinstance(action, Ask):
                asked += len(action.witnesses)
                for witness in action.witnesses:  # they have not heard it either
                    detector.witness_said(action.peer, witness, None)
            elif isinstance(action, Verdict) and action.peer == victim:
                return now[0] - silent_from, asked
    raise RuntimeError("the silent peer was never declared")


def at_rest_per_daemon_s(size: int) -> float:
    """Messages a daemon sends and receives per second with no job: a heartbeat
    on `live` every `ping_ivl_s` and a DEALER ping every second, to every peer it
    watches (its ring neighbours: daemon/core/watching.py, or every peer in a
    small cluster), each answered (daemon/peers/health.py); its neighbours do
    the same to it."""
    timings = DetectorTimings.for_timeout(DaemonConfig().peer_timeout_s)
    per_peer = 1 / timings.ping_ivl_s + 1 / _DEALER_PING_IVL_S
    me, *others = (endpoint_of(i) for i in range(size))
    neighbours = ring_neighbours(me, others)
    watched = len(others) if neighbours is None else len(neighbours)
    return 2 * 2 * per_peer * watched  # sent and received; pings and answers


def measure(size: int) -> Row:
    started = time.perf_counter()
    cluster = Cluster(size)
    at_start = len(cluster.network.linked[cluster.endpoints[0]])
    form = cluster.form()
    declare_s, asked = detect(size)
    news = cluster.lose(cluster.endpoints[-1], form.time_s + declare_s)
    links = [len(peers) for peers in cluster.network.linked.values()]
    return Row(size, form, declare_s, asked, news, at_rest_per_daemon_s(size),
               at_start, max(links), sum(links), time.perf_counter() - started)


def table(rows: Sequence[Row]) -> str:
    lines = [
        "| M | form: sent / received per daemon | form: all | form: time | declare | "
        "witnesses asked | news: sent per daemon | news: all | at rest, per daemon | "
        "links: at start / most / all |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.daemons} "
            f"| {row.form.sent_per_daemon} / {row.form.received_per_daemon} "
            f"| {row.form.total:,} | {row.form.time_s * 1e3:.1f} ms "
            f"| {row.declare_s:.1f} s | {row.witnesses_asked} "
            f"| {row.news.sent_per_daemon} | {row.news.total:,} "
            f"| {row.rest_per_daemon_s:,.0f} msg/s "
            f"| {row.links_at_start} / {row.links_most:,} / {row.links_total:,} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,64,256,1024",
                        help="daemon counts, comma-separated (default 4,64,256,1024)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    logging.getLogger("gradsync").setLevel(logging.ERROR)  # M daemons' news, M times
    rows = [measure(int(size)) for size in args.sizes.split(",")]
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows], indent=1))
    else:
        print(table(rows))
        print(f"\nsimulation wall time: "
              f"{', '.join(f'{r.daemons}: {r.wall_s:.1f} s' for r in rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
