"""A formation on the wire: the coordinator's `Formed` parts, and a member's
assembly of them into the same `Formation` (membership.py).

A formation names every member daemon and its ranks, so it grows with the
job: a job of a thousand daemons does not fit one header frame (64 KiB).  The
coordinator splits the member list into parts that do; a member keeps the
parts of one generation until it holds them all, then checks them as strictly
as any message (every rank exactly once, the generation the hash of the
members' runs) before it trusts them.
"""

from __future__ import annotations

import dataclasses

from gradsync.daemon.core.membership import Formation, generation_of
from gradsync.protocol.errors import ProtocolError
from gradsync.protocol.peer import MAX_FORMED_MEMBERS, Formed, FormedMember

#: Header bytes a part's members may take, by the estimate below (a header
#: frame holds 64 KiB; the other fields, a job name of 128 characters among
#: them, take under 2 KiB).
PART_BYTES = 62 * 1024


def _wire_bytes(member: FormedMember) -> int:
    """An upper bound on a member's msgpack size: its endpoint, two 64-bit
    integers, and at most 5 bytes per rank."""
    return len(member[0].encode()) + 24 + 5 * len(member[3])


def formed_parts(job: str, world_size: int, formation: Formation) -> list[Formed]:
    """`formation` as `Formed` parts that each fit one header frame."""
    members: list[FormedMember] = [
        (daemon, boot, incarnation, ranks)
        for daemon, ranks, (boot, incarnation)
        in zip(formation.daemons, formation.ranks_by_daemon, formation.runs, strict=True)
    ]
    parts: list[tuple[int, list[FormedMember]]] = []
    size = PART_BYTES
    for index, member in enumerate(members):
        cost = _wire_bytes(member)
        if size + cost > PART_BYTES or len(parts[-1][1]) >= MAX_FORMED_MEMBERS:
            parts.append((index, []))
            size = 0
        parts[-1][1].append(member)
        size += cost
    return [
        Formed(job, formation.generation, world_size, len(members), first, tuple(part),
               formation.alpha_s, formation.beta_s_per_byte, formation.codec_Bps,
               formation.loopback, formation.links_measured)
        for first, part in parts
    ]


@dataclasses.dataclass
class _Assembling:
    first: Formed
    parts: dict[int, tuple[FormedMember, ...]]
    held: int = 0


class FormedAssembly:
    """The `Formed` parts a member holds, per job, until one generation is whole."""

    def __init__(self) -> None:
        self._by_job: dict[str, _Assembling] = {}

    def add(self, message: Formed) -> Formation | None:
        """Keep one part; the formation once every part of its generation is here.

        A part of another generation than the one assembling replaces it (the
        coordinator sends a newer generation whole).  Raises `ProtocolError` if
        the parts disagree or the whole is not a formation of the job.
        """
        held = self._by_job.get(message.job)
        if held is None or (held.first.gen, held.first.members) != (message.gen, message.members):
            held = self._by_job[message.job] = _Assembling(message, {})
        if _figures(held.first) != _figures(message):
            del self._by_job[message.job]
            raise ProtocolError(f"formed: parts of job {message.job!r} generation "
                                f"{message.gen:x} disagree")
        if message.first not in held.parts:
            held.parts[message.first] = message.part
            held.held += len(message.part)
        if held.held < message.members:
            return None
        del self._by_job[message.job]
        return _whole(held)

    def forget(self, job: str) -> None:
        self._by_job.pop(job, None)


def _figures(message: Formed) -> tuple[object, ...]:
    return (message.world_size, message.alpha_s, message.beta_s_per_byte, message.codec_Bps,
            message.loopback, message.measured)


def _whole(held: _Assembling) -> Formation:
    first = held.first
    members: list[FormedMember] = []
    for start in sorted(held.parts):
        if start != len(members):
            raise ProtocolError(f"formed: parts of job {first.job!r} overlap or leave gaps")
        members.extend(held.parts[start])
    daemons = [member[0] for member in members]
    ranks = sorted(rank for member in members for rank in member[3])
    if len(set(daemons)) != len(daemons) or ranks != list(range(first.world_size)):
        raise ProtocolError(f"formed: job {first.job!r} does not hold every rank of "
                            f"{first.world_size} exactly once on distinct daemons")
    if [member[3][0] for member in members] != sorted(member[3][0] for member in members):
        raise ProtocolError(f"formed: members of job {first.job!r} are not in rank order")
    if generation_of((d, b, i) for d, b, i, _ in members) != first.gen:
        raise ProtocolError(f"formed: generation {first.gen:x} of job {first.job!r} is not "
                            "its members' runs")
    return Formation(
        daemons=tuple(daemons),
        ranks_by_daemon=tuple(member[3] for member in members),
        generation=first.gen,
        alpha_s=first.alpha_s,
        beta_s_per_byte=first.beta_s_per_byte,
        codec_Bps=first.codec_Bps,
        loopback=first.loopback,
        links_measured=first.measured,
        runs=tuple((boot, incarnation) for _, boot, incarnation, _ in members),
    )
