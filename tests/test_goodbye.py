"""A daemon that leaves on purpose (SIGTERM) says goodbye to its peers: they log
its leaving at info level, with no "data stream broke" or "peer lost" warning;
a daemon that dies without a word still gets those warnings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from cluster import curve_args, free_ports, peer_args, run_spread

from conftest import DaemonProcess, poll_until

StartDaemon = Callable[..., DaemonProcess]


def _warnings_since(daemon: DaemonProcess, offset: int) -> list[str]:
    return [line for line in daemon.log()[offset:].splitlines() if " WARNING " in line]


@pytest.mark.timeout(180)
def test_clean_stop_says_goodbye(start_daemon: StartDaemon, short_tmp: str) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(3)]
    keys = curve_args(Path(short_tmp) / "keys", endpoints)
    daemons = [start_daemon(*peer_args(i, endpoints, *keys[i])) for i in range(3)]
    results = run_spread(daemons, (1, 1, 1), "multinode_finish.py", ["262144", "2"],
                         job="goodbye")
    for result in results:
        assert result.records()[-1]["wrong"] == 0, result.stdout
    for daemon in daemons:  # every data stream carried slices: closing them would warn
        poll_until(lambda d=daemon: "job 'goodbye' ended" in d.log(), 20, "the job ends")
    marks = [len(daemon.log()) for daemon in daemons]

    assert daemons[0].stop() == 0
    for daemon in daemons[1:]:
        poll_until(lambda d=daemon: f"peer {endpoints[0]} left: it shut down" in d.log(), 20,
                   f"{daemon.endpoint} logs that {endpoints[0]} left")
    for daemon, mark in zip(daemons[1:], marks[1:], strict=True):
        assert _warnings_since(daemon, mark) == [], daemon.log()[mark:]

    # Without a goodbye, the loss is still a warning.
    daemons[2].process.kill()
    daemons[2].process.wait(10)
    poll_until(lambda: f"peer {endpoints[2]} lost" in daemons[1].log(), 60,
               f"{daemons[1].endpoint} warns that {endpoints[2]} was lost")
    assert any(f"peer {endpoints[2]} lost" in line
               for line in _warnings_since(daemons[1], marks[1]))
