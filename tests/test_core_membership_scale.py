"""Membership at scale (issue 48, part 2), in the simulation of
benchmarks/membership_scale.py: M daemons' real cores on a simulated network.

What holds today is asserted as it is; what the issue asks of the protocol
(no faster growth than O(M log M)) is a strict xfail: it fails today, and the
day the formation and the failure news stop being all-to-all it passes, which
fails the suite until the mark is removed.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.membership_scale import Cluster, at_rest_per_daemon_s, detect, measure


@pytest.mark.parametrize("size", [2, 5, 16])
def test_every_daemon_forms_the_job_alike_then_ends_it_when_one_is_lost(size: int) -> None:
    row = measure(size, full_up_to=size)  # raises unless all formed alike, all ended it
    assert row.simulated == size
    # Today every daemon announces to, and withdraws to, every other one.
    assert row.form.total == size * (size - 1)
    assert row.form.sent_per_daemon == row.form.received_per_daemon == size - 1
    assert row.news.total == (size - 1) * (size - 2)


def test_a_sampled_cluster_counts_every_daemons_sends() -> None:
    full, sampled = measure(12, full_up_to=12), measure(12, full_up_to=4)
    assert sampled.simulated == 2
    assert (sampled.form.total, sampled.news.total) == (full.form.total, full.news.total)


def test_the_default_detector_declares_a_vanished_peer_within_3_s() -> None:
    for size in (3, 64):
        declare_s, asked = detect(size)
        assert declare_s <= 3.0, (size, declare_s)
        assert 0 < asked <= size - 2  # witnesses are the other peers, a few of them


def test_a_formed_cluster_holds_one_generation() -> None:
    cluster = Cluster(6, full_up_to=6)
    cluster.form()
    generations = {job.across.formation.generation  # type: ignore[union-attr]
                   for job in cluster.jobs.values()}
    assert len(generations) == 1


def grows_within_m_log_m(small: int, large: int, cost_small: float, cost_large: float) -> bool:
    """Whether a total cost grew from `small` to `large` daemons no faster than
    M log M (with 50 % slack)."""
    bound = (large * math.log2(large)) / (small * math.log2(small))
    return cost_large / cost_small <= 1.5 * bound


@pytest.mark.xfail(strict=True, reason="issue 48, part 2: a job forms by every daemon "
                   "announcing to every other, its failure news is every survivor "
                   "withdrawing to every other, and every daemon heartbeats every peer")
def test_membership_costs_grow_no_faster_than_m_log_m() -> None:
    small, large = measure(16, full_up_to=16), measure(64, full_up_to=64)
    assert grows_within_m_log_m(16, 64, small.form.total, large.form.total)
    assert grows_within_m_log_m(16, 64, small.news.total, large.news.total)
    assert grows_within_m_log_m(16, 64, 16 * at_rest_per_daemon_s(16),
                                64 * at_rest_per_daemon_s(64))
