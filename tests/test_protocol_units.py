"""Unit tests of the wire protocol, and of the argument checks the client makes locally.

Framing must survive any split of the byte stream, decoding must refuse
anything outside the schema, every exception must cross the wire as itself,
and a call with unusable arguments must fail in the caller before anything is
sent (so it consumes no collective key).
"""

from __future__ import annotations

import inspect
import random
import struct
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import msgpack
import numpy as np
import pytest

from conftest import DaemonProcess
from gradsync.client import Client, InvalidArgumentError
from gradsync.client.array_checks import check_array
from gradsync.protocol import errors, messages
from gradsync.protocol.codec import MAX_FRAME_BYTES, FrameReader, decode_body, encode_frame
from gradsync.protocol.dtypes import (
    BITWISE_OPS,
    DTYPES,
    FLOAT_DTYPES,
    ReduceOp,
    check_op_for_dtype,
    parse_reduce_op,
)
from gradsync.protocol.errors import GradsyncError, ProtocolError, VersionMismatchError
from gradsync.protocol.version import PROTOCOL_VERSION

HELLO = {"job": "j", "rank": 0, "world_size": 2, "local_rank": 0, "local_world_size": 2,
         "pid": 99}
#: Every collective is a `collective` request (an allreduce had a kind of its own until v4).
ALLREDUCE = {"collective": "allreduce", "key": 3, "segment": 1, "offset": 0, "count": 4,
             "dtype": "float32", "op": "sum"}


def body_of(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def envelope(kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": 1, "kind": kind, **fields}


# -- framing -----------------------------------------------------------------


def test_frame_reader_reassembles_any_split_of_the_stream() -> None:
    rng = random.Random(7)
    sent = [
        messages.request("collective", i, **{**ALLREDUCE, "key": f"bucket-{i}" * (i % 5)})
        for i in range(60)
    ] + [messages.ok_reply(i, blob=b"\x00" * rng.randint(0, 3000)) for i in range(20)]
    sent.append(messages.request("ping", 0))
    stream = b"".join(encode_frame(m) for m in sent)
    expected = [body_of(m) for m in sent]
    for trial in range(200):
        reader = FrameReader()
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randint(0, 40)))
        if trial == 0:
            cuts = list(range(1, len(stream)))  # one byte at a time
        bodies: list[bytes] = []
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            bodies.extend(reader.feed(stream[start:end]))
        assert bodies == expected, f"trial {trial}"
        assert reader.feed(b"") == []


def test_frame_reader_merges_frames_delivered_together() -> None:
    frames = [encode_frame(envelope("ping", id=i)) for i in range(100)]
    reader = FrameReader()
    assert len(reader.feed(b"".join(frames) + frames[0][:3])) == 100
    assert len(reader.feed(frames[0][3:])) == 1


def test_frame_reader_accepts_empty_and_maximal_frames() -> None:
    reader = FrameReader()
    maximal = bytes(range(256)) * (MAX_FRAME_BYTES // 256)
    stream = struct.pack("<I", 0) + struct.pack("<I", len(maximal)) + maximal
    assert reader.feed(stream) == [b"", maximal]


@pytest.mark.parametrize("length", [MAX_FRAME_BYTES + 1, 2**31, 2**32 - 1])
def test_frame_reader_refuses_oversized_length_as_soon_as_the_prefix_is_in(length: int) -> None:
    reader = FrameReader()
    prefix = struct.pack("<I", length)
    assert reader.feed(encode_frame(envelope("ping")) + prefix[:2]) != []
    with pytest.raises(ProtocolError, match=str(length)):
        reader.feed(prefix[2:])


def test_encode_frame_refuses_oversized_messages() -> None:
    with pytest.raises(ProtocolError, match="frame limit"):
        encode_frame(envelope("ping", junk="x" * MAX_FRAME_BYTES))


# -- decoding ----------------------------------------------------------------


def test_valid_requests_decode_to_their_maps() -> None:
    for kind, fields in [("hello", HELLO), ("collective", ALLREDUCE), ("ping", {}),
                         ("bye", {}), ("alloc", {"nbytes": 5}), ("free", {"segment": 2}),
                         ("collective", {**ALLREDUCE, "segment": None, "timeout_s": 2.5}),
                         ("collective", {**ALLREDUCE, "key": "grads.0", "timeout_s": None})]:
        message = envelope(kind, **fields)
        assert messages.decode_request(body_of(message)) == message


@pytest.mark.parametrize(
    "value", [[1, 2], 5, "ping", None, 1.5, b"\x00", True, [envelope("ping")]]
)
def test_decode_request_refuses_non_maps(value: Any) -> None:
    with pytest.raises(ProtocolError, match="map"):
        messages.decode_request(body_of(value))


@pytest.mark.parametrize(
    "message",
    [{1: 2}, {**envelope("ping"), 5: "x"}, {**envelope("ping"), b"bin": 1},
     {**envelope("ping"), None: 1}],
    ids=["int-key", "extra-int-key", "bytes-key", "nil-key"],
)
def test_decode_request_refuses_non_string_map_keys(message: dict[Any, Any]) -> None:
    with pytest.raises(ProtocolError):
        messages.decode_request(body_of(message))


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [("hello", "rank", True), ("hello", "world_size", False), ("hello", "pid", True),
     ("alloc", "nbytes", True), ("free", "segment", False), ("collective", "count", True),
     ("collective", "offset", False), ("collective", "key", True),
     ("collective", "segment", True), ("collective", "timeout_s", True)],
)
def test_decode_request_refuses_bool_as_int(kind: str, field: str, value: bool) -> None:
    fields = {"hello": HELLO, "alloc": {"nbytes": 1}, "free": {"segment": 1},
              "collective": ALLREDUCE}[kind]
    with pytest.raises(ProtocolError, match=repr(field)):
        messages.decode_request(body_of(envelope(kind, **{**fields, field: value})))


@pytest.mark.parametrize("field", ["v", "id"])
def test_decode_request_refuses_bool_in_the_envelope(field: str) -> None:
    with pytest.raises(ProtocolError):
        messages.decode_request(body_of({**envelope("ping"), field: True}))


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [("hello", "rank", "0"), ("hello", "job", 5), ("alloc", "nbytes", 1.0),
     ("collective", "count", "4"), ("collective", "dtype", 1), ("collective", "key", 1.5),
     ("collective", "key", None), ("collective", "key", [1]), ("collective", "collective", 5),
     ("collective", "timeout_s", "1"), ("collective", "segment", "1"),
     ("hello", "job", b"bytes")],
)
def test_decode_request_refuses_wrong_types(kind: str, field: str, value: Any) -> None:
    fields = {"hello": HELLO, "alloc": {"nbytes": 1}, "collective": ALLREDUCE}[kind]
    with pytest.raises(ProtocolError, match=repr(field)):
        messages.decode_request(body_of(envelope(kind, **{**fields, field: value})))


@pytest.mark.parametrize(
    ("kind", "fields"),
    [("ping", {"extra": 1}), ("bye", {"reason": "done"}), ("hello", {**HELLO, "host": "x"}),
     ("collective", {**ALLREDUCE, "host": "x"})],
)
def test_decode_request_refuses_extra_fields(kind: str, fields: dict[str, Any]) -> None:
    with pytest.raises(ProtocolError, match="unknown fields"):
        messages.decode_request(body_of(envelope(kind, **fields)))


@pytest.mark.parametrize("kind", ["", "PING", "stats", "error", "ok", "hello2"])
def test_decode_request_refuses_unknown_kinds(kind: str) -> None:
    with pytest.raises(ProtocolError, match="unknown message kind"):
        messages.decode_request(body_of(envelope(kind)))


def test_decode_request_names_a_missing_field() -> None:
    fields = dict(ALLREDUCE)
    del fields["dtype"]
    with pytest.raises(ProtocolError, match="'dtype'"):
        messages.decode_request(body_of(envelope("collective", **fields)))


def test_decode_request_refuses_overlong_keys() -> None:
    with pytest.raises(ProtocolError, match="longer than"):
        messages.decode_request(body_of(envelope("collective", **{**ALLREDUCE, "key": "k" * 257})))
    long_ok = envelope("collective", **{**ALLREDUCE, "key": "k" * 256})
    assert messages.decode_request(body_of(long_ok)) == long_ok


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 99, -1])
def test_other_versions_raise_version_mismatch_with_both_numbers(version: int) -> None:
    with pytest.raises(VersionMismatchError) as caught:
        messages.decode_request(body_of({**envelope("ping"), "v": version}))
    assert str(version) in str(caught.value) and str(PROTOCOL_VERSION) in str(caught.value)
    assert caught.value.details == {"peer_version": version, "our_version": PROTOCOL_VERSION}


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"\x81", b"\x92\x01", body_of(envelope("ping")) + b"\x00",
     msgpack.packb(msgpack.ExtType(1, b"x")), msgpack.packb([[[[[]]]]] * 5000),
     b"\xdd\xff\xff\xff\xff"],
    ids=["empty", "reserved-byte", "truncated-map", "truncated-array", "trailing-data",
         "ext-type", "too-long-array", "huge-array-header"],
)
def test_undecodable_bodies_raise_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="undecodable"):
        decode_body(body)


def test_decode_reply_allows_result_fields_but_checks_errors() -> None:
    reply = messages.ok_reply(4, segment=2, name="gradsync-1-2", nbytes=4096)
    assert messages.decode_reply(body_of(reply)) == reply
    with pytest.raises(ProtocolError, match="'code'"):
        messages.decode_reply(body_of({**envelope("error"), "message": "m"}))
    with pytest.raises(ProtocolError, match="unknown reply kind"):
        messages.decode_reply(body_of(envelope("hello")))


# -- errors across the wire --------------------------------------------------

ERROR_CLASSES = sorted(
    (cls for _, cls in inspect.getmembers(errors, inspect.isclass)
     if issubclass(cls, GradsyncError)),
    key=lambda cls: cls.__name__,
)


def test_every_error_class_has_its_own_code() -> None:
    codes = [cls.code for cls in ERROR_CLASSES]
    assert len(codes) == len(set(codes)), codes
    assert len(ERROR_CLASSES) >= 14


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_error_from_wire_round_trips_each_class(cls: type[GradsyncError]) -> None:
    original = cls("rank 1 of job 'x' said no", {"job": "x", "rank": 1, "missing": [1, 2]})
    frame = encode_frame(
        messages.error_reply(9, original.code, original.message, original.details)
    )
    (body,) = FrameReader().feed(frame)
    reply = messages.decode_reply(body)
    rebuilt = errors.error_from_wire(reply["code"], reply["message"], reply["details"])
    assert type(rebuilt) is cls
    assert rebuilt.message == original.message and str(rebuilt) == str(original)
    assert rebuilt.details == original.details


def test_error_hierarchy_and_unknown_codes() -> None:
    assert issubclass(errors.DaemonShuttingDownError, errors.DaemonUnavailableError)
    assert issubclass(errors.CollectiveTimeoutError, TimeoutError)
    assert issubclass(errors.InvalidArgumentError, ValueError)
    for cls in (errors.MismatchError, errors.RankLostError, errors.PeerLostError,
                errors.CollectiveTimeoutError):
        assert issubclass(cls, errors.CollectiveError)
        assert not issubclass(cls, errors.DaemonUnavailableError)
    unknown = errors.error_from_wire("from_the_future", "new", {"a": 1})
    assert type(unknown) is GradsyncError and unknown.details == {"a": 1}


# -- reduce ops and the dtypes they are defined for ----------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("op", list(ReduceOp))
def test_check_op_for_dtype_refuses_avg_of_integers_and_bits_of_floats(op: ReduceOp) -> None:
    for dtype in DTYPES:
        is_float = dtype in FLOAT_DTYPES
        if (op is ReduceOp.AVG and not is_float) or (op in BITWISE_OPS and is_float):
            kind = "float" if is_float else "integer"
            with pytest.raises(ValueError, match=rf"'{op.value}' is not defined for {kind} "
                                                 rf"dtype {dtype}\b"):
                check_op_for_dtype(op, dtype)
        else:
            check_op_for_dtype(op, dtype)


@pytest.mark.timeout(10)
def test_parse_reduce_op_takes_the_bitwise_names_and_lists_them() -> None:
    assert [parse_reduce_op(name) for name in ("BAND", "bor", "BXor")] == [
        ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    with pytest.raises(ValueError, match=r"expected one of: sum, avg, min, max, prod, band, "
                                         r"bor, bxor$"):
        parse_reduce_op("xor")


# -- argument checks in the client -------------------------------------------


def _read_only() -> np.ndarray:
    array = np.ones(4, dtype=np.float32)
    array.setflags(write=False)
    return array


BAD_CALLS: list[Any] = [
    pytest.param(lambda: np.arange(10, dtype=np.float32)[::2], "sum", "C-contiguous",
                 id="strided"),
    pytest.param(lambda: np.asfortranarray(np.ones((3, 4), dtype=np.float32)), "sum",
                 "C-contiguous", id="fortran"),
    pytest.param(_read_only, "sum", "read-only", id="read-only"),
    pytest.param(lambda: np.ones(4, dtype=np.int32), "avg", "avg", id="avg-int32"),
    pytest.param(lambda: np.ones(4, dtype=np.uint8), "AVG", "avg", id="avg-uint8"),
    pytest.param(lambda: np.ones(4, dtype=np.float32), "band",
                 "'band' is not defined for float dtype float32", id="band-float32"),
    pytest.param(lambda: np.ones(4, dtype=np.float16), "BOR",
                 "'bor' is not defined for float dtype float16", id="bor-float16"),
    pytest.param(lambda: np.ones(4, dtype=ml_dtypes.bfloat16), "bxor",
                 "'bxor' is not defined for float dtype bfloat16", id="bxor-bfloat16"),
    pytest.param(lambda: np.ones(4, dtype=np.float32), "xor", "unknown reduce op", id="op"),
    pytest.param(lambda: np.ones(4, dtype=np.float32), 3, "unknown reduce op", id="op-int"),
    pytest.param(lambda: np.ones(4, dtype=np.complex64), "sum", "unsupported dtype",
                 id="complex64"),
    pytest.param(lambda: np.ones(4, dtype=np.bool_), "sum", "unsupported dtype", id="bool"),
    pytest.param(lambda: np.ones(4, dtype=np.uint16), "sum", "unsupported dtype",
                 id="uint16"),
    pytest.param(lambda: [1.0, 2.0], "sum", "numpy array", id="list"),
]


@pytest.mark.timeout(10)
def test_a_checked_array_remembered_does_not_pass_a_bad_one_of_the_same_kind() -> None:
    """check_array keeps what it found of a host array by (dtype, op, elements): an array
    of the same three that is strided or read-only is still refused."""
    good = np.ones(8, dtype=np.float32)
    first = check_array(good, "sum", lambda: None)
    assert check_array(np.zeros(8, dtype=np.float32), "sum", lambda: None) is first
    assert first == ("float32", ReduceOp.SUM, 8, None)
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        check_array(np.ones(16, dtype=np.float32)[::2], "sum", lambda: None)
    read_only = np.ones(8, dtype=np.float32)
    read_only.setflags(write=False)
    with pytest.raises(InvalidArgumentError, match="read-only"):
        check_array(read_only, "sum", lambda: None)


@pytest.fixture
def two_ranks(daemon: DaemonProcess) -> Iterator[tuple[Client, Client]]:
    """Both ranks of a world-2 job, with a short deadline: a bad call that wrongly
    reached the daemon fails fast, not by hanging."""
    first = Client(daemon.endpoint, job="args", rank=0, world_size=2, timeout_s=5)
    second = Client(daemon.endpoint, job="args", rank=1, world_size=2, timeout_s=5)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


def assert_no_key_used(first: Client, second: Client) -> None:
    """Nothing reached the daemon: rank 0's next key still pairs with rank 1's first."""
    a = np.full(3, 1.5, dtype=np.float32)
    b = np.full(3, 2.0, dtype=np.float32)
    work = first.all_reduce(a, async_op=True)
    second.all_reduce(b)
    assert work is not None and work.wait()
    np.testing.assert_array_equal(a, np.full(3, 3.5, dtype=np.float32))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("make", "op", "match"), BAD_CALLS)
def test_client_refuses_bad_arguments_locally_without_using_a_key(
    two_ranks: tuple[Client, Client], make: Any, op: Any, match: str
) -> None:
    bad = make()
    before = np.array(bad, copy=True)
    with pytest.raises(InvalidArgumentError, match=match):
        two_ranks[0].all_reduce(bad, op=op)
    np.testing.assert_array_equal(np.asarray(bad), before)
    assert_no_key_used(*two_ranks)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("collective", ["reduce", "reduce_scatter"])
def test_client_refuses_bitwise_ops_of_floats_in_the_other_reducing_collectives(
    two_ranks: tuple[Client, Client], collective: str
) -> None:
    data = np.arange(4, dtype=np.float64)
    with pytest.raises(InvalidArgumentError, match="'bor' is not defined for float dtype float64"):
        if collective == "reduce":
            two_ranks[0].reduce(data, dst=1, op="bor")
        else:
            two_ranks[0].reduce_scatter(np.zeros(2, dtype=np.float64), data, op="bor")
    np.testing.assert_array_equal(data, np.arange(4, dtype=np.float64))
    assert_no_key_used(*two_ranks)


@pytest.mark.timeout(30)
def test_client_empty_refuses_bad_dtype_and_shape(daemon: DaemonProcess) -> None:
    with Client(daemon.endpoint, job="empty-args") as client:
        with pytest.raises(InvalidArgumentError, match="unsupported dtype"):
            client.empty(4, np.complex128)
        with pytest.raises(InvalidArgumentError, match="negative"):
            client.empty((2, -1))
        assert client.empty((0, 5)).shape == (0, 5)


@pytest.mark.parametrize(
    "kwargs",
    [{"rank": 2, "world_size": 2}, {"rank": 0}, {"rank": -1, "world_size": 2},
     {"rank": 0, "world_size": 2, "local_world_size": 3}, {"timeout_s": 0.0},
     {"timeout_s": -1.0}, {"timeout_s": float("nan")}],
)
def test_client_refuses_bad_identity_before_connecting(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        Client("ipc:///nonexistent/gradsync/never.sock", job="identity", **kwargs)


@pytest.mark.timeout(30)
def test_infinite_client_timeout_is_refused_or_works(daemon: DaemonProcess) -> None:
    try:
        client = Client(daemon.endpoint, job="forever", timeout_s=float("inf"))
    except InvalidArgumentError:
        return  # refusing it like 0 and NaN is fine
    with client:
        array = np.ones(4, dtype=np.float32)
        client.all_reduce(array)
        np.testing.assert_array_equal(array, np.ones(4, dtype=np.float32))
