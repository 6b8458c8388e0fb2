"""Helpers for multi-daemon tests: several gradsyncd on 127.0.0.1, ranks spread over them."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.topology import free_ports
from conftest import DaemonProcess, RankResult, assert_all_exited_0, collect, spawn_rank
from gradsync.client.cli.keygen import generate_keypair

__all__ = ["curve_args", "free_ports", "peer_args", "run_spread", "spawn_spread",
           "start_cluster"]


def peer_args(index: int, endpoints: Sequence[str], *extra: str) -> list[str]:
    return ["--listen", endpoints[index], "--peers", ",".join(endpoints), *extra]


def start_cluster(start_daemon: Callable[..., DaemonProcess], count: int,
                  *extra: str) -> list[DaemonProcess]:
    """`count` daemons peered over 127.0.0.1 with --insecure, and `extra` flags each."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(count)]
    return [start_daemon(*peer_args(i, endpoints, "--insecure", *extra)) for i in range(count)]


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
    """Keys for daemons at `endpoints` (what `gradsync keygen` writes, made in this
    process: tests/test_keygen.py covers the command; one folder holding every public
    key): each daemon's CURVE flags."""
    folder.mkdir(mode=0o700, exist_ok=True)
    for index, endpoint in enumerate(endpoints):  # node<i>.key and node<i>.key_secret
        generate_keypair(str(folder), f"node{index}", endpoint)
    return [["--curve-secret", str(folder / f"node{index}.key_secret"),
             "--curve-authorized", str(folder)] for index in range(len(endpoints))]
