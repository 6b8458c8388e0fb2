"""gradsync.daemon: the node daemon `gradsyncd`.

Layered so that dependencies point down: `io/` (client sessions, request
handlers, server lifecycle, peer wiring, statistics endpoint) and `peers/`
(the ZeroMQ links and data streams) call into `run/` (the executor and the
inter-daemon phase) and `core/` (matching, membership, plans, the auto
policy: no sockets, no event loop); `algorithms/` are pure schedules and the
cost model; `backends/` own the buffers (host shm, CUDA IPC) and reductions.
"""
