"""The client wire's envelope: decoding and checking requests and replies.

Every message is a map with `v` (protocol version), `id` (request number,
echoed by the reply) and `kind`, plus the fields its kind declares (each
request's schema is its class's in requests.py).  Unknown kinds, missing or
extra fields and wrong types are refused with a `ProtocolError` that names the
field, so one bad client cannot confuse the daemon; `requests.parse_request`
then checks the values.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync.protocol.codec import Message, decode_body
from gradsync.protocol.errors import ProtocolError, VersionMismatchError
from gradsync.protocol.requests import REQUEST_SCHEMAS
from gradsync.protocol.requests import clip as clip  # echoing user input, for both ends
from gradsync.protocol.version import PROTOCOL_VERSION

#: kind → field → (accepted types, required), from the typed requests (requests.py).
REQUESTS = REQUEST_SCHEMAS

REPLIES: dict[str, dict[str, tuple[tuple[type, ...], bool]]] = {
    "ok": {},
    "error": {
        "code": ((str,), True),
        "message": ((str,), True),
        "details": ((dict,), False),
    },
}

_ALLOWED_KEYS = {
    kind: frozenset(schema) | {"v", "id", "kind"} for kind, schema in (REQUESTS | REPLIES).items()
}

MAX_KEY_CHARS = 256
#: Error messages are cut to this many characters so a reply always fits a frame.
MAX_ERROR_CHARS = 4096


_NONE = type(None)


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _check_fields(
    message: dict[str, Any],
    schema: dict[str, tuple[tuple[type, ...], bool]],
    extra_allowed: bool,
) -> None:
    kind = message["kind"]
    for field, (types, required) in schema.items():
        if field not in message:
            if required:
                raise ProtocolError(f"{clip(kind)} message lacks field {field!r}")
            continue
        # msgpack yields exact builtin types, so an exact type test is enough (and
        # keeps bool out of int fields); subclasses only come from local callers.
        if type(message[field]) not in types and not _type_ok(message[field], types):
            names = "/".join("nil" if t is _NONE else t.__name__ for t in types)
            raise ProtocolError(
                f"{clip(kind)} field {field!r} must be {names}, "
                f"got {type(message[field]).__name__}"
            )
    if not extra_allowed and not message.keys() <= _ALLOWED_KEYS[kind]:
        extra = set(message) - set(schema) - {"v", "id", "kind"}
        if extra:
            raise ProtocolError(
                f"{clip(kind)} message has unknown fields {clip(sorted(extra), 200)}"
            )


def check_version(
    message: Mapping[str, Any], ours: int = PROTOCOL_VERSION, wire: str = "protocol"
) -> None:
    """Refuse a map without an integer `v`, or with another version than `ours` of
    the `wire` (the client protocol, or the daemons' own: protocol/peer.py)."""
    version = message.get("v")
    if not _type_ok(version, (int,)):
        raise ProtocolError(f"message lacks an integer {wire} version 'v'")
    if version != ours:
        raise VersionMismatchError(
            f"{wire} version mismatch: peer speaks v{version}, this side speaks v{ours}",
            {"peer_version": version, "our_version": ours},
        )


def check_header(message: Any) -> Message:
    """Check the envelope every message shares; return it typed as a map."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a message must be a map, got {type(message).__name__}")
    check_version(message)
    if not _type_ok(message.get("id"), (int,)):
        raise ProtocolError("message lacks an integer 'id'")
    if not isinstance(message.get("kind"), str):
        raise ProtocolError("message lacks a string 'kind'")
    return message


def decode_request(body: bytes) -> Message:
    """Decode and validate a client request; raise `ProtocolError` if bad."""
    message = check_header(decode_body(body))
    schema = REQUESTS.get(message["kind"])
    if schema is None:
        raise ProtocolError(
            f"unknown message kind {clip(message['kind'])}; known: {', '.join(REQUESTS)}"
        )
    _check_fields(message, schema, extra_allowed=False)
    key = message.get("key")
    if isinstance(key, str) and len(key) > MAX_KEY_CHARS:
        raise ProtocolError(f"collective key longer than {MAX_KEY_CHARS} characters")
    return message


def decode_reply(body: bytes) -> Message:
    """Decode and validate a daemon reply; extra fields are allowed (results)."""
    message = check_header(decode_body(body))
    schema = REPLIES.get(message["kind"])
    if schema is None:
        raise ProtocolError(f"unknown reply kind {clip(message['kind'])}")
    _check_fields(message, schema, extra_allowed=True)
    return message


def request(kind: str, request_id: int, **fields: Any) -> Message:
    """Build a request header."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "kind": kind, **fields}


def ok_reply(request_id: int, **fields: Any) -> Message:
    """Build a success reply to request `request_id`."""
    return {"v": PROTOCOL_VERSION, "id": request_id, "kind": "ok", **fields}


def error_reply(
    request_id: int, code: str, message: str, details: dict[str, Any] | None = None
) -> Message:
    """Build an error reply; `request_id` is -1 when the request had no usable id."""
    return {
        "v": PROTOCOL_VERSION,
        "id": request_id,
        "kind": "error",
        "code": code,
        "message": message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "…",
        "details": details or {},
    }
