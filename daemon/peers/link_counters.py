"""What the peer links count, and their warnings about it, each given once.

The counters are the links' statistics (`gradsync stats`, the tests, the
stats endpoint): a typed record, `LinkCounts`, written only through the
methods of one `LinkCounters` that every part of the links shares, by the names
of `Counter` (mypy checks them); `PeerLinks.counters` reads it as a dict.  A
broken or hostile peer may send bad messages by the thousand, so each kind of
trouble is warned about once per peer (again only at debug level), and only so
many kinds are remembered.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal, get_args

log = logging.getLogger("gradsync.daemon.peers")

_MAX_WARNINGS = 1024


@dataclasses.dataclass
class LinkCounts:
    """How many of each, so far."""

    sent: int = 0  # application messages sent
    received: int = 0  # application messages accepted (handed to the events' `message`)
    malformed: int = 0  # dropped: undecodable header, wrong version, unknown kind, bad fields
    unknown_peer: int = 0  # dropped: sender is not one of our peers
    rejected_keys: int = 0  # CURVE handshakes refused by the ZAP handler
    handshake_failed: int = 0  # our DEALER's handshake with a peer failed
    peer_lost: int = 0  # up → lost transitions
    peer_suspected: int = 0  # peers the failure detector began to suspect (silent)
    peer_unreachable: int = 0  # of the lost, those declared cut off from us alone
    stream_sent: int = 0  # application messages sent over a data stream
    stream_received: int = 0  # ... and accepted from one
    stream_encrypted_sent: int = 0  # of those, sent over a sealed (AEAD) stream (CURVE links)
    stream_encrypted_received: int = 0  # ... and accepted from one
    stream_refused: int = 0  # incoming data streams closed: bad hello, wrong token, stranger
    stream_failed: int = 0  # data streams that could not open or broke
    stream_auth_failed: int = 0  # sealed streams refused: a hello or record failed auth


#: A counter's name: a field of `LinkCounts`.
Counter = Literal[
    "sent", "received", "malformed", "unknown_peer", "rejected_keys", "handshake_failed",
    "peer_lost", "peer_suspected", "peer_unreachable", "stream_sent", "stream_received",
    "stream_encrypted_sent",
    "stream_encrypted_received", "stream_refused", "stream_failed", "stream_auth_failed",
]
#: Every counter, in the record's order.
COUNTERS: tuple[Counter, ...] = get_args(Counter)
assert tuple(field.name for field in dataclasses.fields(LinkCounts)) == COUNTERS


class LinkCounters:
    """The counters of one daemon's peer links (their one writer), and the warnings
    already given."""

    def __init__(self) -> None:
        self._counts = LinkCounts()
        self._warned: set[str] = set()

    def as_dict(self) -> dict[str, int]:
        """A snapshot, by counter name (`PeerLinks.counters`, the statistics)."""
        return dataclasses.asdict(self._counts)

    def add(self, counter: Counter, count: int = 1) -> None:
        """Count `count` more `counter` events."""
        setattr(self._counts, counter, getattr(self._counts, counter) + count)

    def sent(self, stream: bool = False, sealed: bool = False) -> None:
        """An application message sent (over a data stream, a sealed one)."""
        self.add("sent")
        if stream:
            self.add("stream_sent")
        if sealed:
            self.add("stream_encrypted_sent")

    def count(self, counter: Counter, key: str, text: str, *args: object) -> None:
        """Count one `counter` event, and warn of it (`text % args`) once per `key`."""
        self.add(counter)
        self.warn_once(key, text, *args)

    def drop(self, counter: Counter, peer: str, reason: str) -> None:
        """Count a dropped message; warn once per peer and counter."""
        self.count(counter, f"{counter}:{peer}", "dropped a message from %s: %s", peer, reason)

    def stream_event(self, counter: Counter, peer: str, reason: str) -> None:
        """Count a data stream refused or broken; warn once per peer and counter."""
        self.count(counter, f"{counter}:{peer}", "peer %s: %s", peer, reason)

    def warn_once(self, key: str, text: str, *args: object) -> None:
        """Warn `text % args` the first time for `key`, log it at debug level after."""
        if key in self._warned:
            log.debug(text, *args)
            return
        if len(self._warned) < _MAX_WARNINGS:
            self._warned.add(key)
        log.warning(text, *args)
