"""A `PeerEvents` for tests of the peer links: it collects what it is told.

Messages queue up for `await events.next()`; links that come up or are lost
and broken data streams are recorded in lists; `place` asks the function it
was given (none: fresh buffers for every payload).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.peers import PeerMessage

Place = Callable[[str, dict[str, Any], list[int]], Sequence[PlacedPayload | None] | None]


class Events:
    """What one `PeerLinks` reported, in order."""

    def __init__(self, place: Place | None = None) -> None:
        self.messages: asyncio.Queue[PeerMessage] = asyncio.Queue()
        self.up: list[str] = []
        #: (peer, `time.monotonic()` when its loss was reported)
        self.lost: list[tuple[str, float]] = []
        #: Why each loss, as reported.
        self.why: list[str] = []
        self.broken: list[tuple[str, str]] = []
        self._place = place

    async def next(self, timeout_s: float = 10.0) -> PeerMessage:
        """The next message from any peer; TimeoutError after `timeout_s`."""
        return await asyncio.wait_for(self.messages.get(), timeout_s)

    def message(self, message: PeerMessage) -> None:
        self.messages.put_nowait(message)

    def place(
        self, peer: str, header: dict[str, Any], sizes: list[int]
    ) -> Sequence[PlacedPayload | None] | None:
        return None if self._place is None else self._place(peer, header, sizes)

    def peer_up(self, peer: str) -> None:
        self.up.append(peer)

    def peer_lost(self, peer: str, why: str = "") -> None:
        self.lost.append((peer, time.monotonic()))
        self.why.append(why)

    def stream_broken(self, peer: str, why: str) -> None:
        self.broken.append((peer, why))
