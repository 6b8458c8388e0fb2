"""TCP endpoints of peer daemons: parsing, resolution, and "is this the same daemon?".

Peers are named by the endpoint they listen on (`tcp://HOST:PORT`).  The same
daemon may be written several ways (`tcp://node1:7070`, `tcp://10.0.0.1:7070`,
`tcp://localhost:7070` on node1 itself), so endpoints are compared by port and
by the addresses their hosts resolve to, not as strings.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

from gradsync.protocol.endpoint import WILDCARD_HOSTS, TcpEndpoint, parse_tcp_endpoint

__all__ = ["WILDCARD_HOSTS", "TcpEndpoint", "is_local_address", "parse_tcp_endpoint",
           "read_peers_file", "resolve_host", "same_endpoint"]

def _normalise_ip(address: str) -> str:
    return str(ipaddress.ip_address(address.split("%", 1)[0]))


def resolve_host(host: str) -> frozenset[str]:
    """IP addresses of `host` (itself when it is an address); empty if it does not resolve."""
    with contextlib.suppress(ValueError):
        return frozenset({_normalise_ip(host)})
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return frozenset()
    return frozenset(_normalise_ip(str(info[4][0])) for info in infos)


def is_local_address(address: str) -> bool:
    """True if this machine owns `address`: binding to it succeeds only then."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


def same_endpoint(a: TcpEndpoint, b: TcpEndpoint) -> bool:
    """True if `a` and `b` name the same listening socket.

    A wildcard host (`tcp://*:7070`, only meaningful for `listen`) matches any
    host of this machine on the same port.
    """
    if a.port != b.port:
        return False
    if a.host == b.host:
        return True
    if a.is_wildcard or b.is_wildcard:
        other = b if a.is_wildcard else a
        return other.is_wildcard or any(is_local_address(ip) for ip in resolve_host(other.host))
    return bool(resolve_host(a.host) & resolve_host(b.host))


def read_peers_file(path: str) -> list[str]:
    """Peer endpoints from a file: one `tcp://HOST:PORT` a line, `#` starts a comment.

    A bare `HOST:PORT` or `HOST PORT` line is read as `tcp://HOST:PORT`, so a
    hostfile or a Slurm node list with a port appended works as it is.
    Raises `ValueError` naming the file and line of a bad entry.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read peers file {path}: {exc}") from None
    peers = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        if not text.startswith("tcp://"):
            text = "tcp://" + ":".join(text.split())
        try:
            parse_tcp_endpoint(text)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        peers.append(text)
    return peers
