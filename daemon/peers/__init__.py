"""Peer links: authenticated ZeroMQ TCP links between the daemons of a cluster.

`PeerLinks` connects this daemon to its peers, carries header + zero-copy
payload messages between them, notices peers that die or stop answering, and
measures each link's latency and bandwidth for the algorithm cost model.

It tells the daemon what happens through one events interface, `PeerEvents`
(events.py): `message(PeerMessage)`, `place(peer, header, sizes)` (where a
stream message's payloads go), `peer_up(peer)`, `peer_lost(peer)` and
`stream_broken(peer, why)`, all called from the event loop.

Modules:
  links.py         `PeerLinks`: settings, start and close, sending, link state, probing
  link_sockets.py  the ZeroMQ ROUTER and DEALERs: options, CURVE + ZAP, monitors, closing
  link_table.py    which peer is which: links by name, senders by routing id and key
  link_counters.py `COUNTERS`, what the links count, and their warnings, each given once
  outgoing.py      framing a message, and waiting for it to leave on the ZeroMQ link
  incoming.py      checking what arrives, answering probes, handing messages on
  events.py        `PeerEvents`, the interface towards the daemon, and `PeerMessage`
  health.py        link health: ZMTP heartbeats, monitor events → up / lost, liveness pings
  keys.py          CURVE key files, and the key recorded for each peer's endpoint
  zap.py           the ZAP handler that admits authorised CURVE keys
  wire.py          header framing of peer messages and link probes
  probe.py         link latency and bandwidth measurement
  socket_io.py     `LoopSocket`: a ZeroMQ socket driven by the event loop
  data_plane.py    the plain-TCP data streams of insecure links: listen, connect, route
  stream.py        one data stream: its framing, sender and receiver
  endpoints.py     `tcp://HOST:PORT` endpoints and peers files

Settings that cannot work raise `ConfigError` (daemon/errors.py), key files
`KeyFileError`, its subclass.
"""

from gradsync.daemon.peers.endpoints import read_peers_file
from gradsync.daemon.peers.events import PeerEvents, PeerMessage
from gradsync.daemon.peers.health import PeerState
from gradsync.daemon.peers.keys import (
    Certificate,
    CurveConfig,
    KeyFileError,
    load_authorized,
    load_authorized_certificates,
    load_secret,
)
from gradsync.daemon.peers.link_counters import COUNTERS
from gradsync.daemon.peers.link_settings import LinkSettings
from gradsync.daemon.peers.links import PeerLinks
from gradsync.daemon.peers.probe import LinkStats

__all__ = [
    "COUNTERS",
    "Certificate",
    "CurveConfig",
    "KeyFileError",
    "LinkSettings",
    "LinkStats",
    "PeerEvents",
    "PeerLinks",
    "PeerMessage",
    "PeerState",
    "load_authorized",
    "load_authorized_certificates",
    "load_secret",
    "read_peers_file",
]
