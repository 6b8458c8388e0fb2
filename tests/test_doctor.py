"""`gradsync doctor`: every check is tested by breaking what it checks (a small
tmpfs as /dev/shm in a mount namespace, a closed peer port, a world-readable
secret key, a socket open to everyone, a low open-file limit) and by the same
thing in order."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from cluster import free_ports

from conftest import DaemonProcess, poll_until

pytestmark = pytest.mark.timeout(120)
StartDaemon = Callable[..., DaemonProcess]
DOCTOR = [sys.executable, "-m", "gradsync.client.cli", "doctor", "--json"]


def doctor(*args: str, prefix: Sequence[str] = (), limit_files: int | None = None,
           ) -> tuple[int, dict[str, dict[str, str]]]:
    """(exit status, findings by check) of one `gradsync doctor --json` run."""
    def lower_limit() -> None:
        if limit_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit_files, limit_files))

    result = subprocess.run([*prefix, *DOCTOR, *args], capture_output=True, text=True,
                            timeout=60, preexec_fn=lower_limit)
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.returncode, {f["check"]: f for f in json.loads(result.stdout)}


def test_shm_too_small_for_the_job() -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a mount namespace")
    small = ["unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]
    code, found = doctor("--expect-bytes", "64MiB", "--daemon", "ipc:///nonexistent/d.sock",
                         prefix=small)
    assert code == 1 and found["shm"]["status"] == "problem", found["shm"]
    assert "16 MiB" in found["shm"]["detail"] and "shm-size" in found["shm"]["fix"]
    code, found = doctor("--expect-bytes", "8MiB", prefix=small)
    assert found["shm"]["status"] == "ok", found["shm"]
    _, found = doctor(prefix=small)  # no size given: 16 MiB is a container's default
    assert found["shm"]["status"] == "warning", found["shm"]


def test_daemon_socket_and_its_mode(daemon: DaemonProcess) -> None:
    code, found = doctor("--daemon", daemon.endpoint)
    assert code == 0, found
    assert found["socket"]["status"] == "ok" and found["daemon"]["status"] == "ok", found
    os.chmod(daemon.socket_path, 0o666)
    try:
        code, found = doctor("--daemon", daemon.endpoint)
    finally:
        os.chmod(daemon.socket_path, 0o600)
    assert code == 1 and found["socket"]["status"] == "problem", found["socket"]
    _, found = doctor("--daemon", f"ipc://{daemon.folder}/none.sock")
    assert found["socket"]["status"] == "warning" and found["daemon"]["status"] == "warning"


def test_peer_link_and_port(start_daemon: StartDaemon) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    peers = ",".join(endpoints)
    first = start_daemon("--listen", endpoints[0], "--peers", peers, "--insecure")
    code, found = doctor("--daemon", first.endpoint)
    assert code == 1, found
    assert found[f"port {endpoints[1]}"]["status"] == "problem", found
    assert found[f"link {endpoints[1]}"]["status"] == "problem", found
    assert f"port {endpoints[0]}" not in found  # the daemon's own address is not a peer
    start_daemon("--listen", endpoints[1], "--peers", peers, "--insecure")

    def healthy() -> bool:
        return doctor("--daemon", first.endpoint)[0] == 0

    poll_until(healthy, 30, "doctor finds the second daemon's link up and port open")
    _, found = doctor("--daemon", first.endpoint)
    assert found[f"link {endpoints[1]}"]["status"] == "ok"
    assert found[f"port {endpoints[1]}"]["status"] == "ok"


def test_secret_key_mode(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "gradsync.client.cli", "keygen", str(tmp_path),
                    "--name", "n0"], check=True, capture_output=True, timeout=60)
    secret = tmp_path / "n0.key_secret"
    keys = ["--curve-secret", str(secret), "--curve-authorized", str(tmp_path),
            "--daemon", "ipc:///nonexistent/d.sock"]
    code, found = doctor(*keys)
    assert found["secret key"]["status"] == "ok" and found["authorized keys"]["status"] == "ok"
    secret.chmod(0o644)
    code, found = doctor(*keys)
    assert code == 1 and found["secret key"]["status"] == "problem", found["secret key"]
    assert "chmod 600" in found["secret key"]["fix"]
    (tmp_path / "n0.key").unlink()
    _, found = doctor(*keys)
    assert found["authorized keys"]["status"] == "problem"


def test_open_file_limit() -> None:
    _, found = doctor("--daemon", "ipc:///nonexistent/d.sock", limit_files=256)
    assert found["open files"]["status"] == "warning" and "256" in found["open files"]["detail"]
    _, found = doctor("--daemon", "ipc:///nonexistent/d.sock", limit_files=8192)
    assert found["open files"]["status"] == "ok"
    assert found["fast path"]["status"] == "ok"  # the tests insist on the C module
    assert found["torch backend"]["status"] == "ok"
