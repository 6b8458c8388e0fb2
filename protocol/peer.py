"""The daemon-to-daemon wire: typed messages, strictly checked both ways.

A peer message is a msgpack header map `{"v": PEER_PROTOCOL_VERSION, "src":
SENDER, "kind": KIND, ...fields}` followed by raw payload frames (only a slice
carries one).  The envelope ("v", "src") is the links' (daemon/peers/wire.py);
this module owns everything after it: one frozen dataclass per kind, whose
`to_wire()` gives the fields and whose `from_wire(fields)` refuses anything
malformed with `ProtocolError`.  Only daemons speak this wire, so it has a
version of its own: a change here does not break clients, and a client change
does not break a cluster mid-upgrade.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeGuard

from gradsync.protocol import algorithm_names
from gradsync.protocol.codec import is_integer, is_number
from gradsync.protocol.compression import COMPRESSIONS
from gradsync.protocol.errors import ProtocolError
from gradsync.protocol.messages import check_version

#: Bumped on every incompatible change of a message below (the client wire's
#: PROTOCOL_VERSION is separate: protocol/version.py).
PEER_PROTOCOL_VERSION = 4

#: The AEAD ciphers of sealed data streams (daemon/peers/stream_crypto.py), by
#: their wire names; a stream's hello gives its cipher's index here.
STREAM_CIPHERS: tuple[str, ...] = ("aes-256-gcm", "chacha20-poly1305")

#: The allreduce algorithms between daemons (and what a client may ask for).
ALGORITHM_NAMES = algorithm_names.ALGORITHM_NAMES
ALGORITHM_CHOICES = algorithm_names.ALGORITHM_CHOICES

#: Link-layer kinds (latency and bandwidth probes), answered by the links themselves.
PING = "link.ping"
BULK = "link.bulk"
PONG = "link.pong"
#: A daemon leaving on purpose (SIGTERM) says so to each peer, which answers with
#: a PONG and from then on takes the link's end as a goodbye, not a failure.
BYE = "link.bye"
#: A failure detector's question about a peer it suspects (`about`), answered by
#: a PONG that says how long ago the asked daemon last heard it (`heard_s`).
ASK = "link.ask"
#: A daemon that declared the receiver lost or unreachable says so, and why
#: (`why`), where its messages still get through (a one-way cut): the receiver
#: drops the link too, with the sender's words.
CUT = "link.cut"
LINK_KINDS = frozenset({PING, BULK, PONG, BYE, ASK, CUT})
#: The longest `why` a CUT carries (characters).
MAX_WHY = 1024

#: Timings a `Costs` message may carry.
MAX_TIMES = 64
#: Codec rates an `Announce` may carry.
MAX_CODEC_RATES = 8
#: An upper bound for any duration on the wire (seconds).
MAX_SECONDS = 1e3

Key = int | str


def is_seconds(value: Any) -> TypeGuard[int | float]:
    """A plausible duration on the wire: a number in [0, MAX_SECONDS)."""
    return is_number(value) and 0 <= value < MAX_SECONDS


def check_peer_version(header: Mapping[str, Any]) -> None:
    """Refuse a header of another peer protocol version, naming both."""
    check_version(header, PEER_PROTOCOL_VERSION, "peer protocol")


_NOTHING = object()


def _need(condition: bool, kind: str, what: str, shown: Any = _NOTHING) -> None:
    """Refuse a message unless `condition`; `shown` (clipped) ends the reason.  The
    text is only built on failure: these checks run for every slice."""
    if not condition:
        got = "" if shown is _NOTHING else f", got {_clip(shown)}"
        raise ProtocolError(f"{kind}: {what}{got}")


def _text(fields: Mapping[str, Any], name: str, kind: str) -> str:
    """A string field (the header's size limit bounds its length)."""
    value = fields.get(name)
    if not isinstance(value, str):
        raise ProtocolError(f"{kind}: {name!r} must be a string")
    return value


def _int(fields: Mapping[str, Any], name: str, kind: str) -> int:
    value = fields.get(name)
    if not is_integer(value):
        raise ProtocolError(f"{kind}: {name!r} must be an integer")
    return value


def _key(fields: Mapping[str, Any], kind: str) -> Key:
    value = fields.get("key")
    if not (is_integer(value) or isinstance(value, str)):
        raise ProtocolError(f"{kind}: 'key' must be an integer or a string")
    return value


def _clip(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Fingerprint:
    """What every member must agree on for one collective: locally between ranks
    (`algorithm` is what they asked for) and between daemons (what runs).
    `compression` (protocol/compression.py) travels as a seventh element, only
    when set, so an uncompressed collective's wire is as before."""

    collective: str
    dtype: str
    count: int
    op: str | None
    algorithm: str | None = None
    root: int | None = None
    compression: str | None = None

    def describe(self) -> str:
        op = f" op={self.op}" if self.op else ""
        algorithm = f" algorithm={self.algorithm}" if self.algorithm else ""
        root = f" root={self.root}" if self.root is not None else ""
        compression = f" compression={self.compression}" if self.compression else ""
        return f"{self.collective} {self.dtype}[{self.count}]{op}{root}{algorithm}{compression}"

    def to_wire(self) -> list[Any]:
        fields = [self.collective, self.dtype, self.count, self.op, self.root, self.algorithm]
        return fields if self.compression is None else [*fields, self.compression]

    @classmethod
    def from_wire(cls, value: Any) -> Fingerprint:
        _need(isinstance(value, list) and len(value) in (6, 7), "fingerprint",
              "must be [collective, dtype, count, op, root, algorithm(, compression)]", value)
        collective, dtype, count, op, root, algorithm = value[:6]
        compression = value[6] if len(value) == 7 else None
        _need(isinstance(collective, str) and isinstance(dtype, str) and is_integer(count)
              and (op is None or isinstance(op, str)) and (root is None or is_integer(root))
              and (algorithm is None or isinstance(algorithm, str))
              and (len(value) == 6 or compression in COMPRESSIONS), "fingerprint",
              "fields of the wrong type", value)
        return cls(collective, dtype, count, op, algorithm, root, compression)


class WireMessage:
    """Base of the typed messages: `kind` names it on the wire."""

    kind: ClassVar[str]

    def to_wire(self) -> dict[str, Any]:
        """The header fields, `kind` included (the links add "v" and "src")."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {"kind": self.kind, **fields}


@dataclasses.dataclass(frozen=True)
class Announce(WireMessage):
    """A daemon's share of a job: which ranks it holds, and its link figures."""

    kind: ClassVar[str] = "announce"
    job: str
    incarnation: int
    #: The sender's run (daemon/core/membership.py BOOT): incarnations compare within one.
    boot: int
    world_size: int
    ranks: tuple[int, ...]
    alpha_s: float
    beta_s_per_byte: float
    #: What `auto` compression weighs (daemon/core/compression_policy.py): the
    #: sender's codec rates (buffer bytes/s, by rate name), whether all its peers
    #: are on its own host, and whether its link figures are defaults (its links
    #: were not yet measured).  Sent only when set: older peers read it as before.
    codec_Bps: tuple[tuple[str, float], ...] = ()
    loopback: bool = False
    unmeasured: bool = False
    #: The sender picked the receiver as the job's coordinator, not its standby
    #: (daemon/core/coordinating.py: behind a partial cut, views differ).
    lead: bool = False

    def to_wire(self) -> dict[str, Any]:
        fields = {**super().to_wire(), "ranks": list(self.ranks)}
        del fields["codec_Bps"], fields["loopback"], fields["unmeasured"], fields["lead"]
        if self.codec_Bps:
            fields["codec_Bps"] = dict(self.codec_Bps)
        for flag in ("loopback", "unmeasured", "lead"):
            if getattr(self, flag):
                fields[flag] = True
        return fields

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Announce:
        kind = cls.kind
        ranks, world = fields.get("ranks"), fields.get("world_size")
        _need(isinstance(ranks, list) and all(is_integer(r) for r in ranks), kind,
              "'ranks' must be a list of integers")
        _need(is_integer(world) and world >= 1, kind, "'world_size' must be a positive integer")
        assert isinstance(ranks, list) and isinstance(world, int)
        _need(bool(ranks) and all(0 <= r < world for r in ranks)
              and len(set(ranks)) == len(ranks), kind, "ranks out of range or repeated")
        alpha, beta = fields.get("alpha_s"), fields.get("beta_s_per_byte")
        _need(is_number(alpha) and is_number(beta), kind,
              "link costs must be numbers")
        rates = fields.get("codec_Bps", {})
        _need(isinstance(rates, dict) and len(rates) <= MAX_CODEC_RATES
              and all(isinstance(name, str) and len(name) <= 32 and is_number(rate)
                      and 0 < rate < float("inf") for name, rate in rates.items()), kind,
              "'codec_Bps' must map at most 8 rate names to positive numbers")
        flags = [fields.get(flag, False) for flag in ("loopback", "unmeasured", "lead")]
        _need(all(isinstance(flag, bool) for flag in flags), kind,
              "'loopback', 'unmeasured' and 'lead' must be booleans")
        return cls(_text(fields, "job", kind), _int(fields, "incarnation", kind),
                   _int(fields, "boot", kind), world, tuple(sorted(ranks)),
                   float(alpha), float(beta),  # type: ignore[arg-type]
                   tuple(sorted((name, float(rate)) for name, rate in rates.items())),
                   *flags)


@dataclasses.dataclass(frozen=True)
class Withdraw(WireMessage):
    """A daemon's part of a job ended: why, who caused it, and whether cleanly."""

    kind: ClassVar[str] = "withdraw"
    job: str
    incarnation: int
    boot: int
    reason: str
    #: The error code its clients got (protocol/errors.py), so ours get the same kind.
    code: str
    #: The daemon where the end began (a rank lost there, say).
    origin: str
    clean: bool
    #: A member declared lost or cut off where that ended the job (its data will
    #: not come: members waiting for it fail now); "" if none.  Sent only when set.
    lost: str = ""

    def to_wire(self) -> dict[str, Any]:
        return _without_empty_lost(super().to_wire())

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Withdraw:
        kind = cls.kind
        return cls(_text(fields, "job", kind), _int(fields, "incarnation", kind),
                   _int(fields, "boot", kind), *_why_it_ended(fields, kind))


def _without_empty_lost(fields: dict[str, Any]) -> dict[str, Any]:
    if not fields["lost"]:
        del fields["lost"]
    return fields


def _why_it_ended(fields: Mapping[str, Any], kind: str) -> tuple[str, str, str, bool, str]:
    """What a `Withdraw` and the `Left` passing it on both say: reason, code,
    origin, clean, lost (optional)."""
    clean, lost = fields.get("clean"), fields.get("lost", "")
    _need(isinstance(clean, bool), kind, "'clean' must be a boolean")
    _need(isinstance(lost, str) and len(lost) <= 1024, kind, "'lost' must be a string")
    return (_text(fields, "reason", kind), _text(fields, "code", kind),
            _text(fields, "origin", kind), bool(clean), str(lost))


@dataclasses.dataclass(frozen=True)
class Slice(WireMessage):
    """The header of one slice of a collective's data (its payload follows).

    `step` -1 is a fingerprint-only agreement (no data); `t` is the transfer of
    that step, `off` the element offset within it.
    """

    kind: ClassVar[str] = "slice"
    job: str
    gen: int
    key: Key
    fp: Fingerprint
    step: int
    t: int
    off: int

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "fp": self.fp.to_wire()}

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Slice:
        kind = cls.kind
        return cls(_text(fields, "job", kind), _int(fields, "gen", kind), _key(fields, kind),
                   Fingerprint.from_wire(fields.get("fp")), _int(fields, "step", kind),
                   _int(fields, "t", kind), _int(fields, "off", kind))


@dataclasses.dataclass(frozen=True)
class Abort(WireMessage):
    """One collective failed on the sender: every member fails it with this error."""

    kind: ClassVar[str] = "abort"
    job: str
    gen: int
    key: Key
    code: str
    message: str
    details: dict[str, Any]

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Abort:
        kind = cls.kind
        details = fields.get("details")
        _need(isinstance(details, dict), kind, "'details' must be a map")
        return cls(_text(fields, "job", kind), _int(fields, "gen", kind), _key(fields, kind),
                   _text(fields, "code", kind), _text(fields, "message", kind),
                   dict(details))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Unformable(WireMessage):
    """A job's coordinator to one announcer: this run of the job (the
    announcer's `boot` and `incarnation`, echoed) can never form, because the
    daemon `peer` that held some of its ranks was lost before it formed.  The
    announcer's ranks fail now with `message`, not at their deadline."""

    kind: ClassVar[str] = "unformable"
    job: str
    boot: int
    incarnation: int
    message: str
    code: str
    peer: str

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Unformable:
        kind = cls.kind
        return cls(_text(fields, "job", kind), _int(fields, "boot", kind),
                   _int(fields, "incarnation", kind), _text(fields, "message", kind),
                   _text(fields, "code", kind), _text(fields, "peer", kind))


@dataclasses.dataclass(frozen=True)
class Broke(WireMessage):
    """To a peer that is back after being lost (a restart, a cut link): the
    sender broke `job` before it formed while the receiver was away.  The
    receiver's ranks of that job, there already or joining soon, would wait
    for ranks that gave up: they fail now, with `reason`."""

    kind: ClassVar[str] = "broke"
    job: str
    reason: str
    code: str

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Broke:
        kind = cls.kind
        return cls(_text(fields, "job", kind), _text(fields, "reason", kind),
                   _text(fields, "code", kind))


#: One member of a formation on the wire: its daemon, that daemon's boot and
#: incarnation of the job, and the ranks it holds.
FormedMember = tuple[str, int, int, tuple[int, ...]]
#: Members a `Formed` part may carry (a part must fit one header frame).
MAX_FORMED_MEMBERS = 4096
#: Daemons a formation may have.
MAX_MEMBERS = 1 << 16


def _formed_member(value: Any, world_size: int) -> FormedMember:
    kind = Formed.kind
    _need(isinstance(value, list) and len(value) == 4, kind,
          "a member must be [daemon, boot, incarnation, ranks]")
    daemon, boot, incarnation, ranks = value
    _need(isinstance(daemon, str) and 0 < len(daemon) <= 1024, kind,
          "a member's daemon must be a string")
    _need(is_integer(boot) and is_integer(incarnation), kind,
          "a member's boot and incarnation must be integers")
    _need(isinstance(ranks, list) and bool(ranks)
          and all(is_integer(r) and 0 <= r < world_size for r in ranks)
          and len(set(ranks)) == len(ranks), kind,
          "a member's ranks must be distinct integers below world_size")
    return daemon, int(boot), int(incarnation), tuple(sorted(ranks))


@dataclasses.dataclass(frozen=True)
class Formed(WireMessage):
    """A job's coordinator to its members: the job formed.  One part of the
    member list (members `first` onwards, of `members` in all, in the
    formation's order), the generation, and the figures every member derives
    the same way (membership.py `form`).  A large formation comes in parts, so
    that each fits one header frame."""

    kind: ClassVar[str] = "formed"
    job: str
    gen: int
    world_size: int
    members: int
    first: int
    part: tuple[FormedMember, ...]
    alpha_s: float
    beta_s_per_byte: float
    codec_Bps: tuple[tuple[str, float], ...]
    loopback: bool
    measured: bool

    def to_wire(self) -> dict[str, Any]:
        fields = super().to_wire()
        fields["part"] = [[d, b, i, list(r)] for d, b, i, r in self.part]
        fields["codec_Bps"] = dict(self.codec_Bps)
        return fields

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Formed:
        kind = cls.kind
        world, members, first = (_int(fields, name, kind)
                                 for name in ("world_size", "members", "first"))
        _need(world >= 1 and 1 <= members <= MAX_MEMBERS and 0 <= first < members, kind,
              "'world_size', 'members' and 'first' out of range")
        part = fields.get("part")
        _need(isinstance(part, list) and 0 < len(part) <= MAX_FORMED_MEMBERS
              and first + len(part) <= members, kind, "'part' must list members in range")
        assert isinstance(part, list)
        alpha, beta = fields.get("alpha_s"), fields.get("beta_s_per_byte")
        _need(is_number(alpha) and is_number(beta), kind, "link costs must be numbers")
        rates = fields.get("codec_Bps")
        _need(isinstance(rates, dict) and len(rates) <= MAX_CODEC_RATES
              and all(isinstance(name, str) and len(name) <= 32 and is_number(rate)
                      and 0 < rate < float("inf") for name, rate in rates.items()), kind,
              "'codec_Bps' must map at most 8 rate names to positive numbers")
        assert isinstance(rates, dict)
        loopback, measured = fields.get("loopback"), fields.get("measured")
        _need(isinstance(loopback, bool) and isinstance(measured, bool), kind,
              "'loopback' and 'measured' must be booleans")
        return cls(_text(fields, "job", kind), _int(fields, "gen", kind), world, members,
                   first, tuple(_formed_member(m, world) for m in part),
                   float(alpha), float(beta),  # type: ignore[arg-type]
                   tuple(sorted((name, float(rate)) for name, rate in rates.items())),
                   bool(loopback), bool(measured))


@dataclasses.dataclass(frozen=True)
class Left(WireMessage):
    """A job's coordinator to its members: member `daemon` withdrew from
    generation `gen` (its `Withdraw`, passed on once per generation)."""

    kind: ClassVar[str] = "left"
    job: str
    gen: int
    daemon: str
    reason: str
    code: str
    origin: str
    clean: bool
    #: As the withdrawal's `lost` (sent only when set).
    lost: str = ""

    def to_wire(self) -> dict[str, Any]:
        return _without_empty_lost(super().to_wire())

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Left:
        kind = cls.kind
        return cls(_text(fields, "job", kind), _int(fields, "gen", kind),
                   _text(fields, "daemon", kind), *_why_it_ended(fields, kind))


#: (algorithm, buffer bytes): what one timing of `auto`'s calibration is of.
TimingGroup = tuple[str, int]


@dataclasses.dataclass(frozen=True)
class Drain(WireMessage):
    """To a member whose withdrawal the coordinator passed on (`Left`), from a
    member whose collective still waits for its data: send me that withdrawal
    yourself.  It comes down the data stream behind the member's last slices,
    so the collective fails only if they never come."""

    kind: ClassVar[str] = "drain"
    job: str
    boot: int
    incarnation: int

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Drain:
        kind = cls.kind
        return cls(_text(fields, "job", kind), _int(fields, "boot", kind),
                   _int(fields, "incarnation", kind))


@dataclasses.dataclass(frozen=True)
class Costs(WireMessage):
    """A member's link figures and timings for one epoch of `auto`."""

    kind: ClassVar[str] = "costs"
    job: str
    gen: int
    epoch: int
    alpha_s: float
    beta_s_per_byte: float
    times: dict[TimingGroup, float]
    explore_factor: float

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "times": [
            [name, nbytes, seconds] for (name, nbytes), seconds in self.times.items()]}

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Costs:
        kind = cls.kind
        epoch = _int(fields, "epoch", kind)
        alpha, beta = fields.get("alpha_s"), fields.get("beta_s_per_byte")
        _need(is_seconds(alpha) and is_seconds(beta) and epoch >= 1, kind,
              "epoch must be positive, alpha and beta seconds in [0, 1000)")
        factor = fields.get("explore_factor")
        _need(is_number(factor) and 1 <= factor < 1e6, kind,
              "explore_factor must be a number >= 1", factor)
        return cls(_text(fields, "job", kind), _int(fields, "gen", kind), epoch,
                   float(alpha), float(beta), _timings(fields.get("times")),  # type: ignore[arg-type]
                   float(factor))  # type: ignore[arg-type]


def _timings(value: Any) -> dict[TimingGroup, float]:
    """A costs message's [[algorithm, bytes, seconds], ...]."""
    _need(isinstance(value, list) and len(value) <= MAX_TIMES, "costs",
          f"'times' must be a list of at most {MAX_TIMES} entries")
    times: dict[TimingGroup, float] = {}
    for entry in value:
        _need(isinstance(entry, list) and len(entry) == 3 and entry[0] in ALGORITHM_NAMES
              and is_integer(entry[1]) and entry[1] >= 0 and is_seconds(entry[2])
              and entry[2] > 0, "costs",
              "each timing must be [algorithm, bytes >= 0, seconds in (0, 1000)]", entry)
        times[(entry[0], entry[1])] = float(entry[2])
    return times


#: A typed application message.
Message = (Announce | Withdraw | Slice | Abort | Costs | Unformable | Broke | Formed | Left
           | Drain)

#: Every application kind, by name.
MESSAGES: dict[str, type[Message]] = {
    cls.kind: cls
    for cls in (Announce, Withdraw, Slice, Abort, Costs, Unformable, Broke, Formed, Left,
                Drain)
}
#: The kinds that take a data stream where one is open: a withdrawal follows the
#: sender's slices, so a peer never hears that a daemon left before it has read
#: that daemon's last slices.
STREAM_KINDS: tuple[str, ...] = (Slice.kind, Withdraw.kind)
#: Control kinds, which only matter to a peer that is up: one that is down fails
#: its own collectives, and hears the announcements again when it is back.
CONTROL_KINDS = frozenset({Announce.kind, Withdraw.kind, Abort.kind, Costs.kind,
                           Unformable.kind, Broke.kind, Formed.kind, Left.kind, Drain.kind})


def from_wire(fields: Mapping[str, Any]) -> Message:
    """The typed message of a decoded header; `ProtocolError` on anything malformed."""
    kind = fields.get("kind")
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown peer message kind {_clip(kind)}")
    return cls.from_wire(fields)


# -- link probes -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Probe:
    """A link probe (PING, or BULK with payload frames) or its answer (PONG).

    An ASK names a peer (`about`); its PONG carries `about` back and, when the
    answering daemon's link to that peer is up, `heard_s`: how long ago it
    last heard it (daemon/core/failure_detector.py).  A CUT says why (`why`)
    the sender declared the receiver lost or unreachable.

    A PONG also tells where the answering daemon's data streams listen
    (`data_port`, `data_token`, and `data_host` where the daemon advertises a
    host other than its link's: a NAT or port forward), when it has them, and
    on CURVE links its offer
    to this peer: the public X25519 key (`data_key`, 32 bytes) and the cipher
    it runs fast (`data_cipher`, one of STREAM_CIPHERS); see
    daemon/peers/stream_crypto.py.
    """

    kind: str
    seq: int
    data_port: int | None = None
    data_token: bytes | None = None
    data_key: bytes | None = None
    data_cipher: str | None = None
    data_host: str | None = None
    about: str | None = None
    heard_s: float | None = None
    why: str | None = None

    def to_wire(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"kind": self.kind, "seq": self.seq}
        if self.why is not None:
            fields["why"] = self.why
        if self.about is not None:
            fields["about"] = self.about
            if self.heard_s is not None:
                fields["heard_s"] = self.heard_s
        if self.data_port is not None:
            fields.update(data_port=self.data_port, data_token=self.data_token)
            if self.data_host is not None:
                fields["data_host"] = self.data_host
            if self.data_key is not None:
                fields.update(data_key=self.data_key, data_cipher=self.data_cipher)
        return fields

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> Probe:
        kind = fields.get("kind")
        _need(kind in LINK_KINDS, "probe", "unknown link kind", kind)
        seq = _int(fields, "seq", str(kind))
        about, heard = fields.get("about"), fields.get("heard_s")
        _need(about is None or (isinstance(about, str) and 0 < len(about.encode()) <= 255),
              str(kind), "'about' must be a peer endpoint of 1 to 255 bytes")
        _need(kind != ASK or about is not None, str(kind), "an ask needs 'about'")
        _need(heard is None or (about is not None and is_seconds(heard)), str(kind),
              "'heard_s' must be seconds, with 'about'", heard)
        why = fields.get("why")
        _need((why is None and kind != CUT) or (isinstance(why, str) and len(why) <= MAX_WHY),
              str(kind), "a cut needs 'why', a text of at most 1024 characters")
        port, token = fields.get("data_port"), fields.get("data_token")
        if port is None and token is None:
            return cls(str(kind), seq, about=about,
                       heard_s=None if heard is None else float(heard), why=why)
        _need(is_integer(port) and 0 < port < 65536 and isinstance(token, bytes)
              and 0 < len(token) < 256, str(kind),
              "'data_port' must be a port and 'data_token' 1 to 255 bytes")
        host = fields.get("data_host")
        _need(host is None or (isinstance(host, str) and 0 < len(host.encode()) <= 255
                               and not any(c in host for c in "/;@ []")), str(kind),
              "'data_host' must be a host name or address of 1 to 255 bytes", host)
        key, cipher = fields.get("data_key"), fields.get("data_cipher")
        _need(key is None or (isinstance(key, bytes) and len(key) == 32), str(kind),
              "'data_key' must be 32 bytes")
        _need((key is None and cipher is None) or (key is not None and cipher in STREAM_CIPHERS),
              str(kind), "'data_cipher' must come with 'data_key' and name a stream cipher", cipher)
        return cls(str(kind), seq, int(port), bytes(token),  # type: ignore[arg-type]
                   None if key is None else bytes(key), cipher, host)


# -- checkpoint replicas (daemon/io/checkpoint_peers.py) ----------------------

#: Parts a checkpoint message may list, at most.
MAX_CKPT_PARTS = 2048
#: The longest item name or daemon endpoint a checkpoint message carries (bytes).
MAX_CKPT_NAME = 255
#: A part's size on the wire, at most (bytes).
MAX_CKPT_PART_BYTES = 1 << 44
#: What a `CkptAsk` asks: the parts held, to commit a step, to send a part back.
CKPT_QUESTIONS = ("held", "commit", "pull")

#: (rank, item): one part of a checkpoint, as the client names it.
CkptPart = tuple[int, str]
#: (origin daemon, rank, item): one part, with the daemon its rank put it on.
CkptWhere = tuple[str, int, str]


def _name(value: Any, kind: str, what: str) -> str:
    _need(isinstance(value, str) and 0 < len(value.encode()) <= MAX_CKPT_NAME, kind,
          f"{what} must be a text of 1 to {MAX_CKPT_NAME} bytes", value)
    return str(value)


def _rank(value: Any, kind: str) -> int:
    _need(is_integer(value) and 0 <= value < 1 << 31, kind, "a rank must be in [0, 2**31)",
          value)
    return int(value)


def _ckpt_list(value: Any, kind: str, what: str) -> list[Any]:
    _need(isinstance(value, list) and len(value) <= MAX_CKPT_PARTS, kind,
          f"{what!r} must be a list of at most {MAX_CKPT_PARTS} entries")
    return list(value)


def _ckpt_parts(value: Any, kind: str) -> tuple[CkptPart, ...]:
    """[[rank, item], ...] on the wire."""
    parts = []
    for entry in _ckpt_list(value, kind, "parts"):
        _need(isinstance(entry, list) and len(entry) == 2, kind, "a part is [rank, item]", entry)
        parts.append((_rank(entry[0], kind), _name(entry[1], kind, "an item")))
    return tuple(parts)


def _ckpt_where(value: Any, kind: str) -> CkptWhere:
    _need(isinstance(value, list) and len(value) == 3, kind,
          "a part's place is [origin, rank, item]", value)
    return (_name(value[0], kind, "an origin"), _rank(value[1], kind),
            _name(value[2], kind, "an item"))


def _ckpt_step(fields: Mapping[str, Any], kind: str, allow_any: bool = False) -> int:
    step = _int(fields, "step", kind)
    _need(step >= (-1 if allow_any else 0) and step < 1 << 63, kind,
          "'step' must be a non-negative integer" + (" (or -1: any)" if allow_any else ""), step)
    return step


@dataclasses.dataclass(frozen=True)
class CkptAsk(WireMessage):
    """A question to a peer daemon about a job's checkpoints, answered by one
    `CkptAnswer` with the same `req`: `what` is "held" (the parts and replicas of
    `step` it holds; -1: of every step), "commit" (mark its parts of `step`
    complete; `parts` are all of the step's, on whatever daemon) or "pull"
    (send `part` back as `CkptChunk`s, then answer)."""

    kind: ClassVar[str] = "ckpt_ask"
    job: str
    req: int
    what: str
    step: int
    parts: tuple[CkptPart, ...] = ()
    part: CkptWhere | None = None

    def to_wire(self) -> dict[str, Any]:
        fields = {**super().to_wire(), "parts": [list(p) for p in self.parts]}
        fields["part"] = None if self.part is None else list(self.part)
        return fields

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> CkptAsk:
        kind = cls.kind
        what = fields.get("what")
        _need(what in CKPT_QUESTIONS, kind, f"'what' must be one of {CKPT_QUESTIONS}", what)
        part = fields.get("part")
        _need((part is None) == (what != "pull"), kind, "a pull (alone) names its 'part'")
        return cls(_name(fields.get("job"), kind, "'job'"), _int(fields, "req", kind),
                   str(what), _ckpt_step(fields, kind, allow_any=what == "held"),
                   _ckpt_parts(fields.get("parts"), kind),
                   None if part is None else _ckpt_where(part, kind))


@dataclasses.dataclass(frozen=True)
class CkptHeld:
    """What a daemon holds of one step of a job: whether the step is complete
    (committed), all its parts (once complete), and the parts it holds, each with
    its origin and size (its own ranks' parts have this daemon as origin)."""

    step: int
    complete: bool
    parts: tuple[CkptPart, ...]
    held: tuple[tuple[str, int, str, int], ...]

    def to_wire(self) -> list[Any]:
        return [self.step, self.complete, [list(p) for p in self.parts],
                [list(h) for h in self.held]]

    @classmethod
    def from_wire(cls, value: Any) -> CkptHeld:
        kind = CkptAnswer.kind
        _need(isinstance(value, list) and len(value) == 4 and isinstance(value[1], bool)
              and is_integer(value[0]) and 0 <= value[0] < 1 << 63, kind,
              "a holding is [step, complete, parts, held]", value)
        held = []
        for entry in _ckpt_list(value[3], kind, "held"):
            _need(isinstance(entry, list) and len(entry) == 4 and is_integer(entry[3])
                  and 0 <= entry[3] <= MAX_CKPT_PART_BYTES, kind,
                  "a held part is [origin, rank, item, bytes]", entry)
            held.append((*_ckpt_where(entry[:3], kind), int(entry[3])))
        return cls(int(value[0]), value[1], _ckpt_parts(value[2], kind), tuple(held))


@dataclasses.dataclass(frozen=True)
class CkptAnswer(WireMessage):
    """The answer to a `CkptAsk` (or to a pushed replica: `req` is the push's):
    whether it went well, why not, and for "held" what the daemon holds."""

    kind: ClassVar[str] = "ckpt_answer"
    job: str
    req: int
    ok: bool
    error: str = ""
    held: tuple[CkptHeld, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        return {**super().to_wire(), "held": [h.to_wire() for h in self.held]}

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> CkptAnswer:
        kind = cls.kind
        ok, error = fields.get("ok"), fields.get("error")
        _need(isinstance(ok, bool), kind, "'ok' must be a boolean")
        _need(isinstance(error, str) and len(error) <= MAX_WHY, kind,
              f"'error' must be a text of at most {MAX_WHY} characters")
        held = _ckpt_list(fields.get("held"), kind, "held")
        return cls(_name(fields.get("job"), kind, "'job'"), _int(fields, "req", kind),
                   bool(ok), str(error), tuple(CkptHeld.from_wire(h) for h in held))


@dataclasses.dataclass(frozen=True)
class CkptChunk(WireMessage):
    """The header of one chunk of a checkpoint part (its bytes follow as the one
    payload): bytes [off, off + payload) of the part (rank, item) of `step` that
    its rank put on daemon `origin`, `nbytes` in all.  `pull`: an answer to our
    "pull" `req`; else a replica pushed to us, answered once whole (or dropped)."""

    kind: ClassVar[str] = "ckpt_chunk"
    job: str
    req: int
    pull: bool
    step: int
    origin: str
    rank: int
    item: str
    nbytes: int
    off: int

    @classmethod
    def from_wire(cls, fields: Mapping[str, Any]) -> CkptChunk:
        kind = cls.kind
        pull, nbytes, off = fields.get("pull"), fields.get("nbytes"), fields.get("off")
        _need(isinstance(pull, bool), kind, "'pull' must be a boolean")
        _need(is_integer(nbytes) and 0 < nbytes <= MAX_CKPT_PART_BYTES and is_integer(off)
              and 0 <= off < nbytes, kind, "'off' must lie in [0, nbytes), nbytes in (0, 2**44]")
        return cls(_name(fields.get("job"), kind, "'job'"), _int(fields, "req", kind),
                   bool(pull), _ckpt_step(fields, kind),
                   _name(fields.get("origin"), kind, "'origin'"),
                   _rank(fields.get("rank"), kind), _name(fields.get("item"), kind, "'item'"),
                   int(nbytes), int(off))  # type: ignore[arg-type]


CkptMessage = CkptAsk | CkptAnswer | CkptChunk
#: The checkpoint kinds, by name (routed apart from the collectives' `MESSAGES`).
CKPT_MESSAGES: dict[str, type[CkptAsk | CkptAnswer | CkptChunk]] = {
    cls.kind: cls for cls in (CkptAsk, CkptAnswer, CkptChunk)
}


def ckpt_from_wire(fields: Mapping[str, Any]) -> CkptMessage:
    """The typed checkpoint message of a decoded header; `ProtocolError` if malformed."""
    kind = fields.get("kind")
    cls = CKPT_MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown checkpoint message kind {_clip(kind)}")
    return cls.from_wire(fields)
