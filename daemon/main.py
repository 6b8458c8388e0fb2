"""`gradsyncd`: command-line entry point of the node daemon."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from gradsync.daemon.config import ConfigError, DaemonConfig, load_config
from gradsync.daemon.journal_logging import setup_logging
from gradsync.protocol.version import __version__

log = logging.getLogger("gradsync.daemon")

#: Read when it exists and no --config is given (the systemd unit's location).
DEFAULT_CONFIG_PATH = "/etc/gradsync/gradsyncd.toml"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsyncd",
        allow_abbrev=False,  # `--thread 4` is a mistake, not --threads
        description="gradsync node daemon: owns shared-memory gradient buffers and "
        "runs collectives for the training processes of this node.",
        epilog="Settings come from flags, then GRADSYNC_<SETTING> environment "
        "variables, then the --config TOML file, then defaults.",
    )
    _add_node_options(parser)
    _add_checkpoint_options(parser)
    _add_peer_options(parser.add_argument_group(
        "peers", "multi-node jobs: links to other daemons"))
    return parser


def _add_node_options(parser: argparse.ArgumentParser) -> None:
    """The daemon on its node: its socket, memory, threads, deadlines, logging."""
    parser.add_argument("--version", action="version", version=f"gradsyncd {__version__}")
    parser.add_argument("--config", metavar="FILE", help="TOML file with settings")
    parser.add_argument("--socket", metavar="ipc://PATH", help="client endpoint")
    parser.add_argument("--threads", metavar="N", help="reduction threads (default: cores)")
    parser.add_argument(
        "--collective-timeout-s", metavar="S", help="deadline of one collective (default 300)"
    )
    parser.add_argument(
        "--max-shm-bytes", metavar="SIZE", help="shared-memory budget, e.g. 8GiB (default)"
    )
    parser.add_argument(
        "--inline-reduce-bytes", metavar="SIZE",
        help="reduce collectives whose slots total up to this size on the event loop "
        "instead of the thread pool (default 4MiB)",
    )
    parser.add_argument(
        "--fast-path-bytes", metavar="SIZE",
        help="synchronous allreduces of single-node jobs up to this size skip the "
        "socket (shared-memory fast path; default 64KiB, 0: off)",
    )
    parser.add_argument(
        "--log-level", metavar="LEVEL", help="debug, info (default), warning, error"
    )
    parser.add_argument(
        "--stats", metavar="ENDPOINT",
        help="read-only statistics endpoint (default: the socket path + .stats)",
    )
    parser.add_argument(
        "--stall-warn-s", metavar="S",
        help="log once what a collective waits for after this long (default 60)",
    )
    parser.add_argument(
        "--exit-when-idle-s", metavar="S",
        help="exit cleanly once no client has been connected for S seconds "
        "(default 0: never; the torch backend's private daemons use it)",
    )
    parser.add_argument(
        "--own-folder", action="store_true", default=None,
        help="the socket's folder is this daemon's alone: remove it, and all in it, on exit",
    )
    parser.add_argument(
        "--group-access", action="store_true", default=None,
        help="let the daemon's group use it: socket 0660, segments 0660 (default: owner only)",
    )


def _add_checkpoint_options(parser: argparse.ArgumentParser) -> None:
    """Checkpoints held in daemon memory (docs/pytorch.md, "Checkpoints")."""
    parser.add_argument(
        "--checkpoints-kept", metavar="K",
        help="complete checkpoints kept per job in daemon memory (default 2)",
    )
    parser.add_argument(
        "--checkpoints-survive-exit", action="store_true", default=None,
        help="at a clean exit, leave the complete checkpoints in /dev/shm for the next "
        "daemon on this socket (a crashed daemon's are taken over either way)",
    )
    parser.add_argument(
        "--checkpoint-replicas", metavar="R",
        help="peer daemons each checkpoint part is copied to, in the links' idle time "
        "(default 1; 0: none)",
    )


def _add_peer_options(peers: argparse._ArgumentGroup) -> None:
    """Links to other daemons, and how collectives run over them."""
    peers.add_argument("--listen", metavar="tcp://HOST:PORT", help="endpoint peers connect to")
    peers.add_argument("--peers", metavar="LIST",
                       help="comma-separated peer endpoints (may include this daemon)")
    peers.add_argument("--peers-file", metavar="FILE", help="one peer endpoint per line")
    peers.add_argument("--peers-from-slurm", action="store_true", default=None,
                       help="peers: one daemon on every node of this Slurm job "
                       "(SLURM_JOB_NODELIST, expanded by scontrol) at --port; --listen "
                       "defaults to this node's name at --port")
    peers.add_argument("--port", metavar="P",
                       help="the peer port of every daemon with --peers-from-slurm "
                       "(default 29400)")
    peers.add_argument("--curve-secret", metavar="FILE",
                       help="this daemon's CURVE secret key (from gradsync keygen)")
    peers.add_argument("--curve-authorized", metavar="DIR",
                       help="folder of the public keys of authorised peers")
    peers.add_argument("--insecure", action="store_true", default=None,
                       help="peer links without CURVE encryption and authentication")
    peers.add_argument("--data-port", metavar="P",
                       help="TCP port the data streams listen on, on --listen's host "
                       "(default 0: any free port)")
    peers.add_argument("--data-advertise", metavar="HOST:PORT",
                       help="where peers open data streams to this daemon, when a NAT or "
                       "port forward sits between (default: --listen's host, --data-port)")
    peers.add_argument("--peer-timeout-s", metavar="S",
                       help="upper bound: a peer silent this long is lost whatever the "
                       "failure detector says (default 10; it declares a vanished peer "
                       "in about 2 s)")
    peers.add_argument("--failure-detector", metavar="{adaptive,timeout}",
                       help="adaptive (default): heartbeats every 0.1 s, suspicion checked "
                       "with other peers, a vanished peer declared in about 2 s; timeout: "
                       "heartbeats once a second, no suspicion, a silent peer declared "
                       "at about --peer-timeout-s")
    peers.add_argument("--watch-neighbours", metavar="N",
                       help="with no job using a peer, heartbeat only the N nearest daemons "
                       "on either side of a ring of all of them (default 0: log2 of the "
                       "daemons; every daemon is watched by 2N others)")
    peers.add_argument("--link-idle-s", metavar="S",
                       help="close a link to a peer that is not a ring neighbour after "
                       "this long with nothing sent or heard, unless a job uses it; it "
                       "opens again on first use (default 60)")
    _add_algorithm_options(peers)


def _add_algorithm_options(peers: argparse._ArgumentGroup) -> None:
    """How a multi-node collective is cut, which algorithm runs it, and its codec lanes."""
    peers.add_argument("--pipeline-slice-bytes", metavar="SIZE",
                       help="inter-daemon transfers are cut into slices this big (4MiB)")
    peers.add_argument("--algorithm", metavar="NAME",
                       help="auto (default), ring, tree, rhd or star")
    peers.add_argument("--auto-explore-factor", metavar="F",
                       help="auto times each algorithm its model prices within F times its "
                            "best, then runs the fastest measured (default 1.5; 1: the model "
                            "alone decides)")
    peers.add_argument("--codec-lanes", metavar="N",
                       help="threads that encode and decode compressed slices (default: "
                            "the cores this daemon may use, at most 4)")


def _run(config: DaemonConfig) -> None:
    from gradsync.daemon.io.server import serve

    try:
        import uvloop
    except ImportError:
        import asyncio

        log.warning("uvloop is not importable; running on the default asyncio loop")
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # The server and the peer links (numpy, ml_dtypes, ZeroMQ, asyncio: most of a
    # second) load once the command line parses: `gradsyncd --help` answers at once.
    from gradsync.daemon.io.server import StartupError
    from gradsync.daemon.slurm import with_slurm_peers

    flags = {k: v for k, v in vars(args).items() if k != "config"}
    config_path = args.config
    if config_path is None and os.path.exists(DEFAULT_CONFIG_PATH):
        config_path = DEFAULT_CONFIG_PATH
    try:
        config = with_slurm_peers(load_config(flags=flags, toml_path=config_path))
    except ConfigError as exc:
        print(f"gradsyncd: configuration error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    try:
        _run(config)
    except StartupError as exc:
        print(f"gradsyncd: cannot start: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"gradsyncd: configuration error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
