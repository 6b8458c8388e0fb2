"""Membership at scale (issue 48, part 2), in the simulation of
benchmarks/membership_scale.py: M daemons' real cores on a simulated network.

Forming a job and its failure news go through the job's coordinator, so they
cost O(M) messages; at rest a daemon heartbeats its 2 log2(M) ring neighbours,
so heartbeats cost O(M log M); links open to the ring neighbours at start and
to other daemons on first use, so they too number O(M log M).
"""

from __future__ import annotations

import functools
import itertools
import math

import pytest

from benchmarks.membership_scale import Cluster, Row, detect, measure


@pytest.mark.parametrize("size", [2, 5, 16, 64])
def test_every_daemon_forms_the_job_alike_then_ends_it_when_one_is_lost(size: int) -> None:
    row = measure(size)  # raises unless all formed alike, all ended it
    # Each daemon announces to the coordinator and its standby; the coordinator
    # sends each the formation.
    assert row.form.total == 3 * (size - 1)
    assert row.form.received_per_daemon <= size and row.form.sent_per_daemon <= size
    # Each survivor withdraws to the coordinator and the standby; the
    # coordinator passes the first on.
    assert row.news.total <= 3 * (size - 2), row.news


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


#: The sizes the issue names, each measured once for the module.
SIZES = (4, 64, 256, 1024)


@functools.cache
def measured(size: int) -> Row:
    return measure(size)


@pytest.mark.parametrize(("small", "large"), list(itertools.pairwise(SIZES)))
def test_membership_messages_grow_no_faster_than_m_log_m(small: int, large: int) -> None:
    """To form a job, to spread the news of a lost daemon, and per second at rest:
    messages in all, from each size to the next."""
    before, after = measured(small), measured(large)
    assert grows_within_m_log_m(small, large, before.form.total, after.form.total)
    assert grows_within_m_log_m(small, large, before.news.total, after.news.total)
    assert grows_within_m_log_m(small, large, small * before.rest_per_daemon_s,
                                large * after.rest_per_daemon_s)
    assert after.declare_s <= 3.0  # detection does not grow at all


@pytest.mark.parametrize(("small", "large"), list(itertools.pairwise(SIZES[1:])))
def test_links_held_grow_no_faster_than_m_log_m(small: int, large: int) -> None:
    """A daemon opens links to its ring neighbours at start, and to the others it
    sends to on first use: the links of a cluster that formed and ended a job of
    every daemon, in all, from each size to the next (from 64: a few daemons
    link every pair, as they watch every other)."""
    before, after = measured(small), measured(large)
    assert grows_within_m_log_m(small, large, before.links_total, after.links_total)
    assert after.links_at_start == min(large - 1, 2 * math.ceil(math.log2(large)))
    assert after.links_most == large - 1  # the coordinator: the formation to every member


def test_the_growth_check_fails_all_to_all_messages() -> None:
    """The check above would catch the old protocol: every daemon to every other."""
    assert not grows_within_m_log_m(64, 256, 64 * 63, 256 * 255)
    assert not grows_within_m_log_m(64, 256, 22 * 64 * 63, 22 * 256 * 255)
