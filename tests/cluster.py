"""Helpers for multi-daemon tests: several gradsyncd on 127.0.0.1, ranks spread over them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from conftest import PROGRAMS, DaemonProcess, RankResult, collect


def free_ports(count: int) -> list[int]:
    """Ports the kernel just handed out; held open together so they differ."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def peer_args(index: int, endpoints: Sequence[str], *extra: str) -> list[str]:
    return ["--listen", endpoints[index], "--peers", ",".join(endpoints), *extra]


def spawn_spread(
    daemons: Sequence[DaemonProcess],
    ranks_per_daemon: Sequence[int],
    program: str,
    args: Sequence[str] = (),
    job: str = "multi",
    env: dict[str, str] | None = None,
) -> list[subprocess.Popen[str]]:
    """Start ranks numbered contiguously per daemon, as torchrun numbers nodes."""
    world = sum(ranks_per_daemon)
    processes = []
    rank = 0
    for daemon, local_world in zip(daemons, ranks_per_daemon, strict=True):
        for local_rank in range(local_world):
            rank_env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world),
                "GRADSYNC_DAEMON": daemon.endpoint,
                "GRADSYNC_JOB": job,
                **(env or {}),
            }
            processes.append(subprocess.Popen(
                [sys.executable, str(PROGRAMS / program), *args],
                env=rank_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            ))
            rank += 1
    return processes


def run_spread(
    daemons: Sequence[DaemonProcess],
    ranks_per_daemon: Sequence[int],
    program: str,
    args: Sequence[str] = (),
    timeout_s: float = 120.0,
    **kwargs: object,
) -> list[RankResult]:
    results = collect(
        spawn_spread(daemons, ranks_per_daemon, program, args, **kwargs),  # type: ignore[arg-type]
        timeout_s,
    )
    for result in results:
        assert result.returncode == 0, (
            f"rank {result.rank} exited {result.returncode}\nstdout:\n{result.stdout}\n"
            f"stderr:\n{result.stderr}\n"
            + "\n".join(f"--- daemon {d.endpoint} log:\n{d.log()[-3000:]}" for d in daemons)
        )
    return results
