"""Doorbells between two processes, measured: how the fast path's waiters wake.

    python -m benchmarks.doorbell [--rounds 20000] [--out benchmarks/RESULTS.md]

A ping-pong between a parent and a forked child: one side rings, the other
wakes and rings back; the table gives the round trip (median and p99 over
batches of 100) for each candidate the fast path could use: the Unix stream
socket (today's control path), an eventfd pair, a futex in a shared page (a
sleeping wait), a spin on a shared word (a busy wait), and a bounded spin
followed by a futex sleep, plain or yielding the core at every look (the
latter is what client/fast_path.py does).  Two processes on two cores, and the same pinned
to one core (as when ranks outnumber cores).
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np

from benchmarks import results_file
from gradsync.protocol.futex import Futex

_BATCH = 100
#: Side → a function ringing the other side, and one waiting for the other side's ring.
Bell = tuple[Callable[[int], None], Callable[[int], None]]


def _socket_bells() -> tuple[Bell, Bell]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def pair(mine: socket.socket) -> Bell:
        return (lambda _n: mine.send(b"x") and None), (lambda _n: mine.recv(1) and None)

    return pair(a), pair(b)


def _eventfd_bells() -> tuple[Bell, Bell]:
    to_child, to_parent = os.eventfd(0), os.eventfd(0)
    parent = ((lambda _n: os.eventfd_write(to_child, 1)),
              (lambda _n: os.eventfd_read(to_parent) and None))
    child = ((lambda _n: os.eventfd_write(to_parent, 1)),
             (lambda _n: os.eventfd_read(to_child) and None))
    return parent, child


def _shared_words(page: mmap.mmap) -> np.ndarray:
    return np.frombuffer(page, dtype=np.uint32, count=32)


def _word_bells(
    page: mmap.mmap, spin_s: float, sleep: bool, yielding: bool = False
) -> tuple[Bell, Bell]:
    """Each side waits for its word to reach the round number: spin up to `spin_s`
    (giving up the core at every look if `yielding`), then (if `sleep`) sleep on
    the word's futex; the ringer wakes sleepers."""
    words = _shared_words(page)
    futexes = [Futex(page, 0), Futex(page, 64)]

    def side(mine: int) -> Bell:
        other = 1 - mine

        def ring(n: int) -> None:
            words[other * 16] = n
            if sleep:
                futexes[other].wake_all()

        def wait(n: int) -> None:
            until = time.perf_counter() + spin_s
            while words[mine * 16] != n:
                if yielding:
                    os.sched_yield()
                if sleep and time.perf_counter() > until:
                    futexes[mine].wait(int(words[mine * 16]), 0.05)

        return ring, wait

    return side(0), side(1)


def measure(make: Callable[[], tuple[Bell, Bell]], rounds: int, one_core: bool) -> list[float]:
    """Round-trip times (seconds per round, per batch) of one doorbell."""
    parent, child = make()
    pid = os.fork()
    if pid == 0:  # the child: answer every ring
        try:
            if one_core:
                os.sched_setaffinity(0, {0})
            ring, wait = child
            for n in range(1, rounds + 1):
                wait(n)
                ring(n)
        finally:
            os._exit(0)
    if one_core:
        os.sched_setaffinity(0, {0})
    ring, wait = parent
    samples = []
    for start in range(1, rounds + 1, _BATCH):
        began = time.perf_counter()
        for n in range(start, min(start + _BATCH, rounds + 1)):
            ring(n)
            wait(n)
        samples.append((time.perf_counter() - began) / _BATCH)
    os.waitpid(pid, 0)
    if one_core:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--out", metavar="RESULTS.md", help="also write the table there")
    args = parser.parse_args(argv)
    page = mmap.mmap(-1, mmap.PAGESIZE, mmap.MAP_SHARED)
    # (name, doorbell, whether it only spins: on one core a spinner holds the core
    # its peer needs until the scheduler preempts it, so it gets few rounds there)
    candidates: list[tuple[str, Callable[[], tuple[Bell, Bell]], bool]] = [
        ("Unix stream socket", _socket_bells, False),
        ("eventfd", _eventfd_bells, False),
        ("futex in a shared page (sleep at once)", lambda: _word_bells(page, 0.0, True), False),
        ("spin on a shared word", lambda: _word_bells(page, float("inf"), False), True),
        ("spin 200 µs, then futex", lambda: _word_bells(page, 200e-6, True), False),
        ("spin 100 µs yielding the core, then futex",
         lambda: _word_bells(page, 100e-6, True, yielding=True), False),
    ]
    lines = ["| doorbell | 2 cores: round trip p50 | p99 | 1 core: p50 | p99 |",
             "| --- | --- | --- | --- | --- |"]
    for name, make, spins in candidates:
        cells = []
        for one_core in (False, True):
            _shared_words(page)[:] = 0
            rounds = min(args.rounds, 4 * _BATCH) if one_core and spins else args.rounds
            samples = measure(make, rounds, one_core)
            cells += [f"{statistics.median(samples) * 1e6:.1f} µs",
                      f"{float(np.percentile(samples, 99)) * 1e6:.1f} µs"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.out:
        text = (
            "# Doorbells between two processes\n\n"
            f"`python -m benchmarks.doorbell --rounds {args.rounds}`: a ping-pong between "
            "two processes, median and p99 of the round trip over batches of 100 rounds "
            "(one core: both pinned to CPU 0).\n\n" + table + "\n"
        )
        results_file.write_section(args.out, "doorbell", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
