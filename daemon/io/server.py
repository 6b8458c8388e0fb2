"""Daemon lifecycle (`Daemon`): claim the socket, serve, shut down cleanly on a signal.

Start: take an exclusive `flock` beside the socket (a live daemon holds it:
refuse; a dead one left it: take over, with the checkpoints it listed), sweep
segments of dead daemons, bind the socket owner-only, serve.  SIGTERM/SIGINT:
stop accepting, fail in-flight collectives with "daemon shutting down", unlink
every segment (but complete checkpoints with `checkpoints_survive_exit`), exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import socket
import stat
from collections.abc import Iterator

import zmq

from gradsync.daemon.backends.shm_pool import sweep_dead_segments
from gradsync.daemon.checkpoint_manifest import spared_segments
from gradsync.daemon.config import DaemonConfig
from gradsync.daemon.io.peering import Peering, wants_peers
from gradsync.daemon.io.service import GradsyncService
from gradsync.daemon.io.session import ClientSession
from gradsync.daemon.io.stats_server import (
    StatsCurve,
    StatsServer,
    stats_curve,
    stats_endpoints,
)
from gradsync.daemon.sd_notify import Notifier
from gradsync.daemon.state import DaemonState
from gradsync.protocol.dtypes import DTYPES
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


#: How long a stopping daemon waits for reductions already on its threads.
STOP_TIMEOUT_S = 20.0


class Daemon:
    """One gradsyncd: `await start()`, then `await serve()` until a signal (or
    `request_stop()`), then `await stop(timeout_s)`; uvicorn's Server is the model.

    `serve()` starts the daemon when it has not been started, and stops it
    when told to.  Nothing here blocks the event loop: a stop fails what is in
    flight at once (graceful), then waits up to `timeout_s` for reductions
    already running on the thread pool, and leaves without them (forced).
    """

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self._exits = contextlib.ExitStack()
        self._stop = asyncio.Event()
        self._started = False
        self.service: GradsyncService | None = None
        self._peering: Peering | None = None
        self._server: asyncio.Server | None = None
        self._stats_server: StatsServer | None = None
        self._notifier: Notifier | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def request_stop(self) -> None:
        """Make `serve()` return (what SIGTERM and SIGINT do)."""
        self._stop.set()

    async def start(self) -> None:
        """Sweep, claim the socket, bind every endpoint, then say ready; raises
        `StartupError` (leaving nothing bound) when an endpoint cannot be had."""
        try:
            await self._start()
        except BaseException:
            await self._close_endpoints()
            self._exits.close()
            raise
        self._started = True

    async def _start(self) -> None:
        config = self.config
        loop = asyncio.get_running_loop()
        path = parse_ipc_endpoint(config.socket)
        use_peers = wants_peers(config)
        if use_peers:
            # ml_dtypes (bfloat16) takes about a second to import here, holding the GIL.
            # A daemon with peers loads it now, before it says ready: on its event loop
            # at the first bfloat16 request, the pause could look like a dead peer.  A
            # single-node daemon loads it then (one pause for that request), and so
            # starts in 0.3-0.4 s instead of 1.0-1.4 s.
            DTYPES["bfloat16"]
        endpoints = stats_endpoints(config.stats, config.socket)
        stats_keys = stats_curve(config, endpoints[0]) if endpoints is not None else None
        self._exits.enter_context(claim_socket(path, config.group_access))
        service = self.service = GradsyncService(DaemonState(config), loop)
        # Holding the socket: the checkpoints of a dead daemon on it are ours to take
        # over, before the sweep (which spares what other sockets' manifests list).
        service.checkpoints.take_over()
        removed = sweep_dead_segments(spared=spared_segments())
        if removed:
            log.info("removed %d segments left by dead daemons", len(removed))
        if use_peers:
            self._peering = Peering(config, service)
            try:
                await self._peering.start()
            except zmq.ZMQError as exc:
                raise StartupError(
                    f"cannot bind the peer endpoint {config.listen}: {exc}"
                ) from None
        self._server = await loop.create_unix_server(
            lambda: ClientSession(service), sock=_bind_unix(path, config.group_access)
        )
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._stop.set)
        await self._start_stats(service, endpoints, stats_keys)
        # Only now, with every endpoint bound: a daemon that says it is ready must not
        # then die of one it could not bind.
        log.info(
            "gradsyncd %s (pid %d) ready on ipc://%s: %d reduce threads, "
            "collective timeout %gs, shm limit %d bytes",
            __version__, os.getpid(), path, config.threads,
            config.collective_timeout_s, config.max_shm_bytes,
        )
        notifier = self._notifier = Notifier()
        # Sockets are bound and peers configured: clients can connect from now on.
        notifier.notify("READY=1", f"MAINPID={os.getpid()}", f"STATUS={_status(service)}")
        self._tasks = [loop.create_task(_keep_systemd_informed(notifier, service)),
                       loop.create_task(_watch_for_stalls(service))]
        if config.exit_when_idle_s > 0:
            self._tasks.append(loop.create_task(
                _exit_when_idle(service, config.exit_when_idle_s, self._stop)))

    async def _start_stats(self, service: GradsyncService,
                           endpoints: tuple[str, str] | None,
                           stats_keys: StatsCurve | None) -> None:
        """Serve statistics on `endpoints` (None: disabled, the path is too long)."""
        config = self.config
        if endpoints is None:
            log.warning("statistics endpoint disabled: %s.stats.pub would exceed the Unix "
                        "socket path limit; pass --stats", config.socket)
            return
        self._stats_server = StatsServer(
            endpoints, service, self._peering.links if self._peering is not None else None,
            stats_keys,
        )
        try:
            await self._stats_server.start(config.group_access)
        except zmq.ZMQError as exc:
            raise StartupError(
                f"cannot bind the stats endpoint {endpoints[0]}: {exc}"
            ) from None

    async def serve(self) -> None:
        """Run until told to stop, then stop."""
        if not self._started:
            await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Fail what is in flight, close every endpoint, unlink every segment."""
        if not self._started:
            return
        self._started = False
        if self._notifier is not None:
            self._notifier.notify("STOPPING=1", "STATUS=shutting down")
        for task in self._tasks:
            task.cancel()
        log.info("shutting down: failing in-flight collectives, unlinking segments")
        assert self.service is not None
        if self._server is not None:
            self._server.close()
        if self._stats_server is not None:
            await self._stats_server.close()
            self._stats_server = None
        self.service.shut_down()
        # Let running reductions finish, off the loop: an empty() buffer is never
        # left half reduced, and the loop still flushes replies meanwhile.
        if not await self.service.drain(timeout_s):
            log.warning("reductions still running after %gs; exiting without them",
                        timeout_s)
        await self._close_endpoints()
        # Let the transports flush the error replies before the process exits.
        await asyncio.sleep(0)
        if self._notifier is not None:
            self._notifier.close()
        self._exits.close()
        if self.config.own_folder:
            folder = os.path.dirname(parse_ipc_endpoint(self.config.socket))
            shutil.rmtree(folder, ignore_errors=True)
        log.info("gradsyncd stopped")

    async def _close_endpoints(self) -> None:
        if self._stats_server is not None:
            await self._stats_server.close()
            self._stats_server = None
        if self._peering is not None:
            await self._peering.close()
            self._peering = None
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None


async def serve(config: DaemonConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT."""
    await Daemon(config).serve()


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


#: A daemon that exits when idle waits at least this long for its first client:
#: the ranks that started it connect only once every node has its daemon.
FIRST_CLIENT_GRACE_S = 60.0


async def _exit_when_idle(service: GradsyncService, idle_s: float, stop: asyncio.Event) -> None:
    """Set `stop` once no client has been connected for `idle_s` seconds (or, before
    any rank joined a job here, for `FIRST_CLIENT_GRACE_S`)."""
    loop = asyncio.get_running_loop()
    joined = 0
    idle_since = loop.time()
    while True:
        await asyncio.sleep(min(0.25, idle_s / 4))
        now = loop.time()
        # A whole job can join and leave between two polls: the counter still moves.
        if service.sessions or service.members_joined != joined:
            joined, idle_since = service.members_joined, now
            continue
        waited = now - idle_since
        if waited >= (idle_s if joined else max(idle_s, FIRST_CLIENT_GRACE_S)):
            log.info("no client for %.1fs: exiting (exit_when_idle_s)", waited)
            stop.set()
            return


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
