"""gradsync.protocol: what the client and the daemon must agree on.

Message kinds and their schema, the version number, the msgpack codec and
framing, the error hierarchy, the dtype and reduce-op tables, and the mapping
of a daemon-owned shared-memory segment.  No sockets, no asyncio.
"""

from gradsync.protocol.version import PROTOCOL_VERSION, __version__

__all__ = ["PROTOCOL_VERSION", "__version__"]
