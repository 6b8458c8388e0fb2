"""The daemon-to-daemon wire (protocol/peer.py): every message survives its own
round trip through msgpack, and anything malformed is refused by name."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from gradsync.daemon.peers.wire import decode_header, encode_header
from gradsync.protocol import peer
from gradsync.protocol.errors import ProtocolError, VersionMismatchError
from gradsync.protocol.version import PROTOCOL_VERSION

FP = peer.Fingerprint("allreduce", "float32", 1000, "sum", "ring", None)
MESSAGES: list[peer.Message] = [
    peer.Announce("job", 7, 1 << 61, 4, (0, 2), 5e-5, 1e-9),
    peer.Announce("job", 7, 1 << 61, 4, (0, 2), 5e-5, 1e-9, lead=True),
    peer.Withdraw("job", 7, 3, "rank 1 died", "rank_lost", "tcp://10.0.0.1:7000", False),
    peer.Slice("job", 1 << 62, 12, FP, 3, 1, 4096),
    peer.Slice("job", 5, "bucket:4", FP, -1, 0, 0),
    peer.Abort("job", 5, "bucket:4", "mismatch", "ranks disagree", {"job": "job", "key": 3}),
    peer.Costs("job", 5, 2, 5e-5, 1e-9, {("ring", 4096): 1e-4, ("rhd", 1 << 20): 2e-3}, 1.5),
    peer.Unformable("job", 1 << 61, 7, "peer daemon tcp://10.0.0.2:7000 of job 'job' was "
                    "lost", "peer_lost", "tcp://10.0.0.2:7000"),
    peer.Broke("job", "peer daemon tcp://10.0.0.2:7000 was lost", "peer_lost"),
    peer.Formed("job", 1 << 62, 4, 3, 1, (("tcp://10.0.0.2:7000", 1 << 61, 7, (1, 3)),
                                          ("tcp://10.0.0.3:7000", 5, 1, (2,))),
                5e-5, 1e-9, (("bf16", 2e9),), False, True),
    peer.Left("job", 1 << 62, "tcp://10.0.0.2:7000", "rank 1 died", "rank_lost",
              "tcp://10.0.0.2:7000", False),
    peer.Left("job", 1 << 62, "tcp://10.0.0.2:7000", "peer daemon tcp://10.0.0.3:7000 was lost",
              "peer_lost", "tcp://10.0.0.2:7000", False, "tcp://10.0.0.3:7000"),
    peer.Withdraw("job", 7, 3, "peer daemon tcp://10.0.0.3:7000 was lost", "peer_lost",
                  "tcp://10.0.0.1:7000", False, "tcp://10.0.0.3:7000"),
    peer.Drain("job", 1 << 61, 7),
]
SENDER = "tcp://127.0.0.1:7000"
#: Fields sent only when set: a message without one reads as without it.
OPTIONAL = frozenset({"lost", "lead"})


def over_the_wire(message: peer.Message) -> dict[str, Any]:
    """The header a receiving daemon's links hand on for this message."""
    body = encode_header(SENDER, message.to_wire())
    return dict(decode_header(body, frozenset(peer.MESSAGES)))


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: peer.Message) -> None:
    header = over_the_wire(message)
    assert header["v"] == peer.PEER_PROTOCOL_VERSION and header["src"] == SENDER
    assert peer.from_wire(header) == message


def test_the_fingerprint_has_one_description_and_a_strict_wire_form() -> None:
    assert FP.describe() == "allreduce float32[1000] op=sum algorithm=ring"
    rooted = peer.Fingerprint("broadcast", "int64", 8, None, "star", 2)
    assert rooted.describe() == "broadcast int64[8] root=2 algorithm=star"
    assert peer.Fingerprint.from_wire(rooted.to_wire()) == rooted
    for bad in (["allreduce", "float32", 1000, "sum", "ring"],  # five fields
                ["allreduce", "float32", "1000", "sum", None, "ring"],
                ["allreduce", "float32", True, "sum", None, "ring"],
                ["allreduce", 4, 1000, "sum", None, "ring"], "allreduce"):
        with pytest.raises(ProtocolError, match="fingerprint"):
            peer.Fingerprint.from_wire(bad)


def test_the_peer_wire_has_a_version_of_its_own() -> None:
    """Daemons compare PEER_PROTOCOL_VERSION, never the client wire's version."""
    fields = {"src": SENDER, **MESSAGES[0].to_wire()}
    other = peer.PEER_PROTOCOL_VERSION + 1
    with pytest.raises(VersionMismatchError) as caught:
        decode_header(msgpack.packb({"v": other, **fields}), frozenset(peer.MESSAGES))
    assert caught.value.details == {"peer_version": other,
                                    "our_version": peer.PEER_PROTOCOL_VERSION}
    if PROTOCOL_VERSION != peer.PEER_PROTOCOL_VERSION:
        with pytest.raises(VersionMismatchError):
            decode_header(msgpack.packb({"v": PROTOCOL_VERSION, **fields}),
                          frozenset(peer.MESSAGES))


def _without(fields: dict[str, Any], name: str) -> dict[str, Any]:
    return {key: value for key, value in fields.items() if key != name}


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_missing_or_mistyped_field_is_refused_by_name(message: peer.Message) -> None:
    fields = message.to_wire()
    for name in fields:
        if name == "kind":
            continue
        with pytest.raises(ProtocolError):
            peer.from_wire({**fields, name: [object.__name__]})
        if name in OPTIONAL:
            assert peer.from_wire(_without(fields, name)) != message
            continue
        with pytest.raises(ProtocolError) as missing:
            peer.from_wire(_without(fields, name))
        assert missing.value.message.startswith(f"{message.kind}:") or "fingerprint" in str(
            missing.value), missing.value
        with pytest.raises(ProtocolError):
            peer.from_wire({**fields, name: [object.__name__]})


@pytest.mark.parametrize(("kind", "change"), [
    ("announce", {"ranks": [0, 0]}), ("announce", {"ranks": [4]}), ("announce", {"ranks": []}),
    ("announce", {"world_size": 0}), ("announce", {"alpha_s": True}),
    ("announce", {"lead": 1}),
    ("withdraw", {"clean": 1}), ("slice", {"key": 1.5}), ("slice", {"step": True}),
    ("abort", {"details": []}), ("costs", {"epoch": 0}), ("costs", {"alpha_s": 1e4}),
    ("costs", {"explore_factor": 0.5}), ("costs", {"times": [["warp", 4096, 1e-3]]}),
    ("costs", {"times": [["ring", -1, 1e-3]]}), ("costs", {"times": [["ring", 1, 0.0]]}),
    ("costs", {"times": [["ring", 1, 1e-3]] * (peer.MAX_TIMES + 1)}),
    ("formed", {"part": [["tcp://10.0.0.2:7000", 1, 1, [4]]]}),
    ("formed", {"part": [["tcp://10.0.0.2:7000", 1, 1, [1, 1]]]}),
    ("formed", {"part": [["tcp://10.0.0.2:7000", 1, 1]]}), ("formed", {"part": []}),
    ("formed", {"first": 2}), ("formed", {"members": 0}), ("formed", {"loopback": 0}),
    ("left", {"clean": 1}), ("left", {"lost": 7}), ("withdraw", {"lost": ["x"]}),
])
def test_out_of_range_values_are_refused(kind: str, change: dict[str, Any]) -> None:
    (message,) = [m for m in MESSAGES if m.kind == kind][:1]
    with pytest.raises(ProtocolError, match=kind):
        peer.from_wire({**message.to_wire(), **change})


def test_unknown_kinds_and_link_probes() -> None:
    with pytest.raises(ProtocolError, match="unknown peer message kind"):
        peer.from_wire({"kind": "rumour", "job": "job"})
    pong = peer.Probe(peer.PONG, 3, 41000, b"t" * 16)
    assert peer.Probe.from_wire(pong.to_wire()) == pong
    offer = peer.Probe(peer.PONG, 3, 41000, b"t" * 16, b"k" * 32,  # a CURVE link's offer
                       "chacha20-poly1305")
    assert peer.Probe.from_wire(offer.to_wire()) == offer
    assert peer.Probe.from_wire({"kind": peer.PING, "seq": 1}) == peer.Probe(peer.PING, 1)
    forwarded = peer.Probe(peer.PONG, 3, 41000, b"t" * 16, data_host="fd00::7")  # --data-advertise
    assert peer.Probe.from_wire(forwarded.to_wire()) == forwarded
    for bad in ({"kind": peer.PONG, "seq": "1"}, {"kind": "chunk", "seq": 1},
                {"kind": peer.PONG, "seq": 1, "data_port": 0, "data_token": b"t"},
                {"kind": peer.PONG, "seq": 1, "data_port": 80, "data_token": ""},
                {**offer.to_wire(), "data_key": b"k" * 31},
                {**offer.to_wire(), "data_cipher": "aes-128-gcm"},
                {**offer.to_wire(), "data_cipher": None},
                {**pong.to_wire(), "data_cipher": "aes-256-gcm"},
                {**pong.to_wire(), "data_host": ""}, {**pong.to_wire(), "data_host": 7},
                {**pong.to_wire(), "data_host": "[::1]"},
                {**pong.to_wire(), "data_host": "evil/path"},
                {**pong.to_wire(), "data_host": "h" * 256}):
        with pytest.raises(ProtocolError):
            peer.Probe.from_wire(bad)



def test_the_failure_detectors_questions_answers_and_notices() -> None:
    """ASK names a suspect; its PONG says when the answering daemon last heard it
    (or, without `heard_s`, that its link to it is not up); CUT says why."""
    ask = peer.Probe(peer.ASK, 4, about="tcp://10.0.0.2:29400")
    told = peer.Probe(peer.PONG, 4, about="tcp://10.0.0.2:29400", heard_s=0.25)
    unknown = peer.Probe(peer.PONG, 4, about="tcp://10.0.0.2:29400")
    cut = peer.Probe(peer.CUT, 5, why="unreachable from tcp://10.0.0.1:29400 for 4.0s")
    for probe in (ask, told, unknown, cut):
        assert peer.Probe.from_wire(probe.to_wire()) == probe
    for bad in ({"kind": peer.ASK, "seq": 1}, {"kind": peer.ASK, "seq": 1, "about": ""},
                {"kind": peer.ASK, "seq": 1, "about": "h" * 256},
                {**told.to_wire(), "heard_s": -1.0}, {**told.to_wire(), "heard_s": "0"},
                {"kind": peer.PONG, "seq": 1, "heard_s": 0.5},
                {"kind": peer.CUT, "seq": 1}, {"kind": peer.CUT, "seq": 1, "why": "w" * 1025},
                {"kind": peer.PING, "seq": 1, "why": 7}):
        with pytest.raises(ProtocolError):
            peer.Probe.from_wire(bad)


def test_the_algorithms_are_named_once() -> None:
    from gradsync.client.client import ALGORITHMS as CLIENT_CHOICES
    from gradsync.daemon.algorithms import ALGORITHMS
    from gradsync.daemon.config import ALGORITHM_CHOICES as CONFIG_CHOICES

    assert tuple(ALGORITHMS) == peer.ALGORITHM_NAMES
    assert CLIENT_CHOICES == CONFIG_CHOICES == ("auto", *peer.ALGORITHM_NAMES)


CHECKPOINT_MESSAGES: list[peer.CkptMessage] = [
    peer.CkptAsk("job", 4, "held", -1),
    peer.CkptAsk("job", 5, "commit", 3, ((0, "data"), (0, "metadata"), (1, "data"))),
    peer.CkptAsk("job", 6, "pull", 3, part=("tcp://10.0.0.2:7000", 1, "data")),
    peer.CkptAnswer("job", 5, False, "no room"),
    peer.CkptAnswer("job", 4, True, held=(
        peer.CkptHeld(3, True, ((0, "data"), (1, "data")), ((SENDER, 0, "data", 4096),)),
        peer.CkptHeld(3, True, (), (("tcp://10.0.0.2:7000", 1, "data", 8192),)),
        peer.CkptHeld(4, False, (), ((SENDER, 0, "data", 4096),)))),
    peer.CkptChunk("job", 9, False, 3, SENDER, 0, "data", 1 << 30, 1 << 20),
]


@pytest.mark.parametrize("message", CHECKPOINT_MESSAGES, ids=lambda m: type(m).__name__)
def test_checkpoint_messages_round_trip_and_refuse_missing_fields(
    message: peer.CkptMessage
) -> None:
    body = encode_header(SENDER, message.to_wire())
    fields = dict(decode_header(body, frozenset(peer.CKPT_MESSAGES)))
    assert peer.ckpt_from_wire(fields) == message
    for name in message.to_wire():
        if name != "kind" and not (name == "part" and fields["part"] is None):
            with pytest.raises(ProtocolError, match=message.kind):
                peer.ckpt_from_wire(_without(fields, name))


@pytest.mark.parametrize(("kind", "change"), [
    ("ckpt_ask", {"what": "delete"}), ("ckpt_ask", {"step": -2}),
    ("ckpt_ask", {"what": "commit", "step": -1}), ("ckpt_ask", {"part": ["a", 0, "data"]}),
    ("ckpt_ask", {"parts": [[0, "data"]] * (peer.MAX_CKPT_PARTS + 1)}),
    ("ckpt_ask", {"parts": [[-1, "data"]]}), ("ckpt_ask", {"parts": [[0, ""]]}),
    ("ckpt_ask", {"parts": [[0, "x" * 256]]}), ("ckpt_ask", {"parts": [[True, "data"]]}),
    ("ckpt_ask", {"job": ""}),
    ("ckpt_answer", {"ok": 1}), ("ckpt_answer", {"error": "e" * 1025}),
    ("ckpt_answer", {"held": [[3, "yes", [], []]]}),
    ("ckpt_answer", {"held": [[3, True, [], [[SENDER, 0, "data", -1]]]]}),
    ("ckpt_answer", {"held": [[3, True, [], [[SENDER, 0, "data"]]]]}),
    ("ckpt_chunk", {"off": -1}), ("ckpt_chunk", {"nbytes": 0, "off": 0}),
    ("ckpt_chunk", {"off": 1 << 30}), ("ckpt_chunk", {"nbytes": (1 << 44) + 1}),
    ("ckpt_chunk", {"pull": 0}), ("ckpt_chunk", {"origin": 7}),
])
def test_malformed_checkpoint_messages_are_refused(kind: str, change: dict[str, Any]) -> None:
    message = next(m for m in CHECKPOINT_MESSAGES if m.kind == kind)
    with pytest.raises(ProtocolError, match=kind):
        peer.ckpt_from_wire({**message.to_wire(), **change})
    with pytest.raises(ProtocolError, match="unknown checkpoint message kind"):
        peer.ckpt_from_wire({**message.to_wire(), "kind": "ckpt_delete"})
