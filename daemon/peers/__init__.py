"""Peer links: authenticated ZeroMQ TCP links between the daemons of a cluster.

`PeerLinks` connects this daemon to its peers, carries header + zero-copy
payload messages between them, notices peers that die or stop answering, and
measures each link's latency and bandwidth for the algorithm cost model.
"""

from gradsync.daemon.peers.endpoints import read_peers_file
from gradsync.daemon.peers.events import PeerEvents, PeerMessage
from gradsync.daemon.peers.keys import (
    Certificate,
    CurveConfig,
    KeyFileError,
    load_authorized,
    load_authorized_certificates,
    load_secret,
)
from gradsync.daemon.peers.links import (
    COUNTERS,
    PeerLinks,
    PeerState,
)
from gradsync.daemon.peers.probe import LinkStats

__all__ = [
    "COUNTERS",
    "Certificate",
    "CurveConfig",
    "KeyFileError",
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
