"""Child processes of a benchmark run: start them in their own sessions, wait, stop, clean up.

Ranks (and the `gradsync launch` or `mpirun` that starts them) run in their
own sessions, so a terminal's Ctrl-C reaches only the driver, which then stops
every group it started, in order.  SIGTERM and SIGHUP unwind the driver like
Ctrl-C (`signals_unwind`), so its `finally` blocks run either way.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

KILL_GRACE_S = 10.0


def rank_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment of a rank: `OMP_NUM_THREADS=1` (as torchrun sets it), plus `extra`."""
    return {**(os.environ if base is None else base), "OMP_NUM_THREADS": "1", **extra}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any `GRADSYNC_*` variable (they configure daemons and
    clients, e.g. GRADSYNC_DAEMON names a daemon's socket), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRADSYNC_")}
    return {**env, **extra}


def start_group(
    command: Sequence[str], env: dict[str, str], log_path: str
) -> subprocess.Popen[bytes]:
    """Start `command` in a new session, output appended to `log_path`."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            list(command), env=env, stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )


def stop_group(process: subprocess.Popen[bytes], grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM this process's own session (it and what it started), then SIGKILL
    whatever is left of it, even when the leader itself has already exited."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):  # nobody left in the group
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(grace_s)


def wait_all(processes: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> str | None:
    """None when all exit 0; else what went wrong (stopping the rest)."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in processes]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            time.sleep(1.0)  # give the others a moment to record their own errors
            for process in processes:
                stop_group(process)
            return f"process {failed[0][0]} exited with status {failed[0][1]}"
        if all(c == 0 for c in codes):
            return None
        if time.monotonic() > deadline:
            for process in processes:
                stop_group(process)
            return f"timed out after {timeout_s:g}s"
        time.sleep(0.05)


def run_all(
    commands: Sequence[tuple[Sequence[str], dict[str, str]]], log_path: str, timeout_s: float
) -> str | None:
    """Start every (command, env) in its own session, wait for all; None when all succeeded.

    Whatever happens (a failure, a timeout, an interrupt), no process is left behind.
    """
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for command, env in commands:
            processes.append(start_group(command, env, log_path))
        return wait_all(processes, timeout_s)
    finally:
        for process in processes:
            stop_group(process)


def log_tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as source:
            return "".join(source.readlines()[-lines:])
    except OSError:
        return ""


def exit_without_destructors(code: int) -> None:
    """End a worker that has written its result: flush, then leave without C++
    static destructors.  torch 2.13 keeps gloo's (and torchft's) threads past
    the process groups' end, and a normal exit now and then aborts ("terminate
    called without an active exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def module_command(module: str, *args: str) -> list[str]:
    """`python -m benchmarks.MODULE ARGS`: how a benchmark starts its worker processes,
    which inherit its working directory (the repository root) or PYTHONPATH."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """How this run was started, as `python -m benchmarks.NAME ARGS`, for RESULTS.md
    (`script`: the benchmark module's `__file__`)."""
    args = list(sys.argv[1:] if argv is None else argv)
    name = os.path.splitext(os.path.basename(script))[0]
    return shlex.join(["python", "-m", f"benchmarks.{name}", *args])


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def signals_unwind(*signums: int) -> None:
    """Make these signals (default SIGTERM, SIGHUP) raise KeyboardInterrupt, as Ctrl-C does."""
    for signum in signums or (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
