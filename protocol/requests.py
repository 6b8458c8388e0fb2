"""The client wire, typed: one frozen dataclass per request, checked in one place.

`messages.decode_request` checks a request's envelope and field types against
each class's `SCHEMA` (a bad one is a `ProtocolError`, counted as malformed);
`parse_request` then turns it into its dataclass, whose `from_wire` checks
every value that needs no daemon state (ranges, names, the collective and its
reduction) and raises `InvalidArgumentError` naming the field.  What depends
on the daemon (a job's world size, the segments a client may use, its limits)
the daemon checks where it holds that state (io/service.py, core/collectives/).

The bytes are those of protocol v3: every request is a map with `v`, `id`,
`kind` and the fields below; `allreduce` and `collective` are one family,
`Collective`, whose kind says which collective it is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from gradsync.protocol.algorithm_names import ALGORITHM_CHOICES
from gradsync.protocol.errors import InvalidArgumentError
from gradsync.protocol.version import PROTOCOL_VERSION

if TYPE_CHECKING:  # protocol/dtypes.py imports numpy: `gradsync --help` must not
    from gradsync.protocol.dtypes import ReduceOp

_NONE = type(None)
_KEY_TYPES: tuple[type, ...] = (int, str)

#: field -> (accepted types, required); `bool` is never an int here.
Schema = dict[str, tuple[tuple[type, ...], bool]]

MAX_LOCAL_RANKS = 1024
MAX_WORLD_SIZE = 1 << 20
MAX_JOB_NAME_CHARS = 128

ALLREDUCE = "allreduce"
#: The collectives a `collective` request names.
COLLECTIVES = frozenset({
    ALLREDUCE, "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
    "all_to_all",
})
#: Collectives that take a reduction.
REDUCING = frozenset({ALLREDUCE, "reduce", "reduce_scatter"})
#: Collectives that take a root rank.
ROOTED = frozenset({"broadcast", "reduce", "gather", "scatter"})


def clip(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: echoing user input must stay small."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclasses.dataclass(frozen=True)
class Hello:
    """The first request of a session: who the client is in which job."""

    kind: ClassVar[str] = "hello"
    SCHEMA: ClassVar[Schema] = {
        "job": ((str,), True),
        "rank": ((int,), True),
        "world_size": ((int,), True),
        "local_rank": ((int,), True),
        "local_world_size": ((int,), True),
        "pid": ((int,), True),
    }

    job: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    pid: int

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Hello:
        job, rank = message["job"], message["rank"]
        world, local_world = message["world_size"], message["local_world_size"]
        local_rank = message["local_rank"]
        if not job or len(job) > MAX_JOB_NAME_CHARS:
            raise InvalidArgumentError(
                f"job name must have 1 to {MAX_JOB_NAME_CHARS} characters")
        if local_world > MAX_LOCAL_RANKS or world > MAX_WORLD_SIZE:
            raise InvalidArgumentError(
                f"at most {MAX_LOCAL_RANKS} ranks per daemon and {MAX_WORLD_SIZE} in a job, "
                f"got local_world_size={local_world}, world_size={world}"
            )
        if not (0 < local_world <= world):
            raise InvalidArgumentError(
                f"need 0 < local_world_size <= world_size, got {local_world} and {world}"
            )
        if not (0 <= rank < world) or not (0 <= local_rank < local_world):
            raise InvalidArgumentError(
                f"rank {rank} / local_rank {local_rank} out of range for "
                f"world_size {world} / local_world_size {local_world}"
            )
        return cls(job, rank, world, local_rank, local_world, message["pid"])


@dataclasses.dataclass(frozen=True)
class _NoFields:
    """A request that is its kind alone."""

    kind: ClassVar[str]
    SCHEMA: ClassVar[Schema] = {}

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Any:
        return cls()


@dataclasses.dataclass(frozen=True)
class Ping(_NoFields):
    """Is the daemon there, and who is it (its identity in the reply)."""

    kind: ClassVar[str] = "ping"


@dataclasses.dataclass(frozen=True)
class Bye(_NoFields):
    """The client leaves on purpose (no reply): its job ends cleanly."""

    kind: ClassVar[str] = "bye"


@dataclasses.dataclass(frozen=True)
class GroupInfo(_NoFields):
    """Which ranks of the caller's job are connected (to size a sub-group)."""

    kind: ClassVar[str] = "group_info"


@dataclasses.dataclass(frozen=True)
class Alloc:
    """A buffer of the daemon's: host shared memory, or device memory on `device`."""

    kind: ClassVar[str] = "alloc"
    SCHEMA: ClassVar[Schema] = {
        "nbytes": ((int,), True),
        # A CUDA device ordinal for device memory (None: host shared memory), and
        # the client's interprocess event handle for the slab.
        "device": ((int, _NONE), False),
        "event": ((bytes, _NONE), False),
    }

    nbytes: int
    device: int | None = None
    event: bytes | None = None

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Alloc:
        nbytes = message["nbytes"]
        if nbytes <= 0:
            raise InvalidArgumentError(f"alloc needs a positive size, got {nbytes}")
        return cls(nbytes, message.get("device"), message.get("event"))


@dataclasses.dataclass(frozen=True)
class Free:
    """Give back a segment the client holds."""

    kind: ClassVar[str] = "free"
    SCHEMA: ClassVar[Schema] = {"segment": ((int,), True)}

    segment: int

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Free:
        return cls(message["segment"])


@dataclasses.dataclass(frozen=True)
class Attach:
    """Map memory the client already shares (a descriptor of its own, by number): a
    torch storage moved to shared memory becomes a segment, so it needs no staging."""

    kind: ClassVar[str] = "attach"
    SCHEMA: ClassVar[Schema] = {"fd": ((int,), True), "nbytes": ((int,), True)}

    fd: int
    nbytes: int

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Attach:
        # fd and size are judged after who asks (io/service.py): a client the daemon
        # refuses learns that first, whatever it sent.
        return cls(message["fd"], message["nbytes"])


_COLLECTIVE_SCHEMA: Schema = {
    "collective": ((str,), True),
    "key": (_KEY_TYPES, True),
    "segment": ((int, _NONE), True),
    "offset": ((int,), True),
    "count": ((int,), True),
    "out_segment": ((int, _NONE), False),
    "out_offset": ((int,), False),
    "out_count": ((int, _NONE), False),
    "dtype": ((str,), True),
    "op": ((str, _NONE), False),
    "root": ((int, _NONE), False),
    "timeout_s": ((float, int, _NONE), False),
    # allreduce only: the algorithm asked for, and the seconds this rank already
    # waited for the key on the shared-memory fast path (protocol/fast_path.py)
    # before it came here: its deadline counts from then.
    "algorithm": ((str, _NONE), False),
    "waited_s": ((float, int, _NONE), False),
    # allreduce and reduce_scatter (protocol/compression.py); sent only when set.
    "compression": ((str, _NONE), False),
    "error_feedback": ((bool,), False),
}

#: Fields only an allreduce may carry.
_ALLREDUCE_ONLY = ("algorithm", "waited_s")
#: Fields an allreduce (in place) must not carry; a root, like any collective
#: without one, it ignores.
_NOT_FOR_ALLREDUCE = ("out_segment", "out_count")


@dataclasses.dataclass(frozen=True)
class Collective:
    """Any collective: its kind, key, where its input (and output) lie, what
    reduces it, and how long to wait.  On the wire every collective is one
    `collective` request that names its kind (since PROTOCOL_VERSION 4; an
    allreduce had a request kind of its own before)."""

    kind: ClassVar[str] = "collective"
    SCHEMA: ClassVar[Schema] = _COLLECTIVE_SCHEMA

    collective: str
    key: int | str
    segment: int | None
    offset: int
    count: int
    dtype: str
    op: ReduceOp | None = None
    root: int | None = None
    out_segment: int | None = None
    out_offset: int = 0
    out_count: int | None = None
    #: None: the daemon's collective_timeout_s.
    timeout_s: float | None = None
    #: allreduce only: the algorithm asked for (None: the daemon's choice).
    algorithm: str | None = None
    #: allreduce only: seconds already waited for this key on the fast path.
    waited_s: float = 0.0
    #: allreduce and reduce_scatter: the wire format between daemons (None: exact),
    #: and whether each daemon feeds its rounding residual into the next call.
    compression: str | None = None
    error_feedback: bool = False

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> Collective:
        from gradsync.protocol.compression import check_compressible, parse_compression
        from gradsync.protocol.dtypes import DTYPES, check_op_for_dtype, parse_reduce_op

        collective = message["collective"]
        if collective not in COLLECTIVES:
            raise InvalidArgumentError(
                f"unknown collective {clip(collective)}; expected one of "
                f"{', '.join(sorted(COLLECTIVES))}"
            )
        _check_fields_of(collective, message)
        dtype = message["dtype"]
        if dtype not in DTYPES:
            raise InvalidArgumentError(
                f"unsupported dtype {clip(dtype)}; supported: {', '.join(DTYPES)}"
            )
        op = None
        if collective in REDUCING:
            try:
                op = parse_reduce_op(message.get("op") or "")
                check_op_for_dtype(op, dtype)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
        algorithm = message.get("algorithm")
        if algorithm is not None and algorithm not in ALGORITHM_CHOICES:
            raise InvalidArgumentError(
                f"unknown algorithm {clip(algorithm)}; expected one of "
                f"{', '.join(ALGORITHM_CHOICES)}"
            )
        compression = parse_compression(message.get("compression"))
        error_feedback = bool(message.get("error_feedback", False))
        check_compressible(compression, collective, dtype, op.value if op else None,
                           error_feedback)
        out_count = message.get("out_count")
        buffers = [(message["count"], message["offset"])]
        if out_count is not None:
            buffers.append((out_count, message.get("out_offset", 0)))
        for count, offset in buffers:
            if count < 0 or offset < 0:
                raise InvalidArgumentError(f"negative count {count} or offset {offset}")
        timeout_s = message.get("timeout_s") or None
        if timeout_s is not None and not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise InvalidArgumentError(f"timeout_s must be positive and finite, got {timeout_s}")
        waited_s = message.get("waited_s") or 0.0
        if not (waited_s >= 0 and math.isfinite(waited_s)):
            raise InvalidArgumentError(f"waited_s must be >= 0 and finite, got {waited_s}")
        return cls(
            collective, message["key"], message["segment"], message["offset"],
            message["count"], dtype, op, message.get("root") if collective in ROOTED else None,
            message.get("out_segment"), message.get("out_offset", 0), out_count,
            None if timeout_s is None else float(timeout_s), algorithm, float(waited_s),
            compression, error_feedback,
        )

    def to_wire(self, request_id: int) -> dict[str, Any]:
        """The request as the client sends it: the fields its kind uses."""
        message: dict[str, Any] = {
            "v": PROTOCOL_VERSION, "id": request_id, "kind": self.kind,
            "collective": self.collective, "key": self.key, "segment": self.segment,
            "offset": self.offset, "count": self.count, "dtype": self.dtype,
            "op": self.op.value if self.op else None, "timeout_s": self.timeout_s,
        }
        if self.collective == ALLREDUCE:
            message["op"] = message["op"] or "sum"
            message["algorithm"] = self.algorithm
            if self.waited_s:
                message["waited_s"] = self.waited_s
        else:
            message.update(out_segment=self.out_segment, out_offset=self.out_offset,
                           out_count=self.out_count, root=self.root)
        return {**message, **self._compression_fields()}

    def _compression_fields(self) -> dict[str, Any]:
        if self.compression is None:
            return {}
        return {"compression": self.compression, "error_feedback": self.error_feedback}


MAX_CHECKPOINT_ITEM_CHARS = 64
#: A client that only stores rank R's checkpoints of job J joins a job of its own,
#: `checkpoint:J#R` (world size 1: a rank lost elsewhere never breaks it, and a
#: replacement rank joins at once); it and the ranks of J itself may use J's
#: checkpoints, no other job may.
CHECKPOINT_JOB_PREFIX = "checkpoint:"


def checkpoint_session_job(job: str, rank: int) -> str:
    """The job of a session that stores rank `rank`'s checkpoints of `job`."""
    return f"{CHECKPOINT_JOB_PREFIX}{job}#{rank}"


def parse_checkpoint_session_job(name: str) -> tuple[str, int] | None:
    """(job, rank) of a `checkpoint_session_job` name, None for any other job."""
    if not name.startswith(CHECKPOINT_JOB_PREFIX):
        return None
    job, _, rank = name.removeprefix(CHECKPOINT_JOB_PREFIX).rpartition("#")
    return (job, int(rank)) if job and rank.isdigit() else None
MAX_CHECKPOINT_STEP = (1 << 63) - 1


def _checkpoint_job(message: dict[str, Any]) -> str:
    job = message["job"]
    if not job or len(job) > MAX_JOB_NAME_CHARS:
        raise InvalidArgumentError(f"job name must have 1 to {MAX_JOB_NAME_CHARS} characters")
    return str(job)


def _checkpoint_step(step: Any, kind: str) -> int:
    if not 0 <= step <= MAX_CHECKPOINT_STEP:
        raise InvalidArgumentError(f"{kind}: step must be in [0, 2**63), got {clip(step)}")
    return int(step)


@dataclasses.dataclass(frozen=True)
class CheckpointPut:
    """A daemon-owned segment for one part (`item`) of the caller's rank in checkpoint
    `step` of `job`: it outlives the client, and counts only once committed."""

    kind: ClassVar[str] = "ckpt_put"
    SCHEMA: ClassVar[Schema] = {
        "job": ((str,), True), "step": ((int,), True), "item": ((str,), True),
        "nbytes": ((int,), True),
    }

    job: str
    step: int
    item: str
    nbytes: int

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> CheckpointPut:
        item, nbytes = message["item"], message["nbytes"]
        if not item or len(item) > MAX_CHECKPOINT_ITEM_CHARS or not item.isprintable():
            raise InvalidArgumentError(
                f"ckpt_put: item must be 1 to {MAX_CHECKPOINT_ITEM_CHARS} printable "
                f"characters, got {clip(item)}")
        if nbytes <= 0:
            raise InvalidArgumentError(f"ckpt_put needs a positive size, got {nbytes}")
        return cls(_checkpoint_job(message), _checkpoint_step(message["step"], cls.kind),
                   item, nbytes)


@dataclasses.dataclass(frozen=True)
class CheckpointCommit:
    """Mark checkpoint `step` of `job` complete: every part named in `parts`
    ([rank, item] pairs) must have been put.  Only then can it be opened."""

    kind: ClassVar[str] = "ckpt_commit"
    SCHEMA: ClassVar[Schema] = {
        "job": ((str,), True), "step": ((int,), True), "parts": ((list,), True),
    }

    job: str
    step: int
    parts: tuple[tuple[int, str], ...]

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> CheckpointCommit:
        parts = []
        for part in message["parts"]:
            if not (isinstance(part, list) and len(part) == 2 and type(part[0]) is int
                    and part[0] >= 0 and isinstance(part[1], str)):
                raise InvalidArgumentError(
                    f"ckpt_commit: each part must be [rank, item], got {clip(part)}")
            parts.append((part[0], part[1]))
        if not parts:
            raise InvalidArgumentError("ckpt_commit needs at least one part")
        return cls(_checkpoint_job(message), _checkpoint_step(message["step"], cls.kind),
                   tuple(parts))


@dataclasses.dataclass(frozen=True)
class CheckpointList:
    """The complete checkpoints of `job` this daemon holds, newest first."""

    kind: ClassVar[str] = "ckpt_list"
    SCHEMA: ClassVar[Schema] = {"job": ((str,), True)}

    job: str

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> CheckpointList:
        return cls(_checkpoint_job(message))


@dataclasses.dataclass(frozen=True)
class CheckpointOpen:
    """The segments of complete checkpoint `step` of `job` (None: the newest)."""

    kind: ClassVar[str] = "ckpt_open"
    SCHEMA: ClassVar[Schema] = {"job": ((str,), True), "step": ((int, _NONE), False)}

    job: str
    step: int | None = None

    @classmethod
    def from_wire(cls, message: dict[str, Any]) -> CheckpointOpen:
        step = message.get("step")
        return cls(_checkpoint_job(message),
                   None if step is None else _checkpoint_step(step, cls.kind))


Request = (Hello | Ping | Bye | GroupInfo | Alloc | Free | Attach | Collective | CheckpointPut
           | CheckpointCommit | CheckpointList | CheckpointOpen)

#: Every request kind's class.
REQUEST_TYPES: dict[str, type[Request]] = {
    cls.kind: cls for cls in (Hello, Ping, Bye, Alloc, Free, Attach, GroupInfo, Collective,
                              CheckpointPut, CheckpointCommit, CheckpointList, CheckpointOpen)
}

#: kind -> field -> (accepted types, required): what `messages.decode_request` checks.
REQUEST_SCHEMAS: dict[str, Schema] = {kind: cls.SCHEMA for kind, cls in REQUEST_TYPES.items()}


def _check_fields_of(collective: str, message: dict[str, Any]) -> None:
    """Refuse a field the schema allows but this kind of collective has no use for."""
    if collective == ALLREDUCE:
        misplaced = [f for f in _NOT_FOR_ALLREDUCE if message.get(f) is not None]
        why = "an allreduce works in place"
    else:
        misplaced = [f for f in _ALLREDUCE_ONLY if message.get(f) is not None]
        why = "only an allreduce takes them"
    if misplaced:
        raise InvalidArgumentError(f"{collective} request has {', '.join(misplaced)}: {why}")


def parse_request(message: dict[str, Any]) -> Request:
    """The typed request of a message `messages.decode_request` accepted; raises
    `InvalidArgumentError` for a value out of its range."""
    return REQUEST_TYPES[message["kind"]].from_wire(message)
