"""Runs one daemon's part of an inter-daemon schedule over the peer links.

A schedule (see `gradsync.daemon.algorithms`) says, per step, which element
ranges this daemon sends to which peer and which it receives, reducing or
copying.  The executor cuts every transfer into pipeline slices of about
`slice_bytes`, so a peer reduces slice i while slice i+1 is on the wire, and
applies slices as they arrive; slices of a later step that arrive early are
kept until that step.  Sends read the buffer as it is at the start of their
step (the schedule guarantees no receive of the same step touches those
ranges), which is what lets large slices go zero-copy from the buffer.

Steps do not wait for each other where the data does not: a slice of the next
step's sends goes out as soon as every receive of the current step that
writes into its range has been applied (a ring forwards each reduced slice at
once instead of after the whole step).  Its bytes are then final, since no
later step writes them before the step after next.

A slice of the current step whose header arrives over a data stream before
its payload can be placed (`place`): a copy is received straight into the
buffer, a reduction into a small reused chunk that is combined into the buffer
each time it fills, while it is still in cache (receives.py).  That saves a copy
of every all-gather byte and a trip through memory for every reduced one.

With a wire codec (compressed collectives, backends/wire_codec.py) every slice
is encoded as it is sent, which rounds its range in place to what the peer
decodes, and decoded as it arrives (added, or copied), both on the run's codec
lane (codec_lane.py: the daemon's codec threads, each job after the earlier
ones on its range); such slices are not placed, since the bytes on the wire
are not the buffer's.  Reducing receives of one step that overlap (a star's
root, a tree node's two children) are decoded in the order the step lists
them, whatever order their slices arrive in, so every run adds in the same
order and the result does not depend on timing or on the number of threads.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gradsync.daemon.backends.reduce import combine_into
from gradsync.daemon.backends.wire_codec import WireCodec
from gradsync.daemon.run.codec_lane import CodecLane
from gradsync.daemon.run.receives import (
    ChunkPool,
    CopyPlacement,
    Expected,
    Placement,
    ReducePlacement,
    remaining_of,
)
from gradsync.daemon.run.residuals import record
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import CollectiveTimeoutError, GradsyncError, ProtocolError
from gradsync.protocol.peer import Fingerprint

#: Sends at least this large go zero-copy and are tracked until libzmq lets go.
ZERO_COPY_BYTES = 64 * 1024
SendSlice = Callable[[int, dict[str, Any], memoryview | bytes, bool], Any]


@dataclasses.dataclass
class _Slice:
    """One slice of a send: transfer `t` to `peer`, elements [begin, end)."""

    peer: int
    transfer: int
    begin: int
    end: int
    offset: int
    #: Elements of the previous step's receives that must land here first.
    waiting: int = 0
    sent: bool = False


class ScheduleRun:
    """One collective's inter-daemon phase on this daemon.

    Transfers are matched by order, not by address: the t-th send of a step to
    a peer pairs with that peer's t-th receive from us in the same step (the
    links are FIFO per peer).  Sender and receiver may place the data at
    different offsets of their buffers, which is what gather, scatter and
    all-to-all need; slices name (step, t, offset within the transfer).
    """

    def __init__(
        self,
        schedule: Any,
        buffer: np.ndarray,
        op: ReduceOp,
        send: SendSlice,
        slice_bytes: int,
        loop: asyncio.AbstractEventLoop,
        fingerprint: Fingerprint | None = None,
        algorithm: str = "",
        agree_with: Sequence[int] = (),
        chunks: ChunkPool | None = None,
        codec: WireCodec | None = None,
        residual: np.ndarray | None = None,
        codec_pool: concurrent.futures.Executor | None = None,
    ) -> None:
        self.schedule = schedule
        #: The wire format of a compressed collective (None: the buffer's bytes), and
        #: with error feedback the residual array its roundings are recorded in.
        self.codec = codec
        self.residual = residual
        self._chunks = chunks if chunks is not None else ChunkPool()
        self._agree_with = list(agree_with)
        self._agreements_missing = set(agree_with)
        self.fingerprint = fingerprint
        self.algorithm = algorithm
        self.buffer = buffer
        self.op = op
        self._send = send
        self._slice = max(1, slice_bytes // max(1, buffer.itemsize))
        if codec is not None:  # whole blocks of a block-scaled format (see in_blocks)
            self._slice = max(codec.block, self._slice - self._slice % codec.block)
        self.step = -1
        self.done: asyncio.Future[None] = loop.create_future()
        #: Where the codec runs: `codec_pool`'s threads (codec_lane.py).
        self._lane = CodecLane(loop, codec_pool, self.done)
        self._expected: dict[tuple[int, int], Expected] = {}
        #: Compressed runs: per receive of the current step, the reducing receives
        #: listed before it that overlap it; and slices that wait for those.
        self._before: dict[tuple[int, int], list[Expected]] = {}
        self._held: dict[tuple[int, int], list[tuple[Expected, int, int, Any]]] = {}
        self._missing = 0
        self._early: dict[int, list[tuple[int, int, int, Any]]] = {}
        #: The next step's send slices, sorted by `begin`, and their begins.
        self._next: list[_Slice] = []
        self._next_begins: list[int] = []
        #: (daemon index, future of the send) of every zero-copy slice sent.
        self.trackers: list[tuple[int, Any]] = []
        #: Slices of the current step being received in place.
        self._placed: set[Placement] = set()
        #: Bytes put on the wire, and the buffer bytes they carry (equal uncompressed).
        self.bytes_sent = 0
        self.bytes_raw = 0
        #: Per peer (daemon index): [bytes on the wire, buffer bytes they carry], for traces.
        self.sent_to: dict[int, list[int]] = {}
        #: (start, end, peers it received from) of every finished step, for traces.
        self.step_times: list[tuple[float, float, list[int]]] = []
        self._step_started = 0.0

    @property
    def steps(self) -> int:
        return len(self.schedule.steps)

    def waiting_for(self) -> list[int]:
        """Peers (daemon indices) whose slices the current step still needs."""
        if self.step == -1 and self._agreements_missing:
            return sorted(self._agreements_missing)
        return sorted({peer for (peer, _), exp in self._expected.items() if remaining_of(exp)})

    def needs_from(self, peer: int) -> bool:
        """Whether this run still expects a slice directly from daemon index `peer`."""
        if self.done.done():
            return False
        if peer in self._agreements_missing:
            return True
        for (source, _), expected in self._expected.items():
            if source == peer and remaining_of(expected):
                return True
        for index in range(self.step + 1, self.steps):
            wanted = sum(recv.stop - recv.start
                         for recv in self.schedule.steps[index].recvs if recv.peer == peer)
            if not wanted:
                continue
            # Slices of a later step that came early are here already (checked when
            # their step begins); only the rest is still to come.
            kept = sum(self._kept_count(payload)
                       for source, _, _, payload in self._early.get(index, ())
                       if source == peer)
            if kept < wanted:
                return True
        return False

    def start(self) -> None:
        """Begin; with `agree_with`, first a fingerprint-only message to each of those
        daemons (step -1), and step 0 only once all of theirs have arrived."""
        if not self._agree_with:
            self._advance()
            return
        for peer in self._agree_with:
            self._send(peer, {"step": -1, "t": 0, "off": 0}, b"", False)
        self._check_agreed()

    def _check_agreed(self) -> None:
        if not self._agreements_missing and self.step == -1:
            self._advance()

    def fail(self, error: GradsyncError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        self.release()

    def deliver(self, peer: int, step: int, transfer: int, offset: int, payload: Any) -> None:
        """A slice from daemon index `peer`; raises ProtocolError if it does not fit."""
        if self.done.done():
            return
        if step == -1:
            if peer not in self._agreements_missing:
                raise ProtocolError(f"a second agreement from daemon #{peer}")
            self._agreements_missing.discard(peer)
            self._check_agreed()
            return
        if step > self.step:
            if step >= self.steps:
                raise ProtocolError(f"slice for step {step} of a {self.steps}-step schedule")
            self._early.setdefault(step, []).append((peer, transfer, offset, payload))
            return
        if step < self.step:
            raise ProtocolError(f"slice for step {step} arrived at step {self.step}")
        self._apply(peer, transfer, offset, payload)
        if self._missing == 0:
            self._advance()

    def place(
        self, peer: int, step: int, transfer: int, offset: int, nbytes: int
    ) -> Placement | None:
        """Where a slice of the current step can be received in place, or None.

        None (a later step, a bad address, a run that ended) sends the slice the
        ordinary way, where `deliver` keeps or rejects it.  A placed slice is
        reserved at once, so a duplicate of it is rejected like any other.
        """
        if self.done.done() or step != self.step or step < 0 or self.codec is not None:
            return None
        expected = self._expected.get((peer, transfer))
        itemsize = self.buffer.itemsize
        count = nbytes // itemsize
        if expected is None or nbytes % itemsize or not expected.claim(offset, count):
            return None
        begin = expected.start + offset
        target = self.buffer[begin : begin + count]
        placement: Placement = (
            ReducePlacement(expected, begin, target, self.op, self._chunks)
            if expected.reduce
            else CopyPlacement(expected, begin, target)
        )
        self._placed.add(placement)
        return placement

    def release(self) -> None:
        """The run is over (done, failed or abandoned): placed slices still
        arriving no longer touch the buffer."""
        for placement in self._placed:
            placement.cancel()
        self._placed.clear()

    def _apply(self, peer: int, transfer: int, offset: int, payload: Any) -> None:
        if isinstance(payload, Placement):
            self._arrived(payload)
            return
        expected = self._expected.get((peer, transfer))
        try:
            count = self._count_of(payload)
        except ProtocolError as exc:
            raise ProtocolError(f"{exc.message}, from daemon #{peer} at step {self.step}") from None
        if expected is None or not expected.claim(offset, count):
            raise ProtocolError(
                f"unexpected slice (transfer {transfer}, offset {offset}, {count} elements) "
                f"from daemon #{peer} at step {self.step}"
            )
        if self.codec is not None:
            key = (peer, transfer)
            if any(earlier.got < earlier.stop - earlier.start
                   for earlier in self._before.get(key, ())):
                self._held.setdefault(key, []).append((expected, offset, count, payload))
                return
            self._decode(expected, offset, count, payload)
            if expected.got == expected.stop - expected.start and self._held:
                self._release_held()
            return
        begin = expected.start + offset
        target = self.buffer[begin : begin + count]
        if expected.reduce:
            combine_into(target, np.frombuffer(payload, dtype=self.buffer.dtype), self.op)
        else:
            np.copyto(target, np.frombuffer(payload, dtype=self.buffer.dtype))
        expected.got += count
        self._missing -= count
        if self._next:
            self._landed(begin, begin + count)

    def _decode(self, expected: Expected, offset: int, count: int, payload: Any) -> None:
        """Queue a compressed slice's decode on the lane, and count it as applied."""
        assert self.codec is not None
        begin = expected.start + offset
        target = self.buffer[begin : begin + count]
        self._lane.submit(functools.partial(self.codec.decode_into, payload, target,
                                            add=expected.reduce), _nothing, target.nbytes,
                          (begin, begin + count))
        expected.got += count
        self._missing -= count
        if self._next:
            self._landed(begin, begin + count)

    def _release_held(self) -> None:
        """Decode held slices whose earlier overlapping receives are all queued, in
        the order the step lists their receives (each release may free the next)."""
        released = True
        while released:
            released = False
            for key in list(self._held):
                if any(earlier.got < earlier.stop - earlier.start
                       for earlier in self._before.get(key, ())):
                    continue
                for expected, offset, count, payload in self._held.pop(key):
                    self._decode(expected, offset, count, payload)
                released = True

    def raw_nbytes(self, nbytes: int) -> int:
        """Buffer bytes a payload of `nbytes` carries (0 for one that fits no count)."""
        return raw_nbytes(self.codec, self.buffer.itemsize, nbytes)

    def _kept_count(self, payload: Any) -> int:
        """`_count_of` a slice kept early, 0 for one that fits none (refused at its step)."""
        try:
            return self._count_of(payload)
        except ProtocolError:
            return 0

    def _count_of(self, payload: Any) -> int:
        """Elements a slice's payload carries; ProtocolError if it fits none."""
        nbytes = memoryview(payload).nbytes
        if self.codec is not None:
            return self.codec.count(nbytes)
        return nbytes // self.buffer.itemsize

    def _arrived(self, placement: Placement) -> None:
        """A placed slice is all in: count it, as `_apply` does for the others."""
        if placement not in self._placed:
            raise ProtocolError("a placed slice arrived for a run that dropped it")
        self._placed.discard(placement)
        placement.expected.got += placement.count
        self._missing -= placement.count
        if self._next:
            self._landed(placement.begin, placement.begin + placement.count)

    def _overlapping(self, lo: int, hi: int) -> list[_Slice]:
        """The next step's send slices that overlap elements [lo, hi)."""
        first = bisect.bisect_left(self._next_begins, lo - self._slice + 1)
        last = bisect.bisect_left(self._next_begins, hi)
        return [piece for piece in self._next[first:last] if piece.end > lo]

    def _landed(self, lo: int, hi: int) -> None:
        """Elements [lo, hi) of this step arrived: send next-step slices now final."""
        for piece in self._overlapping(lo, hi):
            piece.waiting -= min(hi, piece.end) - max(lo, piece.begin)
            if piece.waiting == 0 and not piece.sent:
                self._send_slice(self.step + 1, piece)

    def _plan_next(self, step: int) -> None:
        """Cut step `step + 1`'s sends into slices; count what each waits for."""
        self._next = []
        if step + 1 >= len(self.schedule.steps):
            self._next_begins = []
            return
        pieces = self._slices(self.schedule.steps[step + 1])
        pieces.sort(key=lambda piece: piece.begin)
        self._next = pieces
        self._next_begins = [piece.begin for piece in pieces]
        for recv in self.schedule.steps[step].recvs:
            for piece in self._overlapping(recv.start, recv.stop):
                piece.waiting += min(recv.stop, piece.end) - max(recv.start, piece.begin)

    def _advance(self) -> None:
        steps = self.schedule.steps
        while True:
            now = time.monotonic()
            if self.step >= 0:
                peers = sorted({peer for peer, _ in self._expected})
                self.step_times.append((self._step_started, now, peers))
            self._step_started = now
            self.step += 1
            if self.step >= len(steps):
                if not self.done.done():
                    self.done.set_result(None)
                return
            step = steps[self.step]
            # The slices planned while the previous step ran (some sent already).
            for piece in self._next or self._slices(step):
                if not piece.sent:
                    self._send_slice(self.step, piece)
            self._plan_next(self.step)
            for piece in self._next:
                if piece.waiting == 0:  # final already: needs nothing from this step
                    self._send_slice(self.step + 1, piece)
            self._expected = {}
            self._before = {}
            self._missing = 0
            received_from: dict[int, int] = {}
            reducing: list[Expected] = []
            for recv in step.recvs:
                transfer = received_from.get(recv.peer, 0)
                received_from[recv.peer] = transfer + 1
                expected = self._expected[(recv.peer, transfer)] = Expected(
                    recv.reduce, recv.start, recv.stop
                )
                self._missing += recv.stop - recv.start
                if self.codec is not None and recv.reduce:
                    earlier = [other for other in reducing
                               if other.start < recv.stop and recv.start < other.stop]
                    if earlier:
                        self._before[(recv.peer, transfer)] = earlier
                    reducing.append(expected)
            for peer, transfer, offset, payload in self._early.pop(self.step, []):
                self._apply(peer, transfer, offset, payload)
            if self._missing > 0:
                return

    def _slices(self, step: Any) -> list[_Slice]:
        """A step's sends cut into pipeline slices, in send order."""
        pieces = []
        sent_to: dict[int, int] = {}
        for send in step.sends:
            transfer = sent_to.get(send.peer, 0)
            sent_to[send.peer] = transfer + 1
            for begin in range(send.start, send.stop, self._slice):
                end = min(begin + self._slice, send.stop)
                pieces.append(_Slice(send.peer, transfer, begin, end, begin - send.start))
        return pieces

    def _send_slice(self, step: int, piece: _Slice) -> None:
        itemsize = self.buffer.itemsize
        self.bytes_raw += (piece.end - piece.begin) * itemsize
        piece.sent = True
        if self.codec is not None:
            values = self.buffer[piece.begin : piece.end]
            residual = (None if self.residual is None
                        else self.residual[piece.begin : piece.end])
            self._lane.submit(functools.partial(_encode, self.codec, values, residual),
                              functools.partial(self._post, step, piece), values.nbytes,
                              (piece.begin, piece.end))
            return
        # Bytes, not elements: bfloat16 has no buffer-protocol format of its own.
        self._post(step, piece,
                   self.buffer.view(np.uint8)[piece.begin * itemsize : piece.end * itemsize].data)

    def _post(self, step: int, piece: _Slice, view: memoryview) -> None:
        """Send one slice's bytes (the buffer's, or their encoding)."""
        zero_copy = view.nbytes >= ZERO_COPY_BYTES
        header = {"step": step, "t": piece.transfer, "off": piece.offset}
        tracker = self._send(piece.peer, header, view if zero_copy else bytes(view), zero_copy)
        if tracker is not None:
            self.trackers.append((piece.peer, tracker))
        self.bytes_sent += view.nbytes
        sent = self.sent_to.setdefault(piece.peer, [0, 0])
        sent[0] += view.nbytes
        sent[1] += (piece.end - piece.begin) * self.buffer.itemsize

    async def wait_sent(self, timeout_s: float) -> None:
        """Wait until libzmq no longer reads any zero-copy slice of the buffer.

        `trackers` hold futures of `zmq.MessageTracker`s: the future is done once
        the message is queued, the tracker once libzmq has let go of the memory.
        A send that failed raises its error; one that is not a `GradsyncError`
        (a data stream's socket error) comes as `SendFailed` naming the peer.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        if self._lane.busy:  # compressed runs only: no task on the others' path
            try:
                await asyncio.wait_for(self._lane.settle(), timeout_s)
            except TimeoutError:
                raise CollectiveTimeoutError(
                    f"this daemon did not code its last slices within {timeout_s:g}s") from None
        if self._lane.error is not None:
            raise self._lane.error
        delay = 0.0
        while not all(_released(peer, sending) for peer, sending in self.trackers):
            if loop.time() > deadline:
                raise CollectiveTimeoutError(
                    f"the peer links did not send this daemon's last slices within {timeout_s:g}s"
                )
            await asyncio.sleep(delay)
            delay = min(max(2 * delay, 50e-6), 2e-3)

    async def settle(self) -> None:
        """Wait until no encode or decode of this run touches the buffer any more."""
        await self._lane.settle()


def _encode(codec: WireCodec, values: np.ndarray, residual: np.ndarray | None) -> memoryview:
    """A slice's encoding, a fresh buffer nobody writes again (zero-copy from it is
    safe); it rounds `values` in place, and with error feedback records the rounding."""
    if residual is None:
        return codec.encode(values)
    before = values.copy()
    view = codec.encode(values)
    record(residual, before, values)
    return view


def _nothing(_: object) -> None:
    """A decode's follow-up: its bookkeeping was done when it was queued."""


class SendFailed(Exception):
    """A slice could not be sent to daemon index `peer`: its data stream broke."""

    def __init__(self, peer: int, cause: BaseException) -> None:
        super().__init__(f"sending to daemon #{peer} failed: {cause}")
        self.peer = peer
        self.cause = cause


def _released(peer: int, sending: Any) -> bool:
    """True once a tracked send no longer needs its buffer (raises if it failed)."""
    if not sending.done():
        return False
    try:
        tracker = sending.result()
    except GradsyncError:
        raise
    except Exception as exc:
        raise SendFailed(peer, exc) from exc
    return tracker is None or bool(tracker.done)


def raw_nbytes(codec: WireCodec | None, itemsize: int, nbytes: int) -> int:
    """Buffer bytes a payload of `nbytes` carries (0 for one that fits no count)."""
    if codec is None:
        return nbytes
    try:
        return codec.count(nbytes) * itemsize
    except ProtocolError:
        return 0
