"""Old import path of `gradsync keygen`, now `gradsync.client.cli.keygen`.

Kept only while tests/test_peer_links.py imports `generate_keypair` from here
(outside the client part of issue 21); delete this file with that import.
Nothing in the library imports it.
"""

from gradsync.client.cli.keygen import generate_keypair

__all__ = ["generate_keypair"]
