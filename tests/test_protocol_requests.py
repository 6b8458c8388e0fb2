"""The typed client wire (protocol/requests.py): round trips and value checks.

Type errors are `messages.decode_request`'s (test_protocol_units.py); here the
values each request's `from_wire` refuses, by the daemon's rules, with no
daemon: what the daemon answers to them is test_protocol_robustness.py's.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from gradsync.protocol import messages
from gradsync.protocol import requests as wire
from gradsync.protocol.codec import encode_frame
from gradsync.protocol.dtypes import ReduceOp
from gradsync.protocol.errors import InvalidArgumentError
from gradsync.protocol.version import PROTOCOL_VERSION


def through_the_wire(message: dict[str, Any]) -> wire.Request:
    """What the daemon makes of `message`: framed, decoded, checked, typed."""
    body = encode_frame(message)[4:]
    return wire.parse_request(messages.decode_request(body))


@pytest.mark.parametrize("request_", [
    wire.Collective("allreduce", 7, 3, 64, 16, "float32", ReduceOp.AVG, algorithm="ring",
                    timeout_s=5.0, waited_s=0.25),
    wire.Collective("allreduce", "bucket-0", None, 0, 0, "bfloat16", ReduceOp.SUM),
    wire.Collective("all_gather", 2, 1, 0, 8, "int32", None, out_segment=2, out_offset=32,
                    out_count=32),
    wire.Collective("reduce", 3, 1, 0, 8, "float64", ReduceOp.MAX, root=1),
    wire.Collective("scatter", 4, None, 0, 0, "uint8", None, root=0, out_segment=5,
                    out_count=4),
], ids=["allreduce", "named-key", "all_gather", "reduce", "scatter"])
def test_a_collective_survives_the_wire_unchanged(request_: wire.Collective) -> None:
    assert through_the_wire(request_.to_wire(11)) == request_


def test_every_collective_is_one_request_kind_naming_its_collective() -> None:
    allreduce = wire.Collective("allreduce", 1, 1, 0, 4, "float32", ReduceOp.SUM).to_wire(1)
    broadcast = wire.Collective("broadcast", 1, 1, 0, 4, "float32", root=0).to_wire(2)
    assert allreduce["kind"] == broadcast["kind"] == "collective"
    assert allreduce["collective"] == "allreduce" and broadcast["collective"] == "broadcast"
    assert "waited_s" not in allreduce  # only a rank that waited on the fast page says so
    assert "out_segment" not in allreduce and "algorithm" not in broadcast
    assert "allreduce" not in wire.REQUEST_TYPES  # the kind of protocol v3 and before


def collective(**fields: Any) -> dict[str, Any]:
    base = {"kind": "collective", "collective": "all_gather", "key": 1, "segment": 1,
            "offset": 0, "count": 4, "out_segment": 1, "out_offset": 64, "out_count": 8,
            "dtype": "float32"}
    return {**base, **fields}


def allreduce(**fields: Any) -> dict[str, Any]:
    base = {"kind": "collective", "collective": "allreduce", "key": 1, "segment": 1,
            "offset": 0, "count": 4,
            "dtype": "float32", "op": "sum"}
    return {**base, **fields}


@pytest.mark.parametrize("message, error", [
    (collective(collective="allreduce", op="sum"),
     "allreduce request has out_segment, out_count: an allreduce works in place"),
    (allreduce(op=None), "unknown reduce op ''"),
    (collective(algorithm="ring"), "all_gather request has algorithm: only an allreduce"),
    (collective(collective="gossip"), "unknown collective 'gossip'"),
    (allreduce(dtype="complex64"), "unsupported dtype 'complex64'"),
    (allreduce(op="median"), "median"),
    (allreduce(dtype="int32", op="avg"), "avg"),
    (allreduce(algorithm="fastest"), "unknown algorithm 'fastest'"),
    (allreduce(count=-1), "negative count -1"),
    (collective(out_offset=-8), "negative count 8 or offset -8"),
    (allreduce(timeout_s=-1.0), "timeout_s must be positive and finite"),
    (allreduce(timeout_s=math.inf), "timeout_s must be positive and finite"),
    (allreduce(waited_s=-0.5), "waited_s must be >= 0"),
    (allreduce(waited_s=math.nan), "waited_s must be >= 0"),
    (collective(collective="reduce", op="xor", dtype="float32", root=0), "xor"),
], ids=lambda value: value if isinstance(value, str) else "")
def test_a_bad_value_is_refused_naming_it(message: dict[str, Any], error: str) -> None:
    with pytest.raises(InvalidArgumentError, match=error.replace("(", r"\(")):
        wire.Collective.from_wire(message)


def test_a_zero_timeout_means_the_daemons_default_and_a_root_only_where_it_counts() -> None:
    parsed = wire.Collective.from_wire(allreduce(timeout_s=0, root=3))
    assert parsed.timeout_s is None and parsed.root is None and parsed.op is ReduceOp.SUM
    assert wire.Collective.from_wire(collective(collective="gather", out_count=None,
                                                root=2)).root == 2


@pytest.mark.parametrize("fields, error", [
    ({"job": ""}, "job name must have 1 to 128"),
    ({"job": "j" * 129}, "job name must have 1 to 128"),
    ({"local_world_size": 1025, "world_size": 2048}, "at most 1024 ranks per daemon"),
    ({"world_size": 1, "local_world_size": 2}, "need 0 < local_world_size <= world_size"),
    ({"rank": 4}, "rank 4 / local_rank 0 out of range"),
    ({"local_rank": 2}, "local_rank 2 out of range"),
])
def test_a_hello_out_of_range_is_refused(fields: dict[str, Any], error: str) -> None:
    hello = {"kind": "hello", "job": "train", "rank": 0, "world_size": 4, "local_rank": 0,
             "local_world_size": 2, "pid": 1, **fields}
    with pytest.raises(InvalidArgumentError, match=error):
        wire.Hello.from_wire(hello)


def test_every_request_kind_parses_to_its_type() -> None:
    made = [
        messages.request("hello", 1, job="j", rank=0, world_size=1, local_rank=0,
                         local_world_size=1, pid=5),
        messages.request("ping", 2), messages.request("bye", 3),
        messages.request("alloc", 4, nbytes=4096), messages.request("free", 5, segment=9),
        messages.request("attach", 6, fd=3, nbytes=4096), messages.request("group_info", 7),
    ]
    parsed = [through_the_wire(message) for message in made]
    assert parsed == [wire.Hello("j", 0, 1, 0, 1, 5), wire.Ping(), wire.Bye(),
                      wire.Alloc(4096), wire.Free(9), wire.Attach(3, 4096), wire.GroupInfo()]
    with pytest.raises(InvalidArgumentError, match="alloc needs a positive size"):
        wire.Alloc.from_wire({"kind": "alloc", "nbytes": 0})
    assert set(wire.REQUEST_TYPES) == set(messages.REQUESTS)


@pytest.mark.parametrize("request_", [
    wire.Collective("allreduce", 7, 3, 64, 16, "float32", ReduceOp.AVG, compression="fp8",
                    error_feedback=True),
    wire.Collective("reduce_scatter", 2, 1, 0, 8, "float64", ReduceOp.SUM, out_segment=2,
                    out_count=4, compression="bf16"),
], ids=["allreduce-fp8", "reduce_scatter-bf16"])
def test_a_compressed_collective_survives_the_wire(request_: wire.Collective) -> None:
    assert through_the_wire(request_.to_wire(3)) == request_
    plain = wire.Collective("allreduce", 1, 1, 0, 4, "float32", ReduceOp.SUM).to_wire(1)
    assert "compression" not in plain  # the bytes of an uncompressed request are unchanged


@pytest.mark.parametrize(("fields", "says"), [
    ({"dtype": "int32", "compression": "bf16"}, "only float32 and float64"),
    ({"op": "max", "compression": "fp8"}, "op='max'"),
    ({"compression": "int4"}, "unknown compression 'int4'"),
    ({"error_feedback": True}, "needs a compression"),
])
def test_the_daemon_refuses_compression_where_it_has_no_meaning(
    fields: dict[str, Any], says: str
) -> None:
    message = {"v": PROTOCOL_VERSION, "id": 1, "kind": "collective", "collective": "allreduce",
               "key": 1, "segment": 1, "offset": 0,
               "count": 4, "dtype": "float32", "op": "sum", **fields}
    with pytest.raises(InvalidArgumentError, match=says):
        through_the_wire(message)
    broadcast = {"v": PROTOCOL_VERSION, "id": 1, "kind": "collective",
                 "collective": "broadcast", "key": 1, "segment": 1, "offset": 0, "count": 4,
                 "dtype": "float32", "root": 0, "compression": "bf16"}
    with pytest.raises(InvalidArgumentError, match="broadcast cannot be compressed"):
        through_the_wire(broadcast)


def test_a_peer_fingerprint_carries_the_format_only_when_set() -> None:
    from gradsync.protocol.errors import ProtocolError
    from gradsync.protocol.peer import Fingerprint

    plain = Fingerprint("allreduce", "float32", 8, "sum", "ring")
    packed = Fingerprint("allreduce", "float32", 8, "sum", "ring", compression="fp8")
    assert len(plain.to_wire()) == 6 and packed.to_wire()[6] == "fp8"
    assert Fingerprint.from_wire(packed.to_wire()) == packed != plain
    with pytest.raises(ProtocolError, match="fingerprint"):
        Fingerprint.from_wire([*plain.to_wire(), "int4"])
