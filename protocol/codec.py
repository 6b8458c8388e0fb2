"""Framing and strict msgpack encoding of control messages.

A frame on the local stream socket is a 4-byte little-endian length followed
by one msgpack map (the header).  Only small control messages travel this way:
data lives in daemon-owned shared memory, so a frame larger than
`MAX_FRAME_BYTES` is a protocol violation, not a big payload.
"""

from __future__ import annotations

import struct
from typing import Any, TypeGuard

import msgpack

from gradsync.protocol.errors import ProtocolError


def is_integer(value: Any) -> TypeGuard[int]:
    """An int that is not a bool: Python and msgpack both let True pass as 1, and no
    count, rank, port or sequence number may be given as one."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> TypeGuard[int | float]:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)

MAX_FRAME_BYTES = 64 * 1024
_LENGTH = struct.Struct("<I")
LENGTH_BYTES = _LENGTH.size

Message = dict[str, Any]


def encode_frame(message: Message) -> bytes:
    """Serialize one message and prefix it with its length."""
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"message of kind {message.get('kind')!r} is {len(body)} bytes, "
            f"above the {MAX_FRAME_BYTES}-byte frame limit"
        )
    return _LENGTH.pack(len(body)) + body


def decode_body(body: bytes) -> Any:
    """Decode one frame body strictly: str keys only, bounded sizes, no ext types."""
    try:
        return msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_FRAME_BYTES,
            max_bin_len=MAX_FRAME_BYTES,
            max_array_len=4096,
            max_map_len=256,
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"undecodable frame ({type(exc).__name__}: {exc})") from None


class FrameReader:
    """Incremental splitter of a byte stream into frame bodies."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return every complete frame body now available.

        Raises `ProtocolError` on a length above the limit: the stream cannot be
        resynchronised after that, so the caller must close the connection.
        """
        buffer = self._buffer
        buffer += data
        bodies: list[bytes] = []
        start = 0
        while len(buffer) - start >= LENGTH_BYTES:
            (length,) = _LENGTH.unpack_from(buffer, start)
            if length > MAX_FRAME_BYTES:
                raise ProtocolError(
                    f"frame length {length} exceeds the {MAX_FRAME_BYTES}-byte limit"
                )
            end = start + LENGTH_BYTES + length
            if end > len(buffer):
                break
            bodies.append(bytes(buffer[start + LENGTH_BYTES : end]))
            start = end
        if start:
            del buffer[:start]
        return bodies
