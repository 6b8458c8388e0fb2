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
