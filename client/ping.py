"""Ask a daemon who it is: the library's ping (the `gradsync ping` command is cli/ping.py).

The torch backend, the launcher and the command all use `query`; it lives in
the library because the library must not import the command line.
"""

from __future__ import annotations

from gradsync.client.connection import Connection
from gradsync.protocol.codec import Message


def query(endpoint: str, timeout_s: float) -> Message:
    """The daemon's identity (version, pid, protocol); raises if it does not answer."""
    connection = Connection(endpoint, connect_timeout_s=timeout_s)
    try:
        return connection.call("ping", timeout_s=timeout_s)
    finally:
        connection.close()
