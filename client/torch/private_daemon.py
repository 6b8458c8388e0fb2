"""Daemons started for the job when none is running: `init_process_group` with no setup.

When no daemon answers at the default socket (and `GRADSYNC_DAEMON` is not
set, and `GRADSYNC_AUTOSTART` is not 0), the backend starts one gradsyncd per
node for the job, as gloo and NCCL need no service either:

- Every rank says through the group's c10d store whether it found a daemon
  and which node it is on (`node_key`); a job whose ranks disagree fails at
  once, naming them.
- On each node the ranks take a lock file in a private folder (0700, named
  from the job and the node) in turn; the holder that finds no daemon answering
  starts it, so exactly one does, whatever LOCAL_RANK says.
- A job on several nodes: each starter picks its address (the route to the
  store's host, or `GRADSYNC_IFNAME`) and a free port, makes a fresh CURVE
  keypair, and writes endpoint and public key to the store; every daemon then
  starts with all of them as its peers and authorised keys.  The store is
  trusted, as gloo and NCCL trust it.
- The daemon runs with `--exit-when-idle-s` and `--own-folder`: it exits once
  the job's ranks on its node are gone (all of them, the starter included),
  removing its folder, segments and sockets.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from gradsync.client.cli.keygen import generate_keypair, write_public_certificate
from gradsync.client.daemon_process import DaemonStartError, start_daemon
from gradsync.client.node_address import (
    IFNAME_VARIABLE,
    free_port,
    interface_address,
    is_loopback,
    node_key,
    route_address,
)
from gradsync.client.ping import query
from gradsync.client.torch.rendezvous import values
from gradsync.protocol.endpoint import MAX_SOCKET_PATH
from gradsync.protocol.errors import GradsyncError

__all__ = ["AUTOSTART_VARIABLE", "IDLE_EXIT_S", "choose_daemon"]

#: 0: never start a daemon; a missing one is an error naming its socket.
AUTOSTART_VARIABLE = "GRADSYNC_AUTOSTART"
#: A private daemon exits this long after the last of its node's ranks left.
IDLE_EXIT_S = 2.0
_MANAGED = "managed"
_START_TIMEOUT_S = 60.0


def _answers(endpoint: str, timeout_s: float = 5.0) -> bool:
    try:
        query(endpoint, timeout_s)
    except GradsyncError:
        return False
    return True


def choose_daemon(
    store: Any, rank: int, size: int, job: str, configured: str, timeout_s: float
) -> str:
    """The daemon this rank uses: the configured one, or one started for the job."""
    explicit = "GRADSYNC_DAEMON" in os.environ
    allowed = os.environ.get(AUTOSTART_VARIABLE, "1").strip() != "0"
    mine = _MANAGED if explicit or not allowed or _answers(configured) else node_key()
    store.set(f"gradsync/where/{rank}", mine)
    where = values(store, [f"gradsync/where/{r}" for r in range(size)])
    managed = [r for r, w in enumerate(where) if w == _MANAGED]
    if managed and len(managed) < size:
        others = [r for r in range(size) if r not in managed]
        raise dist.DistBackendError(
            f"gradsync: ranks {managed} found a running gradsyncd but ranks {others} found "
            f"none (and would start one for the job): run a daemon on every node of the "
            f"job, or on none")
    if mine == _MANAGED:
        return configured
    nodes = list(dict.fromkeys(where))
    endpoint = _private_endpoint(job, mine)
    with _start_lock(endpoint, timeout_s) as lock_fd:
        if not _answers(endpoint):
            started_by = os.pread(lock_fd, 64, 0).decode(errors="replace").strip()
            if started_by:
                raise dist.DistBackendError(
                    f"gradsync: the private gradsyncd that {started_by} started for this "
                    f"job at {endpoint} does not answer (its log went to that rank's stderr)")
            os.pwrite(lock_fd, f"rank {rank} (pid {os.getpid()})\n".encode(), 0)
            _start(store, job, nodes, nodes.index(mine), endpoint, rank)
    # Later process groups of this process (new_group, DeviceMesh) use the same daemon.
    os.environ["GRADSYNC_DAEMON"] = endpoint
    return endpoint


def _private_endpoint(job: str, node: str) -> str:
    """`ipc://$XDG_RUNTIME_DIR-or-/tmp/gradsync-job-UID-HASH/gradsyncd.sock`: /tmp where
    the runtime folder's path is too long for the sockets (with their `.stats.pub`)."""
    digest = hashlib.sha256(f"{job}\n{node}".encode()).hexdigest()[:16]
    folder = f"gradsync-job-{os.getuid()}-{digest}"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(runtime or "/tmp", folder, "gradsyncd.sock")
    if len(path.encode()) + len(".stats.pub") > MAX_SOCKET_PATH:
        path = os.path.join("/tmp", folder, "gradsyncd.sock")
    return "ipc://" + path


@contextlib.contextmanager
def _start_lock(endpoint: str, timeout_s: float) -> Iterator[int]:
    """Hold the node's start lock (`SOCKET.start` in the private folder) in turn."""
    path = endpoint[len("ipc://"):]
    folder = os.path.dirname(path)
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = os.lstat(folder)
    if info.st_uid != os.getuid() or info.st_mode & 0o077 or not os.path.isdir(folder):
        raise dist.DistBackendError(
            f"gradsync: {folder} exists but is not a private folder of this user "
            f"(mode {info.st_mode & 0o7777:04o}, owner {info.st_uid}); remove it")
    fd = os.open(path + ".start", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                if time.monotonic() > deadline:
                    raise dist.DistBackendError(
                        f"gradsync: another rank on {socket.gethostname()} held the start "
                        f"lock {path}.start for {timeout_s:g}s (the process group's "
                        f"timeout) without starting the job's daemon") from None
                time.sleep(0.01)
        yield fd
    finally:
        os.close(fd)


def _start(store: Any, job: str, nodes: list[str], index: int, endpoint: str, rank: int) -> None:
    """Start this node's daemon for the job, peered with the other nodes' through the store."""
    folder = os.path.dirname(endpoint[len("ipc://"):])
    args = ["--exit-when-idle-s", str(IDLE_EXIT_S), "--own-folder", "--log-level", "warning"]
    if len(nodes) > 1:
        args += _peer_args(store, folder, len(nodes), index)
    try:
        # Detached: a supervisor that kills this rank's children (Ray does, as a worker
        # exits) must not take the daemon other ranks of the node still use.
        process = start_daemon(endpoint, args, new_session=True, detached=True)
    except OSError as exc:
        raise dist.DistBackendError(f"gradsync: cannot start gradsyncd: {exc}") from exc
    try:
        process.wait_ready(_START_TIMEOUT_S)
    except DaemonStartError as exc:
        process.stop(5.0)
        raise dist.DistBackendError(
            f"gradsync: rank {rank} started a gradsyncd for job {job} on "
            f"{socket.gethostname()} and it failed: {exc} (its log is above, on this "
            f"rank's stderr: `{process.shown_command()}`)") from exc


def _peer_args(store: Any, folder: str, count: int, index: int) -> list[str]:
    """Listen, peers and CURVE keys of node `index`'s daemon, agreed through the store."""
    host = _listen_host(store, count)
    listen = f"tcp://{host}:{free_port(host)}"
    keys = os.path.join(folder, "keys")
    public_path, secret_path = generate_keypair(keys, f"node{index}", endpoint=listen)
    public = _public_key(public_path)
    store.set(f"gradsync/daemon/{index}", f"{listen} {public}")
    authorized = os.path.join(folder, "authorized")
    os.mkdir(authorized, 0o700)
    peers = []
    for other, value in enumerate(values(store, [f"gradsync/daemon/{i}" for i in range(count)])):
        peer, key = value.split(" ")
        write_public_certificate(os.path.join(authorized, f"node{other}.key"), key, peer)
        peers.append(peer)
    return ["--listen", listen, "--peers", ",".join(peers),
            "--curve-secret", secret_path, "--curve-authorized", authorized]


def _public_key(certificate: str) -> str:
    with open(certificate, encoding="ascii") as handle:
        for line in handle:
            name, _, value = line.strip().partition("=")
            if name.strip() == "public-key":
                return value.strip().strip('"')
    raise dist.DistBackendError(f"gradsync: no public-key in {certificate}")


def _store_address(store: Any) -> tuple[str, int] | None:
    """Host and port of the TCPStore under the group's PrefixStores, if there is one."""
    while store is not None:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host, int(getattr(store, "port", 0))
        store = getattr(store, "underlying_store", None)
    return None


def _listen_host(store: Any, nodes: int) -> str:
    """This node's address for its peers: GRADSYNC_IFNAME's, or the route to the store."""
    try:
        ifname = os.environ.get(IFNAME_VARIABLE)
        if ifname:  # the user's choice, loopback included
            return interface_address(ifname)
        address = _store_address(store)
        if address is None:
            raise dist.DistBackendError(
                f"gradsync: the job spans {nodes} nodes but its store is no TCPStore, so "
                f"no route to it can choose the daemons' interface; set {IFNAME_VARIABLE}")
        host = route_address(*address)
    except GradsyncError as exc:
        raise dist.DistBackendError(f"gradsync: {exc}") from exc
    if is_loopback(host):
        raise dist.DistBackendError(
            f"gradsync: the job spans {nodes} nodes but the route to its store "
            f"({address[0]}:{address[1]}) leaves through loopback ({host}), which the "
            f"other nodes cannot reach; set {IFNAME_VARIABLE} or a MASTER_ADDR they can")
    return host
