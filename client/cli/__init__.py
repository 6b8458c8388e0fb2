"""gradsync.client.cli: the `gradsync` command (launch, demo, ping, stats/top/trace, keygen).

Kept apart from the library: a training process imports `gradsync.client` and
never this package, and the library never imports it.  `main` (the console
script `gradsync`) builds the parser of every subcommand, so the command
modules import only what their options need; numpy, ZeroMQ and the like load
inside the function that runs a command (tests/test_cli_imports.py keeps it so).
"""

from __future__ import annotations

from gradsync.client.cli.main import main

__all__ = ["main"]
