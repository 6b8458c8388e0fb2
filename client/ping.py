"""`gradsync ping`: ask a daemon who it is."""

from __future__ import annotations

import os
import sys

from gradsync.client.connection import Connection
from gradsync.protocol.codec import Message
from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.errors import GradsyncError


def query(endpoint: str, timeout_s: float) -> Message:
    """The daemon's identity (version, pid, protocol); raises if it does not answer."""
    connection = Connection(endpoint, connect_timeout_s=timeout_s)
    try:
        return connection.call("ping", timeout_s=timeout_s)
    finally:
        connection.close()


def ping(daemon: str | None, timeout_s: float) -> int:
    endpoint = daemon or os.environ.get("GRADSYNC_DAEMON") or default_endpoint()
    try:
        reply = query(endpoint, timeout_s)
    except GradsyncError as exc:
        print(f"gradsync ping: {exc}", file=sys.stderr)
        return 1
    print(
        f"gradsyncd {reply.get('version')} (pid {reply.get('pid')}, "
        f"protocol v{reply.get('protocol')}) at {endpoint}"
    )
    return 0
