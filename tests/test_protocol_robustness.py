"""A daemon fed garbage over raw sockets answers every framed message and keeps serving.

These tests speak the wire protocol by hand (4-byte little-endian length +
msgpack map) so they can send what no `Client` would: random bytes, wrong
types, unknown kinds, oversized frames, requests out of order, requests for
other clients' memory.
"""

from __future__ import annotations

import json
import math
import random
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest

from conftest import DaemonProcess, segments_of
from gradsync.client import Client
from gradsync.client.ping import query
from gradsync.protocol import messages
from gradsync.protocol.codec import MAX_FRAME_BYTES, FrameReader
from gradsync.protocol.version import PROTOCOL_VERSION

StartDaemon = Callable[..., DaemonProcess]
MAX_SHM = 64 * 1024 * 1024


class RawConnection:
    """A hand-driven client socket: send any bytes, read framed replies."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(endpoint[len("ipc://") :])
        self.reader = FrameReader()
        self.bodies: list[bytes] = []
        self.next_id = 1

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(struct.pack("<I", len(body)) + body)

    def send(self, message: Any) -> None:
        self.send_body(msgpack.packb(message, use_bin_type=True))

    def request(self, kind: str, **fields: Any) -> int:
        """Send a well-enveloped request; returns its id."""
        request_id = self.next_id
        self.next_id += 1
        self.send({"v": PROTOCOL_VERSION, "id": request_id, "kind": kind, **fields})
        return request_id

    def recv(self) -> dict[str, Any] | None:
        """The next reply (validated as a reply), or None at end of stream."""
        while not self.bodies:
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self.bodies.extend(self.reader.feed(data))
        return messages.decode_reply(self.bodies.pop(0))

    def call(self, kind: str, **fields: Any) -> dict[str, Any]:
        request_id = self.request(kind, **fields)
        reply = self.recv()
        assert reply is not None, f"daemon closed the connection instead of answering {kind}"
        assert reply["id"] == request_id, reply
        return reply

    def expect_eof(self) -> None:
        while True:
            reply = self.recv()
            if reply is None:
                return

    def close(self) -> None:
        self.sock.close()


def hello(conn: RawConnection, job: str, world: int = 1, rank: int = 0) -> None:
    reply = conn.call(
        "hello", job=job, rank=rank, world_size=world, local_rank=rank,
        local_world_size=world, pid=12345,
    )
    assert reply["kind"] == "ok", reply


def assert_two_rank_allreduce_works(endpoint: str, job: str) -> None:
    first = Client(endpoint, job=job, rank=0, world_size=2)
    second = Client(endpoint, job=job, rank=1, world_size=2)
    try:
        a = np.arange(1000, dtype=np.float64)
        b = np.arange(1000, dtype=np.float64) * 3
        work = first.all_reduce(a, async_op=True)
        second.all_reduce(b)
        assert work is not None and work.wait()
        np.testing.assert_array_equal(a, np.arange(1000, dtype=np.float64) * 4)
        np.testing.assert_array_equal(b, a)
    finally:
        first.close()
        second.close()


# -- version -----------------------------------------------------------------


@pytest.mark.timeout(30)
def test_hello_of_another_version_gets_version_mismatch_naming_both(
    daemon: DaemonProcess,
) -> None:
    conn = RawConnection(daemon.endpoint)
    try:
        conn.send({"v": 99, "id": 1, "kind": "hello", "job": "j", "rank": 0,
                   "world_size": 1, "local_rank": 0, "local_world_size": 1, "pid": 1})
        reply = conn.recv()
        assert reply is not None and reply["kind"] == "error", reply
        assert reply["code"] == "version_mismatch", reply
        assert "99" in reply["message"], reply
        assert f"v{PROTOCOL_VERSION}" in reply["message"], reply
        assert reply["details"] == {"peer_version": 99, "our_version": PROTOCOL_VERSION}
        conn.expect_eof()  # the session is over
    finally:
        conn.close()
    assert query(daemon.endpoint, 5.0)["protocol"] == PROTOCOL_VERSION


# -- garbage -----------------------------------------------------------------

#: The schema as the design states it; `bool` is never an integer.
FIELD_TYPES: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"job": (str,), "rank": (int,), "world_size": (int,), "local_rank": (int,),
              "local_world_size": (int,), "pid": (int,)},
    "alloc": {"nbytes": (int,)},
    "free": {"segment": (int,)},
    "collective": {"collective": (str,), "key": (int, str), "segment": (int, type(None)),
                   "offset": (int,), "count": (int,), "dtype": (str,), "op": (str, type(None)),
                   "timeout_s": (float, int, type(None))},
}
TEMPLATES: dict[str, dict[str, Any]] = {
    "hello": {"job": "g", "rank": 0, "world_size": 1, "local_rank": 0,
              "local_world_size": 1, "pid": 1},
    "alloc": {"nbytes": 4096},
    "free": {"segment": 1},
    "collective": {"collective": "allreduce", "key": 0, "segment": None, "offset": 0,
                   "count": 0, "dtype": "float32", "op": "sum", "timeout_s": 1.0},
}
JUNK: list[Any] = [
    True, False, "7", "", 7, 0, -1, 2**64 - 1, -(2**63), 1.5, -0.0, float("inf"),
    None, [], [1, [2, [3, [4]]]], {"a": {"b": [None, {"c": b"x"}]}}, b"\x00\xff",
]


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _junk_for(types: tuple[type, ...], rng: random.Random) -> Any:
    return rng.choice([j for j in JUNK if not _type_ok(j, types)])


def unframed_garbage(rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(category, body) pairs that fail decoding or the envelope/schema check."""
    emitted = 0
    while emitted < 300:  # random bytes that are not a map (a map could be a valid request)
        body = rng.randbytes(rng.randint(0, 120))
        try:
            decoded = msgpack.unpackb(body, strict_map_key=False)
        except Exception:
            decoded = None
        if isinstance(decoded, dict):
            continue
        emitted += 1
        yield "random bytes", body
    non_maps: list[Any] = [0, -5, 2**64 - 1, 1.25, "hello", "", None, True, [1, 2, 3],
                           [{"v": 1}], b"\x01\x02", [[[[[]]]]], ["ping", 1, 1]]
    for index in range(100):
        yield "not a map", msgpack.packb(non_maps[index % len(non_maps)], use_bin_type=True)
    header = {"v": PROTOCOL_VERSION, "id": 7}
    missing: list[dict[str, Any]] = [{}, {"v": PROTOCOL_VERSION}, {"id": 1, "kind": "ping"},
                                     {"v": PROTOCOL_VERSION, "kind": "ping"},
                                     {"v": PROTOCOL_VERSION, "id": 1}]
    for kind, template in TEMPLATES.items():
        for field in FIELD_TYPES[kind]:
            if kind == "collective" and field in ("timeout_s", "op"):
                continue  # optional (an allreduce without its op: from_wire refuses it)
            message = {**header, "kind": kind, **template}
            del message[field]
            missing.append(message)
    for index in range(100):
        yield "missing field", msgpack.packb(missing[index % len(missing)], use_bin_type=True)
    for _ in range(200):
        kind = rng.choice(list(TEMPLATES))
        message = {**header, "kind": kind, **TEMPLATES[kind]}
        field = rng.choice(["v", "id", "kind", *FIELD_TYPES[kind]])
        if field == "v":
            message["v"] = rng.choice([True, "1", 1.0, None, [1], {"v": 1}])
        elif field == "id":
            message["id"] = _junk_for((int,), rng)
        elif field == "kind":
            message["kind"] = _junk_for((str,), rng)
        else:
            message[field] = _junk_for(FIELD_TYPES[kind][field], rng)
        yield "wrong type", msgpack.packb(message, use_bin_type=True)
    unknown = ["helo", "", "ALLREDUCE", "ping ", "x" * 1000, "ƒ" * 300, "__init__", "error",
               "ok", "stats"]
    for index in range(50):
        kind = unknown[index % len(unknown)] if index < 20 else rng.randbytes(8).hex()
        yield "unknown kind", msgpack.packb({**header, "kind": kind}, use_bin_type=True)
    for index in range(50):
        kind = rng.choice([*TEMPLATES, "ping", "bye"])
        extra = {f"extra{index}": rng.choice(JUNK[:13])}
        message = {**header, "kind": kind, **TEMPLATES.get(kind, {}), **extra}
        yield "extra field", msgpack.packb(message, use_bin_type=True)
    long_key = {**header, "kind": "collective", **TEMPLATES["collective"], "key": "k" * 300}
    for _ in range(10):
        yield "key too long", msgpack.packb(long_key, use_bin_type=True)


#: Requests that are well-formed but refused before any 'hello'.
def before_hello(conn: RawConnection) -> Iterator[tuple[str, dict[str, Any], set[str]]]:
    base = TEMPLATES["hello"]
    bad_hellos = [
        {**base, "job": ""}, {**base, "job": "j" * 200}, {**base, "rank": -1},
        {**base, "rank": 2**64 - 1}, {**base, "world_size": 0, "local_world_size": 0},
        {**base, "world_size": -(2**63)}, {**base, "local_world_size": 2},
        {**base, "local_rank": 1}, {**base, "pid": 1, "local_world_size": 0},
    ]
    for index in range(45):
        fields = bad_hellos[index % len(bad_hellos)]
        yield "bad hello", {"kind": "hello", **fields}, {"invalid_argument", "job"}
    for index in range(60):
        kind = ["alloc", "free", "collective"][index % 3]
        yield "before hello", {"kind": kind, **TEMPLATES[kind]}, {"protocol"}


def send_batched(conn: RawConnection, bodies: list[tuple[str, bytes]], batch: int = 25) -> int:
    """Send unframed garbage in batches; each must get one error reply with id -1."""
    for start in range(0, len(bodies), batch):
        chunk = bodies[start : start + batch]
        for _, body in chunk:
            conn.send_body(body)
        for category, body in chunk:
            reply = conn.recv()
            assert reply is not None, f"daemon hung up after {category} {body[:40]!r}"
            assert reply["kind"] == "error" and reply["code"] == "protocol", (category, reply)
            assert reply["id"] == -1, (category, reply)
    return len(bodies)


OWNER_PROGRAM = """
import json, os, sys
from gradsync.client.connection import Connection
connection = Connection(sys.argv[1])
connection.call("hello", job="garbage-owner", rank=0, world_size=1, local_rank=0,
                local_world_size=1, pid=os.getpid())
segment = connection.call("alloc", nbytes=8192)
print(json.dumps(segment), flush=True)
for line in sys.stdin:  # "allreduce": reduce over its own segment, print the reply
    reply = connection.send("collective", collective="allreduce", key=json.loads(line),
                            segment=segment["segment"],
                            offset=0, count=2048, dtype="float32", op="sum")
    print(json.dumps(connection.wait(reply, None)), flush=True)
"""


def fuzz_allreduce(rng: random.Random, own: int, other: int) -> Iterator[dict[str, Any]]:
    """Schema-valid allreduce requests with random, mostly wrong, values."""
    for index in range(150):
        fields: dict[str, Any] = {
            "key": f"fuzz{index}" if index % 2 else 10_000 + index,
            "segment": rng.choice([None, own, own, other, 0, -1, 2**63, 999_999]),
            "offset": rng.choice([0, 0, 4, 8, -4, 1, 2, 4096, 2**62]),
            "count": rng.choice([0, 1, 3, 256, 1024, 1025, -1, 2**40]),
            "dtype": rng.choice(["float32", "float64", "int8", "int64", "bfloat16",
                                 "complex64", "Float32", "", "bool"]),
            "op": rng.choice(["sum", "avg", "max", "MIN", "prod", "band", "BXOR", "xor", "",
                              "sum "]),
        }
        choice = rng.randrange(4)
        if choice == 1:
            fields["timeout_s"] = None
        elif choice == 2:
            fields["timeout_s"] = rng.choice([1, 2.5, 30])
        elif choice == 3:
            fields["timeout_s"] = rng.choice([-1, -0.5])
        yield fields


ITEMSIZE = {"float32": 4, "float64": 8, "int8": 1, "int64": 8, "bfloat16": 2}
OPS = {"sum", "avg", "max", "min", "prod", "band", "bxor"}


def fuzz_is_valid(fields: dict[str, Any], own: int, own_bytes: int) -> bool:
    """The daemon's contract for one allreduce of a world-1 job."""
    size = ITEMSIZE.get(fields["dtype"])
    op = fields["op"].lower()
    if size is None or op not in OPS:
        return False
    is_float = fields["dtype"].startswith(("float", "bfloat"))
    if (op == "avg" and not is_float) or (op in ("band", "bxor") and is_float):
        return False
    count, offset = fields["count"], fields["offset"]
    if count < 0 or offset < 0:
        return False
    timeout = fields.get("timeout_s")
    if timeout is not None and timeout <= 0:
        return False
    if count == 0:
        return True
    return fields["segment"] == own and offset % size == 0 and offset + count * size <= own_bytes


@pytest.mark.timeout(90)
def test_a_thousand_garbage_frames_get_error_replies_and_daemon_keeps_serving(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon("--max-shm-bytes", str(MAX_SHM))
    rng = random.Random(20240611)
    frames = 0

    # 1. Undecodable / unenveloped / schema-violating frames on one connection.
    stranger = RawConnection(daemon.endpoint)
    frames += send_batched(stranger, list(unframed_garbage(rng)))

    # 2. Well-formed requests a client may not make yet (before 'hello').
    requests = list(before_hello(stranger))
    for start in range(0, len(requests), 20):
        chunk = requests[start : start + 20]
        ids = [stranger.request(**fields) for _, fields, _ in chunk]
        for (category, _, codes), request_id in zip(chunk, ids, strict=True):
            reply = stranger.recv()
            assert reply is not None and reply["kind"] == "error", (category, reply)
            assert reply["code"] in codes and reply["id"] == request_id, (category, reply)
    frames += len(requests)
    # Still usable: a ping is served, and a good hello now succeeds.
    assert stranger.call("ping")["kind"] == "ok"
    hello(stranger, "garbage-a")
    frames += 2

    # 3. After 'hello': other clients' memory, out-of-bounds views, absurd sizes.
    # The other client is another process: connections of one process may share
    # their segments (a sub-group uses its parent's buffers).
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_PROGRAM, daemon.endpoint],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert owner.stdout is not None
    theirs = json.loads(owner.stdout.readline())
    assert theirs["kind"] == "ok", theirs
    conn = RawConnection(daemon.endpoint)
    hello(conn, "garbage-b")
    mine = conn.call("alloc", nbytes=4096)
    assert mine["kind"] == "ok" and mine["nbytes"] == 4096, mine
    own, other = mine["segment"], theirs["segment"]
    frames += 5
    ar = TEMPLATES["collective"]
    refused: list[tuple[str, dict[str, Any], str]] = [
        ("alloc", {"nbytes": 0}, "invalid_argument"),
        ("alloc", {"nbytes": -1}, "invalid_argument"),
        ("alloc", {"nbytes": -(2**63)}, "invalid_argument"),
        ("alloc", {"nbytes": 2**63 - 1}, "shm_exhausted"),
        ("alloc", {"nbytes": 2**40}, "shm_exhausted"),
        ("alloc", {"nbytes": MAX_SHM + 1}, "shm_exhausted"),
        ("free", {"segment": other}, "invalid_argument"),
        ("free", {"segment": 999_999}, "invalid_argument"),
        ("free", {"segment": -1}, "invalid_argument"),
        ("collective", {**ar, "segment": other, "count": 4}, "invalid_argument"),
        ("collective", {**ar, "segment": own, "offset": 4096, "count": 1}, "invalid_argument"),
        ("collective", {**ar, "segment": own, "offset": 4092, "count": 2}, "invalid_argument"),
        ("collective", {**ar, "segment": own, "offset": -4, "count": 1}, "invalid_argument"),
        ("collective", {**ar, "segment": own, "offset": 2, "count": 1}, "invalid_argument"),
        ("collective", {**ar, "segment": own, "count": 2**62}, "invalid_argument"),
        ("collective", {**ar, "segment": own, "count": -1}, "invalid_argument"),
        ("collective", {**ar, "segment": None, "count": 3}, "invalid_argument"),
        ("collective", {**ar, "segment": 999_999, "count": 1}, "invalid_argument"),
        ("collective", {**ar, "dtype": "complex64"}, "invalid_argument"),
        ("collective", {**ar, "op": "xor"}, "invalid_argument"),
        ("collective", {**ar, "dtype": "int32", "op": "AVG"}, "invalid_argument"),
        ("collective", {**ar, "timeout_s": -1}, "invalid_argument"),
        ("hello", TEMPLATES["hello"], "protocol"),
    ]
    for kind, fields, code in refused:
        reply = conn.call(kind, **fields)
        assert reply["kind"] == "error" and reply["code"] == code, (kind, fields, reply)
    frames += len(refused)
    # The refused free did not free the owner's segment: it still reduces.
    assert owner.stdin is not None
    owner.stdin.write("7\n")
    owner.stdin.flush()
    reply = json.loads(owner.stdout.readline())
    assert reply["kind"] == "ok", reply
    frames += 1

    # 4. Random schema-valid allreduce values; replies may come out of order.
    fuzz = list(fuzz_allreduce(rng, own, other))
    sent = {conn.request("collective", collective="allreduce", **fields): fields
            for fields in fuzz}
    answered: dict[int, dict[str, Any]] = {}
    while len(answered) < len(sent):
        reply = conn.recv()
        assert reply is not None, "daemon hung up during allreduce fuzzing"
        assert reply["id"] in sent and reply["id"] not in answered, reply
        answered[reply["id"]] = reply
    for request_id, fields in sent.items():
        reply = answered[request_id]
        if fuzz_is_valid(fields, own, 4096):
            assert reply["kind"] == "ok", (fields, reply)
        else:
            assert reply["kind"] == "error", (fields, reply)
            assert reply["code"] == "invalid_argument", (fields, reply)
    assert any(r["kind"] == "ok" for r in answered.values()), "fuzzing hit no valid case"
    frames += len(fuzz)

    # 5. Oversized length prefixes: an error reply, then the daemon hangs up.
    for prefix in [MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1, 10 * MAX_FRAME_BYTES]:
        for after_hello in (False, True):
            big = RawConnection(daemon.endpoint)
            if after_hello:
                hello(big, f"big-{prefix}")
            big.send_raw(struct.pack("<I", prefix) + b"\x81" * 64)
            reply = big.recv()
            assert reply is not None and reply["code"] == "protocol" and reply["id"] == -1
            assert str(prefix) in reply["message"], reply
            big.expect_eof()
            big.close()
            frames += 1

    # 6. Truncated frames, then disconnect.
    for index in range(24):
        cut = RawConnection(daemon.endpoint)
        body = msgpack.packb({"v": PROTOCOL_VERSION, "id": 1, "kind": "ping"})
        frame = struct.pack("<I", len(body) + index) + body
        cut.send_raw(frame[: rng.randint(1, len(frame) - 1)] if index % 2 else frame)
        cut.close()
        frames += 1

    # 7. Other versions: refused and disconnected, whatever the kind.
    for version in (0, PROTOCOL_VERSION + 1, -1, 2**32):
        other_version = RawConnection(daemon.endpoint)
        other_version.send({"v": version, "id": 1, "kind": "ping"})
        reply = other_version.recv()
        assert reply is not None and reply["code"] == "version_mismatch", reply
        other_version.expect_eof()
        other_version.close()
        frames += 1

    assert frames >= 1000, frames
    owner.communicate(timeout=30)  # closing its stdin lets it exit
    for raw in (stranger, conn):
        raw.close()
    daemon.assert_alive()
    assert "Traceback" not in daemon.log(), daemon.log()  # nothing escaped a handler
    assert query(daemon.endpoint, 5.0)["kind"] == "ok"
    assert_two_rank_allreduce_works(daemon.endpoint, "after-garbage")
    deadline = time.monotonic() + 10
    while segments_of(daemon.pid):  # every garbage client's segment is freed on hang-up
        assert time.monotonic() < deadline, segments_of(daemon.pid)
        time.sleep(0.01)


# -- known holes: each must get an error reply, not a silent hang-up ---------


@pytest.mark.timeout(30)
def test_alloc_of_the_largest_uint64_gets_an_error_reply(daemon: DaemonProcess) -> None:
    conn = RawConnection(daemon.endpoint)
    try:
        hello(conn, "huge")
        request_id = conn.request("alloc", nbytes=2**64 - 1)
        reply = conn.recv()
        assert reply is not None, "daemon hung up instead of answering"
        assert reply["id"] == request_id and reply["kind"] == "error", reply
        assert reply["code"] in {"shm_exhausted", "invalid_argument"}, reply
    finally:
        conn.close()
    daemon.assert_alive()


def _echoing_requests() -> list[Any]:
    filler = "\x00" * 16_400  # repr() quadruples it past the 64 KiB frame limit
    return [
        pytest.param(False, {"kind": filler}, "protocol", id="unknown-kind"),
        pytest.param(False, {"kind": "ping", **{f"{filler[:3300]}{i}": 1 for i in range(5)}},
                     "protocol", id="extra-fields"),
        pytest.param(True, {"kind": "collective", **TEMPLATES["collective"], "dtype": filler},
                     "invalid_argument", id="dtype"),
        pytest.param(True, {"kind": "collective", **TEMPLATES["collective"], "op": filler},
                     "invalid_argument", id="op"),
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("after_hello", "fields", "code"), _echoing_requests())
def test_error_reply_echoing_a_long_value_is_still_delivered(
    daemon: DaemonProcess, after_hello: bool, fields: dict[str, Any], code: str
) -> None:
    conn = RawConnection(daemon.endpoint)
    try:
        if after_hello:
            hello(conn, "echo")
        conn.send({"v": PROTOCOL_VERSION, "id": 5, **fields})
        reply = conn.recv()
        assert reply is not None, "daemon hung up instead of answering"
        assert reply["kind"] == "error" and reply["code"] == code, reply
        assert conn.call("ping")["kind"] == "ok"
    finally:
        conn.close()
    daemon.assert_alive()


@pytest.mark.timeout(30)
def test_nan_timeout_is_refused_with_an_error_reply(daemon: DaemonProcess) -> None:
    conn = RawConnection(daemon.endpoint)
    try:
        hello(conn, "nan", world=2)
        reply = conn.call("collective", **{**TEMPLATES["collective"], "timeout_s": math.nan})
        assert reply["kind"] == "error" and reply["code"] == "invalid_argument", reply
    finally:
        conn.close()
    daemon.assert_alive()


@pytest.mark.timeout(30)
def test_huge_world_is_refused_or_its_timeout_is_still_delivered(
    daemon: DaemonProcess,
) -> None:
    conn = RawConnection(daemon.endpoint, timeout_s=3)
    try:
        reply = conn.call("hello", job="crowd", rank=0, world_size=20_000, local_rank=0,
                          local_world_size=20_000, pid=1)
        if reply["kind"] == "error":
            return  # refusing such a job outright is fine too
        reply = conn.call("collective", **{**TEMPLATES["collective"], "timeout_s": 0.2})
        assert reply["kind"] == "error" and reply["code"] == "timeout", reply
    finally:
        conn.close()
    daemon.assert_alive()
