"""Local daemon endpoints: `ipc://PATH` names a Unix stream socket."""

from __future__ import annotations

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
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65535:
            raise ValueError(f"a tcp:// stats endpoint needs a port below 65535: {endpoint!r}")
        return f"{host}:{int(port) + 1}"
    return endpoint + ".pub"
