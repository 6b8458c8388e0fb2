"""`gradsync doctor`: every check is tested by breaking what it checks (a small
tmpfs as /dev/shm in a mount namespace, a closed peer port, a daemon listening
on loopback in a network namespace whose peer is on another, a peer presenting
another key than the one on file, a data port nobody listens on, a peer in
another protocol version, a world-readable secret key, a socket open to
everyone, a low open-file limit) and by the same thing in order."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import msgpack
import pytest
import zmq
from cluster import free_ports, peer_args

from benchmarks.topology import namespaces, namespaces_unavailable
from conftest import DaemonProcess, poll_until
from gradsync.client.cli.keygen import generate_keypair
from gradsync.protocol.peer import PEER_PROTOCOL_VERSION

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


def test_a_shm_budget_larger_than_dev_shm(start_daemon: StartDaemon) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a mount namespace")
    small = ["unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o size=16m tmpfs /dev/shm && exec "$@"', "sh"]
    default = start_daemon()  # an 8 GiB budget on a 16 MiB /dev/shm
    _, found = doctor("--daemon", default.endpoint, prefix=small)
    budget = found["shm in use"]
    assert budget["status"] == "warning" and "8192 MiB budget" in budget["detail"], budget
    assert "only 16 MiB" in budget["detail"] and "max_shm_bytes" in budget["fix"], budget
    fitting = start_daemon("--max-shm-bytes", "8MiB")
    _, found = doctor("--daemon", fitting.endpoint, prefix=small)
    assert found["shm in use"]["status"] == "ok", found["shm in use"]


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


def test_a_peer_not_linked_at_rest_is_no_problem(start_daemon: StartDaemon) -> None:
    """Four daemons, one ring neighbour on either side: the first has no link to
    the one opposite (it opens on first use).  Doctor says so and finds nothing
    wrong; the Prometheus `peer_up` gauge leaves that peer out."""
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(4)]
    daemons = [start_daemon(*peer_args(i, endpoints, "--insecure", "--watch-neighbours", "1"))
               for i in range(4)]
    ring = sorted(endpoints)
    first = daemons[endpoints.index(ring[0])]
    poll_until(lambda: doctor("--daemon", first.endpoint)[0] == 0, 30,
               "doctor to find the ring neighbours' links up")
    _, found = doctor("--daemon", first.endpoint)
    assert found[f"link {ring[2]}"]["status"] == "ok", found
    assert "not connected" in found[f"link {ring[2]}"]["detail"], found
    assert found[f"port {ring[2]}"]["status"] == "ok", found
    prometheus = subprocess.run(
        [sys.executable, "-m", "gradsync.client.cli", "stats", "--daemon", first.endpoint,
         "--prometheus"], capture_output=True, text=True, timeout=60, check=True).stdout
    up = [line for line in prometheus.splitlines() if line.startswith("gradsync_peer_up{")]
    assert len(up) == 2 and all(line.endswith(" 1.0") for line in up), up
    assert not any(ring[2] in line for line in up), up


def test_secret_key_mode(tmp_path: Path) -> None:
    generate_keypair(str(tmp_path), "n0")
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


def keygen(folder: Path, name: str, endpoint: str) -> Path:
    """A node's CURVE key pair in `folder` (NAME.key, NAME.key_secret), as `gradsync
    keygen` writes it (tests/test_keygen.py covers the command)."""
    return Path(generate_keypair(str(folder), name, endpoint)[0])


def test_a_peer_presenting_another_key_than_the_one_on_file(
    start_daemon: StartDaemon, short_tmp: str,
) -> None:
    endpoints = [f"tcp://127.0.0.1:{port}" for port in free_ports(2)]
    keys, old, authorized = (Path(short_tmp) / n for n in ("keys", "old", "authorized"))
    for folder in (keys, old, authorized):
        folder.mkdir(mode=0o700)
    for index, endpoint in enumerate(endpoints):
        os.link(keygen(keys, f"node{index}", endpoint), authorized / f"node{index}.key")
    # node1 made a new key, and node0's folder still holds the old one.
    (authorized / "node1.key").unlink()
    os.link(keygen(old, "node1", endpoints[1]), authorized / "node1.key")
    daemons = [start_daemon(*peer_args(i, endpoints, "--curve-secret",
                                       str(keys / f"node{i}.key_secret"),
                                       "--curve-authorized", str(authorized)))
               for i in range(2)]

    def link(index: int) -> dict[str, str]:
        return doctor("--daemon", daemons[index].endpoint)[1][f"link {endpoints[1 - index]}"]

    # node0 refuses node1's new key: node1's side of the handshake says so.
    poll_until(lambda: "HANDSHAKE_FAILED" in link(1)["detail"], 60,
               "node1's doctor to report the failed handshake")
    found = link(1)
    assert found["status"] == "problem" and "refused our key" in found["fix"], found
    found = link(0)
    assert found["status"] == "problem" and "curve-authorized" in found["fix"], found
    code, _ = doctor("--daemon", daemons[0].endpoint)
    assert code == 1


def test_a_data_port_nobody_listens_on(start_daemon: StartDaemon) -> None:
    ports = free_ports(3)
    endpoints = [f"tcp://127.0.0.1:{port}" for port in ports[:2]]
    # node1 advertises a data port nothing listens on (a wrong NAT mapping, a firewall).
    first = start_daemon(*peer_args(0, endpoints, "--insecure"))
    start_daemon(*peer_args(1, endpoints, "--insecure", "--data-advertise",
                             f"127.0.0.1:{ports[2]}"))

    def data() -> dict[str, str]:
        return doctor("--daemon", first.endpoint)[1].get(f"data {endpoints[1]}", {})

    poll_until(lambda: data().get("status") == "problem", 60,
               "node0's doctor to report node1's closed data port")
    found = data()
    assert f"127.0.0.1:{ports[2]}" in found["detail"] and "refused" in found["detail"], found
    assert "firewall" in found["fix"]
    code, found = doctor("--daemon", first.endpoint)
    assert code == 1 and found[f"link {endpoints[1]}"]["status"] == "ok", found
    assert found[f"version {endpoints[1]}"]["status"] == "ok", found


@pytest.fixture
def older_peer() -> Iterator[str]:
    """A daemon of another peer protocol version, as far as its links show: a ROUTER
    that answers every probe with a PONG in version 2."""
    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    stop = threading.Event()

    def answer() -> None:
        while not stop.is_set():
            if not router.poll(100):
                continue
            frames = router.recv_multipart()
            try:
                seq = msgpack.unpackb(frames[1]).get("seq", 0)
            except Exception:
                seq = 0
            router.send_multipart([frames[0], msgpack.packb(
                {"v": 2, "kind": "pong", "src": endpoint, "seq": seq})])

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield endpoint
    stop.set()
    thread.join(5)
    router.close()
    context.term()


def test_a_peer_in_another_protocol_version(start_daemon: StartDaemon, older_peer: str) -> None:
    (port,) = free_ports(1)
    endpoints = [f"tcp://127.0.0.1:{port}", older_peer]
    daemon = start_daemon(*peer_args(0, endpoints, "--insecure"))

    def version() -> dict[str, str]:
        return doctor("--daemon", daemon.endpoint)[1].get(f"version {older_peer}", {})

    poll_until(lambda: version().get("status") == "problem", 60,
               "the doctor to report the older peer's version")
    found = version()
    assert "v2" in found["detail"] and f"v{PEER_PROTOCOL_VERSION}" in found["detail"], found
    assert "same gradsync version" in found["fix"]


def test_peers_from_slurm_outside_a_job_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    result = subprocess.run([*DOCTOR, "--peers-from-slurm", "--daemon",
                             "ipc:///nonexistent/d.sock"], capture_output=True, text=True,
                            timeout=60, env=env)
    found = {f["check"]: f for f in json.loads(result.stdout)}
    assert result.returncode == 1 and found["slurm"]["status"] == "problem", found
    assert "SLURM_JOB_NODELIST is not set" in found["slurm"]["detail"]


def test_a_daemon_listening_on_loopback_with_peers_on_other_hosts(
    start_daemon: StartDaemon,
) -> None:
    reason = namespaces_unavailable()
    if reason:
        pytest.skip(reason)
    with namespaces(2) as topo:
        inside = topo.prefix(0)
        ports = free_ports(3)
        other = f"tcp://{topo.hosts[1]}:{ports[2]}"  # node 1's address (no daemon there)
        # node 0's host name mapped to loopback: its peers could never reach it.
        wrong = start_daemon("--listen", f"tcp://127.0.0.1:{ports[0]}", "--peers", other,
                             "--insecure", prefix=inside)
        right = start_daemon("--listen", f"tcp://{topo.hosts[0]}:{ports[1]}", "--peers", other,
                             "--insecure", prefix=inside)
        code, found = doctor("--daemon", wrong.endpoint, prefix=inside)
        assert code == 1 and found["listen"]["status"] == "problem", found["listen"]
        assert "127.0.0.1 (lo), a loopback address" in found["listen"]["detail"], found
        assert topo.hosts[1] in found["listen"]["detail"] and "/etc/hosts" in found["listen"]["fix"]
        _, found = doctor("--daemon", right.endpoint, prefix=inside)
        assert found["listen"]["status"] == "ok", found["listen"]
        assert f"{topo.hosts[0]} ({topo.interfaces[0]})" in found["listen"]["detail"], found
        for daemon in (wrong, right):  # before their namespace goes
            assert daemon.stop(30) == 0, daemon.log_tail()
