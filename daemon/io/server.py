"""Daemon lifecycle: claim the socket, serve, shut down cleanly on a signal.

Start: sweep segments of dead daemons, take an exclusive `flock` beside the
socket (a live daemon holds it: refuse; a dead one left it: take over), bind
the socket owner-only, serve.  SIGTERM/SIGINT: stop accepting, fail in-flight
collectives with "daemon shutting down", unlink every segment, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
from collections.abc import Iterator

import zmq

from gradsync.daemon.backends.shm_pool import sweep_dead_segments
from gradsync.daemon.config import DaemonConfig
from gradsync.daemon.io.peering import Peering, wants_peers
from gradsync.daemon.io.service import GradsyncService
from gradsync.daemon.io.session import ClientSession
from gradsync.daemon.io.stats_server import StatsServer, stats_curve, stats_endpoints
from gradsync.daemon.sd_notify import Notifier
from gradsync.daemon.state import DaemonState
from gradsync.protocol.endpoint import parse_ipc_endpoint
from gradsync.protocol.version import __version__

log = logging.getLogger("gradsync.daemon")


class StartupError(RuntimeError):
    """The daemon cannot start; the message says why and what to do."""


@contextlib.contextmanager
def claim_socket(path: str, group_access: bool = False) -> Iterator[None]:
    """Hold `PATH.lock` for the daemon's lifetime; remove a stale socket file."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        mode = 0o750 if group_access else 0o700
        os.makedirs(folder, mode=mode, exist_ok=True)
        os.chmod(folder, mode)
    elif os.stat(folder).st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (
        os.stat(folder).st_mode & stat.S_ISVTX
    ):
        raise StartupError(f"socket folder {folder} is writable by others; use a private folder")
    lock_path = path + ".lock"
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            owner = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            raise StartupError(
                f"another gradsyncd (pid {owner}) is already serving ipc://{path}; "
                "stop it first or pass a different --socket"
            ) from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise StartupError(f"{path} exists and is not a socket; refusing to replace it")
            log.info("removing stale socket %s left by a daemon that is gone", path)
            os.unlink(path)
        try:
            yield
        finally:
            # The lock file stays: removing it would let two later daemons both "win".
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    finally:
        os.close(lock_fd)


def _bind_unix(path: str, group_access: bool = False) -> socket.socket:
    """Bind the client socket with mode 0600, or 0660 (umask applies at bind time)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117 if group_access else 0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old_umask)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(config: DaemonConfig) -> None:
    """Run the daemon until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    path = parse_ipc_endpoint(config.socket)
    removed = sweep_dead_segments()
    if removed:
        log.info("removed %d segments left by dead daemons", len(removed))
    use_peers = wants_peers(config)
    endpoints = stats_endpoints(config.stats, config.socket)
    stats_keys = stats_curve(config, endpoints[0]) if endpoints is not None else None
    with claim_socket(path, config.group_access):
        service = GradsyncService(DaemonState(config), loop)
        peering = Peering(config, service) if use_peers else None
        if peering is not None:
            try:
                await peering.start()
            except zmq.ZMQError as exc:
                await peering.close()
                raise StartupError(
                    f"cannot bind the peer endpoint {config.listen}: {exc}"
                ) from None
        server = await loop.create_unix_server(
            lambda: ClientSession(service), sock=_bind_unix(path, config.group_access)
        )
        stop = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        stats_server = None
        if endpoints is None:
            log.warning("statistics endpoint disabled: %s.stats.pub would exceed the Unix "
                        "socket path limit; pass --stats", config.socket)
        else:
            stats_server = StatsServer(
                endpoints, service, peering.links if peering is not None else None, stats_keys
            )
            try:
                await stats_server.start(config.group_access)
            except zmq.ZMQError as exc:
                await stats_server.close()
                raise StartupError(
                    f"cannot bind the stats endpoint {endpoints[0]}: {exc}"
                ) from None
        # Only now, with every endpoint bound: a daemon that says it is ready must not
        # then die of one it could not bind.
        log.info(
            "gradsyncd %s (pid %d) ready on ipc://%s: %d reduce threads, "
            "collective timeout %gs, shm limit %d bytes",
            __version__, os.getpid(), path, config.threads,
            config.collective_timeout_s, config.max_shm_bytes,
        )
        notifier = Notifier()
        # Sockets are bound and peers configured: clients can connect from now on.
        notifier.notify("READY=1", f"MAINPID={os.getpid()}", f"STATUS={_status(service)}")
        heartbeat = loop.create_task(_keep_systemd_informed(notifier, service))
        stalls = loop.create_task(_watch_for_stalls(service))
        await stop.wait()
        notifier.notify("STOPPING=1", "STATUS=shutting down")
        heartbeat.cancel()
        stalls.cancel()
        log.info("shutting down: failing in-flight collectives, unlinking segments")
        server.close()
        if stats_server is not None:
            await stats_server.close()
        service.shut_down()
        if peering is not None:
            await peering.close()
        await server.wait_closed()
        # Let the transports flush the error replies before the process exits.
        await asyncio.sleep(0)
        notifier.close()
    log.info("gradsyncd stopped")


def _status(service: GradsyncService) -> str:
    counters = service.state.requests
    return (
        f"{len(service.jobs)} jobs, {len(service.sessions)} clients, "
        f"{counters.collectives} collectives done, {counters.failed} failed, "
        f"{service.buffers.in_use} bytes of shared memory"
    )


async def _watch_for_stalls(service: GradsyncService) -> None:
    interval = min(1.0, service.config.stall_warn_s / 4)
    while True:
        await asyncio.sleep(interval)
        service.report_stalls()


async def _keep_systemd_informed(notifier: Notifier, service: GradsyncService) -> None:
    """WATCHDOG=1 from the event loop itself (a stuck loop stops it), and STATUS= lines."""
    if not notifier.enabled:
        return
    interval = notifier.watchdog_s or 5.0
    last_status = ""
    while True:
        lines = ["WATCHDOG=1"] if notifier.watchdog_s else []
        status = _status(service)
        if status != last_status:
            lines.append(f"STATUS={status}")
            last_status = status
        if lines:
            notifier.notify(*lines)
        await asyncio.sleep(interval)
