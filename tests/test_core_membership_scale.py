"""Membership at scale (issue 48, part 2), in the simulation of
benchmarks/membership_scale.py: M daemons' real cores on a simulated network.

Forming a job and its failure news go through the job's coordinator, so they
cost O(M) messages; at rest a daemon heartbeats its 2 log2(M) ring neighbours,
so heartbeats cost O(M log M).
"""

from __future__ import annotations

import math

import pytest

from benchmarks.membership_scale import Cluster, at_rest_per_daemon_s, detect, measure


@pytest.mark.parametrize("size", [2, 5, 16, 64])
def test_every_daemon_forms_the_job_alike_then_ends_it_when_one_is_lost(size: int) -> None:
    row = measure(size)  # raises unless all formed alike, all ended it
    # Each daemon announces to the coordinator, which sends each the formation.
    assert row.form.total == 2 * (size - 1)
    assert row.form.sent_per_daemon == row.form.received_per_daemon == size - 1
    # Each survivor withdraws to the coordinator, which passes the first on.
    assert row.news.total <= 2 * (size - 2), row.news


def test_the_default_detector_declares_a_vanished_peer_within_3_s() -> None:
    for size in (3, 64):
        declare_s, asked = detect(size)
        assert declare_s <= 3.0, (size, declare_s)
        assert 0 < asked <= size - 2  # witnesses are the other peers, a few of them


def test_a_formed_cluster_holds_one_generation() -> None:
    cluster = Cluster(6)
    cluster.form()
    generations = {job.across.formation.generation  # type: ignore[union-attr]
                   for job in cluster.jobs.values()}
    assert len(generations) == 1


def grows_within_m_log_m(small: int, large: int, cost_small: float, cost_large: float) -> bool:
    """Whether a total cost grew from `small` to `large` daemons no faster than
    M log M (with 50 % slack)."""
    bound = (large * math.log2(large)) / (small * math.log2(small))
    return cost_large / cost_small <= 1.5 * bound


def test_forming_and_failure_news_grow_no_faster_than_m_log_m() -> None:
    small, large = measure(16), measure(256)
    assert grows_within_m_log_m(16, 256, small.form.total, large.form.total)
    assert grows_within_m_log_m(16, 256, small.news.total, large.news.total)


def test_the_growth_check_fails_all_to_all_messages() -> None:
    """The check above would catch the old protocol: every daemon to every other."""
    assert not grows_within_m_log_m(16, 256, 16 * 15, 256 * 255)


def test_heartbeats_at_rest_grow_no_faster_than_m_log_m() -> None:
    assert grows_within_m_log_m(16, 256, 16 * at_rest_per_daemon_s(16),
                                256 * at_rest_per_daemon_s(256))
