"""A job's cross-daemon state has one writer, `ClusterJobs`: what the layers
above tell it (a run started, ended, a rank left) and the early slices it
keeps, with the bytes they hold counted in one place (`EarlySlices`).

Driven through the core with the fake transport of test_core_membership.py.
"""

from __future__ import annotations

import asyncio

import numpy as np
from test_core_membership import (
    PEER,
    THEIRS,
    _formed_theirs,
    _left,
    _star_run,
    announce,
    core,
    local_job,
)
from test_core_membership import loop as loop  # the fixture

from gradsync.daemon.core.cluster_job import EarlySlices, payload_bytes
from gradsync.protocol import peer as wire
from gradsync.protocol.errors import CollectiveError, RankLostError

FP = wire.Fingerprint("allreduce", "float32", 8, "sum", "star")


def _slice(job_name: str, generation: int, key: int) -> wire.Slice:
    return wire.Slice(job_name, generation, key, FP, 0, 0, 0)


def test_early_slices_count_their_bytes_in_and_out() -> None:
    early = EarlySlices()
    one, two = np.ones(8, np.float32).tobytes(), np.ones(16, np.float32).tobytes()
    early.keep(None, (PEER, _slice("j", 1, 0), [one]), len(one))
    early.keep(3, (PEER, _slice("j", 1, 3), [two]), len(two))
    assert early.nbytes == 96
    assert payload_bytes(early.take_unformed()) == 32 and early.nbytes == 64
    assert early.take(4) == [] and early.nbytes == 64
    assert payload_bytes(early.take(3)) == 64 and early.nbytes == 0
    early.keep(5, (PEER, _slice("j", 1, 5), [one]), len(one))
    early.clear()
    assert early.nbytes == 0 and not early.by_key and not early.unformed


def test_an_abort_drops_the_slices_kept_for_its_key(loop: asyncio.AbstractEventLoop) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(5), ())
    assert job.across.formation is not None
    data = np.full(8, 2.0, np.float32)
    for key in (0, 1):
        cluster.on_message(PEER, _slice(job.name, job.across.formation.generation, key).to_wire(),
                           (data.tobytes(),))
    assert sorted(job.across.early.by_key) == [0, 1] and job.across.early.nbytes == 64
    cluster.abort(job, 0, CollectiveError("key 0 failed"))
    assert list(job.across.early.by_key) == [1] and job.across.early.nbytes == 32
    assert "abort" in transport.kinds()


def test_a_peers_abort_drops_the_slices_kept_for_its_key(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """A key a member aborted before our ranks submitted it never runs here (they
    get the error at once): its early slices must not hold the budget until the
    job ends, where enough of them would break the job as 'out of step'."""
    cluster, _, jobs = core(loop)
    job = local_job(cluster, jobs, loop)
    cluster.on_message(PEER, announce(5), ())
    generation = job.across.formation.generation  # type: ignore[union-attr]
    data = np.full(8, 2.0, np.float32)
    for key in (0, 1):
        cluster.on_message(PEER, _slice(job.name, generation, key).to_wire(), (data.tobytes(),))
    cluster.on_message(PEER, wire.Abort(job.name, generation, 0, "mismatch", "key 0 failed",
                                        {}).to_wire(), ())
    assert 0 in job.failed
    assert list(job.across.early.by_key) == [1] and job.across.early.nbytes == 32


def test_a_withdrawal_waits_for_the_running_collectives_then_goes_out(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """The peer's ranks left cleanly while ours still run a collective that needs
    nothing more from it: our withdrawal follows once that run ends."""
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    _formed_theirs(cluster, job)
    ours, theirs = np.full(8, 1.0, np.float32), np.full(8, 2.0, np.float32)
    run = _star_run(cluster, job, transport, loop, ours)
    assert job.across.runs == {0: run}
    cluster.on_message(PEER, wire.Slice(job.name, job.across.formation.generation,  # type: ignore[union-attr]
                                        0, FP, 0, 0, 0).to_wire(), (theirs.tobytes(),))
    cluster.on_message(PEER, _left(job, clean=True), ())
    withdrawals = lambda: [h for _, h, _ in transport.sent if h.get("kind") == "withdraw"]  # noqa: E731
    assert job.across.withdrawal is not None and not withdrawals()
    cluster.run_ended(job, 0)
    assert not job.across.runs and len(withdrawals()) == 1  # to the coordinator


def test_a_rank_leaving_cleanly_makes_the_withdrawal_say_so(
    loop: asyncio.AbstractEventLoop,
) -> None:
    cluster, transport, jobs = core(loop)
    job = local_job(cluster, jobs, loop, THEIRS)
    _formed_theirs(cluster, job)
    cluster.ended_cleanly(job)
    cluster.broke_here(job, RankLostError("rank 0 disconnected"))
    withdrawals = [wire.from_wire(header) for _, header, _ in transport.sent
                   if header["kind"] == "withdraw"]
    assert withdrawals and all(isinstance(w, wire.Withdraw) and w.clean for w in withdrawals)
