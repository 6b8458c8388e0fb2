"""A private `gradsyncd` as a subprocess: start it, wait until it answers, stop it.

The one launcher of the project: `gradsync launch` and `gradsync demo` start
a daemon with it when none answers, the tests' fixtures start theirs with it,
and so do the benchmarks.  It runs `python -m gradsync.daemon` as a process
(the client never imports the daemon package), optionally after a command
prefix such as `ip netns exec NS`.  Readiness is a ping answered before a
deadline, never a fixed sleep, and a daemon that exits first fails the start
at once.  Stopping is SIGTERM, then SIGKILL after a timeout.  Afterwards
`sweep_segments` lists and removes the `/dev/shm/gradsync-<pid>-*` segments
the daemon left behind (their names end in a random tag; the pid part is what
ties them to this daemon), so a caller can report a leak without leaving one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gradsync.client.ping import query
from gradsync.protocol.errors import GradsyncError
from gradsync.protocol.shm import SEGMENT_PREFIX, SHM_DIR

#: The interpreter's words of a daemon command, after the prefix.
_DAEMON_MODULE = ("-m", "gradsync.daemon")

#: A detached daemon's keeper: a shell that runs it in the background, passes
#: SIGTERM and SIGINT on, and exits with its status once it is gone.  A
#: supervisor that kills the caller's children (Ray kills a worker's when the
#: worker exits) kills only the keeper; the daemon lives on to its idle exit.
_KEEPER = ("sh", "-c", '"$@" & child=$!; trap \'kill -TERM $child 2>/dev/null\' TERM INT; '
           'while :; do wait $child; status=$?; kill -0 $child 2>/dev/null || exit $status; '
           'done', "gradsyncd-keeper")


class DaemonStartError(RuntimeError):
    """The daemon exited (`exit_code` set) or did not answer a ping in time (None)."""

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def segments_of(pid: int) -> list[str]:
    """Names of the /dev/shm segments of the daemon with this pid (`gradsync-<pid>-*`)."""
    prefix = f"{SEGMENT_PREFIX}{pid}-"
    try:
        return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefix))
    except OSError:
        return []


@dataclasses.dataclass
class DaemonProcess:
    """A started gradsyncd, and what happened when it stopped."""

    endpoint: str
    #: The folder that holds its socket and log, when the caller made one for it.
    folder: str | None
    process: subprocess.Popen[bytes]
    #: Its stdout and stderr; None when they go where the caller's go.
    log_path: Path | None
    exit_code: int | None = None
    #: It ignored SIGTERM for the whole stop timeout and was killed.
    killed: bool = False
    leaked_segments: list[str] = dataclasses.field(default_factory=list)
    #: How many leading words of `command` are a prefix (e.g. `ip netns exec NS`).
    prefix_words: int = 0
    #: How many of those are the keeper of a detached daemon (not shown).
    keeper_words: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def command(self) -> list[str]:
        return [str(arg) for arg in self.process.args]  # type: ignore[union-attr]

    def shown_command(self) -> str:
        """Its command as a user would type it: `[prefix] gradsyncd ARGS`."""
        words = self.command
        rest = words[self.prefix_words + 1 + len(_DAEMON_MODULE) :]
        return shlex.join([*words[self.keeper_words : self.prefix_words], "gradsyncd", *rest])

    def log(self) -> str:
        """Everything it wrote so far ("" without a log file)."""
        if self.log_path is None:
            return ""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        return "".join(self.log().splitlines(keepends=True)[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self, timeout_s: float, poll_s: float = 0.02) -> None:
        """Return once it answers a ping; DaemonStartError if it exits or `timeout_s` passes.

        Leaves the process as it is either way: stopping it is the caller's.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise DaemonStartError(
                    f"gradsyncd exited with status {self.process.returncode}",
                    self.process.returncode,
                )
            try:
                query(self.endpoint, 1.0)
                return
            except GradsyncError:
                if time.monotonic() > deadline:
                    raise DaemonStartError(
                        f"gradsyncd did not answer at {self.endpoint} within {timeout_s:g}s"
                    ) from None
                time.sleep(poll_s)

    def terminate(self) -> None:
        """SIGTERM, if it still runs."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float) -> int:
        """Wait for its exit (SIGKILL after `timeout_s`); record and return its status."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.killed = True
            self.process.kill()
            self.process.wait()
        self.exit_code = self.process.returncode
        return self.exit_code

    def stop(self, timeout_s: float) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status."""
        self.terminate()
        return self.wait_stopped(timeout_s)

    def sweep_segments(self) -> list[str]:
        """Remove the segments it left behind; returns (and records) their names."""
        self.leaked_segments = segments_of(self.pid)
        for name in self.leaked_segments:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
        return self.leaked_segments


def daemon_command(endpoint: str, daemon_args: Sequence[str] = ()) -> list[str]:
    """`python -m gradsync.daemon --socket ENDPOINT DAEMON_ARGS`: gradsyncd under this
    interpreter."""
    return [sys.executable, *_DAEMON_MODULE, "--socket", endpoint, *daemon_args]


def start_daemon(
    endpoint: str,
    daemon_args: Sequence[str] = (),
    *,
    folder: str | None = None,
    log_path: str | Path | None = None,
    prefix: Sequence[str] = (),
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    new_session: bool = False,
    detached: bool = False,
) -> DaemonProcess:
    """Start `[prefix] python -m gradsync.daemon --socket ENDPOINT DAEMON_ARGS`.

    Output goes to `log_path` (stderr too) or, without one, where ours goes;
    `env` None inherits this environment.  `new_session`: a terminal's Ctrl-C
    then reaches only the caller, which stops the daemon when it is done.
    `detached`: the daemon is not the caller's child but its keeper's (`_KEEPER`),
    so it outlives a caller killed with its children.  Call `wait_ready` next.
    """
    keeper = _KEEPER if detached else ()
    prefix = [*keeper, *prefix]
    command = [*prefix, *daemon_command(endpoint, daemon_args)]
    log = Path(log_path) if log_path is not None else None
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(open(log, "wb")) if log is not None else None
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            env=env, cwd=cwd, start_new_session=new_session,
        )
    return DaemonProcess(endpoint, folder, process, log, prefix_words=len(prefix),
                         keeper_words=len(keeper))
