"""What an inter-daemon collective schedule is, and the rules every schedule obeys.

A schedule is a pure description, for one daemon (rank `rank` of `size`), of
which element ranges of the buffer it sends to whom and receives from whom at
each step.  Algorithms build them (`ring.py`, `rhd.py`, `tree.py`, `star.py`);
the executor runs them over the peer links; `simulate.py` runs them on arrays.

Rules (checked by `check_schedules`, relied on by the executor):

* Every daemon's schedule has the same number of steps; a step may be empty.
* Within one step every send reads the buffer as it was at the start of the
  step, and every receive is applied after all of them have read it.
* Ranges are non-empty and inside ``[0, count)``; zero-length transfers never
  appear (empty slices of short buffers are simply left out).
* On one daemon within one step no receive overlaps a send, and a copying
  receive overlaps no other receive, so sends can go zero-copy from the buffer
  while copies land concurrently.  Reducing receives may overlap each other
  (a tree node combines both children's chunk at once): the executor applies
  those one after another, in the order the step lists them, so results are
  deterministic.  Sends may overlap each other (a broadcast sends one range to
  several peers).
* Pairing: for each step and each ordered pair of daemons (a, b), the ranges a
  sends to b, in order, equal the ranges b receives from a, in order.  Sends
  and receives are sorted by (peer, start, stop), so one FIFO link per peer
  suffices to match them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


class ScheduleError(ValueError):
    """A schedule breaks a rule above; the message names the daemon, step and range.

    A bug in an algorithm, never a peer's fault, hence not a `CollectiveError`.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """Send elements ``[start, stop)`` of the buffer to daemon `peer`."""

    peer: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class Recv:
    """Receive elements ``[start, stop)`` from daemon `peer`.

    With `reduce` the data is combined into the local range with the reduce op;
    without, it overwrites the local range.
    """

    peer: int
    start: int
    stop: int
    reduce: bool

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True, slots=True)
class Step:
    """What one daemon does in one step: its sends and receives, each sorted by peer."""

    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.sends and not self.recvs


@dataclasses.dataclass(frozen=True, slots=True)
class Schedule:
    """One daemon's part of a collective: `steps` over a buffer of `count` elements."""

    algorithm: str
    rank: int
    size: int
    count: int
    steps: tuple[Step, ...]


def check_args(rank: int, size: int, count: int) -> None:
    """Refuse a rank outside ``[0, size)``, a size below 1 or a negative count."""
    if size < 1:
        raise ValueError(f"size must be at least 1, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if count < 0:
        raise ValueError(f"count must be non-negative, got {count}")


def split_bounds(start: int, stop: int, parts: int) -> list[int]:
    """Boundaries cutting ``[start, stop)`` into `parts` pieces whose sizes differ by ≤ 1.

    Piece i is ``[bounds[i], bounds[i + 1])``; with fewer elements than parts
    some pieces are empty.  Every daemon computes the same cut, which is what
    lets them agree on ranges without telling each other.
    """
    length = stop - start
    return [start + (i * length) // parts for i in range(parts + 1)]


class StepBuilder:
    """Collects one daemon's transfers step by step, dropping empty ranges."""

    def __init__(self, steps: int) -> None:
        self._sends: list[list[Send]] = [[] for _ in range(steps)]
        self._recvs: list[list[Recv]] = [[] for _ in range(steps)]

    def send(self, step: int, peer: int, start: int, stop: int) -> None:
        if start < stop:
            self._sends[step].append(Send(peer, start, stop))

    def recv(self, step: int, peer: int, start: int, stop: int, *, reduce: bool) -> None:
        if start < stop:
            self._recvs[step].append(Recv(peer, start, stop, reduce))

    def build(self, algorithm: str, rank: int, size: int, count: int) -> Schedule:
        steps = tuple(
            Step(
                tuple(sorted(sends, key=lambda s: (s.peer, s.start, s.stop))),
                tuple(sorted(recvs, key=lambda r: (r.peer, r.start, r.stop))),
            )
            for sends, recvs in zip(self._sends, self._recvs, strict=True)
        )
        return Schedule(algorithm, rank, size, count, steps)


def in_blocks(schedule: Schedule, block: int, count: int) -> Schedule:
    """`schedule`, built over ceil(count / block) units, as a schedule over `count`
    elements whose every range starts at a multiple of `block`.

    For block-scaled wire formats (fp8): a block of the buffer then always
    travels whole, so rounding it again where it is forwarded changes nothing.
    Unit ranges map monotonically and stay non-empty, so every rule holds still.
    """
    def scale(start: int, stop: int) -> tuple[int, int]:
        return start * block, min(stop * block, count)

    steps = tuple(
        Step(tuple(Send(s.peer, *scale(s.start, s.stop)) for s in step.sends),
             tuple(Recv(r.peer, *scale(r.start, r.stop), r.reduce) for r in step.recvs))
        for step in schedule.steps
    )
    return Schedule(schedule.algorithm, schedule.rank, schedule.size, count, steps)


def check_schedules(schedules: Sequence[Schedule]) -> None:
    """Check that the schedules of all daemons of one collective obey every rule.

    Raises `ScheduleError` naming the daemon, the step and the range at fault.
    """
    size = len(schedules)
    if size == 0:
        raise ScheduleError("no schedules")
    first = schedules[0]
    for index, schedule in enumerate(schedules):
        if schedule.rank != index or schedule.size != size:
            raise ScheduleError(
                f"schedule #{index} is for rank {schedule.rank} of {schedule.size}, "
                f"expected rank {index} of {size}"
            )
        if schedule.count != first.count or len(schedule.steps) != len(first.steps):
            raise ScheduleError(
                f"daemon {index}: {len(schedule.steps)} steps over {schedule.count} elements, "
                f"daemon 0: {len(first.steps)} steps over {first.count} elements"
            )
        for number, step in enumerate(schedule.steps):
            _check_step(schedule, number, step)
    for number in range(len(first.steps)):
        _check_pairing(schedules, number)


def _check_step(schedule: Schedule, number: int, step: Step) -> None:
    where = f"daemon {schedule.rank}, step {number}"
    transfers: list[Send | Recv] = [*step.sends, *step.recvs]
    for transfer in transfers:
        kind = "send to" if isinstance(transfer, Send) else "recv from"
        if not 0 <= transfer.peer < schedule.size or transfer.peer == schedule.rank:
            raise ScheduleError(f"{where}: {kind} invalid peer {transfer.peer}")
        if not 0 <= transfer.start < transfer.stop <= schedule.count:
            raise ScheduleError(
                f"{where}: {kind} {transfer.peer} range [{transfer.start}, {transfer.stop}) "
                f"is empty or outside [0, {schedule.count})"
            )
    for ordered, name in ((step.sends, "sends"), (step.recvs, "recvs")):
        keys = [(t.peer, t.start, t.stop) for t in ordered]
        if keys != sorted(keys):
            raise ScheduleError(f"{where}: {name} are not sorted by (peer, start, stop)")
    # Sweep over range endpoints: a receive may overlap only reducing receives.
    events = sorted(
        (t.start, t.stop, isinstance(t, Recv), isinstance(t, Recv) and t.reduce, t.peer)
        for t in transfers
    )
    for i, (start, stop, is_recv, is_reduce, peer) in enumerate(events):
        for other_start, other_stop, other_recv, other_reduce, other_peer in events[i + 1 :]:
            if other_start >= stop:
                break
            if not (is_recv or other_recv) or (is_reduce and other_reduce):
                continue
            raise ScheduleError(
                f"{where}: {_describe(is_recv, is_reduce, peer, start, stop)} overlaps "
                f"{_describe(other_recv, other_reduce, other_peer, other_start, other_stop)}"
            )


def _describe(is_recv: bool, is_reduce: bool, peer: int, start: int, stop: int) -> str:
    if not is_recv:
        return f"send to {peer} [{start}, {stop})"
    kind = "reducing" if is_reduce else "copying"
    return f"{kind} recv from {peer} [{start}, {stop})"


def _check_pairing(schedules: Sequence[Schedule], number: int) -> None:
    sent: dict[tuple[int, int], list[tuple[int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for schedule in schedules:
        step = schedule.steps[number]
        for send in step.sends:
            sent.setdefault((schedule.rank, send.peer), []).append((send.start, send.stop))
        for recv in step.recvs:
            received.setdefault((recv.peer, schedule.rank), []).append((recv.start, recv.stop))
    for src, dst in sorted(set(sent) | set(received)):
        out, into = sent.get((src, dst), []), received.get((src, dst), [])
        if out != into:
            raise ScheduleError(
                f"step {number}: daemon {src} sends {_ranges(out)} to daemon {dst}, "
                f"which receives {_ranges(into)} from it"
            )


def _ranges(ranges: list[tuple[int, int]]) -> str:
    if not ranges:
        return "nothing"
    return ", ".join(f"[{start}, {stop})" for start, stop in ranges)
