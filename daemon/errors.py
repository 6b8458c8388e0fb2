"""The daemon's start-up error, apart from the modules that raise it.

`ConfigError` is raised both by the configuration (config.py, slurm.py, the
stats server) and by the peer links (peers/), which check their own settings
and key files at start.  It lives here, in a module that imports nothing, so
that `peers/` need not import `daemon.config` (nor config the peers package):
every `except ConfigError` in the daemon catches what either raises.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names key and source."""
