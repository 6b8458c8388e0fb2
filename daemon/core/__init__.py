"""The daemon's decisions, with no sockets and no event loop of their own.

Matching of submissions (`matching.py`), membership and generations across
daemons (`membership.py`, `cluster.py`), the `auto` policy (`auto.py`) and its
per-epoch cost agreement (`cost_epochs.py`), and the plans that say how a
collective runs (`plans.py`).  `io/` and `peers/` call in; nothing here calls
back up.
"""
