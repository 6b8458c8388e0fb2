"""Freed segments give their /dev/shm space back by the time the next collective
returns, on a small tmpfs mounted as /dev/shm in a mount namespace of its own
(daemons and ranks inside it).  Needs root and util-linux; skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest

from benchmarks.topology import free_ports
from conftest import PROGRAMS, DaemonProcess, assert_all_exited_0, collect

StartDaemon = Callable[..., DaemonProcess]
#: Two ranks' inputs and outputs (4 + 8 MiB each for all_gather) and a little more.
TMPFS_SIZE = "32m"


def _namespace_prefix() -> list[str]:
    """A command prefix: a new mount namespace whose /dev/shm is a small tmpfs."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("needs root, unshare and nsenter for a mount namespace")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")
    script = f'mount -t tmpfs -o size={TMPFS_SIZE},mode=1777 tmpfs /dev/shm && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh"]


def _ranks(daemons: list[DaemonProcess], kind: str, env: dict[str, str]) -> list[dict[str, object]]:
    """One rank per daemon if there are two, else two ranks on the one daemon; all
    inside the first daemon's mount namespace."""
    world = 2
    processes = []
    for rank in range(world):
        daemon = daemons[rank % len(daemons)]
        local_world = world // len(daemons)
        processes.append(subprocess.Popen(
            ["nsenter", "-t", str(daemons[0].pid), "-m",
             sys.executable, str(PROGRAMS / "freed_space.py"), kind],
            env={**os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(world),
                 "LOCAL_RANK": str(rank // len(daemons)), "LOCAL_WORLD_SIZE": str(local_world),
                 "GRADSYNC_DAEMON": daemon.endpoint, "GRADSYNC_JOB": f"freed-{kind}"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    results = collect(processes, 90.0)
    assert_all_exited_0(results, "\n".join(d.log() for d in daemons))
    return [json.loads(r.stdout.splitlines()[-1]) for r in results]


def _leftovers(daemon: DaemonProcess) -> list[str]:
    """The daemon's segments in its namespace's /dev/shm (seen through /proc)."""
    folder = f"/proc/{daemon.pid}/root/dev/shm"
    return sorted(n for n in os.listdir(folder) if n.startswith(f"gradsync-{daemon.pid}-"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["fast", "socket"])
def test_freed_space_back_on_one_node(start_daemon: StartDaemon, path: str) -> None:
    daemon = start_daemon(prefix=_namespace_prefix())
    env = {"GRADSYNC_FAST_PATH": "1" if path == "fast" else "0"}
    for kind in ("all_gather", "reduce_scatter"):
        for record in _ranks([daemon], kind, env):
            assert record["failures"] == [], record
    assert _leftovers(daemon) == []


@pytest.mark.timeout(120)
def test_freed_space_back_across_daemons(start_daemon: StartDaemon) -> None:
    first_prefix = _namespace_prefix()
    ports = free_ports(2)
    endpoints = [f"tcp://127.0.0.1:{port}" for port in ports]
    peers = ",".join(endpoints)
    first = start_daemon("--listen", endpoints[0], "--peers", peers, "--insecure",
                         prefix=first_prefix)
    second = start_daemon("--listen", endpoints[1], "--peers", peers, "--insecure",
                          prefix=["nsenter", "-t", str(first.pid), "-m"])
    for kind in ("all_gather", "reduce_scatter"):
        for record in _ranks([first, second], kind, {}):
            assert record["failures"] == [], record
    assert _leftovers(first) == [] and _leftovers(second) == []
