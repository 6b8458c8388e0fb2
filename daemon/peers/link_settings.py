"""What a daemon's peer links are built from, in one object, checked in one place.

`daemon/io/peering.py` makes one from the daemon's configuration; tests make
their own.  `check()` raises `ConfigError` (`InvalidArgumentError` for message
kinds) naming the setting when something cannot work.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from gradsync.daemon.core.failure_detector import DETECTORS, DetectorKind
from gradsync.daemon.errors import ConfigError
from gradsync.daemon.peers.endpoints import TcpEndpoint, parse_tcp_endpoint
from gradsync.daemon.peers.keys import CurveConfig
from gradsync.protocol.codec import is_integer

__all__ = ["LinkSettings"]


@dataclasses.dataclass(frozen=True)
class LinkSettings:
    """The peer links of one daemon: where they listen, whom they link to, how they
    are secured, which messages they carry and how their health is watched.

    `kinds` are the application message kinds accepted from peers; those of
    `stream_kinds` go over TCP data streams once they are open (`stream.py`):
    plaintext on `insecure` links, AEAD-sealed on CURVE ones.  Stream messages of
    at least `place_min_bytes` may be placed before they arrive.  The data streams
    listen on `data_port` of `listen`'s host (0: any free port); peers open them at
    `data_advertise` (`HOST:PORT`) if given, for a NAT or port forward in between.
    """

    listen: str
    peers: Sequence[str]
    curve: CurveConfig | None = None
    insecure: bool = False
    kinds: Collection[str] = ()
    stream_kinds: Collection[str] = ()
    #: Stream kinds of background bulk (checkpoint replicas' chunks): while one is
    #: queued on a stream, its socket keeps little unsent in the kernel, so that a
    #: slice queued behind waits for little (`StreamSender.send`).
    bulk_kinds: Collection[str] = ()
    #: The failure detector's upper bound: a peer silent this long is lost whatever
    #: else (it declares a vanished peer sooner: daemon/core/failure_detector.py).
    peer_timeout_s: float = 10.0
    #: `adaptive`, or `timeout`: the upper bound alone (DetectorTimings.for_timeout).
    failure_detector: DetectorKind = "adaptive"
    #: Ring neighbours heartbeated on either side when no job uses a peer
    #: (daemon/core/watching.py); 0: log2 of the daemons.
    watch_neighbours: int = 0
    #: A link opened on first use closes after this long with nothing sent or
    #: heard, unless it is kept (`PeerLinks.keep_open`).
    link_idle_s: float = 60.0
    #: ZeroMQ's own heartbeats (ZMTP); None: a quarter of `peer_timeout_s`.
    heartbeat_ivl_s: float | None = None
    probe_rounds: int = 5
    probe_bytes: int = 4 * 1024 * 1024
    max_payload_bytes: int = 1 << 31
    io_threads: int = 1
    place_min_bytes: int = 64 * 1024
    data_port: int = 0
    data_advertise: str | None = None

    @property
    def heartbeat_s(self) -> float:
        return (self.peer_timeout_s / 4 if self.heartbeat_ivl_s is None
                else float(self.heartbeat_ivl_s))

    def check(self) -> None:
        """Raise ConfigError naming the first setting that cannot work."""
        self.listen_endpoint()
        if not self.peer_timeout_s > 0:
            raise ConfigError(f"peer_timeout_s must be positive, got {self.peer_timeout_s!r}")
        if not 0 < self.heartbeat_s < self.peer_timeout_s:
            raise ConfigError(
                f"heartbeat_ivl_s must be positive and below peer_timeout_s "
                f"({self.peer_timeout_s}), got {self.heartbeat_ivl_s!r}"
            )
        if self.failure_detector not in DETECTORS:
            raise ConfigError(f"failure_detector must be one of {', '.join(DETECTORS)}, "
                              f"got {self.failure_detector!r}")
        if self.max_payload_bytes < 1024 * 1024:
            raise ConfigError("max_payload_bytes must be at least 1 MiB")
        if self.probe_rounds < 1 or self.probe_bytes < 0 or self.io_threads < 1:
            raise ConfigError(
                "probe_rounds and io_threads must be at least 1, probe_bytes at least 0"
            )
        if self.curve is not None and self.insecure:
            raise ConfigError("pass either CURVE keys or --insecure, not both")
        if not (is_integer(self.data_port) and 0 <= self.data_port < 65536):
            raise ConfigError(f"bad value for 'data_port': {self.data_port!r} is not a port")
        self.advertised_data_endpoint()

    def listen_endpoint(self) -> TcpEndpoint:
        try:
            return parse_tcp_endpoint(self.listen)
        except ValueError as exc:
            raise ConfigError(f"bad value for 'listen': {exc}") from None

    def advertised_data_endpoint(self) -> TcpEndpoint | None:
        """Where peers open this daemon's data streams, if not at its own address."""
        if self.data_advertise is None:
            return None
        try:
            return parse_tcp_endpoint("tcp://" + self.data_advertise)
        except ValueError as exc:
            raise ConfigError(f"bad value for 'data_advertise': {exc}") from None
