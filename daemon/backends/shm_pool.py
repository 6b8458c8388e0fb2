"""The daemon's shared-memory segments: create, account, unlink, sweep.

Only the daemon creates segments (`O_CREAT | O_EXCL`, mode 0600, a random tag in
the name so that no other local user can take the names first).  Space is
reserved with `posix_fallocate`, so a full /dev/shm is an error at allocation
time instead of a SIGBUS when a page is first touched.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import gc
import itertools
import logging
import mmap
import os
import secrets
import stat
import threading
import weakref
from collections.abc import Callable, Set
from typing import TypeVar

import numpy as np

from gradsync.protocol.errors import ShmExhaustedError
from gradsync.protocol.shm import SEGMENT_PREFIX, SHM_DIR, owner_pid, segment_name, segment_path

log = logging.getLogger("gradsync.daemon.shm")

_PAGE = mmap.PAGESIZE
#: Random bytes in a segment name's tag (base64url in the name), and how often to redraw.
_TAG_BYTES = 12
_CREATE_ATTEMPTS = 8
_T = TypeVar("_T")


@dataclasses.dataclass
class Segment:
    """One mapped segment, as the daemon sees it."""

    segment_id: int
    name: str
    nbytes: int
    mapping: mmap.mmap
    owner: str  # who asked for it, for error messages and stats
    #: Memory a client shares and the daemon only maps (`attach`): never unlinked here,
    #: and not counted against the budget (the client's own memory).
    attached: bool = False

    def view(self, offset: int, count: int, dtype: np.dtype) -> np.ndarray:
        """A typed view of `count` elements at `offset` (bounds checked by caller)."""
        return np.frombuffer(self.mapping, dtype=dtype, count=count, offset=offset)


class ShmPool:
    """All segments of one daemon, with a byte budget."""

    def __init__(self, max_bytes: int, shm_dir: str = SHM_DIR, mode: int = 0o600) -> None:
        self.max_bytes = max_bytes
        self.mode = mode
        self.shm_dir = shm_dir
        self._own_bytes = 0
        #: Bytes of released segments still mapped because views of them live on
        #: (a collective still running over them); they count as in use until unmapped.
        self._lingering = 0
        self._lingering_lock = threading.Lock()
        #: Bytes of client memory mapped by `attach`.
        self.attached = 0
        self._ids = itertools.count(1)
        self._segments: dict[int, Segment] = {}
        self._pid = os.getpid()
        self._reclaim: Callable[[], bool] | None = None

    def on_exhausted(self, reclaim: Callable[[], bool]) -> None:
        """Have `reclaim` called when an allocation does not fit (the budget, or
        /dev/shm): it releases segments that are only nice to have (the checkpoints'
        spares) and says whether it released any; then the allocation is checked again."""
        self._reclaim = reclaim

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def in_use(self) -> int:
        """Bytes of segments mapped here: live ones and released ones still in use."""
        return self._own_bytes + self._lingering

    def get(self, segment_id: int) -> Segment | None:
        return self._segments.get(segment_id)

    def allocate(self, nbytes: int, owner: str, segment_id: int | None = None) -> Segment:
        """Create, reserve and map a new segment of at least `nbytes` bytes.

        `segment_id` is the caller's number for it (the daemon numbers slabs of
        every backend from one counter); by default the pool numbers its own.
        """
        segment, reserve = self.allocate_unreserved(nbytes, owner, segment_id)
        try:
            reserve()
        except BaseException:
            self.release(segment.segment_id)
            raise
        return segment

    def allocate_unreserved(
        self, nbytes: int, owner: str, segment_id: int | None = None
    ) -> tuple[Segment, Callable[[], None]]:
        """A new segment as `allocate` makes it, counted and mapped, but with its pages
        not yet reserved: the caller runs the `reserve` returned (ShmExhaustedError
        where /dev/shm is full) before the segment is written.  Reserving makes the
        kernel allocate and zero every page (about 0.25 s per GiB), so a caller on
        the event loop runs it on a thread; once the segment is released, `reserve`
        does nothing."""
        size = self._room_for(nbytes, owner)
        if segment_id is None:
            segment_id = next(self._ids)
        name, fd = self._create()
        path = os.path.join(self.shm_dir, name)
        try:
            if self.mode != 0o600:
                os.fchmod(fd, self.mode)  # exact mode, whatever the umask
            os.ftruncate(fd, size)  # its size now, its pages at `reserve`
            segment = self._map_own(fd, segment_id, name, size, owner)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

        def reserve() -> None:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:  # released before its pages were wanted
                return
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG):
                    raise ShmExhaustedError(
                        f"allocating {size} bytes for {owner}: {self.shm_dir} is full",
                        {"requested": size},
                    ) from None
                raise
            finally:
                os.close(fd)

        return segment, reserve

    def _room_for(self, nbytes: int, owner: str) -> int:
        """The page-rounded size of a new segment of `nbytes`, once the budget and
        /dev/shm have room for it (the spares give way first); else ShmExhaustedError."""
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        size = -(-nbytes // _PAGE) * _PAGE
        if self.in_use + size > self.max_bytes and self._reclaim is not None:
            self._reclaim()
        if self.in_use + size > self.max_bytes and self._lingering:
            gc.collect()  # released segments held only by garbage cycles: unmap them
        if self.in_use + size > self.max_bytes:
            raise ShmExhaustedError(
                f"allocating {size} bytes for {owner} would exceed max_shm_bytes="
                f"{self.max_bytes} ({self.in_use} in use); raise --max-shm-bytes",
                {"requested": size, "in_use": self.in_use, "limit": self.max_bytes},
            )
        free = self._free_bytes()
        if size > free and self._reclaim is not None and self._reclaim():
            free = self._free_bytes()
        if size > free:
            raise ShmExhaustedError(
                f"allocating {size} bytes for {owner}: only {free} bytes free in "
                f"{self.shm_dir}; free space there or enlarge it",
                {"requested": size, "free": free},
            )
        return size

    def _map_own(self, fd: int, segment_id: int, name: str, size: int, owner: str) -> Segment:
        """Map a segment of this daemon's and count it in the budget."""
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        segment = Segment(segment_id, name, size, mapping, owner)
        self._segments[segment_id] = segment
        self._own_bytes += size
        return segment

    def _create(self) -> tuple[str, int]:
        """Create a new segment file under an unpredictable name: (name, descriptor)."""
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return self._claim_name(lambda path: os.open(path, flags, 0o600))

    def _claim_name(self, claim: Callable[[str], _T]) -> tuple[str, _T]:
        """Draw a fresh name and `claim(path)` it (raising FileExistsError if taken).

        /dev/shm is world-writable, so any local user could pre-create names
        that are easy to guess; a random tag (retried on the unlikely
        collision) keeps them from blocking allocations.  The pid stays in the
        name for the sweep of dead daemons' segments.
        """
        for _ in range(_CREATE_ATTEMPTS):
            name = segment_name(self._pid, secrets.token_urlsafe(_TAG_BYTES))
            try:
                return name, claim(os.path.join(self.shm_dir, name))
            except FileExistsError:
                log.warning("segment name %s is taken in %s; drawing another", name,
                            self.shm_dir)
        raise FileExistsError(f"{_CREATE_ATTEMPTS} random segment names in a row were taken "
                              f"in {self.shm_dir}")

    def adopt(self, name: str, nbytes: int, owner: str, segment_id: int) -> Segment:
        """Take over segment `name` that a dead daemon left (a checkpoint's part):
        renamed into this daemon's names, so that no sweep takes it for a dead
        daemon's, mapped, and counted in the budget like a new one."""
        if self.in_use + nbytes > self.max_bytes:
            raise ShmExhaustedError(
                f"taking over {nbytes} bytes for {owner} would exceed max_shm_bytes="
                f"{self.max_bytes} ({self.in_use} in use); raise --max-shm-bytes",
                {"requested": nbytes, "in_use": self.in_use, "limit": self.max_bytes})
        old = os.path.join(self.shm_dir, name)
        fd = os.open(old, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not owned_regular_file(info) or info.st_size != nbytes:
                raise ValueError(f"segment {name} is not a {nbytes}-byte file of uid "
                                 f"{os.getuid()}")
            new_name, _ = self._claim_name(lambda path: os.link(old, path))
            os.unlink(old)
            os.fchmod(fd, self.mode)
            return self._map_own(fd, segment_id, new_name, nbytes, owner)
        finally:
            os.close(fd)

    def attach(self, path: str, nbytes: int, owner: str, segment_id: int) -> Segment:
        """Map `nbytes` of a file the client shares (its descriptor, seen through /proc).

        Only regular files of the daemon's own user, at least `nbytes` long: a
        file that shrinks under a mapping would fault the daemon, so only a
        process that could kill the daemon anyway may share memory this way.
        """
        if nbytes <= 0:
            raise ValueError(f"attach needs a positive size, got {nbytes}")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            info = os.fstat(fd)
            if not owned_regular_file(info):
                raise PermissionError(f"{owner}: only regular files of the daemon's user "
                                      "can be attached")
            if info.st_size < nbytes:
                raise ValueError(f"{owner}: the file holds {info.st_size} bytes, "
                                 f"not the {nbytes} asked for")
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        segment = Segment(segment_id, f"attached-{segment_id}", nbytes, mapping, owner, True)
        self._segments[segment_id] = segment
        self.attached += nbytes
        return segment

    def release(self, segment_id: int,
                unmap_on: Callable[[Callable[[], None]], object] | None = None) -> None:
        """Unlink a segment and unmap it; memory returns once every mapping is gone.

        A segment that views still use (a collective running over it) cannot be
        unmapped yet: it is unmapped, and stops counting as in use, as soon as
        the last view is gone.  With `unmap_on` (a thread's `submit`) the unmapping,
        where the kernel frees the pages (about 0.1 s per GiB), runs there: the
        name is gone and the budget has the room back at once.
        """
        segment = self._segments.pop(segment_id, None)
        if segment is None:
            return
        if segment.attached:  # the client's memory: dropping the mapping is all
            self.attached -= segment.nbytes
            self._unmap(segment, lingering=False)
            return
        self._own_bytes -= segment.nbytes
        try:
            os.unlink(os.path.join(self.shm_dir, segment.name))
        except FileNotFoundError:
            log.warning("segment %s was already removed from %s", segment.name, self.shm_dir)
        if unmap_on is None:
            self._unmap(segment, lingering=True)
        else:
            unmap_on(functools.partial(self._unmap, segment, True))

    def _unmap(self, segment: Segment, lingering: bool) -> None:
        """Close the mapping (and its descriptor) now, or once its last view is gone."""
        try:
            segment.mapping.close()
        except BufferError:  # views exist: the mapping dies with the last of them
            if lingering:
                with self._lingering_lock:
                    self._lingering += segment.nbytes
                weakref.finalize(segment.mapping, self._unmapped, segment.nbytes)

    def _unmapped(self, nbytes: int) -> None:
        # May run in a reduce thread, wherever the last view was dropped.
        with self._lingering_lock:
            self._lingering -= nbytes

    def detach(self, segment_id: int) -> str | None:
        """Unmap a segment but leave it in /dev/shm (for a later daemon); its name."""
        segment = self._segments.pop(segment_id, None)
        if segment is None or segment.attached:
            return None
        self._own_bytes -= segment.nbytes
        self._unmap(segment, lingering=False)
        return segment.name

    def release_all(self) -> None:
        for segment_id in list(self._segments):
            self.release(segment_id)

    def _free_bytes(self) -> int:
        stats = os.statvfs(self.shm_dir)
        return stats.f_bavail * stats.f_frsize


def owned_regular_file(info: os.stat_result) -> bool:
    """A regular file of this process's user (not a link, a device or another's file)."""
    return stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid()


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_dead_segments(shm_dir: str = SHM_DIR, spared: Set[str] = frozenset()) -> list[str]:
    """Remove `gradsync-<pid>-*` segments whose daemon pid no longer runs, but for
    those in `spared` (checkpoints a restarted daemon may take over)."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SEGMENT_PREFIX):
            continue
        pid = owner_pid(name)
        if pid is None or pid == os.getpid() or name in spared or pid_alive(pid):
            continue
        try:
            os.unlink(segment_path(name) if shm_dir == SHM_DIR else os.path.join(shm_dir, name))
            removed.append(name)
        except OSError as exc:
            log.warning("cannot remove stale segment %s: %s", name, exc.strerror)
    return removed
