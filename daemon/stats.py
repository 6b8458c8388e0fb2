"""Live statistics of a daemon: what it did, how fast, what it is waiting for.

`StatsRecorder` is fed by the service as collectives finish or fail and
builds plain-data snapshots (msgpack/JSON-ready) on request.  Latencies are
kept per job and size class in bounded windows, so percentiles reflect recent
behaviour and memory stays flat however long the daemon runs.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import time
from typing import TYPE_CHECKING, Any

from gradsync.protocol.version import PROTOCOL_VERSION, __version__

#: How a job's `done` counts the allreduces its ranks ran on the fast page.
FAST_PATH_KEY = "allreduce/fast"

if TYPE_CHECKING:
    from gradsync.daemon.core.compression_policy import CompressionChoice
    from gradsync.daemon.core.matching import Job
    from gradsync.daemon.io.service import GradsyncService

#: Size classes (upper bounds, bytes) for latency and bandwidth figures.
SIZE_CLASSES = (4 * 1024, 64 * 1024, 1024**2, 16 * 1024**2, 256 * 1024**2, float("inf"))
_WINDOW = 1024
#: Distinct buffer sizes whose `auto` picks a job keeps (later sizes are not listed).
_PICK_SIZES = 64


def size_class(nbytes: int) -> str:
    for bound in SIZE_CLASSES:
        if nbytes <= bound:
            return "inf" if bound == float("inf") else f"<={int(bound)}"
    return "inf"


def _bus_factor(kind: str, ranks: int) -> float:
    """nccl-tests' busbw/algbw factor for a collective over `ranks` ranks."""
    if ranks <= 1:
        return 1.0
    if kind == "allreduce":
        return 2 * (ranks - 1) / ranks
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (ranks - 1) / ranks
    return 1.0


@dataclasses.dataclass
class AutoPicks:
    """`auto`'s picks at one buffer size, and the figures it priced them with last."""

    #: algorithm -> how often `auto` picked it
    picks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: what decided: "model", "explored" (timing a contender) or "measured"
    basis: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: the latest pick and its basis: what `auto` settled on so far
    last: str = ""
    last_basis: str = ""
    alpha_s: float = 0.0
    beta_s_per_byte: float = 0.0
    epoch: int = 0


@dataclasses.dataclass
class CompressionPicks:
    """What `auto` compression chose for one name asked (`auto`, `auto:fp8`, ...)."""

    #: format ("none" for none) -> how often
    picks: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: the latest choice and its basis
    last: CompressionChoice | None = None
    epoch: int = 0


@dataclasses.dataclass
class JobStats:
    done: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    #: Collectives that began on the job's fast page and ended over the socket.
    fast_path_fallbacks: int = 0
    errors: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    bytes_reduced: int = 0
    peer_bytes: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    latencies: dict[str, collections.deque[tuple[float, int, float]]] = dataclasses.field(
        default_factory=dict
    )
    #: What `auto` did per buffer size (nbytes).
    auto: dict[int, AutoPicks] = dataclasses.field(default_factory=dict)
    #: The link costs (alpha s, beta s/byte) the job's latest generation formed
    #: with: what `auto` prices its first epoch with.
    formed_costs: tuple[float, float] | None = None
    #: The daemon that coordinated the job's latest formation (core/coordinating.py).
    coordinator: str | None = None
    #: What `auto` compression chose, by the name asked.
    compression: dict[str, CompressionPicks] = dataclasses.field(default_factory=dict)


class StatsRecorder:
    """Counts and timings per job, plus the daemon-wide view for snapshots."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.jobs: dict[str, JobStats] = collections.defaultdict(JobStats)
        self.errors: collections.Counter[str] = collections.Counter()
        #: The codec as `auto` compression sees it, once measured (run/codec_rates.py).
        self.codec: dict[str, Any] | None = None

    def collective_done(
        self, job: str, kind: str, algorithm: str | None, nbytes: int, ranks: int,
        seconds: float,
    ) -> None:
        stats = self.jobs[job]
        stats.done[f"{kind}/{algorithm or 'local'}"] += 1
        stats.bytes_reduced += nbytes * max(1, ranks)
        window = stats.latencies.setdefault(size_class(nbytes), collections.deque(maxlen=_WINDOW))
        window.append((seconds, nbytes, _bus_factor(kind, ranks)))

    def auto_picked(
        self, job: str, nbytes: int, algorithm: str, basis: str, costs: tuple[float, float],
        epoch: int,
    ) -> None:
        """`auto` chose `algorithm` for an allreduce of `nbytes` on `basis`, priced
        with `costs` (the figures the members agreed for `epoch`, see
        daemon/cost_epochs.py)."""
        stats = self.jobs[job]
        entry = stats.auto.get(nbytes)
        if entry is None:
            if len(stats.auto) >= _PICK_SIZES:
                return
            entry = stats.auto[nbytes] = AutoPicks()
        entry.picks[algorithm] += 1
        entry.basis[basis] += 1
        entry.last, entry.last_basis = algorithm, basis
        entry.alpha_s, entry.beta_s_per_byte = costs
        entry.epoch = epoch

    def compression_chosen(
        self, job: str, asked: str, choice: CompressionChoice, epoch: int
    ) -> None:
        """`auto` compression (`asked`) chose `choice` for a collective of `job`."""
        entry = self.jobs[job].compression.setdefault(asked, CompressionPicks())
        entry.picks[choice.format or "none"] += 1
        entry.last, entry.epoch = choice, epoch

    def codec_measured(self, lanes: int, rates: dict[str, float], loopback: bool) -> None:
        """This daemon's codec rates with its `lanes`, and whether its peers are all
        on this host: what it announces with its jobs."""
        self.codec = {"lanes": lanes, "rates_Bps": dict(rates), "peers_on_this_host": loopback}

    def job_formed(self, job: str, alpha_s: float, beta_s_per_byte: float,
                   coordinator: str | None = None) -> None:
        """A multi-node job formed, coordinated by `coordinator`; `auto`'s first
        figures are these."""
        self.jobs[job].formed_costs = (alpha_s, beta_s_per_byte)
        self.jobs[job].coordinator = coordinator

    def peer_traffic(
        self, job: str, peer: str, sent: int = 0, received: int = 0,
        sent_raw: int | None = None, received_raw: int | None = None,
    ) -> None:
        """Payload bytes exchanged with a peer daemon for a job, on the wire and
        before compression (`*_raw`; the same, uncompressed)."""
        entry = self.jobs[job].peer_bytes.setdefault(
            peer, {"sent": 0, "received": 0, "sent_raw": 0, "received_raw": 0})
        entry["sent"] += sent
        entry["received"] += received
        entry["sent_raw"] += sent if sent_raw is None else sent_raw
        entry["received_raw"] += received if received_raw is None else received_raw

    def fast_path_done(self, job: str, collectives: int, fallbacks: int) -> None:
        """What a job's ranks ran on its fast page, once the job ended (they are not
        timed: the daemon is not on that path)."""
        if collectives or fallbacks:
            stats = self.jobs[job]
            stats.done[FAST_PATH_KEY] += collectives
            stats.fast_path_fallbacks += fallbacks

    def collective_failed(self, job: str | None, code: str) -> None:
        self.errors[code] += 1
        if job is not None:
            self.jobs[job].errors[code] += 1

    def snapshot(self, service: GradsyncService, links: Any = None) -> dict[str, Any]:
        """One plain-data picture of the daemon (see docs/statistics.md)."""
        now = time.monotonic()
        config = service.config
        return {
            "version": __version__,
            "protocol": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "uptime_s": now - self.started,
            "tracing": service.trace.active,
            "config": {
                "socket": config.socket, "threads": config.threads,
                "collective_timeout_s": config.collective_timeout_s,
                "max_shm_bytes": config.max_shm_bytes, "listen": config.listen,
                "peers": list(config.all_peers()), "algorithm": config.algorithm,
                "codec_lanes": config.codec_lanes,
                "peer_timeout_s": config.peer_timeout_s,
                "failure_detector": config.failure_detector,
            },
            "codec": self.codec,
            "shm": {"in_use": service.buffers.in_use, "attached": service.buffers.attached,
                    "segments": len(service.buffers),
                    "limit": config.max_shm_bytes},
            "counters": service.state.counters(),
            "error_feedback": dict(service.state.error_feedback()),
            "errors": dict(self.errors),
            "jobs": {name: self._job(service, name, now) for name in
                     sorted(set(service.jobs) | set(self.jobs))},
            "peers": _peers(links, self.jobs),
            "checkpoints": service.checkpoints.snapshot(),
            "checkpoint_replicas": service.replicas.snapshot(),
        }

    def _job(self, service: GradsyncService, name: str, now: float) -> dict[str, Any]:
        job = service.jobs.get(name)
        stats = self.jobs.get(name, JobStats())
        done = collections.Counter(stats.done)
        fallbacks = stats.fast_path_fallbacks
        live = service.fast.job_counts(name) if job is not None else None
        if live is not None:
            done[FAST_PATH_KEY] += live[0]
            fallbacks += live[1]
        entry: dict[str, Any] = {
            "active": job is not None,
            "done": {key: count for key, count in done.items() if count},
            "fast_path_fallbacks": fallbacks,
            "errors": dict(stats.errors),
            "bytes_reduced": stats.bytes_reduced,
            "peer_bytes": {peer: dict(entry) for peer, entry in stats.peer_bytes.items()},
            "latency": {cls: _percentiles(window) for cls, window in stats.latencies.items()},
        }
        self._choices(stats, entry)
        if job is not None:
            entry.update(_live_job(service, job, now))
            # Where the job is announced now (core/coordinating.py), formed or not.
            if service.cluster is not None and name in service.cluster.forming.coordinators:
                entry["coordinator"] = service.cluster.forming.coordinators[name]
        return entry

    @staticmethod
    def _choices(stats: JobStats, entry: dict[str, Any]) -> None:
        """What the job formed with, and what `auto` and `auto` compression chose."""
        if stats.formed_costs is not None:
            entry["formed_costs"] = {"alpha_s": stats.formed_costs[0],
                                     "beta_s_per_byte": stats.formed_costs[1]}
            entry["coordinator"] = stats.coordinator
        if stats.auto:
            entry["auto"] = {
                str(nbytes): {"picks": dict(auto.picks), "basis": dict(auto.basis),
                              "last": auto.last, "last_basis": auto.last_basis,
                              "alpha_s": auto.alpha_s, "beta_s_per_byte": auto.beta_s_per_byte,
                              "epoch": auto.epoch}
                for nbytes, auto in stats.auto.items()
            }
        if stats.compression:
            entry["compression_auto"] = {
                asked: _compression_entry(picks) for asked, picks in stats.compression.items()}


def _live_job(service: GradsyncService, job: Job, now: float) -> dict[str, Any]:
    """A job still on the daemon: its members, formation and collectives in flight."""
    name = job.name
    formation = job.across.formation
    return {
        "world_size": job.world_size,
        "local_world_size": job.local_world_size,
        "members": {str(rank): {"pid": m.pid, "state": "connected"}
                    for rank, m in sorted(job.members.items())},
        "broken": job.broken.message if job.broken else None,
        # The job's shared-memory fast page (a segment of its own), if it has one.
        "fast_page": (service.fast.describe(name) or {}).get("name"),
        "generation": formation.generation if formation else None,
        "daemons": list(formation.daemons) if formation else None,
        "in_flight": [
            {"key": pending.key, "age_s": now - pending.first_seen,
             "waiting_for_ranks": sorted(set(job.members) - set(pending.submissions))}
            for pending in job.pending.values()
        ] + [
            {"key": key, "step": run.step + 1, "steps": run.steps,
             "algorithm": run.algorithm,
             "waiting_for_peers": [formation.daemons[i] for i in run.waiting_for()]
             if formation else []}
            for key, run in job.across.runs.items()
        ] + [
            {"key": key, "age_s": age_s, "waiting_for_ranks": missing,
             "path": "fast"}
            for key, age_s, missing in service.fast.waiting(name)
        ],
    }


def _compression_entry(entry: CompressionPicks) -> dict[str, Any]:
    """One `auto` compression name's choices and the basis of the latest."""
    last = entry.last
    assert last is not None
    return {"picks": dict(entry.picks), "last": last.format or "none", "reason": last.reason,
            "link_Bps": last.link_Bps, "codec_Bps": dict(last.codec_Bps),
            "speedups": dict(last.speedups), "epoch": entry.epoch}


def _percentiles(window: collections.deque[tuple[float, int, float]]) -> dict[str, float]:
    times = sorted(seconds for seconds, _, _ in window)
    if not times:
        return {}

    def at(q: float) -> float:
        return times[min(len(times) - 1, int(q * len(times)))]

    median = at(0.5)
    nbytes = sorted(n for _, n, _ in window)[len(window) // 2]
    factor = window[-1][2]
    algbw = nbytes / median if median > 0 else 0.0
    return {"count": len(times), "p50_s": median, "p90_s": at(0.9), "p99_s": at(0.99),
            "algbw_Bps": algbw, "busbw_Bps": algbw * factor}


def _peers(links: Any, jobs: dict[str, JobStats]) -> dict[str, Any]:
    if links is None:
        return {}
    peers = {}
    for peer in links.peers:
        stats = links.link_stats(peer)
        peers[peer] = {
            "state": links.peer_state(peer),
            "rtt_s": stats.rtt_s if stats else None,
            "bandwidth_Bps": stats.bytes_per_s if stats else None,
            "heartbeat_age_s": links.heard_age_s(peer),
            **links.detector_facts(peer),
            "data_stream": links.stream_state(peer),
            **links.link_facts(peer),
            **{f"bytes_{way}{suffix}": sum(j.peer_bytes.get(peer, {}).get(way + key, 0)
                                           for j in jobs.values())
               for way in ("sent", "received")
               for key, suffix in (("", ""), ("_raw", "_uncompressed"))},
        }
    return peers
