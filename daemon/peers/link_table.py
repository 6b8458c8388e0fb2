"""Which peer is which: the links of one daemon, by name, routing id and key.

Peers are named by the endpoint strings given in `peers`, the same list on
every node; this daemon's own entry, if listed, is left out.  A message on the
ROUTER names its sender by routing id, the endpoint the sending DEALER was
given, which may be spelled differently from our entry for it (another
address of the same host): it names a peer if it is the same socket.  Under
CURVE the key the ZAP handler accepted (libzmq's User-Id) must also be the
one recorded for that peer (`keys.py`), so that an authorised daemon cannot
speak in the name of another.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from gradsync.daemon.errors import ConfigError
from gradsync.daemon.peers.endpoints import TcpEndpoint, parse_tcp_endpoint, same_endpoint
from gradsync.daemon.peers.health import LIVE_ID_SUFFIX, Link
from gradsync.daemon.peers.keys import CurveConfig, PeerKeys, load_peer_keys
from gradsync.protocol.errors import InvalidArgumentError

#: Routing ids of strangers remembered, at most (a bound for hostile senders).
_MAX_STRANGERS = 1024


def _find_self(
    listen: TcpEndpoint, peers: Sequence[str]
) -> tuple[str | None, list[tuple[str, TcpEndpoint]]]:
    """This daemon's entry in `peers` (if any), and the other peers parsed."""
    me = None
    others: list[tuple[str, TcpEndpoint]] = []
    for text in peers:
        try:
            endpoint = parse_tcp_endpoint(text)
        except ValueError as exc:
            raise ConfigError(f"bad value in 'peers': {exc}") from None
        if same_endpoint(listen, endpoint):
            me = me or text
            continue
        if endpoint.is_wildcard:
            raise ConfigError(f"peer endpoint {text!r} is a wildcard; name a host to connect to")
        for prior_name, prior in others:
            if same_endpoint(prior, endpoint):
                raise ConfigError(f"'peers' lists one daemon twice: {prior_name!r} and {text!r}")
        others.append((text, endpoint))
    return me, others


class LinkTable:
    """The `Link` to each other peer, and the peer a routing id or CURVE key names."""

    def __init__(self, listen_text: str, listen: TcpEndpoint, peers: Sequence[str]) -> None:
        """Find this daemon in `peers` (it listens on `listen`, given as `listen_text`).

        Raises `ConfigError` for a bad or doubled entry, or a wildcard `listen`
        that none of `peers` names.
        """
        me, others = _find_self(listen, peers)
        if me is None and others and listen.is_wildcard:
            raise ConfigError(
                f"listening on {listen_text} but none of 'peers' is this daemon: list this "
                "daemon's own address in 'peers' (the same list on every node)"
            )
        #: This daemon's name among peers, and its routing id on every DEALER.
        self.endpoint: str = me or listen_text
        if len(self.endpoint.encode()) > 255 - len(LIVE_ID_SUFFIX):
            raise ConfigError(f"endpoint {self.endpoint!r} is longer than "
                              f"{255 - len(LIVE_ID_SUFFIX)} bytes")
        #: The other peers by name, in the order given.
        self.links = {name: Link(name, endpoint, None) for name, endpoint in others}
        self._by_routing_id: dict[bytes, str | None] = {
            name.encode(): name for name in self.links
        }
        #: The peer each recorded server key belongs to; empty without CURVE.
        self._peer_by_key: dict[bytes, str] = {}
        self._keyed = False

    def load_keys(self, curve: CurveConfig) -> PeerKeys:
        """Load the keys (`KeyFileError`); from now on senders must have their peer's key."""
        keys = load_peer_keys(curve, {name: link.endpoint for name, link in self.links.items()})
        for name, key in keys.server_keys.items():
            self.links[name].server_key = key
            self._peer_by_key[key] = name
        self._keyed = True
        return keys

    def get(self, peer: str) -> Link:
        """The link to `peer`; raises `InvalidArgumentError` if it is not a peer."""
        try:
            return self.links[peer]
        except KeyError:
            raise InvalidArgumentError(
                f"{peer!r} is not a peer of {self.endpoint}; peers: {', '.join(self.links)}"
            ) from None

    def sender(self, frames: list[zmq.Frame]) -> str | None:
        """Which peer sent a message on the ROUTER, or None for a stranger.

        By routing id (the sender's endpoint, with LIVE_ID_SUFFIX on its
        heartbeat path); under CURVE the key the ZAP handler accepted must also
        be the one recorded for that endpoint, so an authorised daemon cannot
        speak in the name of another.
        """
        peer = self.peer_named(frames[0].bytes.removesuffix(LIVE_ID_SUFFIX))
        if self._keyed and peer is not None:
            try:
                user_id = str(frames[1].get("User-Id")).encode()
            except zmq.ZMQError:
                return None
            if self._peer_by_key.get(user_id) != peer:
                return None
        return peer

    def peer_named(self, routing_id: bytes) -> str | None:
        """The peer a routing id (or stream hello) names, remembered: matching
        a name that is not a peer's own may resolve host names."""
        if routing_id not in self._by_routing_id:
            if len(self._by_routing_id) > _MAX_STRANGERS + len(self.links):
                self._by_routing_id = {name.encode(): name for name in self.links}
            self._by_routing_id[routing_id] = self._match_routing_id(routing_id)
        return self._by_routing_id[routing_id]

    def _match_routing_id(self, routing_id: bytes) -> str | None:
        """The peer whose endpoint is the same socket as the one a routing id names."""
        try:
            endpoint = parse_tcp_endpoint(routing_id.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return None
        for link in self.links.values():
            if same_endpoint(link.endpoint, endpoint):
                return link.name
        return None
