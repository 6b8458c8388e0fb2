"""A private `gradsyncd` for one benchmark run, on a short socket path under /tmp.

Started as a subprocess, awaited by pinging (no fixed sleeps), stopped with
SIGTERM.  On the way out it checks that the daemon exited cleanly and left no
`/dev/shm/gradsync-<pid>-*` segment; leftovers are removed and reported, so a
run never leaves shared memory behind but a leak is still visible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

SHM_DIR = "/dev/shm"
_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0


@dataclasses.dataclass
class DaemonRun:
    """The running daemon, and what happened when it stopped."""

    endpoint: str
    folder: str
    process: subprocess.Popen[bytes]
    log_path: str
    exit_code: int | None = None
    leaked_segments: list[str] = dataclasses.field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def command(self) -> list[str]:
        return [str(arg) for arg in self.process.args]  # type: ignore[union-attr]

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as log:
                return "".join(log.readlines()[-lines:])
        except OSError:
            return ""


def _segments_of(pid: int) -> list[str]:
    prefix = f"gradsync-{pid}-"
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
    except OSError:
        return []


def _answers(endpoint: str, timeout_s: float) -> bool:
    from gradsync.client.ping import query
    from gradsync.protocol.errors import GradsyncError

    try:
        query(endpoint, timeout_s)
    except GradsyncError:
        return False
    return True


def _wait_ready(run: DaemonRun) -> None:
    deadline = time.monotonic() + _READY_TIMEOUT_S
    while not _answers(run.endpoint, 1.0):
        if run.process.poll() is not None:
            raise RuntimeError(
                f"gradsyncd exited with status {run.process.returncode}:\n{run.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"gradsyncd did not answer within {_READY_TIMEOUT_S:g}s")
        time.sleep(0.02)


def _stop(run: DaemonRun) -> None:
    if run.process.poll() is None:
        run.process.send_signal(signal.SIGTERM)
        try:
            run.process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            run.process.kill()
            run.process.wait()
    run.exit_code = run.process.returncode
    run.leaked_segments = _segments_of(run.pid)
    for name in run.leaked_segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


@contextlib.contextmanager
def private_daemon(*daemon_args: str) -> Iterator[DaemonRun]:
    """Yield a ready daemon in a fresh 0700 folder; stop it and clean up afterwards."""
    folder = tempfile.mkdtemp(prefix="gsb-", dir="/tmp")
    os.chmod(folder, 0o700)
    endpoint = f"ipc://{folder}/d.sock"
    log_path = os.path.join(folder, "gradsyncd.log")
    command = [sys.executable, "-m", "gradsync.daemon", "--socket", endpoint, *daemon_args]
    try:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        run = DaemonRun(endpoint, folder, process, log_path)
        try:
            _wait_ready(run)
            yield run
        finally:
            _stop(run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
