"""Wiring of the peer links into the daemon: build, adapt, pump, close.

`PeerLinks` (daemon/peers) moves messages; `ClusterJobs` (cluster.py) decides
what they mean.  This module connects the two and the service: `Peering` is
the links' `PeerEvents`, handing what they hear on to the cluster jobs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from gradsync.daemon.config import ConfigError, DaemonConfig
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.io.service import GradsyncService
from gradsync.daemon.peers.events import PeerMessage
from gradsync.daemon.peers.keys import CurveConfig
from gradsync.daemon.peers.links import PeerLinks
from gradsync.daemon.run.multi_node import CrossDaemonRunner
from gradsync.protocol.peer import CONTROL_KINDS, MESSAGES, STREAM_KINDS

log = logging.getLogger("gradsync.daemon.peering")



class LinksTransport:
    """`PeerTransport` over `PeerLinks`: synchronous, ordered sends."""

    def __init__(self, links: PeerLinks) -> None:
        self.links = links
        self.endpoint = links.endpoint

    def peers(self) -> Sequence[str]:
        return self.links.peers

    def send(
        self, peer: str, header: dict[str, Any], payloads: Sequence[Any] = (),
        zero_copy: bool = False,
    ) -> Any:
        if header["kind"] in CONTROL_KINDS and self.links.peer_state(peer) != "up":
            return None
        sending = self.links.send_nowait(peer, header, payloads, track=zero_copy)
        if not zero_copy:
            # Nothing waits on it; keep a failure from being reported as never retrieved.
            sending.add_done_callback(_quiet)
            return None
        return sending

    def is_up(self, peer: str) -> bool:
        return self.links.peer_state(peer) == "up"

    def link_costs(self) -> tuple[float, float] | None:
        """Latency (alpha = rtt/2) and inverse bandwidth (beta) of the least disturbed link.

        Links are probed once as they come up, usually while every daemon is
        starting and probing all its peers at once; that only ever adds time, so
        at four daemons on two cores round trips read 0.2 to 30 ms and rates 0.1
        to 2 GB/s.  The shortest round trip and the best rate are the readings
        least inflated; the job then takes the medians over its daemons.  They
        price a job's first collectives only: later ones use figures fitted to
        the collectives themselves (cost_epochs.py).
        """
        stats = [self.links.link_stats(peer) for peer in self.links.peers]
        measured = [s for s in stats if s is not None]
        if not measured or len(measured) < len(stats):
            return None
        alpha = min(s.rtt_s for s in measured) / 2
        beta = 1.0 / max(max(s.bytes_per_s for s in measured), 1.0)
        return alpha, beta


def _quiet(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def wants_peers(config: DaemonConfig) -> bool:
    """Whether this daemon is configured for multi-node jobs; checks the settings."""
    if config.listen is None:
        if config.all_peers():
            raise ConfigError("peers are configured but 'listen' is not: pass --listen")
        return False
    if bool(config.curve_secret) != bool(config.curve_authorized):
        raise ConfigError("pass both --curve-secret and --curve-authorized (or neither)")
    return True


class Peering:
    """The running peer side of a daemon: links, cluster state, and the links' events."""

    def __init__(self, config: DaemonConfig, service: GradsyncService) -> None:
        assert config.listen is not None
        curve = None
        if config.curve_secret and config.curve_authorized:
            curve = CurveConfig(config.curve_secret, config.curve_authorized)
        self.service = service
        self.peer_timeout_s = config.peer_timeout_s
        self.links = PeerLinks(
            config.listen,
            list(config.all_peers()),
            curve,
            events=self,
            insecure=config.insecure,
            kinds=MESSAGES,
            # A withdraw follows the sender's slices down the same stream: a daemon
            # whose ranks leave right after their last collective must not overtake
            # the slices its peers still need to finish that collective.
            stream_kinds=STREAM_KINDS,
            peer_timeout_s=config.peer_timeout_s,
        )
        self.cluster = ClusterJobs(config, LinksTransport(self.links), service.stats)
        runner = CrossDaemonRunner(
            self.cluster, service.loop, service.run_call, service.stats, service.trace
        )
        service.join_cluster(self.cluster, runner)
        service.state.cluster = self.cluster.counters
        service.state.link_counters = lambda: self.links.counters

    async def start(self) -> None:
        if self.links.insecure and self.links.peers:
            log.warning(
                "peer links run WITHOUT encryption or authentication (--insecure): "
                "anyone who can reach %s can join jobs and read gradients", self.links.endpoint
            )
        await self.links.start()
        log.info("peer links up on %s; peers: %s", self.links.endpoint,
                 ", ".join(self.links.peers) or "none")

    # -- PeerEvents: called by the links, from the event loop --------------------

    def message(self, message: PeerMessage) -> None:
        """Called by the links, from the event loop, as each message arrives."""
        self.cluster.on_message(message.peer, message.header, message.payloads, self.service.jobs)

    def place(
        self, peer: str, header: dict[str, Any], sizes: list[int]
    ) -> list[Any] | None:
        """Called by the links when a slice's header is in, before its payload."""
        try:
            return self.cluster.place(peer, header, sizes, self.service.jobs)
        except Exception:
            log.exception("placing a slice from %s failed; it arrives the usual way", peer)
            return None

    def peer_up(self, peer: str) -> None:
        self.cluster.peer_up(peer, self.service.jobs)

    def peer_lost(self, peer: str) -> None:
        self.cluster.peer_lost(
            peer, self.service.jobs,
            f"its connection closed or it was silent for {self.peer_timeout_s:g}s",
        )

    def stream_broken(self, peer: str, why: str) -> None:
        self.cluster.stream_broken(peer, self.service.jobs, why)

    def counters(self) -> dict[str, int]:
        return dict(self.links.counters)

    async def close(self) -> None:
        await self.links.close()
