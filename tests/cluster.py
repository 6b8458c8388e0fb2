"""Helpers for multi-daemon tests: several gradsyncd on 127.0.0.1, ranks spread over them."""

from __future__ import annotations

import contextlib
import random
import socket
import subprocess
from collections.abc import Sequence
from pathlib import Path

from conftest import DaemonProcess, RankResult, assert_all_exited_0, collect, spawn_rank


def free_ports(count: int) -> list[int]:
    """Distinct ports free right now on 127.0.0.1.

    Drawn below the kernel's ephemeral range, so that no outgoing connection
    (of this or a concurrent test run) takes one before the links bind it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            port = random.randrange(10_000, max(10_001, low))
            with contextlib.suppress(OSError):
                sock.bind(("127.0.0.1", port))
                ports.append(port)
    return ports


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
            processes.append(spawn_rank(program, args, daemon.endpoint, rank, world,
                                        local_rank, local_world, job, env))
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
    assert_all_exited_0(results, "\n".join(
        f"--- daemon {d.endpoint} log:\n{d.log()[-3000:]}" for d in daemons
    ))
    return results


def curve_args(folder: Path, endpoints: Sequence[str]) -> list[list[str]]:
    """Keys for daemons at `endpoints` (`gradsync keygen`, one folder holding every
    public key): each daemon's CURVE flags."""
    import sys

    folder.mkdir(mode=0o700, exist_ok=True)
    for index, endpoint in enumerate(endpoints):  # node<i>.key and node<i>.key_secret
        keygen = ["keygen", str(folder), "--name", f"node{index}", "--endpoint", endpoint]
        subprocess.run([sys.executable, "-m", "gradsync.client.cli", *keygen],
                       check=True, capture_output=True, timeout=60)
    return [["--curve-secret", str(folder / f"node{index}.key_secret"),
             "--curve-authorized", str(folder)] for index in range(len(endpoints))]
