"""What the peer links count, and their warnings about it, each given once.

The counters are the links' statistics (`gradsync stats`, the tests, the
stats endpoint): every part of the links counts into one `LinkCounters`, by
the names of `COUNTERS`.  A broken or hostile peer may send bad messages by
the thousand, so each kind of trouble is warned about once per peer (again
only at debug level), and only so many kinds are remembered.
"""

from __future__ import annotations

import logging

log = logging.getLogger("gradsync.daemon.peers")

_MAX_WARNINGS = 1024
COUNTERS = (
    "sent",  # application messages sent
    "received",  # application messages accepted (handed to the events' `message`)
    "malformed",  # dropped: undecodable header, wrong version, unknown kind, bad fields
    "unknown_peer",  # dropped: sender is not one of our peers
    "rejected_keys",  # CURVE handshakes refused by the ZAP handler
    "handshake_failed",  # our DEALER's handshake with a peer failed
    "peer_lost",  # up → lost transitions
    "stream_sent",  # application messages sent over a data stream
    "stream_received",  # ... and accepted from one
    "stream_encrypted_sent",  # of those, sent over a sealed (AEAD) stream (CURVE links)
    "stream_encrypted_received",  # ... and accepted from one
    "stream_refused",  # incoming data streams closed: bad hello, wrong token, stranger
    "stream_failed",  # data streams that could not open or broke
    "stream_auth_failed",  # sealed streams refused: a hello or record failed authentication
)


class LinkCounters:
    """The counters of one daemon's peer links, and the warnings already given."""

    def __init__(self) -> None:
        #: Per name of `COUNTERS`, how many so far: `PeerLinks.counters`.
        self.values: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._warned: set[str] = set()

    def count(self, counter: str, key: str, text: str, *args: object) -> None:
        """Count one `counter` event, and warn of it (`text % args`) once per `key`."""
        self.values[counter] += 1
        self.warn_once(key, text, *args)

    def drop(self, counter: str, peer: str, reason: str) -> None:
        """Count a dropped message; warn once per peer and counter."""
        self.count(counter, f"{counter}:{peer}", "dropped a message from %s: %s", peer, reason)

    def stream_event(self, counter: str, peer: str, reason: str) -> None:
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
