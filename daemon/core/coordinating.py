"""The jobs this daemon coordinates: it gathers their announcements, forms
them, tells the members, and passes on the first member's withdrawal.

Every daemon of a job sends its announcement and its withdrawal to the job's
coordinator and its standby only (membership.py `coordinators_of`), which may
hold no rank of the job.  The standby keeps the announcements and does
nothing else while the coordinator is up: once it is lost, the standby is the
coordinator, and knows which of the job's ranks were announced where.  Behind
a partial cut, daemons that reach different peers pick different
coordinators: a member that cannot reach the coordinator others picked
announces to the next daemon as its coordinator (`Announce.lead`), and a
standby that holds every rank and was picked so by one of them forms the
job, so a coordinator out of some members' reach does not stop it.

The coordinator keeps what every daemon used to keep of every peer: the
announcements by daemon, and which withdrawal overtook which announcement.
From them it forms the job and sends each member the formation (`Formed`);
the first withdrawal of a formed generation it passes on to the other members
(`Left`), who then withdraw too, to it (and the standby) alone.  Forming a job
of M daemons, and ending it, so take O(M) messages, not O(M²).
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.daemon.core.cluster_context import ClusterContext, Send, log
from gradsync.daemon.core.formed_parts import formed_parts
from gradsync.daemon.core.membership import (
    Announcement,
    Formation,
    Withdrawals,
    conflicts,
    coordinator_of,
    form,
)
from gradsync.daemon.core.unformed import UnformedJobs
from gradsync.protocol.errors import PeerLostError
from gradsync.protocol.peer import Announce, Left, Unformable, Withdraw

#: Jobs whose announcements or formation are kept, at most (the oldest go first:
#: a job whose members' withdrawals went to another coordinator is never ended here).
JOBS_KEPT = 4096


class JobCoordination:
    """Announcements, formations and withdrawals of the jobs coordinated here."""

    def __init__(self, context: ClusterContext, unformed: UnformedJobs, send: Send) -> None:
        self.context = context
        self.unformed = unformed
        self.send = send
        #: Each job's announcements, by daemon.
        self.tables: dict[str, dict[str, Announcement]] = {}
        #: How many ranks each job's announcements hold in all (kept as they
        #: change, so that an announcement costs O(1) until they may cover all).
        self.held: dict[str, int] = {}
        #: The newest incarnation of each (job, daemon) that daemon withdrew.
        self.withdrawn = Withdrawals()
        #: The generation of each job last formed and sent, until it ends.
        self.formed: dict[str, Formation] = {}

    def on_announce(self, daemon: str, message: Announce) -> None:
        if self.withdrawn.overtook(message.job, daemon, message.boot, message.incarnation):
            self.context.counters.stale_membership += 1  # its withdrawal overtook it
            return
        name = message.job
        if name not in self.tables and len(self.tables) >= JOBS_KEPT:
            oldest = next(iter(self.tables))
            del self.tables[oldest], self.held[oldest]
        table = self.tables.setdefault(name, {})
        previous = table.get(daemon)
        table[daemon] = Announcement(daemon, message)
        self.held[name] = (self.held.get(name, 0) + len(message.ranks)
                           - (len(previous.share.ranks) if previous is not None else 0))
        formation = self.formed.get(name)
        if (formation is not None and daemon in formation.daemons
                and formation.run_of(daemon) != (message.boot, message.incarnation)):
            # Its ranks restarted and created the job anew: this generation cannot go on.
            self._tell_left(name, formation, daemon, Withdraw(
                name, formation.run_of(daemon)[1], formation.run_of(daemon)[0],
                "re-created the job (its ranks restarted); this generation cannot continue",
                PeerLostError.code, daemon, False))
        self._try_form(name, daemon)

    def _try_form(self, name: str, announcer: str) -> None:
        table = self.tables[name]
        world_size = table[announcer].share.world_size
        if self.held[name] < world_size:
            return
        if (coordinator_of(name, self.context.reachable()) != self.context.transport.endpoint
                and not any(announcement.share.lead for announcement in table.values())):
            # The standby: it only keeps the announcements, should it take over.
            # Unless a member picked it as coordinator: that member cannot reach
            # the one picked here (a partial cut), which then never hears from it.
            return
        problem = conflicts(table, world_size)
        if problem is not None:
            log.warning("job %r cannot form yet: %s", name, problem)
            return
        formation = form(table, world_size)
        if formation is None:
            return
        sent = self.formed.get(name)
        if sent is not None and sent.generation == formation.generation:
            self._tell_formed(name, formation, (announcer,))  # it asks again
            return
        self.formed.pop(name, None)
        self.formed[name] = formation
        while len(self.formed) > JOBS_KEPT:
            del self.formed[next(iter(self.formed))]
        log.debug("job %r formed across %d daemons (generation %x), coordinated here",
                  name, len(formation.daemons), formation.generation)
        self._tell_formed(name, formation, formation.daemons)

    def _tell_formed(self, name: str, formation: Formation, members: Sequence[str]) -> None:
        world_size = sum(len(ranks) for ranks in formation.ranks_by_daemon)
        parts = [part.to_wire() for part in formed_parts(name, world_size, formation)]
        for daemon in members:
            for part in parts:
                self.send(daemon, part)

    def peer_up(self, peer: str) -> None:
        """A link (re)connected: a formation sent while it was down did not reach it."""
        for name, formation in list(self.formed.items()):
            if peer in formation.daemons:
                self._tell_formed(name, formation, (peer,))

    def on_withdraw(self, daemon: str, message: Withdraw) -> None:
        """A daemon's part of a job ended (see forming.py `JobForming.withdraw`).

        A withdrawal takes the data stream, behind the sender's slices, and an
        announcement ZeroMQ, so the two can pass each other: incarnations grow
        within each run of a daemon (its `boot`), and a withdrawal older than
        the announcement held from the same boot is dropped, as is an
        announcement no newer than a withdrawal heard from the same boot.
        """
        name, incarnation, boot = message.job, message.incarnation, message.boot
        table = self.tables.get(name, {})
        held = table.get(daemon)
        if held is not None and held.share.boot == boot and held.share.incarnation > incarnation:
            self.context.counters.stale_membership += 1
            return
        self.withdrawn.remember(name, daemon, boot, incarnation)
        if held is not None:
            self._drop(name, daemon)
        formation = self.formed.get(name)
        if (formation is not None and daemon in formation.daemons
                and formation.run_of(daemon) == (boot, incarnation)):
            self._tell_left(name, formation, daemon, message)

    def _tell_left(self, name: str, formation: Formation, daemon: str,
                   message: Withdraw) -> None:
        """The first member to leave a generation: every other member hears it
        (once: they withdraw in turn, and that is no news to anyone)."""
        del self.formed[name]
        left = Left(name, formation.generation, daemon, message.reason, message.code,
                    message.origin, message.clean, message.lost).to_wire()
        for member in formation.daemons:
            if member != daemon:
                self.send(member, left)

    def _drop(self, name: str, daemon: str) -> None:
        table = self.tables[name]
        self.held[name] -= len(table.pop(daemon).share.ranks)
        if not table:
            del self.tables[name], self.held[name]

    def peer_lost(self, peer: str, why: str) -> None:
        """`peer` was lost: its announcements are void, and a job it announced that
        has not formed never will: every other announcer's ranks fail now.  Said
        by the job's coordinator, or by its standby where the lost one was the
        coordinator."""
        told: list[tuple[str, Unformable]] = []
        reachable, endpoint = self.context.reachable(), self.context.transport.endpoint
        for name, table in list(self.tables.items()):
            lost = table.get(peer)
            if lost is not None:
                self._drop(name, peer)
            if (lost is None or name in self.formed  # its members see the loss themselves
                    or coordinator_of(name, reachable) != endpoint):  # the coordinator's to say
                continue
            error = PeerLostError(
                f"peer daemon {peer} of job {name!r} was lost ({why}) before the job "
                f"formed; ranks {list(lost.share.ranks)} can join on no other daemon",
                {"job": name, "peer": peer, "missing": list(lost.share.ranks)},
            )
            told += [(daemon, Unformable(name, a.share.boot, a.share.incarnation,
                                         error.message, error.code, peer))
                     for daemon, a in table.items()]
            self.unformed.remember(name, [peer], error)
        for daemon, message in told:  # after the loop: one told here withdraws at once
            self.send(daemon, message.to_wire())
