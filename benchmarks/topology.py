"""Where the "nodes" of a multi-daemon run live: 127.0.0.1, or network namespaces.

`loopback(M)`: M nodes on 127.0.0.1, told apart by port.
`namespaces(M)`: each node in a network namespace of its own, created here and
deleted on the way out; with `rate`, every node's link is shaped (tbf) to that
rate in each direction, like a NIC, so the wire rather than the CPUs sets the
pace.  Two nodes are joined by one veth pair; more hang off a
Linux bridge that lives in one more namespace (the hub), so nothing is added to
the host's own network namespace.  Addresses are 10.213.50.<i+1>/24, assigned
inside these namespaces only.  Namespace names carry this process's pid, and a
later run deletes the ones whose creator is gone (a run killed with SIGKILL).

A process joins node i's namespace through the command prefix `prefix(i)`
(`ip netns exec NAME`, which execs in place: the pid stays the same, so
signals and /dev/shm segment names work as for a plain child).  Unix sockets
(`ipc://` paths) and /dev/shm are shared across network namespaces, so clients
reach their daemon as on one host.  Needs root and iproute2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import random
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

from gradsync.daemon.backends.shm_pool import pid_alive

SUBNET = "10.213.50"
NAME_PREFIX = "gsbench"
_STALE = re.compile(rf"^{NAME_PREFIX}(\d+)-")
#: Topologies this process has made: the first is gsbenchPID-..., later ones gsbenchPID-N-...
_MADE = itertools.count()
#: Ports for peers inside namespaces (private to them, so fixed).
NETNS_BASE_PORT = 29400


@dataclasses.dataclass(frozen=True)
class Topology:
    """M nodes: their addresses, namespaces (None: the host's) and interface names."""

    kind: str  # "loopback" or "netns"
    hosts: tuple[str, ...]
    namespaces: tuple[str | None, ...]
    interfaces: tuple[str, ...]
    description: str

    @property
    def size(self) -> int:
        return len(self.hosts)

    def prefix(self, node: int) -> list[str]:
        """Command words that run a program inside node `node`'s namespace."""
        namespace = self.namespaces[node]
        return [] if namespace is None else ["ip", "netns", "exec", namespace]

    def endpoints(self, count: int = 1) -> list[list[str]]:
        """`count` sets of M `tcp://HOST:PORT` endpoints, all ports free."""
        if self.kind == "loopback":
            ports = free_ports(count * self.size)
        else:
            ports = [NETNS_BASE_PORT + i for i in range(count * self.size)]
        return [
            [f"tcp://{host}:{ports[c * self.size + i]}" for i, host in enumerate(self.hosts)]
            for c in range(count)
        ]


def free_ports(count: int) -> list[int]:
    """Distinct ports free right now on 127.0.0.1, below the ephemeral range.

    Below it, no outgoing connection (of this or a concurrent run) takes one
    before a daemon binds it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            port = random.randrange(10_000, max(10_001, low))
            if port in ports:
                continue
            with contextlib.suppress(OSError):
                sock.bind(("127.0.0.1", port))
                ports.append(port)
    return ports


@contextlib.contextmanager
def loopback(size: int) -> Iterator[Topology]:
    yield Topology(
        "loopback", ("127.0.0.1",) * size, (None,) * size, ("lo",) * size,
        f"{size} nodes on 127.0.0.1 (loopback, MTU {_mtu(None, 'lo') or '?'})",
    )


def namespaces_unavailable(shaped: bool = False) -> str | None:
    """Why network namespaces (with `shaped`: rate-limited ones) cannot be made here."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (`ip`) to create network namespaces"
    if shaped and shutil.which("tc") is None:
        return "needs iproute2's `tc` to shape the links"
    return None


def _ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def check_rate(rate: str) -> None:
    """Raise ValueError unless `rate` is a tc rate such as 5gbit or 800mbit."""
    if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)", rate):
        raise ValueError(f"rate {rate!r}: expected tc syntax such as 5gbit or 800mbit")


def _shape(namespace: str, interface: str, rate: str) -> None:
    """Cap what leaves `interface` at `rate`: a token bucket with a shallow queue.

    A 256 KB burst and at most 5 ms of queue, like a datacentre switch port;
    a deep queue (hundreds of ms) would add bufferbloat no real fabric has.
    """
    check_rate(rate)
    subprocess.run(
        ["tc", "-n", namespace, "qdisc", "add", "dev", interface, "root", "tbf",
         "rate", rate, "burst", "256kb", "latency", "5ms"],
        check=True, capture_output=True, timeout=30,
    )


def _mtu(namespace: str | None, interface: str) -> int | None:
    try:
        text = _ip(*(["-n", namespace] if namespace else []), "-o", "link", "show", interface)
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"\bmtu (\d+)", text)
    return int(match.group(1)) if match else None


def _delete(names: list[str]) -> list[str]:
    """Delete these namespaces; the ones that could not be deleted."""
    failed = []
    for name in names:
        done = subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        if done.returncode != 0 and name in list_namespaces():
            failed.append(name)
    return failed


def list_namespaces() -> list[str]:
    try:
        text = _ip("netns", "list")
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in text.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Delete namespaces an earlier run of this benchmark left (its pid is gone)."""
    stale = []
    for name in list_namespaces():
        match = _STALE.match(name)
        if match and int(match.group(1)) != os.getpid() and not pid_alive(int(match.group(1))):
            stale.append(name)
    _delete(stale)
    return stale


@contextlib.contextmanager
def namespaces(size: int, rate: str | None = None) -> Iterator[Topology]:
    """`size` nodes in namespaces of their own: a veth pair for 2, a bridge for more.

    `rate` (tc syntax, e.g. "5gbit") caps what each node sends and receives.

    Every namespace is deleted on the way out, however the block ends; stop
    the processes running inside first (a namespace with processes in it
    lives on until they exit).
    """
    if size < 2:
        raise ValueError("namespaces() needs at least 2 nodes")
    serial = next(_MADE)  # two of one process may be up at once
    tag = f"{NAME_PREFIX}{os.getpid()}" + (f"-{serial}" if serial else "")
    nodes = [f"{tag}-n{i}" for i in range(size)]
    hub = f"{tag}-hub" if size > 2 else None
    interfaces = [f"gsb{i}" for i in range(size)]
    created: list[str] = []
    try:
        for name in [*nodes, *([hub] if hub else [])]:
            _ip("netns", "add", name)
            created.append(name)
        if hub is None:
            _ip("link", "add", interfaces[0], "netns", nodes[0], "type", "veth",
                "peer", "name", interfaces[1], "netns", nodes[1])
            shape = "one veth pair"
        else:
            _ip("-n", hub, "link", "add", "gsbbr", "type", "bridge")
            _ip("-n", hub, "link", "set", "gsbbr", "up")
            for i, (node, interface) in enumerate(zip(nodes, interfaces, strict=True)):
                port = f"gsbp{i}"
                _ip("link", "add", interface, "netns", node, "type", "veth",
                    "peer", "name", port, "netns", hub)
                _ip("-n", hub, "link", "set", port, "master", "gsbbr")
                _ip("-n", hub, "link", "set", port, "up")
                if rate:
                    _shape(hub, port, rate)  # what the node receives
            shape = "veth pairs to a Linux bridge in a hub namespace"
        hosts = []
        for i, (node, interface) in enumerate(zip(nodes, interfaces, strict=True)):
            host = f"{SUBNET}.{i + 1}"
            _ip("-n", node, "addr", "add", f"{host}/24", "dev", interface)
            _ip("-n", node, "link", "set", interface, "up")
            _ip("-n", node, "link", "set", "lo", "up")
            if rate:
                _shape(node, interface, rate)  # what the node sends
            hosts.append(host)
        mtu = _mtu(nodes[0], interfaces[0])
        shaped = f", every node's link shaped to {rate} each way (tbf)" if rate else ""
        yield Topology(
            "netns", tuple(hosts), tuple(nodes), tuple(interfaces),
            f"{size} network namespaces joined by {shape} (MTU {mtu or '?'}), "
            f"addresses {SUBNET}.1-{size}/24{shaped}",
        )
    finally:
        left = _delete(list(reversed(created)))
        if left:
            raise RuntimeError(f"could not delete network namespaces {left}")
