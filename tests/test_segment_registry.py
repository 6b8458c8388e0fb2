"""A segment registry shared by a process's clients never outlives the memory it describes.

Issue 47: torchft drops failed replicas' process groups without shutting them
down; their clients' scratch segments stayed in the process's shared registry,
the kernel reused the addresses, and `locate` sent the daemon a dead segment
("segment 33 does not belong to this client").  Real daemon, real clients.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import DaemonProcess, poll_until
from gradsync.client import Client
from gradsync.client.buffers import ScratchPool, SegmentRegistry
from gradsync.client.work import Work
from gradsync.protocol.shm import SHM_DIR, segment_name

#: float32 elements of each staged array: 256 KiB, staged through a 256 KiB scratch
#: segment, so an ordinary array mapped after a dropped client's scratch went away
#: tends to land at the very address the stale entry describes.
N = 64 * 1024
NBYTES = N * 4
ROUNDS = 12


def located(registry: SegmentRegistry, address: int, nbytes: int) -> tuple[int, int] | None:
    """`registry.locate` of a byte array claiming `address`, which may be unmapped: the
    array is never read (`locate` looks at addresses only) and never leaves here, so an
    assertion's report cannot read it either."""
    return registry.locate(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address)))


@pytest.fixture
def segment() -> Iterator[str]:
    """A shared-memory file named like a daemon's segment (for `SegmentRegistry.map`)."""
    name = segment_name(os.getpid(), f"test-{uuid.uuid4().hex[:12]}")
    path = os.path.join(SHM_DIR, name)
    with open(path, "wb") as file:
        file.truncate(NBYTES)
    try:
        yield name
    finally:
        os.unlink(path)


class Owner:
    """Something weakly referable that keeps adopted memory alive."""


@pytest.mark.timeout(30)
def test_locate_never_returns_a_dead_or_older_overlapping_entry(segment: str) -> None:
    registry = SegmentRegistry()
    mapping = registry.map(1, segment, NBYTES, track=False)
    address = int(np.frombuffer(mapping, dtype=np.uint8).ctypes.data)
    assert located(registry, address, NBYTES) == (1, 0)
    del mapping  # a scratch slot of a collected client: its memory is gone
    gc.collect()
    assert located(registry, address, NBYTES) is None
    assert registry.entries() == []
    assert not registry.collected  # scratch (track=False) is freed with its session

    # The address is reused: the newest entry over it wins, an older live one is kept.
    older, newer = Owner(), Owner()
    registry.adopt(2, address, NBYTES, older)
    registry.adopt(3, address + 4096, NBYTES - 4096, newer)
    assert located(registry, address + 8192, 64) == (3, 4096)
    assert located(registry, address, 64) == (2, 0)
    del newer
    gc.collect()
    assert located(registry, address + 8192, 64) == (2, 8192)
    assert list(registry.collected) == [3]  # adopted memory is freed once collected
    assert [entry.segment_id for entry in registry.entries()] == [2]


@pytest.mark.timeout(30)
def test_retired_client_segments_are_never_located(segment: str) -> None:
    registry = SegmentRegistry()
    first, second = registry.new_client(), registry.new_client()
    mapping = registry.map(7, segment, NBYTES, track=True, client=first)
    kept = Owner()
    registry.adopt(8, 0x10000, 4096, kept, client=second)
    array = np.frombuffer(mapping, dtype=np.float32)
    assert registry.locate(array) == (7, 0)
    registry.retire(first)  # its session is gone: the daemon freed segment 7 itself
    assert registry.locate(array) is None
    assert located(registry, 0x10000, 16) == (8, 0)
    # A late registration for a retired client is not recorded at all.
    late = registry.map(9, segment, NBYTES, track=False, client=first)
    assert registry.locate(np.frombuffer(late, dtype=np.uint8)) is None
    del array, mapping, late
    gc.collect()
    assert not registry.collected  # nothing to free: the session took it along
    assert [entry.segment_id for entry in registry.entries()] == [8]


def _pair(daemon: DaemonProcess, job: str, registry: SegmentRegistry) -> list[Client]:
    """Two ranks of one job in this process, sharing `registry` (as torch's groups do)."""
    return [Client(daemon=daemon.endpoint, job=job, rank=rank, world_size=2, local_rank=rank,
                   local_world_size=2, timeout_s=30, _segments=registry)
            for rank in range(2)]


def _wait_all(works: list[Work | None]) -> None:
    """Wait for a round's collectives; the first failure is raised at once, rather than
    a timeout of the rank left waiting for the one that failed."""
    done = [work for work in works if work is not None]
    assert len(done) == len(works)
    poll_until(lambda: all(work.is_completed() for work in done)
               or any(work.is_completed() and work.exception() for work in done),
               60.0, "the round's collectives to complete or fail")
    for work in sorted(done, key=lambda work: work.exception() is None):
        work.wait()


def _ordinary(values: float) -> tuple[mmap.mmap, np.ndarray]:
    """An ordinary (not daemon-owned) float32 array in an anonymous mapping of its own."""
    memory = mmap.mmap(-1, ScratchPool.capacity_for(NBYTES))
    array = np.frombuffer(memory, dtype=np.float32, count=N)
    array[:] = values
    return memory, array


@pytest.mark.timeout(120)
def test_dropped_clients_leave_no_stale_segments(daemon: DaemonProcess) -> None:
    registry = SegmentRegistry()
    keeper = Client(daemon=daemon.endpoint, job="keeper", rank=0, world_size=1, local_rank=0,
                    local_world_size=1, timeout_s=30, _segments=registry)
    try:
        zero_copy = keeper.empty(N)
        survivors: list[np.ndarray] = []  # `empty()` arrays outliving their dropped client
        for round_ in range(ROUNDS):
            pair = _pair(daemon, f"dropped-{round_}", registry)
            # Mapped now, after the last round's clients and scratch went away.
            held = [_ordinary(rank + round_) for rank in range(2)]
            _wait_all([client.all_reduce(array, async_op=True)
                       for client, (_, array) in zip(pair, held, strict=True)])
            for _, array in held:
                np.testing.assert_array_equal(array, np.float32(1 + 2 * round_))
            if survivors:  # its segment died with its client's session: staged now
                survivor = survivors[-1]
                survivor[:] = 3.0
                other = np.full(N, 4.0, dtype=np.float32)
                _wait_all([pair[0].all_reduce(survivor, async_op=True),
                           pair[1].all_reduce(other, async_op=True)])
                np.testing.assert_array_equal(survivor, np.float32(7.0))
            survivors.append(pair[round_ % 2].empty(N))
            zero_copy[:] = round_
            keeper.all_reduce(zero_copy)
            np.testing.assert_array_equal(zero_copy, np.float32(round_))
            # Dropped without close(), as torchft drops a failed replica's group.
            del pair, held
            gc.collect()
        entries = registry.entries()
        assert all(entry.mapping() is not None for entry in entries), entries
        # The keeper's `empty()` array and at most one scratch slot: nothing of the dropped.
        assert len(entries) <= 2, entries
        assert registry.locate(zero_copy) is not None
        assert all(registry.locate(array) is None for array in survivors)
    finally:
        keeper.close()
