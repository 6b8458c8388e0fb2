"""`gradsyncd`: command-line entry point of the node daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from gradsync.daemon.config import ConfigError, DaemonConfig, load_config
from gradsync.daemon.server import StartupError, serve
from gradsync.protocol.version import __version__

log = logging.getLogger("gradsync.daemon")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsyncd",
        description="gradsync node daemon: owns shared-memory gradient buffers and "
        "runs collectives for the training processes of this node.",
        epilog="Settings come from flags, then GRADSYNC_<SETTING> environment "
        "variables, then the --config TOML file, then defaults.",
    )
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
        "--log-level", metavar="LEVEL", help="debug, info (default), warning, error"
    )
    return parser


def _run(config: DaemonConfig) -> None:
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not importable; running on the default asyncio loop")
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "config"}
    try:
        config = load_config(flags=flags, toml_path=args.config)
    except ConfigError as exc:
        print(f"gradsyncd: configuration error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s gradsyncd[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        _run(config)
    except StartupError as exc:
        print(f"gradsyncd: cannot start: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
