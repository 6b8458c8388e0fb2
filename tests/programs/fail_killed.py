"""Rank program for the killed-client tests.

Rank 1 maps a few segments, optionally forks a child that inherits its socket
(as a fork-started DataLoader worker would), prints `{"ready": ...}` and then
blocks until the test SIGKILLs it.

Rank 0 submits an all_reduce, prints `{"submitted": ...}`, then waits at most
argv[1] seconds (a local bound, so a missing error shows as a local timeout,
never a hang) and prints the error it got with a CLOCK_MONOTONIC timestamp.
With `--sync` it makes a synchronous call instead (with argv[1] as its
collective timeout), which waits on the job's fast page.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

from gradsync.client import Client, GradsyncError


def rank1(fork_holder: bool) -> int:
    client = Client()
    first = client.empty(10_000, np.float32)
    second = client.empty(50_000, np.float64)
    first[...] = 1
    second[...] = 2
    child = 0
    if fork_holder:
        child = os.fork()
        if child == 0:  # holds a copy of the client socket until killed
            while True:
                signal.pause()
    print(json.dumps({"ready": os.getpid(), "child": child}), flush=True)
    while True:  # wait to be killed; never returns
        signal.pause()


def rank0(wait_s: float, sync: bool) -> int:
    with Client(timeout_s=wait_s if sync else None) as client:
        array = client.empty(1000, np.float32)
        array[...] = 1
        if sync:
            print(json.dumps({"submitted": os.getpid()}), flush=True)
        else:
            work = client.all_reduce(array, async_op=True)
            assert work is not None
            print(json.dumps({"submitted": os.getpid()}), flush=True)
        record: dict[str, object] = {"rank": 0}
        try:
            if sync:
                client.all_reduce(array)
            else:
                work.wait(timeout=wait_s)
            record["error"] = None
        except GradsyncError as exc:
            record["error"] = type(exc).__name__
            record["message"] = str(exc)
            record["details"] = exc.details
        record["t_error"] = time.monotonic()
        record["unchanged"] = bool(np.all(array == 1))
    print(json.dumps(record), flush=True)
    return 0


def main() -> int:
    wait_s = float(sys.argv[1])
    fork_holder = "--fork-holder" in sys.argv
    if int(os.environ["RANK"]) == 1:
        return rank1(fork_holder)
    return rank0(wait_s, "--sync" in sys.argv)


if __name__ == "__main__":
    sys.exit(main())
