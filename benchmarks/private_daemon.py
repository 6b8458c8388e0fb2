"""Private `gradsyncd`s for one benchmark run, on short socket paths under /tmp.

`private_daemon` starts one (single-node runs); `daemon_cluster` starts several
that peer with each other over TCP, each optionally inside a network namespace
(a command prefix such as `ip netns exec NS`).  Daemons are started as
subprocesses in their own sessions (a terminal's Ctrl-C reaches the driver,
which stops them in order), awaited by pinging (no fixed sleeps), stopped with
SIGTERM.  On the way out it checks that each daemon exited cleanly and left no
`/dev/shm/gradsync-<pid>-*` segment; leftovers are removed and reported, so a
run never leaves shared memory behind but a leak is still visible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence

from processes import clean_env

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
    #: How many leading words of `command` are a prefix (e.g. `ip netns exec NS`).
    prefix_words: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def command(self) -> list[str]:
        return [str(arg) for arg in self.process.args]  # type: ignore[union-attr]

    def shown_command(self) -> str:
        """The command as a user would type it: `[prefix] gradsyncd ARGS`."""
        words = self.command
        prefix, rest = words[: self.prefix_words], words[self.prefix_words + 3 :]
        return shlex.join([*prefix, "gradsyncd", *rest])

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


def _wait_ready(run: DaemonRun, timeout_s: float = _READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not _answers(run.endpoint, 1.0):
        if run.process.poll() is not None:
            raise RuntimeError(
                f"gradsyncd exited with status {run.process.returncode}:\n{run.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"gradsyncd did not answer within {timeout_s:g}s")
        time.sleep(0.02)


def _finish(run: DaemonRun) -> None:
    """Wait for a daemon that was sent SIGTERM (SIGKILL after a grace), then sweep its segments."""
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


def _stop(run: DaemonRun) -> None:
    if run.process.poll() is None:
        run.process.send_signal(signal.SIGTERM)
    _finish(run)


def _launch(
    endpoint: str,
    log_path: str,
    daemon_args: Sequence[str],
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> DaemonRun:
    command = [*prefix, sys.executable, "-m", "gradsync.daemon", "--socket", endpoint,
               *daemon_args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )
    return DaemonRun(endpoint, os.path.dirname(log_path), process, log_path,
                     prefix_words=len(prefix))


def _private_folder() -> str:
    folder = tempfile.mkdtemp(prefix="gsb-", dir="/tmp")
    os.chmod(folder, 0o700)
    return folder


@contextlib.contextmanager
def private_daemon(*daemon_args: str) -> Iterator[DaemonRun]:
    """Yield a ready daemon in a fresh 0700 folder; stop it and clean up afterwards.

    Like `daemon_cluster`, it gets no GRADSYNC_* variable from this environment:
    `daemon_args` alone configure it, so the command a report shows is the whole truth.
    """
    folder = _private_folder()
    try:
        run = _launch(f"ipc://{folder}/d.sock", os.path.join(folder, "gradsyncd.log"),
                      daemon_args, env=clean_env())
        try:
            _wait_ready(run)
            yield run
        finally:
            _stop(run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def daemon_cluster(
    daemon_args: Sequence[Sequence[str]],
    prefixes: Sequence[Sequence[str]] | None = None,
    ready_timeout_s: float = _READY_TIMEOUT_S,
    logs_to: str | None = None,
) -> Iterator[list[DaemonRun]]:
    """Yield len(daemon_args) ready daemons, daemon i started with `daemon_args[i]`
    (its --listen, --peers, keys ...) after `prefixes[i]`.

    Each gets `ipc://FOLDER/d<i>.sock` and `FOLDER/d<i>.log` in one fresh 0700
    folder (the logs can be read until the context ends).  Ready means the
    daemon answers a ping; its peers may still be connecting, and a job's first
    collective waits until the job has formed.  On the way out every daemon is
    sent SIGTERM at once, then each is awaited and its segments swept.
    """
    folder = _private_folder()
    runs: list[DaemonRun] = []
    try:
        for index, args in enumerate(daemon_args):
            prefix = prefixes[index] if prefixes is not None else ()
            # No GRADSYNC_* from this environment: the flags alone configure them.
            runs.append(_launch(f"ipc://{folder}/d{index}.sock",
                                os.path.join(folder, f"d{index}.log"), args, prefix,
                                clean_env()))
        for run in runs:
            _wait_ready(run, ready_timeout_s)
        yield runs
    finally:
        for run in runs:
            if run.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    run.process.send_signal(signal.SIGTERM)
        for run in runs:
            _finish(run)
        if logs_to is not None:
            for index, run in enumerate(runs):
                with contextlib.suppress(OSError):
                    shutil.copyfile(run.log_path, os.path.join(logs_to, f"d{index}.log"))
        shutil.rmtree(folder, ignore_errors=True)
