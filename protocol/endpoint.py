"""Endpoints: `ipc://PATH` names a Unix stream socket (a local daemon), and
`tcp://HOST:PORT` a TCP one (a peer daemon, a statistics endpoint)."""

from __future__ import annotations

import dataclasses
import os

#: Linux's limit for sun_path, less the terminating NUL.
MAX_SOCKET_PATH = 107


def default_endpoint() -> str:
    """`$XDG_RUNTIME_DIR/gradsync/gradsyncd.sock`, else `/tmp/gradsync-$UID/...`."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(runtime, "gradsync") if runtime else f"/tmp/gradsync-{os.getuid()}"
    return "ipc://" + os.path.join(folder, "gradsyncd.sock")


def parse_ipc_endpoint(endpoint: str) -> str:
    """Socket path of an `ipc://PATH` endpoint (a bare absolute path is accepted too)."""
    path = endpoint[len("ipc://") :] if endpoint.startswith("ipc://") else endpoint
    if not path.startswith("/"):
        raise ValueError(
            f"endpoint {endpoint!r} must be ipc:///absolute/path (a Unix socket on this node)"
        )
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {path!r} is {len(path.encode())} bytes; Unix sockets allow "
            f"at most {MAX_SOCKET_PATH}"
        )
    return path


def ipc_endpoint(endpoint: str) -> str:
    """`endpoint` spelled `ipc://PATH`, so that a bare absolute path works wherever an
    endpoint goes (ZeroMQ, which serves statistics beside the socket, needs the
    scheme); raises ValueError as `parse_ipc_endpoint` does."""
    return "ipc://" + parse_ipc_endpoint(endpoint)


def stats_stream_endpoint(endpoint: str) -> str:
    """The PUB endpoint beside a stats endpoint.

    `ipc://PATH` streams at `ipc://PATH.pub`; `tcp://HOST:PORT` at the next port,
    `tcp://HOST:PORT+1` (a TCP endpoint has no room for a suffix).
    """
    if endpoint.startswith("tcp://"):
        parsed = parse_tcp_endpoint(endpoint)
        if parsed.port == 65535:
            raise ValueError(f"a tcp:// stats endpoint needs a port below 65535: {endpoint!r}")
        return str(TcpEndpoint(parsed.host, parsed.port + 1))
    return endpoint + ".pub"


WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::"})


@dataclasses.dataclass(frozen=True)
class TcpEndpoint:
    """A parsed `tcp://HOST:PORT`; `host` is kept as written, without IPv6 brackets."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def is_wildcard(self) -> bool:
        """True for `*`, `0.0.0.0` and `::`: a listen address, not one to connect to."""
        return self.host in WILDCARD_HOSTS

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.host


def parse_tcp_endpoint(text: str) -> TcpEndpoint:
    """Parse `tcp://HOST:PORT` (IPv6 hosts in brackets); raise `ValueError` naming it."""
    if not isinstance(text, str) or not text.startswith("tcp://"):
        raise ValueError(f"endpoint {text!r} must look like tcp://HOST:PORT")
    rest = text[len("tcp://") :]
    if rest.startswith("["):
        host, sep, port_text = rest[1:].partition("]:")
        if not sep:
            raise ValueError(f"endpoint {text!r}: write IPv6 hosts as tcp://[ADDR]:PORT")
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"endpoint {text!r} must look like tcp://HOST:PORT")
    if not host or any(c in host for c in "/;@ "):
        raise ValueError(f"endpoint {text!r} has no usable host")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"endpoint {text!r} needs a port between 1 and 65535")
    return TcpEndpoint(host, int(port_text))
