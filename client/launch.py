"""Old import path of `gradsync launch`, which is now `gradsync.client.cli.launch`.

Kept only while tests/test_torch_ddp.py imports `gradsync.client.launch`
(outside the client part of issue 21); delete this file with that import.
Nothing in the library imports it.
"""

from gradsync.client.cli.launch import *  # noqa: F403
