"""benchmarks: gradsync side by side with gloo, Open MPI and raw pyzmq, plus the GPU check.

A package, run from the repository root as `python -m benchmarks.NAME`
(allreduce, collectives, ddp_step, interdaemon, gpu_check); the worker
processes a benchmark starts run the same way (`python -m benchmarks.rank_worker`
and the like) and inherit its working directory.  Its daemons are started by
`gradsync.client.daemon_process`, the launcher the tests use too
(`benchmarks.private_daemon`).  It is not installed with gradsync.
"""
