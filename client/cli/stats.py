"""`gradsync stats` and `gradsync top`: read a daemon's statistics endpoint.

The endpoint is the daemon's client socket path + `.stats` unless given;
`--json` prints the raw snapshot, `--prometheus` the Prometheus text
exposition format (for node exporters' textfile collectors).  A `tcp://`
endpoint behind CURVE is read with `--curve-secret` (a reader's key from
`gradsync keygen`, its public half in the daemon's authorised folder) and
`--curve-server-key` (the daemon's public `NAME.key`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import msgpack

from gradsync.protocol import messages
from gradsync.protocol.endpoint import default_endpoint, stats_stream_endpoint
from gradsync.protocol.errors import (
    DaemonUnavailableError,
    GradsyncError,
    InvalidArgumentError,
    ProtocolError,
)
from gradsync.protocol.trace_format import chrome_trace

# zmq is imported where a command reads the endpoint, not here: `gradsync` imports
# this module for its options, and `gradsync ping` or `--help` need no ZeroMQ.
if TYPE_CHECKING:
    import zmq

#: The largest reply or snapshot frame taken from a stats endpoint (a long trace's
#: events fit); a bigger one drops the connection instead of filling memory.
_MAX_REPLY_BYTES = 256 * 1024 * 1024


def add_stats_arguments(parser: argparse.ArgumentParser, live: bool = False) -> None:
    parser.add_argument("--daemon", default=None, metavar="ENDPOINT",
                        help="the daemon's client endpoint (default: $GRADSYNC_DAEMON)")
    parser.add_argument("--stats", default=None, metavar="ENDPOINT",
                        help="its statistics endpoint (default: the socket path + .stats)")
    parser.add_argument("--timeout-s", type=float, default=5.0)
    parser.add_argument("--curve-secret", default=None, metavar="FILE",
                        help="for a tcp:// endpoint behind CURVE: the reader's NAME.key_secret")
    parser.add_argument("--curve-server-key", default=None, metavar="FILE",
                        help="for a tcp:// endpoint behind CURVE: the daemon's public NAME.key")
    if live:
        parser.add_argument("--iterations", type=int, default=0,
                            help="stop after this many snapshots (default: run until Ctrl-C)")
    else:
        form = parser.add_mutually_exclusive_group()
        form.add_argument("--json", action="store_true", help="the raw snapshot as JSON")
        form.add_argument("--prometheus", action="store_true",
                          help="Prometheus text exposition format")


def _endpoint(args: argparse.Namespace) -> str:
    if args.stats:
        return _with_scheme(str(args.stats))
    daemon = args.daemon or os.environ.get("GRADSYNC_DAEMON") or default_endpoint()
    return f"{_with_scheme(daemon)}.stats"


def _with_scheme(endpoint: str) -> str:
    """A bare absolute path as `ipc://PATH`, as the daemon takes it (ZeroMQ needs it)."""
    return "ipc://" + endpoint if endpoint.startswith("/") else endpoint


def curve_options(args: argparse.Namespace) -> tuple[bytes, bytes, bytes] | None:
    """(our public, our secret, the daemon's public) key, or None without CURVE."""
    secret_file = getattr(args, "curve_secret", None)
    server_file = getattr(args, "curve_server_key", None)
    if not secret_file and not server_file:
        return None
    if not (secret_file and server_file):
        raise InvalidArgumentError("pass both --curve-secret and --curve-server-key")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(secret_file)
        server, _ = zmq.auth.load_certificate(server_file)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read a CURVE key: {exc}") from None
    if secret is None:
        raise InvalidArgumentError(f"{secret_file} holds no secret key (pass NAME.key_secret)")
    return public, secret, server


def _secure(sock: zmq.Socket[bytes], curve: tuple[bytes, bytes, bytes] | None) -> None:
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve


def _unanswered(endpoint: str, timeout_s: float) -> str:
    hint = "is gradsyncd running?"
    if endpoint.startswith("tcp://"):
        hint += (" behind CURVE, pass --curve-secret and --curve-server-key, with the "
                 "reader's public key in the daemon's authorised folder")
    return f"no statistics from {endpoint} within {timeout_s:g}s ({hint})"


def _decode(body: bytes) -> Any:
    """Strict msgpack without the control-message size limits (snapshots can be big)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable reply from the stats endpoint: {exc}") from None


def _ask(endpoint: str, timeout_s: float, kind: str,
         curve: tuple[bytes, bytes, bytes] | None = None, **fields: Any) -> dict[str, Any]:
    import zmq

    context = zmq.Context()
    try:
        sock = context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)
        sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        _secure(sock, curve)
        sock.connect(endpoint)
        sock.send(msgpack.packb(messages.request(kind, 1, **fields), use_bin_type=True))
        try:
            body = sock.recv()
        except zmq.Again:
            raise DaemonUnavailableError(_unanswered(endpoint, timeout_s)) from None
    finally:
        context.destroy(linger=0)
    reply = messages.check_header(_decode(body))
    if reply["kind"] == "error":
        raise ProtocolError(str(reply.get("message")))
    return reply


def fetch_snapshot(
    endpoint: str, timeout_s: float, curve: tuple[bytes, bytes, bytes] | None = None
) -> dict[str, Any]:
    """One snapshot over REQ/REP; DaemonUnavailableError when nobody answers in time."""
    reply = _ask(endpoint, timeout_s, "stats", curve)
    snapshot = reply.get("snapshot")
    if not isinstance(snapshot, dict):
        raise ProtocolError("the stats reply holds no snapshot")
    return snapshot


def _bytes(value: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return str(value)


def render_table(snapshot: dict[str, Any]) -> str:
    """A readable summary of one snapshot."""
    lines = [
        f"gradsyncd {snapshot['version']} pid {snapshot['pid']}  up {snapshot['uptime_s']:.0f}s  "
        f"shm {_bytes(snapshot['shm']['in_use'])} in {snapshot['shm']['segments']} segments",
    ]
    counters = snapshot.get("counters", {})
    dropped = {k: v for k, v in counters.items()
               if v and k in ("malformed", "stale_generation", "stale_membership",
                              "links_rejected_keys", "links_malformed", "dropped_unknown_job")}
    lines.append(f"collectives {counters.get('collectives', 0)}  failed "
                 f"{counters.get('failed', 0)}  dropped {dropped or 0}  "
                 f"fast path {counters.get('fast_path_collectives', 0)} "
                 f"(left for the socket {counters.get('fast_path_fallbacks', 0)})")
    for name, job in snapshot.get("jobs", {}).items():
        state = "active" if job.get("active") else "ended"
        members = ",".join(job.get("members", {})) or "-"
        lines.append(f"job {name!r} ({state}) ranks here: {members}  "
                     f"done {sum(job['done'].values())}  errors {dict(job['errors']) or 0}")
        latency = [(size, figures) for size, figures in job.get("latency", {}).items() if figures]
        if latency:
            lines.append("    latency by buffer size, over the last collectives of each size:")
        for size, figures in sorted(latency, key=lambda item: _size_bound(item[0])):
            lines.append(
                f"    {_size_label(size):>18}: {figures['count']:>5} collectives  "
                f"p50 {figures['p50_s'] * 1e3:8.3f} ms  p99 {figures['p99_s'] * 1e3:8.3f} ms  "
                f"busbw {figures['busbw_Bps'] / 1e9:6.2f} GB/s"
            )
        for nbytes, auto in sorted(job.get("auto", {}).items(), key=lambda kv: int(kv[0])):
            picks = ", ".join(f"{name} x{count}" for name, count in sorted(auto["picks"].items()))
            basis = ", ".join(f"{name} {count}" for name, count in
                              sorted(auto.get("basis", {}).items()))
            rate = 1 / max(auto["beta_s_per_byte"], 1e-15) / 1e9
            lines.append(
                f"    auto at {_bytes(int(nbytes))}: now {auto.get('last') or '-'} "
                f"({auto.get('last_basis') or '-'}); picked {picks} (by {basis or '-'}); "
                f"priced with alpha {auto['alpha_s'] * 1e6:.0f} µs, {rate:.2f} GB/s, "
                f"epoch {auto['epoch']}"
            )
        for asked, chosen in sorted(job.get("compression_auto", {}).items()):
            picks = ", ".join(f"{name} x{count}" for name, count in
                              sorted(chosen["picks"].items()))
            lines.append(f"    compression {asked}: now {chosen['last']} ({chosen['reason']}); "
                         f"picked {picks}, epoch {chosen['epoch']}")
        lines += [f"    in flight: {_in_flight(flight)}" for flight in job.get("in_flight", [])]
    codec = snapshot.get("codec")
    if codec:
        rates = ", ".join(f"{name} {rate / 1e9:.2f} GB/s"
                          for name, rate in sorted(codec["rates_Bps"].items()))
        lines.append(f"codec: {codec['lanes']} lane(s), {rates or 'no rates'}"
                     f"{'; peers on this host' if codec.get('peers_on_this_host') else ''}")
    for peer, link in snapshot.get("peers", {}).items():
        rtt = f"{link['rtt_s'] * 1e6:.0f} µs" if link.get("rtt_s") else "-"
        age = link.get("heartbeat_age_s")
        heard = f"{age:.1f}s ago" if age is not None else "never"
        stream = link.get("data_stream") or "none (ZeroMQ)"
        lines.append(f"peer {peer}: {link['state']}  rtt {rtt}  heard {heard}  "
                     f"data stream {stream}{_wire_bytes(link)}")
    for job_name, checkpoints in snapshot.get("checkpoints", {}).items():
        for checkpoint in checkpoints:
            state = "complete" if checkpoint["complete"] else "being saved"
            lines.append(f"checkpoint of job {job_name!r} step {checkpoint['step']} ({state}): "
                         f"{_bytes(checkpoint['bytes'])}, age {checkpoint['age_s']:.1f}s, "
                         f"ranks {len(checkpoint['ranks'])}"
                         + (f", adopted from pid {checkpoint['adopted_from']}"
                            if "adopted_from" in checkpoint else "")
                         + (f", replicas on {', '.join(checkpoint['replicas']) or 'none yet'}"
                            if "replicas" in checkpoint else ""))
    for job_name, replicas in snapshot.get("checkpoint_replicas", {}).items():
        for replica in replicas:
            state = "" if replica["complete"] else f" (arriving: {_bytes(replica['got'])})"
            lines.append(f"replica of job {job_name!r} step {replica['step']} rank "
                         f"{replica['rank']} item {replica['item']!r} from {replica['origin']}: "
                         f"{_bytes(replica['bytes'])}{state}")
    return "\n".join(lines)


def _wire_bytes(link: dict[str, Any]) -> str:
    """'  sent A (B before compression) ...' for a peer that carried any bytes."""
    parts = []
    for way in ("sent", "received"):
        wire, raw = link.get(f"bytes_{way}", 0), link.get(f"bytes_{way}_uncompressed", 0)
        if raw:
            before = f" ({_bytes(raw)} before compression)" if raw != wire else ""
            parts.append(f"{way} {_bytes(wire)}{before}")
    return "  " + ", ".join(parts) if parts else ""


def _size_bound(size_class: str) -> float:
    """The upper bound of a latency size class (`<=4096`, or `inf` for the largest)."""
    return float(size_class[2:]) if size_class.startswith("<=") else float("inf")


def _size_label(size_class: str) -> str:
    bound = _size_bound(size_class)
    return f"up to {_bytes(bound)}" if bound != float("inf") else "larger"


def _in_flight(flight: dict[str, Any]) -> str:
    """One in-flight collective: what it waits for, in words."""
    key = flight.get("key")
    if "steps" not in flight:  # still gathering this daemon's ranks
        ranks = ", ".join(str(rank) for rank in flight.get("waiting_for_ranks", [])) or "none"
        return f"key {key!r} for {flight.get('age_s', 0):.1f}s, waiting for local ranks {ranks}"
    # `step` counts from 1; 0 is the fingerprint agreement before the first step, and
    # steps + 1 the write-back after the last one.
    step, steps = flight.get("step", 0), flight.get("steps", 0)
    if step < 1:
        where = f"agreeing with its peers before step 1 of {steps}"
    elif step > steps:
        where = f"all {steps} steps done, writing back"
    else:
        where = f"step {step} of {steps}"
    peers = ", ".join(flight.get("waiting_for_peers") or [])
    return (f"key {key!r}, {flight.get('algorithm')}: {where}"
            + (f", waiting for peers {peers}" if peers else ""))


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_prometheus(snapshot: dict[str, Any]) -> str:
    """The snapshot as Prometheus text exposition format (version 0.0.4)."""
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[dict[str, Any], float]]
               ) -> None:
        out.append(f"# HELP gradsync_{name} {help_text}")
        out.append(f"# TYPE gradsync_{name} {kind}")
        for labels, value in samples:
            text = ",".join(f'{key}="{_label(val)}"' for key, val in labels.items())
            out.append(f"gradsync_{name}{{{text}}} {float(value)!r}" if text
                       else f"gradsync_{name} {float(value)!r}")

    metric("uptime_seconds", "gauge", "Seconds since the daemon started.",
           [({}, snapshot["uptime_s"])])
    metric("shm_bytes", "gauge", "Shared memory in use.", [({}, snapshot["shm"]["in_use"])])
    metric("counter_total", "counter", "Daemon-wide counters (drops, collectives, ...).",
           [({"name": k}, v) for k, v in sorted(snapshot.get("counters", {}).items())])
    metric("errors_total", "counter", "Failed collectives by error type.",
           [({"code": k}, v) for k, v in sorted(snapshot.get("errors", {}).items())])
    done, latency, picks, bases = [], [], [], []
    for job, entry in snapshot.get("jobs", {}).items():
        for kind, count in entry.get("done", {}).items():
            done.append(({"job": job, "collective": kind}, count))
        for nbytes, auto in entry.get("auto", {}).items():
            picks += [({"job": job, "bytes": nbytes, "algorithm": name}, count)
                      for name, count in sorted(auto["picks"].items())]
            bases += [({"job": job, "bytes": nbytes, "basis": name}, count)
                      for name, count in sorted(auto.get("basis", {}).items())]
        for size, figures in entry.get("latency", {}).items():
            for quantile in ("p50", "p90", "p99"):
                if figures:
                    latency.append(({"job": job, "size_class": size,
                                     "quantile": quantile[1:]}, figures[f"{quantile}_s"]))
    metric("collectives_total", "counter", "Collectives completed, by job and kind/algorithm.",
           done)
    metric("latency_seconds", "gauge", "Recent collective latency percentiles.", latency)
    metric("auto_picks_total", "counter",
           "Algorithms auto picked, by job and buffer size in bytes.", picks)
    metric("auto_basis_total", "counter",
           "What decided auto's picks (model, explored, measured), by job and size.", bases)
    metric("peer_rtt_seconds", "gauge", "Round trip to each peer daemon, measured at link-up.",
           [({"peer": p}, link["rtt_s"]) for p, link in snapshot.get("peers", {}).items()
            if link.get("rtt_s") is not None])
    metric("peer_heartbeat_age_seconds", "gauge", "Seconds since anything came from the peer.",
           [({"peer": p}, link["heartbeat_age_s"]) for p, link in snapshot.get("peers", {}).items()
            if link.get("heartbeat_age_s") is not None])
    metric("peer_up", "gauge", "1 when the link to the peer is up; a peer whose link is "
           "not connected (idle: opened on first use) is left out.",
           [({"peer": p}, 1.0 if link["state"] == "up" else 0.0)
            for p, link in snapshot.get("peers", {}).items() if link["state"] != "idle"])
    metric("peer_data_stream_open", "gauge",
           "1 while slices to the peer take a data stream, 0 while they take ZeroMQ.",
           [({"peer": p}, 1.0 if link.get("data_stream") else 0.0)
            for p, link in snapshot.get("peers", {}).items()])
    return "\n".join(out) + "\n"


def run_stats(args: argparse.Namespace) -> int:
    try:
        snapshot = fetch_snapshot(_endpoint(args), args.timeout_s, curve_options(args))
    except GradsyncError as exc:
        print(f"gradsync stats: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(snapshot, indent=2, sort_keys=True))
    elif args.prometheus:
        sys.stdout.write(render_prometheus(snapshot))
    else:
        print(render_table(snapshot))
    return 0


def run_top(args: argparse.Namespace) -> int:
    """A live view of the PUB stream (rich when available, plain text otherwise)."""
    endpoint = stats_stream_endpoint(_endpoint(args))
    try:
        curve = curve_options(args)
    except GradsyncError as exc:
        print(f"gradsync top: {exc}", file=sys.stderr)
        return 1
    import zmq

    context = zmq.Context()
    sock = context.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, _MAX_REPLY_BYTES)
    sock.setsockopt(zmq.RCVHWM, 16)  # snapshots beyond it are dropped: top shows the latest
    _secure(sock, curve)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVTIMEO, int(max(args.timeout_s, 2.0) * 1000))
    sock.connect(endpoint)
    try:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text
    except ImportError:  # pragma: no cover - rich is a dependency, but keep top usable
        Live = None  # type: ignore[assignment,misc]
    shown = 0
    try:
        if Live is not None and sys.stdout.isatty():
            with Live(Text("waiting for the first snapshot…"), console=Console(),
                      refresh_per_second=4) as live:
                while not args.iterations or shown < args.iterations:
                    live.update(Text(render_table(_next(sock, endpoint))))
                    shown += 1
        else:
            while not args.iterations or shown < args.iterations:
                print(render_table(_next(sock, endpoint)), flush=True)
                print(f"--- {time.strftime('%H:%M:%S')}", flush=True)
                shown += 1
    except GradsyncError as exc:
        print(f"gradsync top: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        context.destroy(linger=0)
    return 0


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    add_stats_arguments(parser, live=True)
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to record")
    parser.add_argument("--out", default="trace.json", help="Chrome trace file to write")


def run_trace(args: argparse.Namespace) -> int:
    """Record S seconds of collective phases and write a Chrome trace (Perfetto)."""
    try:
        reply = _ask(_endpoint(args), args.seconds + args.timeout_s + 5, "trace",
                     curve_options(args), seconds=args.seconds)
    except GradsyncError as exc:
        print(f"gradsync trace: {exc}", file=sys.stderr)
        return 1
    events = reply.get("events") or []
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(chrome_trace(events, int(reply.get("pid", 0))), handle)
    print(f"gradsync trace: {len(events)} events written to {args.out}"
          + (f" ({reply.get('dropped')} dropped)" if reply.get("dropped") else ""))
    return 0


def _next(sock: zmq.Socket[bytes], endpoint: str) -> dict[str, Any]:
    import zmq

    try:
        body = sock.recv()
    except zmq.Again:
        raise DaemonUnavailableError(f"no snapshot published at {endpoint}") from None
    snapshot = _decode(body)
    if not isinstance(snapshot, dict):
        raise ProtocolError("a published snapshot must be a map")
    return snapshot
