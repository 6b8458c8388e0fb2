"""The checkpoint writer's compiled memory work (client/_checkpoint_memory.c).

`copy` must give the same bytes as any copy, for every length and alignment (the
streaming loop, its unaligned head and its tail, and the small copies that stay
memcpy), and refuse what it cannot do safely.  `populate` and `drop_pages` must
fill and empty a mapping's page tables (as the kernel counts them in
/proc/self/smaps) without touching the segment's bytes.  All three must let other
threads run while they work: that is why they exist.  The install must have
built the module: CI has a C compiler, and without it a checkpoint save would
silently copy with torch and map with the GIL held.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from gradsync.client import _checkpoint_memory

STREAMING = 256 * 1024  # the C module's threshold: at and above it, the streaming loop
MIB = 2**20
STEP = 4 * MIB


@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 63, 64, 65, 4095, STREAMING - 1,
                                    STREAMING, STREAMING + 1, 3 * MIB + 13])
@pytest.mark.parametrize("offset", [0, 1, 8, 15])
def test_the_copy_gives_the_same_bytes_at_any_length_and_alignment(
    length: int, offset: int
) -> None:
    rng = np.random.default_rng(length * 16 + offset)
    source = rng.integers(0, 256, length + 32, dtype=np.uint8)[offset:offset + length]
    with mmap.mmap(-1, length + 64) as mapping:  # shared memory, as a daemon segment is
        target = np.frombuffer(mapping, dtype=np.uint8)
        target[:] = 0xA5
        _checkpoint_memory.copy(target[offset + 3:offset + 3 + length], source)
        assert np.array_equal(target[offset + 3:offset + 3 + length], source)
        # Not a byte before or after the destination changed.
        assert (target[:offset + 3] == 0xA5).all()
        assert (target[offset + 3 + length:] == 0xA5).all()
        del target


def test_the_copy_refuses_other_lengths_read_only_and_strided_buffers() -> None:
    source = np.arange(64, dtype=np.uint8)
    with pytest.raises(ValueError, match="destination holds 32 bytes, the source 64"):
        _checkpoint_memory.copy(np.zeros(32, np.uint8), source)
    with pytest.raises((BufferError, TypeError)):
        _checkpoint_memory.copy(bytes(64), source)  # not writable
    with pytest.raises((BufferError, TypeError, ValueError)):
        _checkpoint_memory.copy(np.zeros(128, np.uint8)[::2], source)  # not contiguous
    with pytest.raises(TypeError):
        _checkpoint_memory.copy(np.zeros(64, np.uint8))  # type: ignore[call-arg]


def shm_segment(nbytes: int) -> mmap.mmap:
    """A /dev/shm file with its pages there, as a daemon's segment, mapped shared
    without MAP_POPULATE (no page tables yet), its name already gone."""
    path = f"/dev/shm/gradsync-test-{os.getpid()}-checkpoint-memory"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(path)


@pytest.fixture
def segment() -> Iterator[mmap.mmap]:
    mapping = shm_segment(16 * MIB)
    yield mapping
    mapping.close()


def mapped_bytes(mapping: mmap.mmap) -> int:
    """The bytes of `mapping` that have page tables (its VMA's Rss in /proc/self/smaps)."""
    start = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    found = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(x, 16) for x in first.split("-"))
                found = low <= start < high
            elif found and first == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the mapping is not in /proc/self/smaps")


def test_populate_fills_the_page_tables_and_drop_pages_empties_them_keeping_the_bytes(
    segment: mmap.mmap,
) -> None:
    assert mapped_bytes(segment) == 0
    assert _checkpoint_memory.populate(segment, STEP) is True  # Linux 5.14 or later here
    assert mapped_bytes(segment) == 16 * MIB
    # Mapped writable: writing every page now takes no fault (4,096 if it did).
    data = b"\x01" * (16 * MIB)  # its own pages written now, outside the count
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    segment[:] = data
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults < 256
    segment[5 * MIB:5 * MIB + 4] = b"part"
    _checkpoint_memory.drop_pages(segment, STEP)
    assert mapped_bytes(segment) == 0
    assert segment[5 * MIB:5 * MIB + 4] == b"part"  # the segment kept it: a fault maps it again
    with pytest.raises(ValueError, match="positive multiple"):
        _checkpoint_memory.populate(segment, STEP + 1)
    with pytest.raises(ValueError, match="positive multiple"):
        _checkpoint_memory.drop_pages(segment, 0)
    with (mmap.mmap(-1, MIB, prot=mmap.PROT_READ) as read_only,
          pytest.raises((BufferError, TypeError))):
        _checkpoint_memory.populate(read_only, STEP)


def test_a_writers_mapping_comes_with_its_page_tables_and_unmaps() -> None:
    from gradsync.client import checkpoints
    from gradsync.protocol.shm import segment_name

    assert checkpoints._checkpoint_memory is _checkpoint_memory
    name = segment_name(os.getpid(), "checkpoint-memory-test")
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, 8 * MIB)
        mapping = checkpoints.map_populated(name, 8 * MIB)
        assert mapped_bytes(mapping) == 8 * MIB  # its page tables are there already
        checkpoints._close(mapping)
        assert mapping.closed
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("work", ["copy", "populate", "drop_pages"])
def test_other_threads_run_while_it_works(work: str) -> None:
    """A thread counts, letting go of the GIL between counts; while a call that keeps
    the GIL runs (Python's own MAP_POPULATE does), it cannot count even once, though
    a switch between reading the count and making the call may let one count through.
    So three counts during one call (of 256 MiB: tens of milliseconds) show that the
    call lets go; a loaded machine gets five tries."""
    segment = shm_segment(256 * MIB)
    source = np.ones(256 * MIB, np.uint8)
    calls: dict[str, Callable[[], object]] = {
        "copy": lambda: _checkpoint_memory.copy(np.frombuffer(segment, np.uint8), source),
        "populate": lambda: _checkpoint_memory.populate(segment, STEP),
        "drop_pages": lambda: _checkpoint_memory.drop_pages(segment, STEP),
    }
    counted = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1
            time.sleep(0.0001)

    counter = threading.Thread(target=count)
    counter.start()
    during = []
    try:
        for _ in range(5):
            if work == "drop_pages":
                _checkpoint_memory.populate(segment, STEP)  # something to drop
            elif work == "populate":
                _checkpoint_memory.drop_pages(segment, STEP)  # something to fill
            before = counted[0]
            calls[work]()
            during.append(counted[0] - before)
            if during[-1] >= 3:
                break
    finally:
        stop.set()
        counter.join(10)
        segment.close()
    assert during[-1] >= 3, f"{work} kept the GIL: the other thread counted {during} in its calls"


def test_a_checkpoint_save_copies_with_it() -> None:
    torch = pytest.importorskip("torch", reason="torch is the optional extra gradsync[torch]")
    from gradsync.client.torch import checkpoint

    assert checkpoint._checkpoint_memory is _checkpoint_memory
    source = torch.arange(STREAMING * 3, dtype=torch.int32).view(torch.uint8)
    target = torch.zeros_like(source)
    checkpoint._copy([(target, source)])  # cut in two halves, one on the helper thread
    assert torch.equal(target, source)
