"""Private `gradsyncd`s for one benchmark run, on short socket paths under /tmp.

`private_daemon` starts one (single-node runs); `daemon_cluster` starts several
that peer with each other over TCP, each optionally inside a network namespace
(a command prefix such as `ip netns exec NS`).  Both use the project's one
launcher, `gradsync.client.daemon_process` (the tests' fixtures and `gradsync
launch` use it too): daemons run in their own sessions (a terminal's Ctrl-C
reaches the driver, which stops them in order), are awaited by pinging (no
fixed sleeps), stopped with SIGTERM.  On the way out it checks that each daemon
exited cleanly and left no `/dev/shm/gradsync-<pid>-*` segment; leftovers are
removed and reported, so a run never leaves shared memory behind but a leak is
still visible (`DaemonRun.exit_code`, `DaemonRun.leaked_segments`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence

from benchmarks.processes import clean_env
from gradsync.client.daemon_process import DaemonProcess, DaemonStartError, start_daemon

#: A daemon of a benchmark run (the launcher's record of it).
DaemonRun = DaemonProcess

_READY_TIMEOUT_S = 30.0
_STOP_TIMEOUT_S = 30.0


def _wait_ready(run: DaemonRun, timeout_s: float = _READY_TIMEOUT_S) -> None:
    try:
        run.wait_ready(timeout_s)
    except DaemonStartError as exc:
        tail = f":\n{run.log_tail()}" if exc.exit_code is not None else ""
        raise RuntimeError(f"{exc}{tail}") from None


def _finish(run: DaemonRun) -> None:
    """Wait for a daemon that was sent SIGTERM (SIGKILL after a grace), then sweep its segments."""
    run.wait_stopped(_STOP_TIMEOUT_S)
    run.sweep_segments()


def _launch(
    folder: str,
    socket_name: str,
    log_name: str,
    daemon_args: Sequence[str],
    prefix: Sequence[str] = (),
) -> DaemonRun:
    # No GRADSYNC_* from this environment: the flags alone configure it, so the
    # command a report shows is the whole truth.
    return start_daemon(f"ipc://{folder}/{socket_name}", daemon_args, folder=folder,
                        log_path=os.path.join(folder, log_name), prefix=prefix,
                        env=clean_env(), new_session=True)


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
        run = _launch(folder, "d.sock", "gradsyncd.log", daemon_args)
        try:
            _wait_ready(run)
            yield run
        finally:
            run.terminate()
            _finish(run)
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
            runs.append(_launch(folder, f"d{index}.sock", f"d{index}.log", args, prefix))
        for run in runs:
            _wait_ready(run, ready_timeout_s)
        yield runs
    finally:
        for run in runs:
            run.terminate()
        for run in runs:
            _finish(run)
        if logs_to is not None:
            for index, run in enumerate(runs):
                with contextlib.suppress(OSError):
                    shutil.copyfile(str(run.log_path), os.path.join(logs_to, f"d{index}.log"))
        shutil.rmtree(folder, ignore_errors=True)
