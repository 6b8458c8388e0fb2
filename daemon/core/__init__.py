"""The daemon's decisions, with no sockets and no event loop of their own.

Matching of submissions (`matching.py`); what a job is across daemons
(`cluster_job.py`), membership and generations (`membership.py`); the cluster
jobs (`cluster.py`: the peers' messages, early slices, failures — the peer
links' events land here, and it sends through them as its transport); the
`auto` policy (`auto.py`) and its per-epoch cost agreement (`cost_epochs.py`);
the plans that say how a collective runs (`plans.py`).  `io/` and `peers/`
call in; nothing here calls back up.  No asyncio and no clock here: what is
decided later (a job's formation, an epoch's agreement) is settled on an
`Outcome` (`outcome.py`), which `run/outcomes.py` awaits; time comes in as an
injected clock; tests drive the core with fakes and no loop.
"""
