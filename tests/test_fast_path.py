"""The shared-memory fast path for small synchronous allreduces of one node.

Results equal the socket path's bit for bit around the size limit (with the
compiled publish-and-spin and with its Python steps), the statistics say which
path ran, a rank waiting for a late peer sleeps, the daemon idles, and a
daemon that stops or dies reaches a waiting rank as it does on the socket path.
(Mismatch, timeout and dead-rank errors on every path: tests/test_failures.py,
parametrized by path.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    FAST_PATH_SETTINGS,
    WITHOUT_THE_FASTPAGE_MODULE,
    DaemonProcess,
    poll_until,
    run_ranks,
)
from gradsync.client import (
    Client,
    DaemonShuttingDownError,
    DaemonUnavailableError,
    InvalidArgumentError,
)
from gradsync.client.cli.stats import fetch_snapshot
from gradsync.client.ping import query
from gradsync.protocol.fast_path import PUBLISHED

StartDaemon = Callable[..., DaemonProcess]
LIMIT = 4096
_TICKS = os.sysconf("SC_CLK_TCK")


def counters(daemon: DaemonProcess) -> dict[str, int]:
    return query(daemon.endpoint, 10.0)["counters"]  # type: ignore[no-any-return]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
def test_around_the_limit_every_path_agrees_bit_for_bit_and_the_counters_say_which_ran(
    start_daemon: StartDaemon, nranks: int
) -> None:
    daemon = start_daemon("--fast-path-bytes", str(LIMIT))
    digests = {}
    for path, setting in FAST_PATH_SETTINGS.items():
        before = counters(daemon)
        env = {"GRADSYNC_FAST_PATH": setting}
        results = run_ranks(daemon.endpoint, "fast_path_matrix.py", nranks, [str(LIMIT)],
                            job=f"limit-{path}", env=env, timeout_s=100)
        summaries = [result.records()[-1] for result in results]
        assert all(s["failures"] == 0 for s in summaries), [r.stdout for r in results]
        digests[path] = {s["digest"] for s in summaries}
        assert len(digests[path]) == 1, f"ranks disagree on the {path} path: {summaries}"
        after = counters(daemon)
        small, checked = int(summaries[0]["small"]), int(summaries[0]["checked"])
        assert 0 < small < checked
        fast = after["fast_path_collectives"] - before["fast_path_collectives"]
        socket_runs = after["collectives"] - before["collectives"]
        if path != "socket":
            assert (fast, socket_runs) == (small, checked - small)
        else:
            assert (fast, socket_runs) == (0, checked)
        assert after["fast_path_fallbacks"] == before["fast_path_fallbacks"]
    assert digests["fast"] == digests["fast-python"] == digests["socket"]
    daemon.assert_alive()


@pytest.mark.timeout(150)
def test_without_the_compiled_module_a_page_locks_with_flock_and_a_mutex_page_is_declined(
    start_daemon: StartDaemon, tmp_path: Path
) -> None:
    """An install that did not build protocol/_fastpage.c: its daemon formats pages
    with flock as their lock and its clients run the Python steps there; its clients,
    given a daemon that has the module (a mutex page), decline the page with a warning
    and keep to the socket.  Both runs' results are the same bit for bit."""
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_THE_FASTPAGE_MODULE)
    not_built = {"PYTHONPATH": os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    built = start_daemon("--fast-path-bytes", str(LIMIT))
    bare = start_daemon("--fast-path-bytes", str(LIMIT), env=not_built)
    digests = {}
    for name, daemon in [("flock page", bare), ("mutex page declined", built)]:
        before = counters(daemon)
        results = run_ranks(daemon.endpoint, "fast_path_matrix.py", 2, [str(LIMIT)],
                            job=f"unbuilt-{len(digests)}", env=not_built, timeout_s=100)
        summaries = [result.records()[-1] for result in results]
        assert all(s["failures"] == 0 for s in summaries), [r.stdout for r in results]
        digests[name] = {s["digest"] for s in summaries}
        after = counters(daemon)
        small, checked = int(summaries[0]["small"]), int(summaries[0]["checked"])
        fast = after["fast_path_collectives"] - before["fast_path_collectives"]
        socket_runs = after["collectives"] - before["collectives"]
        expected = (small, checked - small) if name == "flock page" else (0, checked)
        assert (fast, socket_runs) == expected, name
        declined = ["needs gradsync.protocol._fastpage" in r.stderr for r in results]
        assert declined == [name == "mutex page declined"] * 2, [r.stderr for r in results]
    assert digests["flock page"] == digests["mutex page declined"]
    assert len(digests["flock page"]) == 1


@pytest.mark.timeout(60)
def test_a_rank_waiting_for_a_late_peer_sleeps_and_the_daemon_idles(
    daemon: DaemonProcess,
) -> None:
    first, second = (Client(daemon.endpoint, job="late", rank=r, world_size=2)
                     for r in range(2))
    try:
        assert first._fast is not None and second._fast is not None
        a, b = np.full(256, 1.0), np.full(256, 2.0)
        waiter = threading.Thread(target=first.all_reduce, args=(a,))
        daemon_cpu, own_cpu, started = cpu_seconds(daemon.pid), time.process_time(), \
            time.monotonic()
        waiter.start()
        time.sleep(2.0)  # what is measured: two seconds of waiting
        own_used = time.process_time() - own_cpu
        daemon_used = cpu_seconds(daemon.pid) - daemon_cpu
        waited = time.monotonic() - started
        # The statistics show what rank 0 waits for, though the daemon is not on the path.
        (flight,) = fetch_snapshot(daemon.endpoint + ".stats", 5.0)["jobs"]["late"]["in_flight"]
        assert flight["path"] == "fast" and flight["waiting_for_ranks"] == [1], flight
        assert flight["key"] == 0 and flight["age_s"] > 1.5, flight
        second.all_reduce(b)
        waiter.join(10)
        assert not waiter.is_alive()
        np.testing.assert_array_equal(a, np.full(256, 3.0))
        np.testing.assert_array_equal(b, a)
        # Clock ticks are 10 ms: 1 % of two seconds is two of them.
        assert daemon_used <= 0.01 * waited + 1 / _TICKS, daemon_used
        assert own_used <= 0.05 * waited, own_used
        assert counters(daemon)["fast_path_collectives"] == 1
        job = fetch_snapshot(daemon.endpoint + ".stats", 5.0)["jobs"]["late"]
        assert job["done"] == {"allreduce/fast": 1} and job["fast_path_fallbacks"] == 0, job
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(60)
def test_a_peer_on_the_socket_brings_the_fast_waiter_along(daemon: DaemonProcess) -> None:
    """Rank 0 waits on the page, rank 1 sends the same key asynchronously: both
    end over the socket with the right result."""
    first, second = (Client(daemon.endpoint, job="mixed", rank=r, world_size=2)
                     for r in range(2))
    try:
        a, b = np.full(64, 1.0, np.float32), np.full(64, 5.0, np.float32)
        waiter = threading.Thread(target=first.all_reduce, args=(a,))
        waiter.start()
        assert first._fast is not None
        poll_until(lambda: first._fast.page.word(0, PUBLISHED) == 0, 10, "rank 0 publishes")
        work = second.all_reduce(b, async_op=True)
        assert work is not None and work.wait()
        waiter.join(10)
        assert not waiter.is_alive()
        np.testing.assert_array_equal(a, np.full(64, 6.0, np.float32))
        np.testing.assert_array_equal(b, a)
        seen = counters(daemon)
        assert (seen["fast_path_fallbacks"], seen["collectives"]) == (1, 1)
    finally:
        first.close()
        second.close()
    # Once the job ended, its statistics keep what its page counted.
    poll_until(lambda: not fetch_snapshot(daemon.endpoint + ".stats", 5.0)["jobs"]["mixed"]
               ["active"], 10, "the job ends")
    job = fetch_snapshot(daemon.endpoint + ".stats", 5.0)["jobs"]["mixed"]
    assert job["done"] == {"allreduce/local": 1} and job["fast_path_fallbacks"] == 1, job


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
def test_a_daemon_that_stops_reaches_the_rank_waiting_on_its_page(
    start_daemon: StartDaemon, stop: str
) -> None:
    daemon = start_daemon()
    client = Client(daemon.endpoint, job="orphan", rank=0, world_size=2)
    errors: list[BaseException] = []
    array = np.full(512, 7, np.int32)

    def wait() -> None:
        try:
            client.all_reduce(array)
        except BaseException as exc:  # kept for the assertions below
            errors.append(exc)

    try:
        waiter = threading.Thread(target=wait)
        waiter.start()
        assert client._fast is not None
        poll_until(lambda: client._fast.page.word(0, PUBLISHED) == 0, 10, "rank 0 publishes")
        stopped_at = time.monotonic()
        daemon.process.send_signal(signal.SIGTERM if stop == "sigterm" else signal.SIGKILL)
        waiter.join(20)
        assert not waiter.is_alive()
        assert time.monotonic() - stopped_at < 5.0
        (error,) = errors
        assert isinstance(error, DaemonUnavailableError), repr(error)
        if stop == "sigterm":
            assert isinstance(error, DaemonShuttingDownError), repr(error)
        else:
            assert not isinstance(error, DaemonShuttingDownError), repr(error)
            daemon.process.wait()
        np.testing.assert_array_equal(array, np.full(512, 7, np.int32))
    finally:
        client.close()
    if stop == "sigterm":
        assert daemon.process.wait(20) == 0, daemon.log()


@pytest.mark.timeout(60)
def test_an_overflowing_fast_sum_is_inf_without_a_warning_under_the_callers_raise(
    daemon: DaemonProcess,
) -> None:
    """The page's reduction runs with floating-point errors ignored, as the
    daemon's does, whatever the caller's numpy error state, and leaves that state."""
    clients = [Client(daemon.endpoint, job="overflow", rank=r, world_size=2) for r in range(2)]
    arrays = [np.full(16, 60000, np.float16) for _ in clients]
    problems: list[BaseException] = []
    states: list[str] = []

    def rank(index: int) -> None:
        try:
            with np.errstate(all="raise"), warnings.catch_warnings():
                warnings.simplefilter("error")
                clients[index].all_reduce(arrays[index])
                states.append(np.geterr()["over"])
        except BaseException as exc:  # reported below, with the thread's error
            problems.append(exc)

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not problems, problems
        assert states == ["raise", "raise"]
        for array in arrays:
            assert np.isposinf(array).all(), array
        assert counters(daemon)["fast_path_collectives"] == 1
    finally:
        for client in clients:
            client.close()


@pytest.mark.timeout(60)
def test_an_explicit_no_compression_still_ends_on_the_page(daemon: DaemonProcess) -> None:
    """compression="none" asks for nothing between daemons: a small synchronous
    allreduce of a one-node job stays on the fast page; an explicit format for an
    integer buffer is still refused, by the socket path's check."""
    clients = [Client(daemon.endpoint, job="plain", rank=r, world_size=2) for r in range(2)]
    arrays = [np.full(64, r + 1.0, np.float32) for r in range(2)]
    try:
        before = counters(daemon)["fast_path_collectives"]
        threads = [threading.Thread(target=c.all_reduce, args=(a,),
                                    kwargs={"compression": "none"})
                   for c, a in zip(clients, arrays, strict=True)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert all((array == 3.0).all() for array in arrays)
        assert counters(daemon)["fast_path_collectives"] == before + 1
        with pytest.raises(InvalidArgumentError, match="compression"):
            clients[0].all_reduce(np.ones(4, np.int32), compression="bf16")
    finally:
        for client in clients:
            client.close()
