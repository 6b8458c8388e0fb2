"""What the peer links tell the daemon: one events interface, `PeerEvents`.

`PeerLinks` takes one object with these methods and calls them from the event
loop, as things happen: no queue between the links and the daemon, no task
switch per message.  The daemon's `Peering` (daemon/io/peering.py) is that
object; tests pass one that collects what it is told.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import zmq

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.protocol.codec import Message


@dataclasses.dataclass(frozen=True)
class PeerMessage:
    """A message from a peer: its header and its payload frames (not copied)."""

    peer: str
    header: Message
    #: ZeroMQ frames, or memoryviews (or `PlacedPayload`s the payloads were
    #: placed in) for messages that came over a data stream.
    frames: list[Any]

    @property
    def payloads(self) -> list[Any]:
        """Views of the payloads (or their sinks), valid while the frames live."""
        return [f.buffer if isinstance(f, zmq.Frame) else f for f in self.frames]


class PeerEvents(Protocol):
    """What happens on the peer links, as the daemon hears of it."""

    def message(self, message: PeerMessage) -> None:
        """An accepted application message, in order per peer."""

    def place(
        self, peer: str, header: Message, sizes: list[int]
    ) -> Sequence[PlacedPayload | None] | None:
        """Where a data stream message's payloads go, asked once its header is in.

        A `PlacedPayload` (or None: a fresh buffer) per payload, or None for
        fresh buffers throughout; the message then carries the sinks instead
        of memoryviews.  Only messages whose payloads add up to at least the
        links' `place_min_bytes` are offered: copying smaller ones costs less
        than placing them.  Must not raise.
        """

    def peer_up(self, peer: str) -> None:
        """The link to `peer` came up (its handshake succeeded, and a ping came back)."""

    def peer_lost(self, peer: str, why: str = "") -> None:
        """The link to `peer` was lost: its connection closed, or the failure
        detector declared it (`why` says which, and on whose word)."""

    def stream_broken(self, peer: str, why: str) -> None:
        """A data stream to or from `peer` broke while it may have lost a message
        (the link itself may still be up; see `data_plane.py`)."""
