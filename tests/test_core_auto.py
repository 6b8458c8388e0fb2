"""The `auto` policy of one job (core/auto.py), driven without a daemon.

Its inputs (the formation's figures, the members' offers per epoch), its
decision and the record it leaves in the statistics, each checked on its own.
The same policy over real daemons: test_multinode.py's auto tests.
"""

from __future__ import annotations

import pytest

from gradsync.daemon.algorithms.calibration import CostMeter
from gradsync.daemon.core.auto import AutoPolicy, Decision, auto_pick, wants_auto
from gradsync.daemon.core.cost_epochs import EPOCH_KEYS
from gradsync.daemon.core.membership import Formation
from gradsync.daemon.stats import StatsRecorder
from gradsync.protocol import peer as wire
from gradsync.protocol.errors import InvalidArgumentError

HERE, PEER = "tcp://10.0.0.1:7000", "tcp://10.0.0.2:7000"
FORMATION = Formation((HERE, PEER), ((0,), (1,)), 0xABC, 50e-6, 1e-9)


def test_a_named_algorithm_is_run_as_asked_and_an_unknown_one_refused() -> None:
    policy = AutoPolicy()
    assert policy.choose("ring", "auto", FORMATION, 1 << 20, 0) == Decision("ring", "requested")
    assert policy.choose(None, "tree", FORMATION, 1 << 20, 0) == Decision("tree", "requested")
    with pytest.raises(InvalidArgumentError, match="unknown algorithm 'fast'"):
        policy.choose(None, "fast", FORMATION, 1 << 20, 0)
    assert wants_auto(None, "auto") and wants_auto("auto", "ring")
    assert not wants_auto("ring", "auto")


@pytest.mark.parametrize("nbytes", [4 << 10, 1 << 20, 64 << 20])
def test_auto_without_an_agreement_takes_the_models_pick_and_records_it(nbytes: int) -> None:
    stats = StatsRecorder()
    decision = AutoPolicy().choose(None, "auto", FORMATION, nbytes, 3, stats, "train")
    expected, _ = auto_pick(2, nbytes, FORMATION.alpha_s, FORMATION.beta_s_per_byte)
    assert decision == Decision(expected, "model")
    picks = stats.jobs["train"].auto[nbytes]
    assert picks.picks[expected] == 1 and picks.basis["model"] == 1
    assert (picks.alpha_s, picks.beta_s_per_byte, picks.epoch) == (50e-6, 1e-9, 0)


def test_a_daemon_offers_its_figures_once_per_epoch_and_never_for_epoch_0() -> None:
    policy = AutoPolicy()
    meter = CostMeter()
    assert policy.offer("train", FORMATION, 0, HERE, meter, 1.0) is None
    costs = policy.offer("train", FORMATION, 1, HERE, meter, 1.0)
    assert costs is not None and (costs.job, costs.gen, costs.epoch) == ("train", 0xABC, 1)
    # Nothing measured yet: it offers what the job formed with.
    assert (costs.alpha_s, costs.beta_s_per_byte) == (50e-6, 1e-9)
    assert policy.offer("train", FORMATION, 1, HERE, meter, 1.0) is None


def test_an_epoch_agrees_on_the_members_medians_and_prices_the_formation_with_them() -> None:
    policy = AutoPolicy()
    key = EPOCH_KEYS  # the first key of epoch 1
    policy.offer("train", FORMATION, 1, HERE, CostMeter(), 1.0)
    assert policy.agreement(FORMATION, key) is None  # the peer's figures are missing
    policy.heard(FORMATION, PEER, wire.Costs("train", 0xABC, 1, 150e-6, 3e-9, {}, 1.0))
    agreement = policy.agreement(FORMATION, key)
    assert agreement is not None
    assert agreement.costs == (pytest.approx(100e-6), pytest.approx(2e-9))
    priced = policy.priced(FORMATION, agreement)
    assert (priced.alpha_s, priced.beta_s_per_byte) == agreement.costs
    assert priced.generation == FORMATION.generation
    assert policy.priced(FORMATION, agreement) is priced  # made once per epoch
    stats = StatsRecorder()
    decision = policy.choose(None, "auto", priced, 1 << 20, key, stats, "train")
    assert decision.algorithm == auto_pick(2, 1 << 20, *agreement.costs)[0]
    assert stats.jobs["train"].auto[1 << 20].epoch == 1
    # Key 0 (epoch 0) keeps the formation's figures: no agreement is asked for.
    assert policy.agreement(FORMATION, 0) is None


def test_measured_times_decide_a_close_call_when_exploring_is_allowed() -> None:
    """With an explore factor above 1, the members' median times pick between
    the algorithms the model prices within that factor of its best."""
    policy = AutoPolicy()
    nbytes = 1 << 20
    best, estimates = auto_pick(2, nbytes, FORMATION.alpha_s, FORMATION.beta_s_per_byte)
    runner_up = sorted(estimates, key=lambda pair: pair[1])[1][0]
    times = {(best, nbytes): 9.0, (runner_up, nbytes): 0.001}
    policy.heard(FORMATION, HERE, wire.Costs("train", 0xABC, 1, 50e-6, 1e-9, times, 100.0))
    policy.heard(FORMATION, PEER, wire.Costs("train", 0xABC, 1, 50e-6, 1e-9, times, 100.0))
    key = EPOCH_KEYS + EPOCH_KEYS // 2  # the second half of epoch 1: no exploring
    decision = policy.choose(None, "auto", FORMATION, nbytes, key)
    assert decision == Decision(runner_up, "measured")
