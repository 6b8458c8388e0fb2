"""`gradsync launch`: run N ranks of a script on this node, like torchrun.

Uses the daemon at the endpoint when one answers; otherwise starts a private
`gradsyncd` for the run and stops it afterwards.  Forwards SIGINT/SIGTERM to
the ranks; when one rank fails, stops the others and exits with its code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from types import FrameType

from gradsync.client.ping import query
from gradsync.protocol.errors import GradsyncError

_DAEMON_START_TIMEOUT_S = 30.0
_GRACE_S = 10.0


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                        help="ranks to start on this node (default 1)")
    parser.add_argument("--daemon", default=None, metavar="ENDPOINT",
                        help="daemon endpoint; a private daemon is started there (or in a "
                        "temporary folder when not given) if none answers")
    parser.add_argument("--job", default=None,
                        help="job name (default: unique per launch)")
    parser.add_argument("script", help="Python script (or executable) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def log(message: str) -> None:
    print(f"gradsync launch: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def daemon_for(endpoint: str | None) -> Iterator[str]:
    """Yield an endpoint with a live daemon, starting a private one if needed."""
    candidate = endpoint or os.environ.get("GRADSYNC_DAEMON")
    if candidate and _answers(candidate):
        yield candidate
        return
    folder = None
    if candidate is None:
        folder = tempfile.mkdtemp(prefix="gradsync-launch-")
        candidate = f"ipc://{folder}/gradsyncd.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "gradsync.daemon", "--socket", candidate],
        stdin=subprocess.DEVNULL,
    )
    try:
        _wait_ready(candidate, process)
        log(f"started a private gradsyncd (pid {process.pid}) at {candidate}")
        yield candidate
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                code = process.wait(_GRACE_S * 3)
            except subprocess.TimeoutExpired:
                process.kill()
                code = process.wait()
            if code != 0:
                log(f"private gradsyncd exited with status {code}")
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _answers(endpoint: str) -> bool:
    try:
        query(endpoint, 2.0)
    except GradsyncError:
        return False
    return True


def _wait_ready(endpoint: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _DAEMON_START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise SystemExit(f"gradsync launch: gradsyncd exited with status {process.returncode}")
        try:
            query(endpoint, 1.0)
            return
        except GradsyncError:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"gradsync launch: gradsyncd did not answer at {endpoint} within "
                    f"{_DAEMON_START_TIMEOUT_S:g}s"
                ) from None
            time.sleep(0.02)


def _rank_command(script: str, script_args: list[str]) -> list[str]:
    if script.endswith(".py") or not os.access(script, os.X_OK):
        return [sys.executable, script, *script_args]
    return [script, *script_args]


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run_ranks(
    command: list[str], nproc: int, endpoint: str, job: str
) -> int:
    """Start the ranks, watch them, and return the launch's exit status."""
    ranks: list[subprocess.Popen[bytes]] = []
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        for rank in ranks:
            if rank.poll() is None:
                rank.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for local_rank in range(nproc):
            env = dict(os.environ)
            env.update(
                RANK=str(local_rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(nproc), GRADSYNC_DAEMON=endpoint, GRADSYNC_JOB=job,
            )
            ranks.append(subprocess.Popen(command, env=env))
        return _watch(ranks, received)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _watch(ranks: list[subprocess.Popen[bytes]], received: list[int]) -> int:
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            if not received:
                log(f"rank {index} exited with status {code}; stopping the other ranks")
            _stop_all(ranks)
            return _exit_code(code or 1)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _stop_all(ranks: list[subprocess.Popen[bytes]]) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for rank in ranks:
        try:
            rank.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()


def run_launch(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1:
        log("--nproc-per-node must be at least 1")
        return 2
    command = _rank_command(args.script, list(args.script_args))
    job = args.job or f"launch-{os.getpid()}"
    with daemon_for(args.daemon) as endpoint:
        return run_ranks(command, args.nproc_per_node, endpoint, job)
