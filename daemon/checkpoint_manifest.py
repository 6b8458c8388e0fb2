"""The checkpoints' manifest: what a restarted daemon takes over (issue 50, part 4).

A daemon that holds complete checkpoints keeps a small msgpack file in /dev/shm
beside their segments: its pid, uid and socket, and per checkpoint the job, the
step, the commit time (Unix seconds) and each part's (rank, item, segment name,
size), which is all `ckpt_open` answers.  It is rewritten (a temporary file, then
a rename) on every commit, which is also where older ones are pruned.

Naming: one manifest per daemon *identity*, and the identity is the client
socket path.  A restarted daemon is one started on the same socket (the
socket's lock file lets one daemon serve it at a time); several daemons of one
user on one node (tests, the torch backend's per-job daemons) have different
sockets and so different manifests:
`/dev/shm/gradsync-checkpoints-<uid>-<sha256 of the socket path>`.  A fixed
per-uid name would make every daemon of the user race for the same file.

Trust: only a regular file (no symlink) owned by the daemon's own user, that
names that user and decodes strictly (no pickle; bounded sizes; every field
checked), is believed; anything else is warned about, removed and ignored.
The segments it lists are checked again when taken over (regular files of the
same user, exactly the listed size).

Sparing: a starting daemon's sweep of dead daemons' segments leaves those that
a dead daemon's manifest lists while that daemon's socket lock file exists (a
daemon may come back there).  Once the lock file is gone (the socket's folder
was removed) the manifest is an orphan: removed, and its segments swept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import re
from collections.abc import Callable, Iterable
from typing import Any

import msgpack

from gradsync.daemon.backends.shm_pool import owned_regular_file, pid_alive
from gradsync.protocol.codec import is_integer, is_number
from gradsync.protocol.requests import MAX_JOB_NAME_CHARS
from gradsync.protocol.shm import SHM_DIR, owner_pid

log = logging.getLogger("gradsync.daemon.checkpoints")

MANIFEST_PREFIX = "gradsync-checkpoints-"
MANIFEST_VERSION = 1
#: Far above any real manifest (about 100 bytes a part); a bigger file is not one of ours.
MAX_MANIFEST_BYTES = 16 * 1024**2
_MAX_ITEMS = 1 << 20
_MANIFEST_NAME = re.compile(r"^gradsync-checkpoints-(\d+)-[0-9a-f]{32}$")
#: A manifest being written (`write_manifest`): the writer's pid, before the rename.
_TEMPORARY_NAME = re.compile(r"^gradsync-checkpoints-(\d+)-[0-9a-f]{32}\.(\d+)\.tmp$")


class ManifestError(ValueError):
    """A manifest file that cannot be believed; the message says why."""


@dataclasses.dataclass(frozen=True)
class SavedPart:
    """One part of a complete checkpoint: (rank, item) in segment `name`."""

    rank: int
    item: str
    name: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class SavedCheckpoint:
    """A complete checkpoint as the manifest lists it."""

    job: str
    step: int
    committed_unix: float
    parts: tuple[SavedPart, ...]
    #: The step's parts that other daemons hold (a job on several nodes): (rank, item).
    elsewhere: tuple[tuple[int, str], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def describe(self) -> str:
        return f"checkpoint step {self.step} of job {self.job!r}"


@dataclasses.dataclass(frozen=True)
class Manifest:
    """A daemon's complete checkpoints, and who that daemon was."""

    pid: int
    uid: int
    socket: str
    checkpoints: tuple[SavedCheckpoint, ...]


def manifest_name(socket_path: str, uid: int | None = None) -> str:
    """The manifest's file name for the daemon on `socket_path` (see the module doc)."""
    digest = hashlib.sha256(os.path.abspath(socket_path).encode()).hexdigest()[:32]
    return f"{MANIFEST_PREFIX}{os.getuid() if uid is None else uid}-{digest}"


def encode(manifest: Manifest) -> bytes:
    return msgpack.packb({
        "v": MANIFEST_VERSION, "pid": manifest.pid, "uid": manifest.uid,
        "socket": manifest.socket,
        "checkpoints": [
            {"job": c.job, "step": c.step, "committed": c.committed_unix,
             "parts": [[p.rank, p.item, p.name, p.nbytes] for p in c.parts],
             **({"elsewhere": [list(e) for e in c.elsewhere]} if c.elsewhere else {})}
            for c in manifest.checkpoints],
    }, use_bin_type=True)


def decode(data: bytes) -> Manifest:
    """The manifest in `data`, checked field by field; `ManifestError` if it is not one."""
    try:
        body = msgpack.unpackb(
            data, raw=False, strict_map_key=True, use_list=True, max_str_len=64 * 1024,
            max_bin_len=0, max_ext_len=0, max_array_len=_MAX_ITEMS, max_map_len=16)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ManifestError(f"not msgpack ({type(exc).__name__}: {exc})") from None
    if _field(body, "v", int) != MANIFEST_VERSION:
        raise ManifestError(f"version {body['v']}, not {MANIFEST_VERSION}")
    checkpoints = tuple(_checkpoint(entry) for entry in _field(body, "checkpoints", list))
    _unique([part.name for checkpoint in checkpoints for part in checkpoint.parts], "a segment")
    _unique([(checkpoint.job, checkpoint.step) for checkpoint in checkpoints], "a checkpoint")
    for checkpoint in checkpoints:
        _unique([(part.rank, part.item) for part in checkpoint.parts], "a part")
    return Manifest(_natural(body, "pid"), _natural(body, "uid"), _field(body, "socket", str),
                    checkpoints)


def _unique(keys: list[Any], what: str) -> None:
    if len(set(keys)) != len(keys):
        raise ManifestError(f"{what} is listed twice")


#: Type checks that refuse a bool where a number is due.
_CHECKS: dict[type, Callable[[Any], bool]] = {int: is_integer, float: is_number}


def _field(record: Any, key: str, kind: type) -> Any:
    if not isinstance(record, dict) or key not in record:
        raise ManifestError(f"no {key!r} in {str(record)[:80]}")
    value = record[key]
    check = _CHECKS.get(kind, lambda value: isinstance(value, kind))
    if not check(value):
        raise ManifestError(f"{key!r} is {value!r:.80}, not {kind.__name__}")
    return value


def _natural(record: Any, key: str) -> int:
    value: int = _field(record, key, int)
    if value < 0:
        raise ManifestError(f"{key!r} is negative: {value}")
    return value


def _checkpoint(entry: Any) -> SavedCheckpoint:
    job: str = _field(entry, "job", str)
    if not 0 < len(job) <= MAX_JOB_NAME_CHARS:
        raise ManifestError(f"job name {job!r:.80} has a bad length")
    parts = tuple(_part(part) for part in _field(entry, "parts", list))
    if not parts:
        raise ManifestError(f"checkpoint of job {job!r} has no parts")
    elsewhere = entry.get("elsewhere", [])
    if not (isinstance(elsewhere, list) and all(
            isinstance(e, list) and len(e) == 2 and is_integer(e[0]) and e[0] >= 0
            and isinstance(e[1], str) for e in elsewhere)):
        raise ManifestError(f"checkpoint of job {job!r}: 'elsewhere' is not [[rank, item], ...]")
    return SavedCheckpoint(job, _natural(entry, "step"), float(_field(entry, "committed", float)),
                           parts, tuple((int(e[0]), str(e[1])) for e in elsewhere))


def _part(part: Any) -> SavedPart:
    if not (isinstance(part, list) and len(part) == 4 and is_integer(part[0])
            and part[0] >= 0 and isinstance(part[1], str) and isinstance(part[2], str)
            and is_integer(part[3]) and part[3] > 0):
        raise ManifestError(f"part {part!r:.80} is not [rank, item, segment, bytes]")
    if owner_pid(part[2]) is None:  # also keeps the name inside /dev/shm
        raise ManifestError(f"{part[2]!r:.80} is not a gradsync segment name")
    return SavedPart(*part)


# -- the file ----------------------------------------------------------------


def read_manifest(path: str) -> Manifest | None:
    """The manifest at `path` (None where there is none); `ManifestError` where the
    file is not a regular file of this user, is too big, or does not decode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ManifestError(f"cannot open it: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not owned_regular_file(info):
            raise ManifestError(f"not a regular file of uid {os.getuid()} "
                                f"(owner uid {info.st_uid})")
        if info.st_size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{info.st_size} bytes, above {MAX_MANIFEST_BYTES}")
        data = os.pread(fd, MAX_MANIFEST_BYTES + 1, 0)
    finally:
        os.close(fd)
    manifest = decode(data)
    if manifest.uid != os.getuid():
        raise ManifestError(f"written for uid {manifest.uid}, not {os.getuid()}")
    return manifest


def write_manifest(manifest: Manifest, path: str) -> None:
    """Replace the manifest at `path` atomically (a temporary file, then a rename)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # left by a crash in this very spot
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(encode(manifest))
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def remove_file(path: str) -> None:
    """Unlink if there (and if allowed: another user's file in /dev/shm is not)."""
    with contextlib.suppress(OSError):
        os.unlink(path)


# -- taking over ---------------------------------------------------------------


@dataclasses.dataclass
class Adoption:
    """What to take over of a dead daemon's checkpoints, and what to drop (with why)."""

    adopt: list[SavedCheckpoint] = dataclasses.field(default_factory=list)
    dropped: list[tuple[SavedCheckpoint, str]] = dataclasses.field(default_factory=list)


def plan_adoption(manifest: Manifest, size_of: Callable[[str], int | None],
                  budget: int) -> Adoption:
    """Whole checkpoints, newest commit first: one with a part missing or of another
    size is dropped (never a torn one), and so is one beyond `budget` bytes."""
    plan = Adoption()
    used = 0
    for checkpoint in sorted(manifest.checkpoints, key=lambda c: c.committed_unix,
                             reverse=True):
        wrong = [p.name for p in checkpoint.parts if size_of(p.name) != p.nbytes]
        if wrong:
            plan.dropped.append((checkpoint, f"segments missing or resized: {wrong[:4]}"))
        elif used + checkpoint.nbytes > budget:
            plan.dropped.append((checkpoint, (
                f"its {checkpoint.nbytes} bytes do not fit in max_shm_bytes "
                f"({budget - used} bytes left); raise --max-shm-bytes")))
        else:
            plan.adopt.append(checkpoint)
            used += checkpoint.nbytes
    return plan


def segment_size(shm_dir: str = SHM_DIR) -> Callable[[str], int | None]:
    """The size of a segment that is a regular file of this user, else None."""
    def size_of(name: str) -> int | None:
        try:
            info = os.stat(os.path.join(shm_dir, name), follow_symlinks=False)
        except OSError:
            return None
        return info.st_size if owned_regular_file(info) else None
    return size_of


def remove_segments(names: Iterable[str], shm_dir: str = SHM_DIR) -> None:
    """Unlink segments of checkpoints that are dropped (those still there)."""
    for name in names:
        remove_file(os.path.join(shm_dir, name))


def load_or_warn(path: str) -> Manifest | None:
    """The manifest at `path`; a bad one is warned about (naming the file), removed,
    and taken as none."""
    try:
        return read_manifest(path)
    except (ManifestError, OSError) as exc:
        log.warning("ignoring the checkpoint manifest %s: %s", path, exc)
        remove_file(path)
        return None


def spared_segments(shm_dir: str = SHM_DIR) -> set[str]:
    """Segments the start-up sweep must leave: those of the user's manifests whose
    daemon runs, or is dead but may come back (its socket lock file exists).
    Orphaned manifests, and ones whose writer died writing them, are removed."""
    spared: set[str] = set()
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return spared
    for name in names:
        path = os.path.join(shm_dir, name)
        temporary = _TEMPORARY_NAME.match(name)
        if temporary and int(temporary.group(1)) == os.getuid() \
                and not pid_alive(int(temporary.group(2))):
            remove_file(path)  # its writer died in the middle of writing it
        match = _MANIFEST_NAME.match(name)
        if match is None or int(match.group(1)) != os.getuid():
            continue
        manifest = load_or_warn(path)
        if manifest is None:
            continue
        if not pid_alive(manifest.pid) and not os.path.exists(manifest.socket + ".lock"):
            log.info("removing the checkpoint manifest %s of pid %d: its socket %s is gone",
                     path, manifest.pid, manifest.socket)
            remove_file(path)
            continue
        spared.update(part.name for c in manifest.checkpoints for part in c.parts)
    return spared


@dataclasses.dataclass(frozen=True)
class ManifestFile:
    """The manifest of the daemon on `socket`: where it is, writing and reading it."""

    socket: str
    shm_dir: str = SHM_DIR

    @property
    def path(self) -> str:
        return os.path.join(self.shm_dir, manifest_name(self.socket))

    def write(self, checkpoints: tuple[SavedCheckpoint, ...]) -> None:
        """List `checkpoints` (none: no file); a failure is logged, never raised, as
        it costs only the takeover after a crash."""
        try:
            if checkpoints:
                write_manifest(Manifest(os.getpid(), os.getuid(), self.socket, checkpoints),
                               self.path)
            else:
                remove_file(self.path)
        except OSError as exc:
            log.warning("cannot write the checkpoint manifest %s: %s", self.path, exc)

    def load(self) -> Manifest | None:
        return load_or_warn(self.path)

    def remove(self) -> None:
        remove_file(self.path)
