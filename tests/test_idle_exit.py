"""`--exit-when-idle-s` with `--own-folder`: the private daemons the torch backend starts.

A real gradsyncd in a subprocess, real clients: the daemon must leave soon
after the last rank of a job goes, even when the whole job joined and left
between two of its polls (a short torchrun attempt does), and must not take a
ping (the backend's "is a daemon there?") for a job that came and went.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import DaemonProcess, poll_until
from gradsync.client.client import Client
from gradsync.client.daemon_process import segments_of, start_daemon
from gradsync.client.ping import query

#: Well under the daemon's 60 s first-client grace, well over its 1 s idle time.
LEAVES_WITHIN_S = 30.0


@pytest.fixture
def idle_daemon(short_tmp: str) -> Iterator[DaemonProcess]:
    """A daemon owning the folder `short_tmp/own`, exiting after 1 s without clients."""
    folder = os.path.join(short_tmp, "own")
    os.mkdir(folder, 0o700)
    log_path = Path(short_tmp) / "d.log"
    started = start_daemon(f"ipc://{folder}/d.sock", ["--exit-when-idle-s", "1", "--own-folder"],
                           log_path=log_path)
    daemon = DaemonProcess(started.endpoint, folder, started.process, log_path)
    daemon.wait_ready(30.0, poll_s=0.01)
    yield daemon
    if daemon.process.poll() is None:
        daemon.stop()
    assert segments_of(daemon.pid) == []


def _exited(daemon: DaemonProcess) -> bool:
    return daemon.process.poll() is not None


def test_a_job_that_joins_and_leaves_between_polls_still_lets_the_daemon_exit(
    idle_daemon: DaemonProcess,
) -> None:
    with Client(daemon=idle_daemon.endpoint, job="brief", rank=0, world_size=1) as client:
        client.all_reduce(np.ones(8, np.float32))
    poll_until(lambda: _exited(idle_daemon), LEAVES_WITHIN_S,
               "the daemon exits 1 s after its only rank left")
    assert idle_daemon.process.returncode == 0, idle_daemon.log()
    assert not os.path.exists(idle_daemon.folder or ""), "its own folder is removed"


def test_pings_before_any_rank_joined_do_not_end_the_first_client_grace(
    idle_daemon: DaemonProcess,
) -> None:
    for _ in range(3):
        query(idle_daemon.endpoint, 10.0)
        time.sleep(1.0)
    idle_daemon.assert_alive()  # 3 s past its idle time: pings are not a job
    with Client(daemon=idle_daemon.endpoint, job="late", rank=0, world_size=1) as client:
        client.barrier()
    poll_until(lambda: _exited(idle_daemon), LEAVES_WITHIN_S,
               "the daemon exits once the rank that came has gone")
    assert idle_daemon.process.returncode == 0, idle_daemon.log()
