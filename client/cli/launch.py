"""`gradsync launch`: run N ranks of a script on this node, like torchrun.

Uses the daemon at the endpoint when one answers; otherwise starts a private
`gradsyncd` for the run and stops it afterwards.  Forwards SIGINT/SIGTERM to
the ranks; when one rank fails, stops the others and exits with its code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from gradsync.client.daemon_process import DaemonStartError, start_daemon
from gradsync.client.ping import query
from gradsync.protocol.endpoint import default_endpoint
from gradsync.protocol.errors import GradsyncError

_DAEMON_START_TIMEOUT_S = 30.0
_GRACE_S = 10.0


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    # torchrun's spellings (--nproc_per_node, --node_rank) are accepted too.
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        metavar="N", help="ranks to start on this node (default 1)")
    parser.add_argument("--daemon", default=None, metavar="ENDPOINT",
                        help="daemon endpoint; a private daemon is started there (or in a "
                        "temporary folder when not given) if none answers")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N",
                        help="nodes the job spans (default 1); ranks are numbered "
                        "node_rank * nproc_per_node + local_rank, as torchrun does")
    parser.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                        help="this node's index in [0, nnodes) (default 0)")
    parser.add_argument("--job", default=None,
                        help="job name (default: unique per launch on one node; "
                        "'launch' across nodes, where every node must use the same name)")
    parser.add_argument("--master-addr", "--master_addr", default=None, metavar="HOST",
                        help="MASTER_ADDR for torch.distributed's env:// rendezvous "
                        "(default: $MASTER_ADDR, else 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", type=int, default=None,
                        metavar="PORT", help="MASTER_PORT (default: $MASTER_PORT, else a "
                        "free port on one node, 29500 across nodes, as torchrun)")
    peers = parser.add_argument_group(
        "private daemon", "settings for the daemon launch starts when none answers"
    )
    peers.add_argument("--listen", metavar="tcp://HOST:PORT", help="peer endpoint to bind")
    peers.add_argument("--peers", metavar="LIST", help="comma-separated peer endpoints")
    peers.add_argument("--curve-secret", metavar="FILE")
    peers.add_argument("--curve-authorized", metavar="DIR")
    peers.add_argument("--insecure", action="store_true", help="peer links without CURVE")
    parser.add_argument("script", help="Python script (or executable) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")


def log(message: str) -> None:
    print(f"gradsync launch: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def daemon_for(
    endpoint: str | None,
    daemon_args: list[str] | None = None,
    signals: SignalForwarder | None = None,
    report: Callable[[str], None] | None = None,
) -> Iterator[str]:
    """Yield an endpoint with a live daemon, starting a private one if needed."""
    candidate = endpoint or os.environ.get("GRADSYNC_DAEMON")
    if candidate is None and _answers(default_endpoint()):
        yield default_endpoint()
        return
    if candidate and _answers(candidate):
        yield candidate
        return
    folder = None
    env = dict(os.environ)
    env.setdefault("GRADSYNC_LOG_LEVEL", "warning")
    # A signal between creating the folder or the process and the `try` below
    # would leak them: hold it until the cleanup is in place.
    with signals.held() if signals else contextlib.nullcontext():
        if candidate is None:
            folder = tempfile.mkdtemp(prefix="gradsync-launch-")
            candidate = f"ipc://{folder}/gradsyncd.sock"
        # Its own session: a Ctrl-C for the ranks must not stop it under them;
        # launch stops it once the ranks are done.
        daemon = start_daemon(candidate, daemon_args or [], folder=folder, env=env,
                              new_session=True)
    try:
        if signals is not None:
            signals.raise_held()
        try:
            daemon.wait_ready(_DAEMON_START_TIMEOUT_S)
        except DaemonStartError as exc:
            raise SystemExit(f"gradsync launch: {exc}") from None
        (report or log)(f"started a private gradsyncd (pid {daemon.pid}) at {candidate}")
        yield candidate
    finally:
        if daemon.alive():
            code = daemon.stop(_GRACE_S * 3)
            if code != 0:
                log(f"private gradsyncd exited with status {code}")
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def _answers(endpoint: str) -> bool:
    try:
        query(endpoint, 2.0)
    except GradsyncError:
        return False
    return True


def _has_peers(endpoint: str) -> bool:
    """Whether the daemon has peer daemons configured (asked, not guessed from our flags)."""
    try:
        return bool(query(endpoint, 2.0).get("peers"))
    except GradsyncError:
        return True  # it answered a moment ago; the ranks will report what is wrong


def _rank_command(script: str, script_args: list[str]) -> list[str]:
    if script.endswith(".py") or not os.access(script, os.X_OK):
        return [sys.executable, script, *script_args]
    return [script, *script_args]


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class LaunchInterrupted(BaseException):
    """SIGINT/SIGTERM arrived before any rank was started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalForwarder:
    """Owns SIGINT/SIGTERM for the whole launch: forwards them to the ranks once they
    run, and aborts the start-up (stopping a private daemon) before that."""

    def __init__(self) -> None:
        self.ranks: list[subprocess.Popen[bytes]] = []
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}
        self._holding = False
        self._pending: list[int] = []

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Record, but do not act on, signals inside the block (see `raise_held`)."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False

    def raise_held(self) -> None:
        """Act on the signals that arrived while held."""
        pending, self._pending = self._pending, []
        for signum in pending:
            self._act(signum)

    def __enter__(self) -> SignalForwarder:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)
        if self._holding:
            self._pending.append(signum)
        else:
            self._act(signum)

    def _act(self, signum: int) -> None:
        if not self.ranks:
            raise LaunchInterrupted(signum)
        for rank in self.ranks:
            if rank.poll() is None:
                rank.send_signal(signum)


def rendezvous_env(
    nnodes: int, master_addr: str | None = None, master_port: int | None = None
) -> dict[str, str]:
    """MASTER_ADDR / MASTER_PORT for torch's env:// (init_process_group("gradsync")).

    A flag wins, then the environment, then torchrun's defaults; on one node
    a free port, so concurrent launches do not meet on 29500.
    """
    addr = master_addr or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = master_port or os.environ.get("MASTER_PORT")
    if port is None:
        port = 29500 if nnodes > 1 else _free_port(addr)
    return {"MASTER_ADDR": addr, "MASTER_PORT": str(port)}


def _free_port(addr: str) -> int:
    with socket.socket() as probe:
        try:
            probe.bind((addr, 0))
        except OSError:
            probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def rank_threads(nproc: int) -> dict[str, str]:
    """OMP_NUM_THREADS=1 for the ranks where several share the node and it is not set,
    as torchrun does: torch otherwise gives each rank a thread per core, and ranks
    that spin-wait on each other's cores ran a small DDP step ten times slower."""
    if nproc < 2 or "OMP_NUM_THREADS" in os.environ:
        return {}
    log(f"OMP_NUM_THREADS=1 for each of the {nproc} ranks (it is not set); set it to give "
        "them more threads")
    return {"OMP_NUM_THREADS": "1"}


def run_ranks(
    command: list[str], nproc: int, endpoint: str, job: str, nnodes: int = 1,
    node_rank: int = 0, signals: SignalForwarder | None = None,
    rendezvous: dict[str, str] | None = None,
) -> int:
    """Start the ranks, watch them, and return the launch's exit status."""
    signals = signals or SignalForwarder()
    ranks = signals.ranks
    received = signals.received
    rendezvous = rendezvous if rendezvous is not None else rendezvous_env(nnodes)
    threads = rank_threads(nproc)
    try:
        for local_rank in range(nproc):
            env = dict(os.environ)
            env.update(rendezvous)
            env.update(threads)
            env.update(
                RANK=str(node_rank * nproc + local_rank), WORLD_SIZE=str(nnodes * nproc),
                LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(nproc),
                GROUP_RANK=str(node_rank), GRADSYNC_DAEMON=endpoint, GRADSYNC_JOB=job,
            )
            with signals.held():
                ranks.append(subprocess.Popen(command, env=env))
            signals.raise_held()
        code = _watch(ranks, received, node_rank * nproc if nnodes > 1 else None)
        # Like torchrun: a launch stopped by a signal is not a success, however the
        # ranks exited.
        return 128 + received[0] if received and code == 0 else code
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
                rank.wait()


def _watch(
    ranks: list[subprocess.Popen[bytes]], received: list[int], first_rank: int | None = None
) -> int:
    """Wait for the ranks; `first_rank`: the global rank of local rank 0 on a node of
    a multi-node job (None on one node, where the two numberings are the same)."""
    while True:
        codes = [rank.poll() for rank in ranks]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            index, code = failed[0]
            if not received:
                # Global ranks, the numbering the job's own messages use.
                who = (f"rank {index}" if first_rank is None
                       else f"rank {first_rank + index} (local rank {index})")
                log(f"{who} exited with status {code}; stopping the other ranks")
            _stop_all(ranks)
            return _exit_code(code or 1)
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


def _stop_all(ranks: list[subprocess.Popen[bytes]]) -> None:
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for rank in ranks:
        try:
            rank.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            rank.kill()
            rank.wait()


def run_launch(args: argparse.Namespace) -> int:
    if args.nproc_per_node < 1:
        log("--nproc-per-node must be at least 1")
        return 2
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        log(f"need --nnodes >= 1 and 0 <= --node-rank < nnodes, got {args.nnodes}, "
            f"{args.node_rank}")
        return 2
    command = _rank_command(args.script, list(args.script_args))
    job = args.job or (f"launch-{os.getpid()}" if args.nnodes == 1 else "launch")
    daemon_args = _daemon_args(args)
    with SignalForwarder() as signals:
        try:
            with daemon_for(args.daemon, daemon_args, signals) as endpoint:
                if args.nnodes > 1 and not _has_peers(endpoint):
                    log(f"a multi-node launch needs a daemon with peers, and the one at "
                        f"{endpoint} has none: run gradsyncd with --listen and --peers on "
                        "every node (or pass them here for a private daemon)")
                return run_ranks(
                    command, args.nproc_per_node, endpoint, job, args.nnodes, args.node_rank,
                    signals, rendezvous_env(args.nnodes, args.master_addr, args.master_port),
                )
        except LaunchInterrupted as interrupted:
            log(f"interrupted by signal {interrupted.signum} while starting")
            return 128 + interrupted.signum


def _daemon_args(args: argparse.Namespace) -> list[str]:
    forwarded = []
    for name in ("listen", "peers", "curve_secret", "curve_authorized"):
        value = getattr(args, name, None)
        if value:
            forwarded += ["--" + name.replace("_", "-"), value]
    if getattr(args, "insecure", False):
        forwarded.append("--insecure")
    return forwarded
