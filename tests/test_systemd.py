"""systemd integration: the unit verifies, sd_notify messages, journald logging, group access."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from conftest import DaemonProcess, launch_daemon, segments_of
from gradsync.client import Client
from gradsync.client.ping import query
from gradsync.protocol.shm import SHM_DIR

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "gradsyncd.service"
ANALYZE = shutil.which("systemd-analyze")


def unit_for_this_machine(folder: Path) -> Path:
    """The unit with ExecStart pointing at this environment's gradsyncd (verify checks it)."""
    gradsyncd = shutil.which("gradsyncd") or str(Path(sys.executable).parent / "gradsyncd")
    text = UNIT.read_text().replace("/usr/local/bin/gradsyncd", gradsyncd)
    path = folder / "gradsyncd.service"
    path.write_text(text)
    return path


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.timeout(60)
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    result = subprocess.run([ANALYZE, "verify", str(unit_for_this_machine(tmp_path))],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.timeout(60)
def test_unit_exposure_does_not_rise_above_the_recorded_score(tmp_path: Path) -> None:
    recorded = re.search(r"exposure score:\s*([0-9.]+)", (REPO / "docs" / "running.md").read_text())
    assert recorded, "docs/running.md must record the unit's exposure score"
    result = subprocess.run(
        [ANALYZE, "security", "--offline=true", str(unit_for_this_machine(tmp_path))],
        capture_output=True, text=True, timeout=50,
    )
    measured = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert measured, result.stdout + result.stderr
    assert float(measured.group(1)) <= float(recorded.group(1)), measured.group(0)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(
    request: pytest.FixtureRequest, short_tmp: str
) -> Iterator[tuple[str, socket.socket]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = f"{short_tmp}/notify"
        sock.bind(address)
    else:
        name = f"gradsync-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind(b"\0" + name.encode())
        address = "@" + name
    sock.settimeout(20)
    yield address, sock
    sock.close()


def messages(sock: socket.socket) -> Iterator[tuple[float, list[str]]]:
    while True:
        data = sock.recv(4096)
        yield time.monotonic(), data.decode().split("\n")


@pytest.mark.timeout(60)
def test_sd_notify_ready_watchdog_stopping(
    notify_socket: tuple[str, socket.socket], short_tmp: str
) -> None:
    address, sock = notify_socket
    endpoint = f"ipc://{short_tmp}/d.sock"
    watchdog_usec = 400_000
    daemon = subprocess.Popen(
        [sys.executable, "-m", "gradsync.daemon", "--socket", endpoint],
        env={**os.environ, "NOTIFY_SOCKET": address, "WATCHDOG_USEC": str(watchdog_usec)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        stream = messages(sock)
        _, first = next(stream)
        assert "READY=1" in first, first
        # READY=1 comes only once the client socket answers: the first ping succeeds.
        assert query(endpoint, 2.0)["pid"] == daemon.pid
        assert any(line.startswith("STATUS=") for line in first)
        watchdogs = []
        while len(watchdogs) < 5:
            when, lines = next(stream)
            if "WATCHDOG=1" in lines:
                watchdogs.append(when)
        gaps = [b - a for a, b in itertools.pairwise(watchdogs)]
        # Sent every WATCHDOG_USEC/2; systemd only acts after a whole WATCHDOG_USEC.
        assert max(gaps) < watchdog_usec / 1e6, gaps
        daemon.send_signal(signal.SIGTERM)
        while True:
            _, lines = next(stream)
            if "STOPPING=1" in lines:
                break
        assert daemon.wait(30) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


@pytest.mark.timeout(60)
def test_journald_format_when_journal_stream_is_set(short_tmp: str) -> None:
    daemon = launch_daemon(short_tmp, env={"JOURNAL_STREAM": "8:12345"})
    assert daemon.stop() == 0
    lines = [line for line in daemon.log().splitlines() if line]
    assert lines and all(re.match(r"^<[2-7]>gradsync", line) for line in lines), lines
    assert not any(re.search(r"\d\d:\d\d:\d\d", line) for line in lines), lines
    assert any(line.startswith("<6>") for line in lines)


@pytest.mark.timeout(60)
def test_group_access_makes_socket_and_segments_group_readable(start_daemon: object) -> None:
    daemon: DaemonProcess = start_daemon("--group-access")  # type: ignore[operator]
    assert stat.S_IMODE(os.stat(daemon.socket_path).st_mode) == 0o660
    with Client(daemon=daemon.endpoint, job="group", rank=0, world_size=1) as client:
        buffer = client.empty(1024, np.float32)
        names = segments_of(daemon.pid)
        assert names
        for name in names:
            assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, name)).st_mode) == 0o660
        del buffer
