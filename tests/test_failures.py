"""The failure model: mismatches, missing and dying ranks, a dying or stopping daemon.

Every error must reach every waiting rank quickly, name who is at fault, leave
buffers untouched, and leave the daemon serving (or, when the daemon itself
stops, reach the client as `DaemonUnavailableError` instead of a hang).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from conftest import (
    FAST_PATH_SETTINGS,
    DaemonProcess,
    assert_lock_released,
    poll_until,
    run_ranks,
    segments_of,
    spawn_ranks,
)
from gradsync.client import (
    Client,
    CollectiveTimeoutError,
    DaemonShuttingDownError,
    DaemonUnavailableError,
    JobError,
    RankLostError,
)
from gradsync.client.ping import query

StartDaemon = Callable[..., DaemonProcess]
_SHM_NAME = re.compile(r"/dev/shm/(gradsync-\d+-[A-Za-z0-9_-]+)")



#: The paths every failure test runs on; the tests marked with EVERY_PATH also run
#: the fast path's Python steps, whose own outcomes (a mismatch, a spin that ends
#: waiting) differ from the compiled module's before the shared waiting code.
EVERY_PATH = pytest.mark.parametrize("path", sorted(FAST_PATH_SETTINGS), indirect=True)


@pytest.fixture(params=["fast", "socket"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which path a small synchronous allreduce takes, for this process and the rank
    programs it starts.  The failures must look the same on all of them."""
    monkeypatch.setenv("GRADSYNC_FAST_PATH", FAST_PATH_SETTINGS[request.param])
    return str(request.param)


def fast_path_env(path: str) -> dict[str, str]:
    return {"GRADSYNC_FAST_PATH": FAST_PATH_SETTINGS[path]}


def assert_path_ran(daemon: DaemonProcess, path: str, fallbacks: int) -> None:
    """The statistics show which path the failed collectives began on."""
    counters = query(daemon.endpoint, 10.0)["counters"]
    assert counters["fast_path_fallbacks"] == (0 if path == "socket" else fallbacks), counters


class LineReader:
    """JSON records from a child's stdout, read from the raw pipe with a deadline."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        self.process = process
        self.fd = process.stdout.fileno()
        self.buffer = b""

    def next_record(self, timeout_s: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"pid {self.process.pid} printed nothing in {timeout_s}s")
            readable, _, _ = select.select([self.fd], [], [], remaining)
            if readable:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    stderr = self.process.stderr.read() if self.process.stderr else ""
                    raise AssertionError(f"pid {self.process.pid} exited early:\n{stderr}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)  # type: ignore[no-any-return]


@contextlib.contextmanager
def reaped(processes: list[subprocess.Popen[str]]) -> Iterator[None]:
    """Kill (by pid) and reap whatever of `processes` is still running at the end."""
    try:
        yield
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def clients(endpoint: str, job: str, world: int, **kwargs: object) -> list[Client]:
    return [
        Client(endpoint, job=job, rank=r, world_size=world, **kwargs)  # type: ignore[arg-type]
        for r in range(world)
    ]


def assert_two_rank_allreduce_works(endpoint: str, job: str) -> None:
    """A fresh 2-rank job on the daemon reduces correctly (rank 0 async, rank 1 sync)."""
    first, second = clients(endpoint, job, 2)
    try:
        a = np.arange(100, dtype=np.float32)
        b = np.arange(100, dtype=np.float32) * 2
        work = first.all_reduce(a, async_op=True)
        second.all_reduce(b)
        assert work is not None and work.wait()
        np.testing.assert_array_equal(a, np.arange(100, dtype=np.float32) * 3)
        np.testing.assert_array_equal(b, a)
    finally:
        first.close()
        second.close()


# -- mismatch ----------------------------------------------------------------

MISMATCH_SENT = {
    "count": ("float32[4]", "float32[5]"),
    "dtype": ("float32[4]", "float64[4]"),
    "op": ("op=sum", "op=max"),
}


@pytest.mark.timeout(60)
@EVERY_PATH
@pytest.mark.parametrize("what", sorted(MISMATCH_SENT))
def test_mismatch_fails_every_rank_names_both_and_keeps_the_job(
    daemon: DaemonProcess, what: str, path: str
) -> None:
    results = run_ranks(daemon.endpoint, "fail_mismatch.py", 2, [what], timeout_s=50,
                        env=fast_path_env(path))
    for result in results:
        (record,) = result.records()
        assert record["error"] == "MismatchError", record
        message = str(record["message"])
        for rank, sent in enumerate(MISMATCH_SENT[what]):
            assert f"rank {rank}" in message, message
            assert sent in message, message
        assert record["unchanged"], f"rank {result.rank}'s buffer changed: {record}"
        assert record["after_ok"], f"rank {result.rank}: the next all_reduce failed"
    assert_path_ran(daemon, path, 1)
    daemon.assert_alive()


# -- missing ranks -----------------------------------------------------------


@pytest.mark.timeout(60)
@EVERY_PATH
def test_connected_rank_that_never_submits_times_out_by_name(
    daemon: DaemonProcess, path: str
) -> None:
    first, second = clients(daemon.endpoint, "silent", 2, timeout_s=1.0)
    try:
        array = np.ones(8, dtype=np.float32)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as caught:
            first.all_reduce(array)
        elapsed = time.monotonic() - started
        assert 0.8 <= elapsed < 10, elapsed
        message = str(caught.value)
        assert "[1]" in message and "never connected" not in message, message
        assert caught.value.details.get("missing") == [1]
        np.testing.assert_array_equal(array, np.ones(8, dtype=np.float32))
        # The silent rank arriving late gets the same failure at once ...
        late = np.ones(8, dtype=np.float32)
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="late"):
            second.all_reduce(late)
        assert time.monotonic() - started < 2.0
        # ... and the job goes on with the next key.
        a, b = np.full(4, 2.0), np.full(4, 5.0)
        work = first.all_reduce(a, async_op=True)
        second.all_reduce(b)
        assert work is not None and work.wait()
        np.testing.assert_array_equal(a, np.full(4, 7.0))
        assert_path_ran(daemon, path, 2)  # the timed-out key, and the late rank's
    finally:
        first.close()
        second.close()
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_rank_that_never_connects_is_named_by_daemon_timeout(
    start_daemon: StartDaemon, path: str
) -> None:
    daemon = start_daemon("--collective-timeout-s", "1")
    with Client(daemon.endpoint, job="lonely", rank=0, world_size=3) as client:
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError) as caught:
            client.all_reduce(np.ones(3))
        assert 0.8 <= time.monotonic() - started < 10
    message = str(caught.value)
    assert "[1, 2]" in message and "never connected" in message, message
    assert "timed out after 1s" in message, message
    assert_path_ran(daemon, path, 1)


@pytest.mark.timeout(60)
def test_rank_program_whose_peer_never_connects_gets_timeout_from_env(
    daemon: DaemonProcess,
) -> None:
    results = run_ranks(
        daemon.endpoint, "fail_missing.py", 2, env={"GRADSYNC_TIMEOUT_S": "1"}, timeout_s=50
    )
    (record,) = results[0].records()
    assert record["error"] == "CollectiveTimeoutError", record
    assert "never connected: [1]" in str(record["message"]), record
    assert 0.8 <= float(record["elapsed_s"]) < 10, record  # type: ignore[arg-type]
    assert record["unchanged"]
    daemon.assert_alive()


# -- a client dies -----------------------------------------------------------


def mapped_segments(pid: int) -> set[str]:
    """Names of gradsync segments a process has mapped (from /proc/PID/maps)."""
    with open(f"/proc/{pid}/maps") as maps:
        return set(_SHM_NAME.findall(maps.read()))


@pytest.mark.timeout(60)
def test_killed_client_fails_waiting_rank_and_frees_its_segments(
    daemon: DaemonProcess, path: str
) -> None:
    # On the fast path rank 0 waits on the job's page (a synchronous call).
    args = ["30"] if path == "socket" else ["30", "--sync"]
    processes = spawn_ranks(daemon.endpoint, "fail_killed.py", 2, args, job="killed",
                            env=fast_path_env(path))
    with reaped(processes):
        rank0, rank1 = processes
        ready = LineReader(rank1).next_record(20)
        submitted = LineReader(rank0)
        assert "submitted" in submitted.next_record(20)
        # Rank 1's own segments: not the job's fast page, which rank 0 maps too.
        dead_segments = mapped_segments(int(ready["ready"])) - mapped_segments(rank0.pid)  # type: ignore[arg-type]
        assert len(dead_segments) == 2, dead_segments
        assert all(os.path.exists(f"/dev/shm/{n}") for n in dead_segments)
        killed_at = time.monotonic()
        rank1.kill()
        rank1.wait()
        record = submitted.next_record(20)
        assert record["error"] == "RankLostError", record
        assert "rank 1" in str(record["message"]), record
        assert str(rank1.pid) in str(record["message"]), record
        assert float(record["t_error"]) - killed_at < 5.0, record  # type: ignore[arg-type]
        assert record["unchanged"]
        assert rank0.wait(20) == 0
    assert_path_ran(daemon, path, 1)
    poll_until(
        lambda: not any(os.path.exists(f"/dev/shm/{n}") for n in dead_segments),
        5.0, "the dead client's segments are unlinked",
    )
    # ... and unmapped by the daemon, so their memory really returns.
    assert not mapped_segments(daemon.pid) & dead_segments
    assert_two_rank_allreduce_works(daemon.endpoint, "killed")  # the same job name re-forms
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_killed_client_is_noticed_even_if_a_forked_child_holds_its_socket(
    daemon: DaemonProcess,
) -> None:
    processes = spawn_ranks(
        daemon.endpoint, "fail_killed.py", 2, ["6", "--fork-holder"], job="forked"
    )
    child = 0
    try:
        with reaped(processes):
            rank0, rank1 = processes
            ready = LineReader(rank1).next_record(20)
            child = int(ready["child"])  # type: ignore[arg-type]
            submitted = LineReader(rank0)
            assert "submitted" in submitted.next_record(20)
            rank1.kill()
            rank1.wait()  # reaped: its pid is gone, not a zombie
            record = submitted.next_record(20)
            assert record["error"] == "RankLostError", record
            assert "rank 1" in str(record["message"])
    finally:
        if child > 0:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_duplicate_rank_is_refused_and_a_clean_leave_fails_the_waiting_rank(
    daemon: DaemonProcess,
) -> None:
    first, second = clients(daemon.endpoint, "members", 2)
    try:
        with pytest.raises(JobError, match="already connected") as caught:
            Client(daemon.endpoint, job="members", rank=1, world_size=2)
        assert f"pid {os.getpid()}" in str(caught.value)
        with pytest.raises(JobError, match="world_size=2"):
            Client(daemon.endpoint, job="members", rank=2, world_size=3)
        a, b = np.ones(3), np.ones(3)
        work = first.all_reduce(a, async_op=True)  # the refusals did not break the job
        second.all_reduce(b)
        assert work is not None and work.wait()
        np.testing.assert_array_equal(a, np.full(3, 2.0))
        work = first.all_reduce(a, async_op=True)
        assert work is not None
        second.close()  # leaves cleanly while rank 0 waits
        with pytest.raises(RankLostError, match="rank 1") as lost:
            work.wait(timeout=10)
        assert "disconnected" in str(lost.value)
        np.testing.assert_array_equal(a, np.full(3, 2.0))
    finally:
        first.close()
        second.close()
    daemon.assert_alive()


# -- the daemon dies or stops ------------------------------------------------


@pytest.mark.timeout(60)
def test_daemon_sigkill_fails_waiting_client_and_next_daemon_sweeps_segments(
    start_daemon: StartDaemon,
) -> None:
    doomed = start_daemon()
    client = Client(doomed.endpoint, job="orphan", rank=0, world_size=2)
    try:
        array = client.empty(4096, np.float32)
        array[...] = 1
        work = client.all_reduce(array, async_op=True)
        assert work is not None
        leftovers = segments_of(doomed.pid)
        assert leftovers, "the daemon should own the empty() segment"
        doomed.process.kill()
        doomed.process.wait()  # reap: a zombie's pid would still look alive to the sweep
        started = time.monotonic()
        with pytest.raises(DaemonUnavailableError) as caught:
            work.wait()
        assert time.monotonic() - started < 5.0
        assert not isinstance(caught.value, DaemonShuttingDownError)
        with pytest.raises(DaemonUnavailableError):
            client.all_reduce(np.ones(2, dtype=np.float32))
        np.testing.assert_array_equal(array, np.ones(4096, dtype=np.float32))
    finally:
        client.close()
    # A fresh socket; the sweep runs at start, before the daemon answers pings.  (Not
    # checked through its log: any other daemon starting on this machine meanwhile,
    # say from a concurrent test run, sweeps the same leftovers.)
    successor = start_daemon()
    assert segments_of(doomed.pid) == []
    assert_two_rank_allreduce_works(successor.endpoint, "after-sweep")


@pytest.mark.timeout(60)
def test_sigterm_fails_pending_collective_with_shutting_down(
    daemon: DaemonProcess,
) -> None:
    client = Client(daemon.endpoint, job="stopping", rank=0, world_size=2)
    try:
        array = client.empty(1024, np.float32)
        array[...] = 3
        work = client.all_reduce(array, async_op=True)
        assert work is not None
        # Requests on one connection are served in order: once this allocation is
        # answered, the daemon holds the all_reduce as pending.
        client.empty(16, np.float32)
        assert not work.is_completed()
        daemon.process.send_signal(signal.SIGTERM)
        with pytest.raises(DaemonShuttingDownError, match="shutting down"):
            work.wait()
        assert isinstance(work.exception(), DaemonUnavailableError)
        np.testing.assert_array_equal(array, np.full(1024, 3, dtype=np.float32))
    finally:
        client.close()
    assert daemon.process.wait(20) == 0, daemon.log()
    assert segments_of(daemon.pid) == []
    assert not os.path.exists(daemon.socket_path)
    # The lock file stays on purpose (removing it races with a starting daemon),
    # but nobody holds it any more.
    assert_lock_released(daemon.socket_path + ".lock")


# -- asynchronous collectives ------------------------------------------------


@pytest.mark.timeout(90)
def test_64_collectives_in_flight_waited_in_shuffled_order(daemon: DaemonProcess) -> None:
    results = run_ranks(daemon.endpoint, "fail_async.py", 2, job="async", timeout_s=80)
    orders = []
    for result in results:
        (record,) = result.records()
        assert record["checked"] == 64
        assert record["wrong"] == [], f"rank {result.rank} got wrong results: {record}"
        orders.append(record["order"])
    assert orders[0] != orders[1], "ranks should wait in different orders"
    daemon.assert_alive()


@pytest.mark.timeout(60)
def test_wait_timeout_leaves_the_collective_in_flight_until_the_peer_catches_up(
    daemon: DaemonProcess,
) -> None:
    first, second = clients(daemon.endpoint, "catch-up", 2)
    try:
        a = np.arange(6, dtype=np.float64)
        b = np.full(6, 10, dtype=np.float64)
        work = first.all_reduce(a, async_op=True)
        assert work is not None
        assert not work.is_completed()
        started = time.monotonic()
        with pytest.raises(CollectiveTimeoutError, match="still in flight"):
            work.wait(timeout=0.3)
        assert 0.25 <= time.monotonic() - started < 5
        assert not work.is_completed() and work.exception() is None
        np.testing.assert_array_equal(a, np.arange(6, dtype=np.float64))  # no partial result
        second.all_reduce(b)
        poll_until(work.is_completed, 10.0, "the collective completes once rank 1 submits")
        assert work.wait() and work.exception() is None
        np.testing.assert_array_equal(a, np.arange(6, dtype=np.float64) + 10)
        np.testing.assert_array_equal(b, a)
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(60)
def test_scratch_for_a_huge_ordinary_array_is_not_kept(daemon: DaemonProcess) -> None:
    """Staging a 320 MiB ordinary array must not pin 512 MiB of scratch for good."""
    with Client(daemon=daemon.endpoint, job="scratch", rank=0, world_size=1) as client:
        huge = np.ones(80 * 1024 * 1024, np.float32)
        client.all_reduce(huge)
        assert huge[0] == 1 and huge[-1] == 1
        # Staged (async: the socket path; small synchronous ones take the fast
        # page, which stages nothing): giving back this slot releases the huge one ...
        small = np.ones(16, np.float32)
        work = client.all_reduce(small, async_op=True)
        assert work is not None and work.wait()
        client.all_reduce(small)  # ... and the next call sends the queued free.
        poll_until(lambda: query(daemon.endpoint, 5.0)["shm_in_use"] <= 256 * 1024**2,
                   10, "the huge scratch segment is freed")


@pytest.mark.timeout(90)
def test_scratch_slot_the_current_size_needs_is_kept(daemon: DaemonProcess) -> None:
    """A 256 MiB ordinary array, after a small one, reuses its scratch segment on every op
    instead of freeing it and allocating a fresh one each time."""
    def scratch_segments() -> set[str]:
        return {name for name in segments_of(daemon.pid)
                if os.path.getsize(os.path.join("/dev/shm", name)) >= 256 * 1024**2}

    with Client(daemon=daemon.endpoint, job="scratch-reuse", rank=0, world_size=1) as client:
        client.all_reduce(np.ones(16, np.float32))  # leaves a small idle slot
        big = np.ones(64 * 1024 * 1024, np.float32)  # 256 MiB
        seen = []
        for _ in range(3):
            client.all_reduce(big)
            seen.append(scratch_segments())
        assert big[0] == 1 and big[-1] == 1
        assert len(seen[0]) == 1, seen
        assert seen[1] == seen[0] and seen[2] == seen[0], seen


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.fault
@pytest.mark.timeout(180)
def test_a_rank_killed_mid_allreduce_leaves_nothing_mapped_in_the_daemon(
    daemon: DaemonProcess,
) -> None:
    """Rounds of "3 ranks, one SIGKILLed mid 64 MiB allreduce": once each round is over the
    daemon maps none of that round's segments, holds no more descriptors than before, and
    its statistics count what it still maps."""
    fds_before = _open_fds(daemon.pid)
    for round_number in range(5):
        processes = spawn_ranks(daemon.endpoint, "fail_killed_mid.py", 3, ["60"],
                                job=f"killed-mid-{round_number}")
        with reaped(processes):
            readers = [LineReader(p) for p in processes]
            for reader in readers:
                assert "ready" in reader.next_record(30)
            # Kill at a different point of the collective each round.
            time.sleep(0.02 * round_number)
            processes[2].kill()
            processes[2].wait()
            for reader in readers[:2]:
                record = reader.next_record(60)
                assert record["error"] in ("RankLostError", "JobError"), record
            for process in processes[:2]:
                assert process.wait(30) == 0
        # The counter drops when the last view of a segment is collected, a moment
        # after the unmapping (in whichever thread dropped it): both are awaited.
        poll_until(lambda: not mapped_segments(daemon.pid)
                   and query(daemon.endpoint, 5.0)["shm_in_use"] == 0, 20.0,
                   f"round {round_number}: the daemon unmaps every segment "
                   f"(still {sorted(mapped_segments(daemon.pid))}, "
                   f"stats in_use {query(daemon.endpoint, 5.0)['shm_in_use']})")
        poll_until(lambda: _open_fds(daemon.pid) <= fds_before, 20.0,
                   f"round {round_number}: no descriptor kept ({_open_fds(daemon.pid)} open, "
                   f"{fds_before} before)")
    daemon.assert_alive()
