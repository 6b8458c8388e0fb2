"""Daemon lifecycle (claiming the socket, permissions, signals) and its shared memory.

Start: one daemon per socket, stale sockets taken over, private folder and
socket.  Stop: SIGTERM and SIGINT exit 0 and leave nothing behind.  Shared
memory: a byte budget and /dev/shm's free space are enforced with an error
(never a SIGBUS), and an `empty()` array that is garbage-collected gives its
segment back.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    DaemonProcess,
    assert_lock_released,
    buffers_of,
    poll_until,
    segments_of,
    wait_until_ready,
)
from gradsync.client import Client, DaemonUnavailableError, ShmExhaustedError
from gradsync.client.ping import query
from gradsync.protocol.shm import SHM_DIR

StartDaemon = Callable[..., DaemonProcess]
DAEMON = [sys.executable, "-m", "gradsync.daemon"]


@contextlib.contextmanager
def own_daemon(
    endpoint: str, log_path: Path, *args: str, umask: int | None = None
) -> Iterator[DaemonProcess]:
    """A daemon on a socket the test chooses; must exit 0 on SIGTERM, leaving no segment."""
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [*DAEMON, "--socket", endpoint, *args],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=None if umask is None else (lambda: os.umask(umask)),
        )
    daemon = DaemonProcess(endpoint, str(log_path.parent), process, log_path)
    try:
        wait_until_ready(endpoint, process, log_path)
        yield daemon
    finally:
        was_running = process.poll() is None
        code = daemon.stop()
        if was_running:
            assert code == 0, f"gradsyncd exited {code} on SIGTERM:\n{daemon.log()}"
            assert segments_of(daemon.pid) == []


def run_daemon_expecting_exit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DAEMON, *args], capture_output=True, text=True, timeout=30,
        stdin=subprocess.DEVNULL,
    )


# -- one daemon per socket ---------------------------------------------------


@pytest.mark.timeout(60)
def test_second_daemon_on_a_live_socket_refuses_and_leaves_the_first_alone(
    daemon: DaemonProcess,
) -> None:
    second = run_daemon_expecting_exit("--socket", daemon.endpoint)
    assert second.returncode != 0
    assert "another gradsyncd" in second.stderr, second.stderr
    assert f"pid {daemon.pid}" in second.stderr, second.stderr
    assert daemon.socket_path in second.stderr, second.stderr
    assert stat.S_ISSOCK(os.stat(daemon.socket_path).st_mode)
    assert query(daemon.endpoint, 5.0)["pid"] == daemon.pid
    daemon.assert_alive()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("left_by", ["sigkilled-daemon", "abandoned-bind"])
def test_stale_socket_file_is_taken_over(
    start_daemon: StartDaemon, short_tmp: str, left_by: str
) -> None:
    if left_by == "sigkilled-daemon":
        dead = start_daemon()
        dead.process.kill()
        dead.process.wait()
        endpoint = dead.endpoint
    else:
        endpoint = f"ipc://{short_tmp}/stale.sock"
        abandoned = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        abandoned.bind(endpoint[len("ipc://") :])
        abandoned.close()
    path = endpoint[len("ipc://") :]
    assert stat.S_ISSOCK(os.stat(path).st_mode), "the stale socket file should be there"
    with pytest.raises(DaemonUnavailableError):
        query(endpoint, 1.0)
    with own_daemon(endpoint, Path(short_tmp) / "successor.log") as successor:
        assert query(endpoint, 5.0)["pid"] == successor.pid
        with Client(endpoint, job="after-takeover") as client:
            array = np.arange(5, dtype=np.float32)
            client.all_reduce(array)
            np.testing.assert_array_equal(array, np.arange(5, dtype=np.float32))
    assert not os.path.exists(path)


@pytest.mark.timeout(60)
def test_regular_file_at_the_socket_path_is_not_deleted(short_tmp: str) -> None:
    path = Path(short_tmp) / "notes.sock"
    path.write_text("precious\n")
    log_path = Path(short_tmp) / "victim.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [*DAEMON, "--socket", f"ipc://{path}"],
            stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 20
        while process.poll() is None and time.monotonic() < deadline:
            if path.is_socket():
                break  # it started serving over the file
            time.sleep(0.01)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        code = process.wait(30)
    assert code != 0, "the daemon should refuse a path that holds a non-socket file"
    assert path.read_text() == "precious\n"


# -- permissions -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_created_folder_socket_and_segments_are_private_even_with_umask_0(
    short_tmp: str,
) -> None:
    folder = Path(short_tmp) / "run" / "gradsync"
    endpoint = f"ipc://{folder}/gradsyncd.sock"
    with own_daemon(endpoint, Path(short_tmp) / "private.log", umask=0) as daemon:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        socket_mode = os.stat(folder / "gradsyncd.sock").st_mode
        assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o600
        with Client(endpoint, job="modes") as client:
            array = client.empty(1000, np.float32)
            names = segments_of(daemon.pid)  # the array's, and the job's fast page
            assert len(names) == 2, names
            for name in names:
                assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o600
            del array
    assert not (folder / "gradsyncd.sock").exists()


@pytest.mark.timeout(60)
def test_another_user_squatting_segment_names_blocks_no_allocation(
    daemon: DaemonProcess,
) -> None:
    """/dev/shm is world-writable: names another local user can guess and pre-create
    (the daemon's pid and small numbers) must not make `alloc` fail."""
    squatted = [os.path.join(SHM_DIR, f"gradsync-{daemon.pid}-{n}") for n in range(1, 65)]
    subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "touch", *squatted],
        check=True, timeout=30,
    )
    try:
        assert all(os.stat(path).st_uid != 0 for path in squatted)
        with Client(daemon.endpoint, job="squatted") as client:
            arrays = [client.empty(1000 * (n + 1), np.float32) for n in range(4)]
            arrays[-1][:] = 1
            client.all_reduce(arrays[-1])
            assert arrays[-1][0] == 1
            ours = [name for name in buffers_of(daemon)
                    if os.stat(os.path.join(SHM_DIR, name)).st_uid == os.getuid()]
            assert len(ours) == 4, ours
            del arrays
    finally:
        for path in squatted:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@pytest.mark.timeout(30)
def test_socket_folder_writable_by_others_is_refused(short_tmp: str) -> None:
    folder = Path(short_tmp) / "open"
    folder.mkdir()
    folder.chmod(0o777)
    result = run_daemon_expecting_exit("--socket", f"ipc://{folder}/d.sock")
    assert result.returncode != 0
    assert "writable by others" in result.stderr, result.stderr
    assert list(folder.iterdir()) == []


@pytest.mark.timeout(30)
def test_client_without_daemon_gets_daemon_unavailable(short_tmp: str) -> None:
    endpoint = f"ipc://{short_tmp}/nobody.sock"
    with pytest.raises(DaemonUnavailableError) as caught:
        Client(endpoint, job="alone")
    assert endpoint in str(caught.value) and "gradsyncd --socket" in str(caught.value)


# -- signals -----------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_with_connected_client_exits_0_and_cleans_up(
    daemon: DaemonProcess, signum: signal.Signals
) -> None:
    client = Client(daemon.endpoint, job="signalled")
    try:
        array = client.empty(10_000, np.float64)
        client.all_reduce(array)
        assert segments_of(daemon.pid)
        daemon.process.send_signal(signum)
        assert daemon.process.wait(20) == 0, daemon.log()
        with pytest.raises(DaemonUnavailableError):
            client.all_reduce(array)
    finally:
        client.close()
    assert segments_of(daemon.pid) == []
    assert not os.path.exists(daemon.socket_path)
    assert_lock_released(daemon.socket_path + ".lock")


# -- shared memory -----------------------------------------------------------


@pytest.mark.timeout(60)
def test_max_shm_bytes_is_enforced_and_daemon_keeps_serving(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon("--max-shm-bytes", "1MiB")
    with Client(daemon.endpoint, job="budget") as client:
        with pytest.raises(ShmExhaustedError, match="max_shm_bytes") as caught:
            client.empty(2 * 1024 * 1024, np.uint8)
        assert caught.value.details.get("limit") == 1024 * 1024
        assert buffers_of(daemon) == []
        ordinary = np.ones(512 * 1024, dtype=np.float32)  # 2 MiB: needs a 2 MiB scratch slot
        with pytest.raises(ShmExhaustedError, match="max_shm_bytes"):
            client.all_reduce(ordinary)
        np.testing.assert_array_equal(ordinary, np.ones(512 * 1024, dtype=np.float32))
        small = client.empty(1000, np.float32)
        small[...] = 2
        client.all_reduce(small, op="max")
        np.testing.assert_array_equal(small, np.full(1000, 2, dtype=np.float32))
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_allocation_beyond_dev_shm_free_space_is_an_error_not_sigbus(
    start_daemon: StartDaemon,
) -> None:
    daemon = start_daemon("--max-shm-bytes", str(2**60))
    stats = os.statvfs(SHM_DIR)
    too_big = stats.f_bavail * stats.f_frsize + 2**30
    with Client(daemon.endpoint, job="greedy") as client:
        with pytest.raises(ShmExhaustedError, match="free") as caught:
            client.empty(too_big, np.uint8)
        assert SHM_DIR in str(caught.value)
        assert buffers_of(daemon) == []
        array = client.empty(4096, np.int32)
        array[...] = 7
        client.all_reduce(array)
        np.testing.assert_array_equal(array, np.full(4096, 7, dtype=np.int32))
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_garbage_collected_empty_array_frees_its_segment(start_daemon: StartDaemon) -> None:
    daemon = start_daemon("--max-shm-bytes", "1MiB")
    count = 600 * 1024 // 4  # two of these do not fit in 1 MiB
    with Client(daemon.endpoint, job="gc") as client:
        first = client.empty(count, np.float32)
        (first_name,) = buffers_of(daemon)
        with pytest.raises(ShmExhaustedError):
            client.empty(count, np.float32)
        view = first[10:20]
        del first
        gc.collect()
        client.all_reduce(view)  # a request that would carry a queued free
        assert os.path.exists(os.path.join(SHM_DIR, first_name)), "a view still uses it"
        del view
        gc.collect()
        # The free travels with the next request; the allocation after it then fits.
        second = client.empty(count, np.float32)
        second[...] = 1
        poll_until(
            lambda: not os.path.exists(os.path.join(SHM_DIR, first_name)), 5.0,
            f"{first_name} unlinked after its array was collected",
        )
        with open(f"/proc/{daemon.pid}/maps") as maps:
            assert first_name not in maps.read(), "the daemon still maps the freed segment"
        client.all_reduce(second)
        np.testing.assert_array_equal(second, np.ones(count, dtype=np.float32))
        assert len(buffers_of(daemon)) == 1
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_a_detached_daemon_outlives_its_starter_killed_with_its_children(short_tmp: str) -> None:
    """What Ray does as a worker exits: SIGKILL to the worker's children.  A detached
    daemon (the torch backend's private one) is its keeper's child, so it serves on,
    and still stops cleanly on SIGTERM."""
    from gradsync.client.daemon_process import start_daemon

    endpoint = f"ipc://{short_tmp}/gradsyncd.sock"
    keeper = start_daemon(endpoint, detached=True, log_path=Path(short_tmp) / "log")
    keeper.wait_ready(30.0)
    pid = int(query(endpoint, 5.0)["pid"])
    assert pid != keeper.pid and keeper.shown_command().startswith("gradsyncd "), keeper.command
    keeper.process.kill()
    keeper.process.wait(10)
    assert int(query(endpoint, 5.0)["pid"]) == pid  # still there, still serving
    os.kill(pid, signal.SIGTERM)
    poll_until(lambda: not os.path.exists(f"/proc/{pid}"), 30.0, "the daemon exits on SIGTERM")
    assert segments_of(pid) == [] and not os.path.exists(endpoint[len("ipc://"):])
