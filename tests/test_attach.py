"""`attach`: the daemon maps memory a client already shares, and reduces it where it lies.

Real daemon, real clients; the shared memory is a memfd the test maps itself.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from conftest import DaemonProcess, poll_until
from gradsync.client import Client, InvalidArgumentError
from gradsync.client.ping import query

N = 1 << 16


@contextlib.contextmanager
def shared_array(n: int) -> Iterator[tuple[int, mmap.mmap, np.ndarray]]:
    """A float32 array over a memfd: (fd, mapping, array)."""
    fd = os.memfd_create("gradsync-test")
    try:
        os.ftruncate(fd, n * 4)
        mapping = mmap.mmap(fd, n * 4)
        yield fd, mapping, np.frombuffer(mapping, dtype=np.float32)
    finally:
        os.close(fd)


def clients(daemon: DaemonProcess, job: str, world: int = 2) -> list[Client]:
    return [Client(daemon=daemon.endpoint, job=job, rank=r, world_size=world, local_rank=r,
                   local_world_size=world, timeout_s=30) for r in range(world)]


def attached(daemon: DaemonProcess) -> int:
    return int(query(daemon.endpoint, 5.0)["shm_attached"])


@pytest.mark.timeout(60)
def test_attached_memory_is_reduced_where_it_lies(daemon: DaemonProcess) -> None:
    pair = clients(daemon, "attach")
    with shared_array(N) as (fd0, map0, a0), shared_array(N) as (fd1, map1, a1):
        for client, fd, array, owner in zip(pair, (fd0, fd1), (a0, a1), (map0, map1),
                                            strict=True):
            client.attach(fd, N * 4, array.ctypes.data, owner)
        assert attached(daemon) == 2 * N * 4
        segments = query(daemon.endpoint, 5.0)["segments"]
        for step in range(3):
            a0[:] = np.arange(N, dtype=np.float32) + step
            a1[:] = 2.0
            works = [c.all_reduce(a, op="sum", async_op=True) for c, a in zip(pair, (a0, a1),
                                                                              strict=True)]
            for work in works:
                assert work is not None
                work.wait()
            want = np.arange(N, dtype=np.float32) + step + 2.0
            np.testing.assert_array_equal(a0, want)
            np.testing.assert_array_equal(a1, want)
            # The result is in the memfd itself (another mapping of it sees it): no copy.
            np.testing.assert_array_equal(
                np.frombuffer(mmap.mmap(fd1, N * 4), dtype=np.float32), want)
        # Nothing was staged: no scratch segment appeared.
        assert query(daemon.endpoint, 5.0)["segments"] == segments
    del a0, a1, map0, map1, works, array, owner
    gc.collect()
    for client in pair:
        client.empty(1)  # any call sends the frees its registry queued
    poll_until(lambda: attached(daemon) == 0, 10, "the daemon to drop both mappings")
    for client in pair:
        client.close()


@pytest.mark.timeout(60)
def test_bad_attach_requests_get_clear_errors_and_the_daemon_serves_on(
    daemon: DaemonProcess,
) -> None:
    (client,) = clients(daemon, "solo", world=1)
    with pytest.raises(InvalidArgumentError, match="descriptor 999"):
        client.attach(999, 4096, 0, client)
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(InvalidArgumentError, match="regular files"):
            client.attach(read_end, 4096, 0, client)
    finally:
        os.close(read_end)
        os.close(write_end)
    with (shared_array(16) as (fd, mapping, array),
          pytest.raises(InvalidArgumentError, match="holds 64 bytes")):
        client.attach(fd, 1 << 20, array.ctypes.data, mapping)
    assert attached(daemon) == 0
    values = np.arange(8, dtype=np.float64)
    client.all_reduce(values)  # still serving (a job of one: unchanged)
    np.testing.assert_array_equal(values, np.arange(8))
    client.close()
    daemon.assert_alive()


FOREIGN_CLIENT = """
import os, sys
from gradsync.client import Client, InvalidArgumentError
os.setgid(65534); os.setuid(65534)  # after the imports: 'nobody' cannot read the venv
client = Client(daemon=sys.argv[1], job="foreign", rank=0, world_size=1, local_rank=0,
                local_world_size=1)
fd = os.memfd_create("foreign"); os.ftruncate(fd, 4096)
try:
    client.attach(fd, 4096, 0, client)
except InvalidArgumentError as exc:
    print("refused:", exc)
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_a_client_of_another_user_cannot_attach(daemon: DaemonProcess, short_tmp: str) -> None:
    os.chmod(short_tmp, 0o711)  # let 'nobody' reach the socket, for this test only
    os.chmod(daemon.socket_path, 0o666)
    result = subprocess.run([sys.executable, "-c", FOREIGN_CLIENT, daemon.endpoint],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "own user" in result.stdout, result.stdout
    assert attached(daemon) == 0
    daemon.assert_alive()
