"""The allreduce algorithms between daemons, named once for both wires.

The client's requests (requests.py) may ask for one, the daemons' slices
(peer.py) carry the one they run; the daemon's configuration names them too.
"""

from __future__ import annotations

ALGORITHM_NAMES: tuple[str, ...] = ("ring", "tree", "rhd", "star")
#: What a client or a daemon's configuration may ask for.
ALGORITHM_CHOICES: tuple[str, ...] = ("auto", *ALGORITHM_NAMES)
