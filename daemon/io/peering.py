"""Wiring of the peer links into the daemon: build, connect, start, close.

`PeerLinks` (daemon/peers) moves messages; `ClusterJobs` (core/cluster.py)
decides what they mean: it is the links' `PeerEvents`, and the links are its
`PeerTransport`.  This module builds both, the inter-daemon runner, and tells
the request handlers about them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from gradsync.daemon.config import ConfigError, DaemonConfig
from gradsync.daemon.core.cluster import ClusterJobs
from gradsync.daemon.core.interfaces import PlacedPayload
from gradsync.daemon.io.checkpoint_peers import CheckpointPeers
from gradsync.daemon.io.service import GradsyncService
from gradsync.daemon.peers.events import PeerMessage
from gradsync.daemon.peers.keys import CurveConfig
from gradsync.daemon.peers.link_settings import LinkSettings
from gradsync.daemon.peers.links import PeerLinks
from gradsync.daemon.run.multi_node import CrossDaemonRunner
from gradsync.protocol.codec import Message
from gradsync.protocol.peer import CKPT_MESSAGES, MESSAGES, STREAM_KINDS, CkptAnswer, CkptChunk

log = logging.getLogger("gradsync.daemon.peering")


def wants_peers(config: DaemonConfig) -> bool:
    """Whether this daemon is configured for multi-node jobs; checks the settings."""
    if config.listen is None:
        if config.all_peers():
            raise ConfigError("peers are configured but 'listen' is not: pass --listen")
        if config.data_port or config.data_advertise:
            raise ConfigError("'data_port' and 'data_advertise' are for peer links: "
                              "pass --listen and --peers too")
        return False
    if bool(config.curve_secret) != bool(config.curve_authorized):
        raise ConfigError("pass both --curve-secret and --curve-authorized (or neither)")
    return True


class PeeringEvents:
    """The links' events: checkpoint messages go to the checkpoint peers, the rest
    (and every link event) to the cluster core."""

    def __init__(self, cluster: ClusterJobs) -> None:
        self.cluster = cluster
        #: Set once the links exist (the checkpoint peers send through them).
        self.checkpoints: CheckpointPeers | None = None

    def message(self, message: PeerMessage) -> None:
        if message.header["kind"] in CKPT_MESSAGES:
            if self.checkpoints is not None:
                self.checkpoints.message(message.peer, message.header, message.payloads)
            return
        self.cluster.message(message)

    def place(self, peer: str, header: Message,
              sizes: list[int]) -> Sequence[PlacedPayload | None] | None:
        if header["kind"] in CKPT_MESSAGES:
            return None  # a fresh buffer, copied into the replica
        return self.cluster.place(peer, header, sizes)

    def peer_up(self, peer: str) -> None:
        self.cluster.peer_up(peer)
        if self.checkpoints is not None:
            self.checkpoints.peer_up(peer)

    def peer_lost(self, peer: str, why: str = "") -> None:
        self.cluster.peer_lost(peer, why)
        if self.checkpoints is not None:
            self.checkpoints.peer_lost(peer, why or "its connection closed")

    def stream_broken(self, peer: str, why: str) -> None:
        self.cluster.stream_broken(peer, why)
        if self.checkpoints is not None:
            self.checkpoints.stream_broken(peer, why)


class Peering:
    """The running peer side of a daemon: links, cluster state, and the links' events."""

    def __init__(self, config: DaemonConfig, service: GradsyncService) -> None:
        assert config.listen is not None
        curve = None
        if config.curve_secret and config.curve_authorized:
            curve = CurveConfig(config.curve_secret, config.curve_authorized)
        self.service = service
        # The cluster core hears what the links hear (it is their PeerEvents), and
        # sends through them (they are its PeerTransport).
        self.cluster = ClusterJobs(config, service.jobs, service.clock.now, service.stats)
        settings = LinkSettings(
            config.listen,
            list(config.all_peers()),
            curve,
            insecure=config.insecure,
            kinds={**MESSAGES, **CKPT_MESSAGES},
            # A withdraw follows the sender's slices down the same stream: a daemon
            # whose ranks leave right after their last collective must not overtake
            # the slices its peers still need to finish that collective.
            # Checkpoint parts, and the answer that follows a pulled part, too.
            stream_kinds=(*STREAM_KINDS, CkptChunk.kind, CkptAnswer.kind),
            # Replicas and pulls: what is queued behind them must not wait long.
            bulk_kinds=(CkptChunk.kind,),
            peer_timeout_s=config.peer_timeout_s,
            failure_detector=config.failure_detector,
            watch_neighbours=config.watch_neighbours,
            link_idle_s=config.link_idle_s,
            data_port=config.data_port,
            data_advertise=config.data_advertise,
        )
        events = PeeringEvents(self.cluster)
        self.links = PeerLinks(settings, events=events)
        self.links.in_use = self.cluster.peers_in_use
        self.links.keep_open = self.cluster.peers_kept
        self.cluster.connect(self.links, service.runs)
        self.checkpoints = events.checkpoints = CheckpointPeers(
            service.checkpoints, service.replicas, self.links, config.checkpoint_replicas,
            busy=self._busy, counters=self.cluster.counters)
        service.checkpoint_peers = self.checkpoints
        runner = CrossDaemonRunner(
            self.cluster, service.loop, service.offload.run, service.stats, service.trace,
            alive=lambda segment: service.buffers.get(segment) is not None,
        )
        service.join_cluster(self.cluster, runner)
        self.cluster.codec_facts = runner.codec_facts  # announced for `auto` compression
        service.state.cluster = self.cluster.counters
        service.state.link_counters = lambda: self.links.counters
        service.state.error_feedback = runner.residuals.snapshot

    async def start(self) -> None:
        if self.links.insecure and self.links.peers:
            log.warning(
                "peer links run WITHOUT encryption or authentication (--insecure): "
                "anyone who can reach %s can join jobs and read gradients", self.links.endpoint
            )
        await self.links.start()
        self.checkpoints.start()
        log.info("peer links up on %s; peers: %s", self.links.endpoint,
                 ", ".join(self.links.peers) or "none")

    def counters(self) -> dict[str, int]:
        return dict(self.links.counters)

    def _busy(self, peer: str) -> bool:
        """Whether a collective of a job spanning `peer` runs here now."""
        return any(job.across.runs and job.across.formation is not None
                   and peer in job.across.formation.daemons
                   for job in self.cluster.jobs.values())

    async def close(self) -> None:
        await self.checkpoints.close()
        await self.links.close()
