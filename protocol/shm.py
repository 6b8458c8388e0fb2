"""Naming and mapping of daemon-owned POSIX shared-memory segments.

Segments live in /dev/shm (Linux's POSIX shm).  Both ends map them with
`os.open` + `mmap` rather than `multiprocessing.shared_memory`, whose
resource tracker would unlink, or warn about, segments it does not own.
"""

from __future__ import annotations

import mmap
import os
import re

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "gradsync-"
_SEGMENT_NAME = re.compile(r"^gradsync-(\d+)-[A-Za-z0-9_-]+$")


def segment_name(daemon_pid: int, tag: str) -> str:
    """`gradsync-<daemon pid>-<tag>`: the pid lets a later daemon sweep leftovers.

    The daemon draws `tag` at random, so that other local users cannot guess names.
    """
    return f"{SEGMENT_PREFIX}{daemon_pid}-{tag}"


def owner_pid(name: str) -> int | None:
    """The daemon pid encoded in a segment name, or None if it is not ours."""
    match = _SEGMENT_NAME.match(name)
    return int(match.group(1)) if match else None


def segment_path(name: str) -> str:
    """Path of a segment; refuses names that could escape /dev/shm."""
    if owner_pid(name) is None:
        raise ValueError(f"not a gradsync segment name: {name!r}")
    return os.path.join(SHM_DIR, name)


def map_segment(name: str, nbytes: int) -> mmap.mmap:
    """Map an existing segment read-write; the caller keeps the mapping alive."""
    fd = os.open(segment_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"segment {name} holds {size} bytes, expected {nbytes}")
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
