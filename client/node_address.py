"""Which address of this node its daemon offers peers: the one that reaches the store.

A job's private daemons (client/torch/private_daemon.py) listen on the
interface whose route leads to the c10d store's host, as gloo picks the
interface for its pairs; `GRADSYNC_IFNAME` names the interface instead, as
`GLOO_SOCKET_IFNAME` does.  Also here: what tells nodes apart (host name,
boot and network namespace: two namespaces of one machine are two nodes).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct

from gradsync.protocol.errors import InvalidArgumentError

__all__ = ["IFNAME_VARIABLE", "interface_address", "node_key", "route_address", "free_port"]

#: Names the interface whose IPv4 address the job's daemons listen on.
IFNAME_VARIABLE = "GRADSYNC_IFNAME"
_SIOCGIFADDR = 0x8915


def node_key() -> str:
    """This node as the job's ranks tell nodes apart: host, boot, network namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = "-"
    try:
        namespace = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        namespace = "-"
    return f"{socket.gethostname()}/{boot}/{namespace}"


def interface_address(name: str) -> str:
    """The IPv4 address of interface `name`; InvalidArgumentError naming what exists."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR,
                                struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            have = ", ".join(sorted(n for _, n in socket.if_nameindex()))
            if exc.errno == errno.ENODEV:
                raise InvalidArgumentError(
                    f"{IFNAME_VARIABLE}={name}: no such interface on {socket.gethostname()} "
                    f"(interfaces here: {have})") from None
            raise InvalidArgumentError(
                f"{IFNAME_VARIABLE}={name}: the interface has no IPv4 address "
                f"({exc.strerror}; interfaces here: {have})") from None
    return socket.inet_ntoa(reply[20:24])


def route_address(host: str, port: int) -> str:
    """The local address of the route to `host:port` (no packet is sent).

    Raises InvalidArgumentError naming the host and every address tried.
    """
    tried: list[str] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise InvalidArgumentError(
            f"cannot resolve the store's host {host!r} ({exc.strerror}); set "
            f"{IFNAME_VARIABLE} to the interface the daemons should use") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            try:
                probe.connect(address)
            except OSError as exc:
                tried.append(f"{address[0]}: {exc.strerror}")
                continue
            return str(probe.getsockname()[0])
    raise InvalidArgumentError(
        f"no interface routes to the store's host {host}:{port} (tried "
        f"{'; '.join(tried) or 'nothing'}); set {IFNAME_VARIABLE}")


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the kernel's pick; a later bind may still race)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])
