"""Old import path of `gradsync stats`/`top`/`trace`, now `gradsync.client.cli.stats`.

Kept only while tests/test_config.py, test_multinode.py, test_multinode_failures.py
and test_slurm.py import `fetch_snapshot` from here (outside the client part of
issue 21); delete this file with those imports.  Nothing in the library imports it.
"""

from gradsync.client.cli.stats import fetch_snapshot

__all__ = ["fetch_snapshot"]
