"""Which daemons hold which ranks of a multi-node job, and when it is formed.

Each daemon announces a job once all of its local ranks have joined: the
ranks it holds, an incarnation number (new every time the job is created on
that daemon) and its measured link costs.  It sends the announcement to two
daemons only: the job's coordinator and its standby (`coordinators_of`: picked
from the job's name among the daemons it can reach, so every daemon picks the
same ones, and jobs spread over daemons).  A job is formed when the coordinator's
announcements cover every rank exactly once: it derives the member order (by
lowest rank held), the generation (a hash of every member's incarnation) and
the cost-model inputs (`form`), and sends them to every member (`Formed`).
So forming a job of M daemons takes 3(M - 1) messages, not M(M - 1).  After a
failure the job is created anew on each daemon, with new incarnations, hence
a new generation: messages of the old one are recognisable and dropped.

Incarnations grow within one run of a daemon (from 1), not across restarts: so
every announcement also names the daemon's `BOOT`, random per start, and
incarnations are only compared within one boot.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import secrets
import statistics
from collections.abc import Iterable

from gradsync.protocol.peer import Announce

_incarnations = itertools.count(1)


#: This run of the daemon (see the module docstring).
BOOT = secrets.randbits(62)


def new_incarnation() -> int:
    """A number no earlier creation of a job on this daemon has used."""
    return next(_incarnations)


@dataclasses.dataclass(frozen=True)
class Announcement:
    """One daemon's share of a job: the announce message it sent (or will send), and
    which daemon that is (the links name the sender; the message does not)."""

    daemon: str
    share: Announce


@dataclasses.dataclass(frozen=True)
class Formation:
    """A formed job: member daemons in their agreed order, and its generation."""

    daemons: tuple[str, ...]
    ranks_by_daemon: tuple[tuple[int, ...], ...]
    generation: int
    alpha_s: float
    beta_s_per_byte: float
    #: For `auto` compression (core/compression_policy.py): each codec rate every
    #: member announced, at the slowest member's; whether every member's peers
    #: are all on its own host; whether every member had measured its links.
    codec_Bps: tuple[tuple[str, float], ...] = ()
    loopback: bool = False
    links_measured: bool = True
    #: Each member's (boot, incarnation) of the job, in member order.
    runs: tuple[tuple[int, int], ...] = ()

    def index_of(self, daemon: str) -> int:
        return self.daemons.index(daemon)

    def run_of(self, daemon: str) -> tuple[int, int]:
        """The (boot, incarnation) of `daemon`'s share of this generation."""
        return self.runs[self.index_of(daemon)]


def generation_of(members: Iterable[tuple[str, int, int]]) -> int:
    """The generation of a formation of these (daemon, boot, incarnation), in order."""
    digest = hashlib.blake2b(digest_size=8)
    for daemon, boot, incarnation in members:
        digest.update(f"{daemon}|{boot}|{incarnation};".encode())
    return int.from_bytes(digest.digest(), "big") >> 1


def coordinators_of(job: str, daemons: Iterable[str], count: int = 2) -> tuple[str, ...]:
    """Of `daemons`, the `count` with the highest hashes of the job's name with
    theirs (rendezvous hashing), best first: the job's coordinator, then its
    standby.  Every daemon that can reach the same daemons picks the same ones,
    jobs spread over daemons, and a daemon lost moves only the jobs it
    coordinated, to their standby, which already holds their announcements."""
    return tuple(sorted(daemons, key=lambda daemon: _rank(job, daemon), reverse=True)[:count])


def coordinator_of(job: str, daemons: Iterable[str]) -> str:
    """The job's coordinator among `daemons` (`coordinators_of`), in one pass: the
    links ask for it every heartbeat interval (ClusterJobs.peers_in_use)."""
    return max(daemons, key=lambda daemon: _rank(job, daemon))


def _rank(job: str, daemon: str) -> tuple[bytes, str]:
    return hashlib.blake2b(f"{job}|{daemon}".encode(), digest_size=8).digest(), daemon


def form(announcements: dict[str, Announcement], world_size: int) -> Formation | None:
    """The formation if the announcements cover ranks 0..world_size-1 exactly once."""
    if any(a.share.world_size != world_size for a in announcements.values()):
        return None
    covered: set[int] = set()
    for announcement in announcements.values():
        if covered & set(announcement.share.ranks):
            return None
        covered |= set(announcement.share.ranks)
    if covered != set(range(world_size)):
        return None
    ordered = sorted(announcements.values(), key=lambda a: a.share.ranks[0])
    return Formation(
        daemons=tuple(a.daemon for a in ordered),
        ranks_by_daemon=tuple(a.share.ranks for a in ordered),
        generation=generation_of((a.daemon, a.share.boot, a.share.incarnation) for a in ordered),
        # Every daemon derives the same figures from the same announcements: the
        # median, so one daemon's probe taken under start-up load does not decide.
        alpha_s=statistics.median(a.share.alpha_s for a in ordered),
        beta_s_per_byte=statistics.median(a.share.beta_s_per_byte for a in ordered),
        codec_Bps=slowest_codecs(a.share for a in ordered),
        loopback=all(a.share.loopback for a in ordered),
        links_measured=not any(a.share.unmeasured for a in ordered),
        runs=tuple((a.share.boot, a.share.incarnation) for a in ordered),
    )


def slowest_codecs(shares: Iterable[Announce]) -> tuple[tuple[str, float], ...]:
    """Each codec rate every share announced, at its lowest: every member codes
    every hop, so the slowest sets the pace."""
    rates: dict[str, float] | None = None
    for share in shares:
        own = dict(share.codec_Bps)
        rates = own if rates is None else {
            name: min(rate, own[name]) for name, rate in rates.items() if name in own}
    return tuple(sorted((rates or {}).items()))


def conflicts(announcements: dict[str, Announcement], world_size: int) -> str | None:
    """Why these announcements can never form a job (overlap, sizes), or None."""
    owners: dict[int, str] = {}
    for announcement in announcements.values():
        if announcement.share.world_size != world_size:
            return (
                f"daemon {announcement.daemon} says world_size={announcement.share.world_size}, "
                f"this daemon's clients say {world_size}"
            )
        for rank in announcement.share.ranks:
            if rank in owners:
                return f"rank {rank} is held by both {owners[rank]} and {announcement.daemon}"
            owners[rank] = announcement.daemon
    return None


def ranks_not_here(members: Iterable[int], world_size: int) -> list[int]:
    """Ranks of a job of `world_size` that this daemon's `members` do not hold:
    a member knows no more of a job that has not formed (its coordinator does)."""
    return sorted(set(range(world_size)) - set(members))


#: Withdrawals remembered, to drop an announcement they overtook.
WITHDRAWALS_KEPT = 4096


class Withdrawals:
    """The newest incarnation each peer withdrew of each job, per boot of that
    peer: an announcement no newer than it, from the same boot, was overtaken
    by it (a withdrawal takes the data stream, an announcement ZeroMQ)."""

    def __init__(self) -> None:
        #: (job, peer) -> (boot, newest incarnation withdrawn), oldest first.
        self._newest: collections.OrderedDict[tuple[str, str], tuple[int, int]] = (
            collections.OrderedDict()
        )

    def remember(self, job: str, peer: str, boot: int, incarnation: int) -> None:
        key = (job, peer)
        previous = self._newest.pop(key, None)
        if previous is not None and previous[0] == boot:
            incarnation = max(incarnation, previous[1])
        self._newest[key] = (boot, incarnation)
        while len(self._newest) > WITHDRAWALS_KEPT:
            self._newest.popitem(last=False)

    def overtook(self, job: str, peer: str, boot: int, incarnation: int) -> bool:
        """True if an announcement of this boot and incarnation is stale."""
        withdrawn = self._newest.get((job, peer))
        return withdrawn is not None and withdrawn[0] == boot and withdrawn[1] >= incarnation
