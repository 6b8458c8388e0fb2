"""`gradsync doctor`: check what makes distributed training fail before it starts.

Each check says ok, warning or problem, with the fix in one line: /dev/shm's
size and free space against what the job needs, the daemon's socket and its
permissions, whether it answers and speaks our protocol, the address and
interface it listens on for peers (loopback with peers elsewhere is a problem),
its peers' links as the daemon's own handshakes, probes and data streams found
them (keys refused, another peer protocol version, a data port that does not
answer), whether every peer's listen port is reachable from here (the peers
given, the daemon's, or the Slurm job's nodes), CURVE key files' ownership and
modes, the open-file and locked-memory limits, the fast path's C module, and
the torch backend's registration.  The exit status is 1 when any check found a
problem; `--json` prints the list.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.metadata
import importlib.util
import ipaddress
import json
import os
import re
import resource
import socket
import stat
import struct
import sys
from collections.abc import Iterator
from typing import Any

from gradsync.daemon.config import DaemonConfig
from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.peer import PEER_PROTOCOL_VERSION
from gradsync.protocol.shm import SHM_DIR
from gradsync.protocol.version import PROTOCOL_VERSION

OK, WARNING, PROBLEM = "ok", "warning", "problem"
#: Below this, /dev/shm is a container's default (Docker: 64 MiB), not a node's.
_SMALL_SHM = 1 << 30
#: ioctl(2) request for an interface's IPv4 address (linux/sockios.h).
_SIOCGIFADDR = 0x8915
#: A rank keeps a few sockets and segments open; a daemon one per client and peer.
_MIN_OPEN_FILES = 4096
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_TCP_ENDPOINT = re.compile(r"^tcp://(\[[^\]]+\]|[^:/]+):(\d+)$")
_SIZE_TEXT = re.compile(r"^\s*(\d+)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


@dataclasses.dataclass
class Finding:
    """One check's verdict: what was checked, how it stands, and the fix."""

    check: str
    status: str
    detail: str
    fix: str = ""


def byte_count(text: str) -> int:
    """`--expect-bytes`: plain bytes or a binary unit (`512MiB`, `8G`)."""
    found = _SIZE_TEXT.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 8G)")
    return int(found.group(1)) * _UNITS[found.group(2).lower()]


def add_doctor_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--daemon", default=None, metavar="ENDPOINT",
                        help=f"daemon endpoint (default: $GRADSYNC_DAEMON or "
                        f"{default_endpoint()})")
    parser.add_argument("--expect-bytes", type=byte_count, default=None, metavar="SIZE",
                        help="shared memory the job on this node will need (e.g. 4GiB)")
    parser.add_argument("--peers", default=None, metavar="ENDPOINTS",
                        help="comma-separated peer endpoints to probe (default: the daemon's)")
    parser.add_argument("--peers-from-slurm", action="store_true",
                        help="probe the daemons of this Slurm job's nodes (SLURM_JOB_NODELIST) "
                        "at --port")
    parser.add_argument("--port", type=int, default=DaemonConfig.port, metavar="P",
                        help=f"the daemons' port with --peers-from-slurm (default "
                        f"{DaemonConfig.port}, as gradsyncd's)")
    parser.add_argument("--curve-secret", default=None, metavar="FILE",
                        help="a daemon's secret key file to check")
    parser.add_argument("--curve-authorized", default=None, metavar="DIR",
                        help="a folder of authorised public keys to check")
    parser.add_argument("--timeout-s", type=float, default=2.0,
                        help="how long each probe waits (default 2)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def check_shm(expect: int | None, shm_dir: str = SHM_DIR) -> Finding:
    try:
        info = os.statvfs(shm_dir)
    except OSError as exc:
        return Finding("shm", PROBLEM, f"{shm_dir}: {exc.strerror}",
                       "mount a tmpfs there (containers: an emptyDir with medium: Memory)")
    size, free = info.f_blocks * info.f_frsize, info.f_bavail * info.f_frsize
    detail = f"{shm_dir}: {size / 2**20:.0f} MiB, {free / 2**20:.0f} MiB free"
    if expect is not None and free < expect:
        return Finding("shm", PROBLEM, f"{detail}; the job needs {expect / 2**20:.0f} MiB",
                       "enlarge /dev/shm (docker run --shm-size, a Memory emptyDir's "
                       "sizeLimit) or free space there")
    if expect is None and size < _SMALL_SHM:
        return Finding("shm", WARNING, f"{detail} (a container's default?)",
                       "pass --expect-bytes, or enlarge /dev/shm before large jobs")
    return Finding("shm", OK, detail)


def check_shm_budget(shm: dict[str, Any], shm_dir: str = SHM_DIR) -> Finding:
    """What the daemon holds and may take (`max_shm_bytes`) against /dev/shm: a
    budget the tmpfs cannot back fails large jobs with ShmExhaustedError first."""
    in_use, limit = shm.get("in_use", 0), shm.get("limit", 0)
    detail = f"the daemon holds {in_use / 2**20:.0f} MiB of its {limit / 2**20:.0f} MiB budget"
    try:
        info = os.statvfs(shm_dir)
    except OSError:
        return Finding("shm in use", OK, detail)  # check_shm reports the missing folder
    room = in_use + info.f_bavail * info.f_frsize
    if limit > room:
        return Finding("shm in use", WARNING, f"{detail}, but {shm_dir} can back only "
                       f"{room / 2**20:.0f} MiB of it",
                       "pass --expect-bytes for the job's need; enlarge /dev/shm, or lower "
                       "the daemon's max_shm_bytes to what it holds")
    return Finding("shm in use", OK, detail)


def check_socket(endpoint: str) -> Finding:
    if not endpoint.startswith("ipc://"):
        return Finding("socket", PROBLEM, f"{endpoint} is not an ipc:// endpoint",
                       "pass --daemon ipc://PATH")
    path = endpoint[len("ipc://"):]
    try:
        info = os.stat(path)
    except OSError:
        return Finding("socket", WARNING, f"no daemon socket at {path}",
                       f"start one: gradsyncd --socket {endpoint} (or use gradsync launch)")
    if not stat.S_ISSOCK(info.st_mode):
        return Finding("socket", PROBLEM, f"{path} is not a socket", "remove it; restart gradsyncd")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o007:
        return Finding("socket", PROBLEM, f"{path} has mode {mode:04o}: open to every user",
                       "restart gradsyncd (it binds 0600, or 0660 with --group-access)")
    if info.st_uid != os.getuid() and not (mode & 0o060 and info.st_gid in os.getgroups()):
        return Finding("socket", PROBLEM, f"{path} (mode {mode:04o}) belongs to uid "
                       f"{info.st_uid}, and this user may not connect",
                       "join the daemon's group (usermod -aG gradsync USER)")
    return Finding("socket", OK, f"{path}, mode {mode:04o}")


def check_daemon(endpoint: str, timeout_s: float) -> tuple[Finding, dict[str, Any] | None]:
    """Whether the daemon answers and speaks our protocol; its statistics if so."""
    from gradsync.client.ping import query
    from gradsync.protocol.errors import GradsyncError

    try:
        reply = query(endpoint, timeout_s)
    except GradsyncError as exc:
        return Finding("daemon", WARNING, str(exc), "start gradsyncd, or pass --daemon"), None
    if reply.get("protocol") != PROTOCOL_VERSION:
        return Finding("daemon", PROBLEM, f"daemon speaks protocol v{reply.get('protocol')}, "
                       f"this client v{PROTOCOL_VERSION}",
                       "install the same gradsync version for daemon and trainers"), None
    snapshot: dict[str, Any] | None = None
    try:
        from gradsync.client.cli.stats import fetch_snapshot

        snapshot = fetch_snapshot(endpoint + ".stats", timeout_s)
    except GradsyncError:
        pass
    return Finding("daemon", OK, f"gradsyncd {reply.get('version')} (pid {reply.get('pid')}, "
                   f"protocol v{reply.get('protocol')})"), snapshot


#: What a failed CURVE handshake means, by the monitor event our side saw.
_HANDSHAKE_FIXES = {
    "HANDSHAKE_FAILED_AUTH": "the peer refused our key: copy this node's NAME.key into the "
                             "peer's --curve-authorized folder and restart it",
}
_KEY_FIX = ("the key on file for the peer (its NAME.key in our --curve-authorized folder) is "
            "not the one it presents, or one side runs --insecure: copy its current NAME.key")


def check_links(snapshot: dict[str, Any]) -> Iterator[Finding]:
    """The daemon's own links, as its probes and handshakes found them: each peer
    up, with our keys, in our protocol version, with its data stream open."""
    # Our side of a handshake with a wrong server key sees nothing: the peer drops
    # it.  The peer's key refused by our ZAP handler is what shows here.
    refused = snapshot.get("counters", {}).get("links_rejected_keys", 0)
    for peer, info in sorted(snapshot.get("peers", {}).items()):
        state, failed = info.get("state", "?"), info.get("handshake_error")
        if state == "up":
            yield Finding(f"link {peer}", OK, f"up (heard {info.get('heartbeat_age_s') or 0:.1f}"
                          " s ago)")
        elif state == "idle":  # past 2N+1 daemons: not a ring neighbour, no job uses it
            yield Finding(f"link {peer}", OK, "not connected: no job here uses it now, "
                          "and it opens on first use (docs/multi-node.md, Who links to whom)")
            continue
        elif failed:
            yield Finding(f"link {peer}", PROBLEM, f"the CURVE handshake failed ({failed})",
                          _HANDSHAKE_FIXES.get(failed, _KEY_FIX))
        elif refused:
            yield Finding(f"link {peer}", PROBLEM, f"the daemon's link is {state}, and it "
                          f"refused {refused} CURVE handshake(s) from keys not on file",
                          _KEY_FIX)
        else:
            yield Finding(f"link {peer}", PROBLEM, f"the daemon's link is {state}",
                          "start that node's daemon; check its firewall, keys and --listen")
        if info.get("version_error"):
            yield Finding(f"version {peer}", PROBLEM, info["version_error"],
                          "install the same gradsync version on every node")
        elif state == "up":
            yield Finding(f"version {peer}", OK, f"peer protocol v{PEER_PROTOCOL_VERSION}, "
                          "as ours")
        yield from _check_data_stream(peer, state, info)


def _check_data_stream(peer: str, state: str, info: dict[str, Any]) -> Iterator[Finding]:
    """The peer's data port, as our daemon's attempt to open a stream to it found it."""
    address, stream = info.get("data_address"), info.get("data_stream")
    if stream:
        yield Finding(f"data {peer}", OK, f"{stream} data stream open to {address}")
    elif info.get("stream_error"):
        yield Finding(f"data {peer}", PROBLEM,
                      f"{info['stream_error']}; large slices go over ZeroMQ, slower",
                      "open the peer's data port (gradsyncd --data-port) in the firewall, or "
                      "fix --data-advertise where a NAT or port forward sits between")
    elif state == "up" and address:
        yield Finding(f"data {peer}", WARNING, f"no data stream to {address} yet",
                      "run doctor again in a few seconds")


def _addresses(host: str) -> list[str]:
    """The addresses `host` resolves to here (none if it does not resolve)."""
    try:
        return sorted({str(info[4][0]) for info in socket.getaddrinfo(host, None)})
    except OSError:
        return []


def interface_of(address: str) -> str | None:
    """The name of the interface whose (first) IPv4 address is `address`, if any."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                  struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
        if socket.inet_ntoa(raw[20:24]) == address:
            return name
    return None


def _is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.split("%", 1)[0]).is_loopback


def check_listen(config: dict[str, Any]) -> Iterator[Finding]:
    """Which address and interface the daemon listens on for its peers, and whether
    its peers can reach it there: a host name that resolves to loopback (Debian's
    /etc/hosts maps it to 127.0.1.1) with peers on other hosts is a classic."""
    listen = config.get("listen")
    found = _TCP_ENDPOINT.match(listen or "")
    if found is None:
        return  # no peer links: one node
    host = found.group(1).strip("[]")
    if host in ("*", "0.0.0.0", "::"):
        yield Finding("listen", OK, f"{listen}: every interface")
        return
    addresses = _addresses(host)
    if not addresses:
        yield Finding("listen", PROBLEM, f"{listen}: {host!r} does not resolve here",
                      "give --listen an address or a name that resolves to this node")
        return
    shown = ", ".join(f"{a} ({interface_of(a) or '?'})" for a in addresses)
    peers = [_TCP_ENDPOINT.match(peer) for peer in config.get("peers", [])]
    peer_hosts = {match.group(1).strip("[]") for match in peers if match}
    remote = sorted(h for h in peer_hosts - {host}
                    if any(not _is_loopback(a) for a in _addresses(h)))
    if all(_is_loopback(a) for a in addresses) and remote:
        yield Finding("listen", PROBLEM, f"{listen} is {shown}, a loopback address, but "
                      f"peers are on other hosts ({', '.join(remote)}): they cannot reach it",
                      "give --listen the address of the interface the nodes share, or map "
                      "the host name to it in /etc/hosts")
        return
    yield Finding("listen", OK, f"{listen}: {shown}")


def check_port(endpoint: str, timeout_s: float) -> Finding:
    """A TCP connection to a peer's listen port, from here."""
    found = _TCP_ENDPOINT.match(endpoint)
    if found is None:
        return Finding(f"port {endpoint}", PROBLEM, "not a tcp://HOST:PORT endpoint",
                       "list peers as tcp://HOST:PORT")
    host, port = found.group(1).strip("[]"), int(found.group(2))
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except OSError as exc:
        return Finding(f"port {endpoint}", PROBLEM,
                       f"cannot connect: {exc.strerror or type(exc).__name__}",
                       "start the daemon there; open the port (and its data port) in the "
                       "firewall; check that HOST resolves to the right interface")
    return Finding(f"port {endpoint}", OK, "reachable")


def check_secret(path: str) -> Finding:
    try:
        info = os.stat(path)
    except OSError as exc:
        return Finding("secret key", PROBLEM, f"{path}: {exc.strerror}",
                       "gradsync keygen DIR --name NODE")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        return Finding("secret key", PROBLEM, f"{path} has mode {mode:04o}: others may read it",
                       f"chmod 600 {path} (and make a new key if others read it)")
    if info.st_uid != os.geteuid():
        return Finding("secret key", WARNING, f"{path} belongs to uid {info.st_uid}",
                       "chown it to the user gradsyncd runs as")
    return Finding("secret key", OK, f"{path}, mode {mode:04o}")


def check_authorized(folder: str) -> Finding:
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".key")]
    except OSError as exc:
        return Finding("authorized keys", PROBLEM, f"{folder}: {exc.strerror}",
                       "copy every node's NAME.key into one folder")
    if not names:
        return Finding("authorized keys", PROBLEM, f"{folder} holds no NAME.key",
                       "copy every node's NAME.key (never NAME.key_secret) into it")
    writable = [n for n in names if os.stat(os.path.join(folder, n)).st_mode & 0o002]
    if writable:
        return Finding("authorized keys", PROBLEM, f"{', '.join(writable)} writable by anyone",
                       f"chmod o-w {folder}/*.key")
    return Finding("authorized keys", OK, f"{len(names)} public keys in {folder}")


def check_limits() -> Iterator[Finding]:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < _MIN_OPEN_FILES:
        yield Finding("open files", WARNING, f"ulimit -n is {soft}",
                      f"raise it to {_MIN_OPEN_FILES} or more (ulimit -n, LimitNOFILE=)")
    else:
        yield Finding("open files", OK, f"ulimit -n is {soft}")
    locked, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    shown = "unlimited" if locked == resource.RLIM_INFINITY else f"{locked // 1024} KiB"
    # Pinned host buffers (GPU staging) count against it; host shm does not.
    yield Finding("locked memory", OK, f"ulimit -l is {shown}")


def check_modules() -> Iterator[Finding]:
    if importlib.util.find_spec("gradsync.protocol._fastpage") is None:
        yield Finding("fast path", WARNING, "its C module was not built: small allreduces "
                      "run the same steps in Python, locked with flock, and a daemon that has "
                      "the module offers its pages to none of this install's clients",
                      "reinstall with gcc and python3-dev present")
    else:
        yield Finding("fast path", OK, "C module built")
    if importlib.util.find_spec("torch") is None:
        yield Finding("torch backend", OK, "torch is not installed (numpy clients only)")
        return
    names = [e.name for e in importlib.metadata.entry_points(group="torch.backends")]
    if "gradsync" in names:
        yield Finding("torch backend", OK, "registered (init_process_group(\"gradsync\"))")
    else:
        yield Finding("torch backend", PROBLEM, "torch is installed, the backend not registered",
                      "pip install gradsync into the environment torch runs in")


def diagnose(args: argparse.Namespace) -> list[Finding]:
    endpoint = args.daemon or os.environ.get("GRADSYNC_DAEMON") or default_endpoint()
    findings = [check_shm(args.expect_bytes), check_socket(endpoint)]
    daemon, snapshot = check_daemon(endpoint, args.timeout_s)
    findings.append(daemon)
    config = (snapshot or {}).get("config", {})
    if args.expect_bytes is None and snapshot is not None:
        findings.append(check_shm_budget(snapshot.get("shm", {})))
    if snapshot is not None:
        findings += check_listen(config)
        findings += check_links(snapshot)
    peers = args.peers.split(",") if args.peers else list(config.get("peers", []))
    if args.peers_from_slurm:
        try:
            peers += slurm_peers(args.port)
        except ValueError as exc:  # ConfigError: not in a job, or no scontrol
            findings.append(Finding("slurm", PROBLEM, str(exc),
                                    "run doctor inside the job (srun), where scontrol is on PATH"))
    own = config.get("listen")
    findings += [check_port(peer, args.timeout_s)
                 for peer in dict.fromkeys(p.strip() for p in peers) if peer and peer != own]
    if args.curve_secret:
        findings.append(check_secret(args.curve_secret))
    if args.curve_authorized:
        findings.append(check_authorized(args.curve_authorized))
    findings += check_limits()
    findings += check_modules()
    return findings


def slurm_peers(port: int) -> list[str]:
    """The daemons of this Slurm job: each node of SLURM_JOB_NODELIST (expanded by
    Slurm's scontrol, as `gradsyncd --peers-from-slurm` does) at `port`."""
    from gradsync.daemon.slurm import expand_hostnames, job_nodelist

    return [f"tcp://{node}:{port}" for node in expand_hostnames(job_nodelist(os.environ),
                                                                os.environ)]


def run_doctor(args: argparse.Namespace) -> int:
    findings = diagnose(args)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=1))
    else:
        for finding in findings:
            line = f"{finding.status:<8} {finding.check}: {finding.detail}"
            print(line + (f"\n{'':9}fix: {finding.fix}" if finding.fix else ""))
    problems = sum(f.status == PROBLEM for f in findings)
    if not args.json:
        print(f"{problems} problem(s), {sum(f.status == WARNING for f in findings)} warning(s)",
              file=sys.stderr)
    return 1 if problems else 0
