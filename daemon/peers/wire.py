"""Peer message frames: a strict msgpack header, then raw payload frames.

A peer message is `[header, payload...]` on the DEALER side (the receiving
ROUTER prepends the sender's routing id).  The header is a map
`{"v": PEER_PROTOCOL_VERSION, "kind": ..., "src": SENDER_ENDPOINT, ...}` of at most
`MAX_FRAME_BYTES`; payload frames are opaque bytes, never decoded.

Kinds starting with `link.` belong to the link layer itself (latency and
bandwidth probes); all other kinds are the application's and must be declared
when the links are built, so that an unknown kind is dropped at the door.
The messages themselves, and the peer protocol's version, are defined in
protocol/peer.py; this module only frames them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import msgpack

from gradsync.protocol.codec import MAX_FRAME_BYTES, Message, decode_body, is_integer
from gradsync.protocol.errors import InvalidArgumentError, ProtocolError
from gradsync.protocol.peer import (
    ASK,
    BULK,
    BYE,
    CUT,
    LINK_KINDS,
    PEER_PROTOCOL_VERSION,
    PING,
    PONG,
    check_peer_version,
)

__all__ = ["ASK", "BULK", "BYE", "CUT", "LINK_KINDS", "PING", "PONG", "check_kinds",
           "decode_header", "encode_header"]

LINK_PREFIX = "link."

#: At most this many payload frames per message (a bound for hostile peers).
MAX_PAYLOAD_FRAMES = 4096
#: Header fields the links fill in; callers supply "kind" and their own fields.
_FILLED_IN = ("v", "src")


def check_kinds(kinds: Collection[str]) -> frozenset[str]:
    """Validate the application's message kinds (non-empty, not `link.*`)."""
    for kind in kinds:
        if not isinstance(kind, str) or not kind or kind.startswith(LINK_PREFIX):
            raise InvalidArgumentError(
                f"message kind {kind!r} is not allowed: use a non-empty string "
                f"not starting with {LINK_PREFIX!r}"
            )
    return frozenset(kinds)


def encode_header(src: str, header: Mapping[str, Any]) -> bytes:
    """Add the envelope to the caller's fields and pack them; refuse oversize headers."""
    clash = [key for key in _FILLED_IN if key in header]
    if clash:
        raise InvalidArgumentError(f"header fields {clash} are filled in by the peer links")
    body: bytes = msgpack.packb({"v": PEER_PROTOCOL_VERSION, "src": src, **header},
                                use_bin_type=True)
    if len(body) > MAX_FRAME_BYTES:
        raise InvalidArgumentError(
            f"header of kind {header.get('kind')!r} is {len(body)} bytes, above the "
            f"{MAX_FRAME_BYTES}-byte limit; send data as payload frames"
        )
    return body


def _int_field(message: Message, field: str) -> None:
    value = message.get(field)
    if not is_integer(value):
        raise ProtocolError(f"{message['kind']!r} message needs an integer {field!r}")


def decode_header(body: bytes, kinds: frozenset[str]) -> Message:
    """Decode and check a header frame; `kinds` are the kinds accepted here.

    Raises `ProtocolError` (`VersionMismatchError` for another version) on
    anything but a well-formed header of an accepted kind.
    """
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"header frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    message = decode_body(body)
    if not isinstance(message, dict):
        raise ProtocolError(f"a header must be a map, got {type(message).__name__}")
    check_peer_version(message)
    kind = message.get("kind")
    if not isinstance(kind, str):
        raise ProtocolError("header lacks a string 'kind'")
    if kind not in kinds:
        raise ProtocolError(f"unknown message kind {kind[:64]!r}")
    if not isinstance(message.get("src"), str):
        raise ProtocolError("header lacks a string 'src'")
    if kind in LINK_KINDS:
        _int_field(message, "seq")
    return message
